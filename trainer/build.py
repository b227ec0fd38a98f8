"""Turning a validated config into a model on its device, with the memory plan and policy it was built for."""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import OmegaConf

import kernels
from conf.capability import gpu_capability
from conf.schema.memory import GPU_PRESETS, PLANNING_GPU
from conf.schema.parallel import world_size
from conf.schema.train import fp8_base
from conf.validate import ConfigError
from kernels.attention import AttentionRoute
from model import CausalLM, DecoderConfig
from model.hf_checkpoint import (is_lora, save_linked_model, unwrap_model)
from model.decoder import Attention
from model.fp8 import check_fp8_widths, fp8_weight_count, quantize_frozen_base
from model.lora import fuse_adapter_products
from offload.byte_model import Capacity
from offload.plan import MemoryPlan, Ranks, plan_memory
from offload.units import GIB
from offload.policy import MemoryPolicy, apply_memory_policy
from trainer.architecture import checkpoint_architecture, model_architecture, rope_changes, rope_overrides
from trainer.console import script_command

log = logging.getLogger(__name__)

# In the run directory, not per checkpoint: the base of a LoRA run that export cannot find elsewhere (a random
# init, or model.path's files with the run's rope), kept once.
BASE_MODEL_DIR = "base_model"


def plan_for(cfg, device: torch.device, per_host: int = 1, capacity: Capacity | None = None,
             world: int | None = None, with_advice: bool = True) -> MemoryPlan:
    """The memory plan of a validated `cfg` on `device`, for one of its ranks (parallel.sequence of them per
    sequence, so at least that many in the world, or `world`; `per_host` sharing this host's memory), or for
    `capacity` (one rank's share, as trainer.loop agrees it over the ranks); `with_advice`: a plan that does not
    fit says what would help."""
    arch = model_architecture(cfg)
    return plan_memory(arch, cfg.train, memory_settings(cfg, arch, device), cfg.seq_len, cfg.batch_size, device,
                       capacity=capacity, with_advice=with_advice,
                       attention_routes=attention_routes(cfg, arch, device),
                       ranks=Ranks(sequence=cfg.parallel.sequence, per_host=per_host,
                                   world=world or max(world_size(), cfg.parallel.sequence), shard=cfg.parallel.shard),
                       micro_batches=cfg.optim.grad_accum_steps)


def attention_routes(cfg, arch: DecoderConfig, device: torch.device) -> tuple[AttentionRoute, ...]:
    """The attention routes the planner tries for this job (kernels.attention.candidates): for the GPU named by
    memory.gpu, or by default (PLANNING_GPU) when none is visible, else for this machine's."""
    planned = cfg.memory.gpu or (PLANNING_GPU if device.type == "cuda" and not torch.cuda.is_available() else None)
    planned_gpu = None if planned is None else gpu_capability(planned)
    return kernels.attention.candidates(device, arch.head_dim, cfg.kernels, cfg.deterministic, planned_gpu)


def memory_settings(cfg, arch: DecoderConfig, device: torch.device):
    """cfg.memory, keeping no attention outputs where the attention that runs records none (the reference
    attention: kernels=reference, a CPU run, a head dim the Triton kernel lacks), and no full layers there
    either: the planner counts the Triton attention's saved tensors, the reference keeps its [T, T] scores."""
    if attention_routes(cfg, arch, device)[0].records:
        return cfg.memory
    for name in ("kept_attention_layers", "full_layers"):
        if cfg.memory[name]:
            raise ConfigError(
                f"memory.{name}={cfg.memory[name]} needs the Triton attention (kernels=auto on a CUDA GPU, or "
                f"kernels=triton, with head dim 64 or 128; here kernels={cfg.kernels}, device {device.type}, "
                f"head dim {arch.head_dim}): set it to null or 0")
    return OmegaConf.merge(cfg.memory, {"kept_attention_layers": 0, "full_layers": 0})


def plan_failure(cfg, plan: MemoryPlan) -> str:
    """The failing plan, once, with only what helps: on a GPU also memory.check=false (should the plan be
    wrong about it); on the CPU, where the host's memory stands for the GPU's and skipping the check could
    only run out of memory, that no GPU is in use and how to plan for one."""
    if plan.capacity.device_type == "cuda":
        return plan.failure() + "\n(memory.check=false skips this check, should the plan be wrong about this GPU)"
    why = "no CUDA GPU is visible" if not torch.cuda.is_available() else f"device={cfg.device}"
    settings = [f"model={cfg.model.name}", f"train={cfg.train.mode}", f"seq_len={cfg.seq_len}"]
    settings += [f"batch_size={cfg.batch_size}"] * (cfg.batch_size != 1)
    settings += [f"parallel.sequence={cfg.parallel.sequence}"] * (cfg.parallel.sequence != 1)
    settings += [f"model.path={cfg.model.path}"] * bool(cfg.model.path)
    if plan.gpu["weights"] > plan.capacity.gpu_limit > 0:     # no memory.* setting can help
        failure = (f"it does not fit: the weights alone ({plan.gpu['weights'] / GIB:.2f} GiB) exceed what this host "
                   f"can give ({plan.capacity.gpu_limit / GIB:.2f} GiB):\n" + plan.describe())
    else:
        failure = plan.failure()
    return (f"{why}, so this job would train on the CPU with the host's memory as the device's, and "
            + failure + f"\nto plan it for a GPU: {script_command('plan.py', *settings, f'memory.gpu={PLANNING_GPU}')} "
            f"(or {' | '.join(p for p in GPU_PRESETS if p != PLANNING_GPU)})")


def check_fp8_job(cfg, device: torch.device) -> None:
    """train.fp8=true needs Hopper's FP8 tensor cores (compute capability 9.0: cuBLAS's row-scaled FP8 product,
    the one measured) and projection widths it takes: ConfigError on the CPU, on older GPUs (the A100) and for
    odd widths."""
    if not fp8_base(cfg.train):
        return
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ConfigError(f"train.fp8=true needs a CUDA GPU with FP8 tensor cores (H100/H200, compute capability "
                          f"9.0+), and this job runs on {'the CPU' if device.type != 'cuda' else 'no visible GPU'}: "
                          f"set train.fp8=false")
    gpu = gpu_capability(device)
    if not gpu.fp8:
        raise ConfigError(f"train.fp8=true needs Hopper's FP8 tensor cores (compute capability 9.0+: H100/H200), and "
                          f"{gpu.name} is {'.'.join(map(str, gpu.compute_capability))}: set train.fp8=false")
    arch = model_architecture(cfg)
    why = check_fp8_widths(arch.hidden_size, arch.num_attention_heads * arch.head_dim,
                           arch.num_key_value_heads * arch.head_dim, arch.intermediate_size)
    if why:
        raise ConfigError(f"train.fp8=true: model {cfg.model.name} has {why}, which the FP8 products cannot take: "
                          f"set train.fp8=false")


@dataclass
class Built:
    """What `build_model` makes: the model, the memory plan it was built for (with the optimizer-state
    layout of full fine-tuning, `plan.full_state`) and the memory policy installed on it (its `stats()`
    gives offload metrics)."""
    model: torch.nn.Module
    plan: MemoryPlan
    policy: MemoryPolicy


def checked_plan(cfg, device: torch.device, per_host: int = 1, capacity: Capacity | None = None) -> MemoryPlan:
    """The memory plan of a validated `cfg` (plan_for); ConfigError with the numbers and what helps when it
    does not fit (unless memory.check=false). Asked before anything is built or written."""
    check_fp8_job(cfg, device)
    plan = plan_for(cfg, device, per_host, capacity)
    if cfg.memory.check and not plan.fits:
        raise ConfigError(plan_failure(cfg, plan))
    return plan


def build_model(cfg, device: torch.device, plan: MemoryPlan, resumed: bool = False, sequence_group=None) -> Built:
    """The model of a validated `cfg` with its memory policy installed, as `plan` (checked_plan) says, and
    the attention route the plan was made for, sequence-parallel over `sequence_group` (None: one process
    holds whole sequences). `resumed`: a checkpoint's weights replace the initial ones (so a random init is
    no news). The other ops' backend is kernels.set_backend's (trainer.loop.train sets it)."""
    log.info("%s", plan.describe())
    dtype = plan.weights_dtype
    arch = model_architecture(cfg)
    if cfg.model.path:
        model = CausalLM.from_pretrained(cfg.model.path, dtype=dtype, device=device, overrides=rope_overrides(arch))
        log.info("loaded %s from %s", cfg.model.name, cfg.model.path)
    else:
        if resumed:
            log.info("model.path is not set: %s is built from random init, then resumed from the checkpoint's "
                     "weights", cfg.model.name)
        else:
            log.warning("model.path is not set: %s starts from RANDOM weights (fine for benchmarks and the demo; "
                        "give model.path=<local HF checkpoint> to fine-tune a real model)", cfg.model.name)
        model = CausalLM.from_config(arch, dtype=dtype, device=device)
    model.train_rope_at(cfg.seq_len)
    if cfg.train.mode == "lora":
        model = lora_model(model, cfg.train, lora_base_path(cfg))
    if fp8_base(cfg.train):
        log.info("FP8 base: %d projections held in e4m3 with row scales", quantize_frozen_base(model))
    install_attention_route(model, dataclasses.replace(plan.attention_route, sequence_group=sequence_group))
    policy = apply_memory_policy(model, plan.placements, plan.mlp_tiles, device, plan.attention)
    return Built(model, plan, policy)


def install_attention_route(model: torch.nn.Module, route: AttentionRoute) -> None:
    """Have every attention module of `model` (under any wrapper) run `route`."""
    for module in model.modules():
        if isinstance(module, Attention):
            module.route = route


def release_sequence_group(model: torch.nn.Module) -> None:
    """Take the sequence-parallel group out of the attention routes of `model`, at the end of its job: the
    model can outlive the job in reference cycles, and a process group still held after close_world destroys
    it is freed at interpreter exit, where its destructor can abort the process (SIGABRT after a finished run)."""
    for module in model.modules():
        if isinstance(module, Attention) and module.route.sequence_group is not None:
            module.route = dataclasses.replace(module.route, sequence_group=None)


def extends_checkpoint(cfg) -> bool:
    """Whether the model built changes model.path's rope (a context extension)."""
    return bool(cfg.model.path) and bool(rope_changes(model_architecture(cfg), checkpoint_architecture(cfg)))


def lora_base_path(cfg) -> str | None:
    """Where the saved adapter's base lives: model.path; for a changed rope or a random init the base_model/
    directory the run keeps (keep_extended_base, trainer.run_dir.keep_random_base), so that an adapter never
    loads onto a base with another rope; None when it keeps none."""
    if cfg.model.path and not extends_checkpoint(cfg):
        return str(Path(cfg.model.path).expanduser().resolve())
    if cfg.model.path or cfg.checkpoint.save_random_base:
        return str(Path(cfg.output_dir).resolve() / BASE_MODEL_DIR)
    return None


def keep_extended_base(cfg, model: torch.nn.Module, run_dir: Path) -> None:
    """The base a LoRA adapter on a changed rope names (lora_base_path), once: model.path's files linked
    beside a config.json of the architecture built, which transformers and peft then load with that rope."""
    base_dir = run_dir / BASE_MODEL_DIR
    if is_lora(model) and extends_checkpoint(cfg) and not base_dir.is_dir():
        save_linked_model(Path(cfg.model.path).expanduser(), unwrap_model(model).config.to_hf_dict(), base_dir)


def lora_model(model: CausalLM, train_cfg, base_path: str | None = None) -> torch.nn.Module:
    """`model` with LoRA adapters as training runs them (offload.byte_model counts what this keeps): peft's
    adapters (apply_lora) with the fused adapter forward, and over a bf16 base the adapter inputs left in bf16."""
    base_dtype = next(model.parameters()).dtype
    model = apply_lora(model, train_cfg, base_path)
    fuse_adapter_products(model)
    if base_dtype == torch.bfloat16:
        keep_adapter_inputs_in_bf16(model)
    return model


def apply_lora(model: CausalLM, train_cfg, base_path: str | None = None) -> torch.nn.Module:
    """Wrap in peft LoRA adapters; the base is frozen and the adapters are kept in fp32.

    The saved adapter_config.json names `base_path` and task_type CAUSAL_LM, so that
    peft.AutoPeftModelForCausalLM.from_pretrained(<adapter dir>) loads it onto transformers' class of the
    family. Both are set after wrapping: get_peft_model would replace the path with the model's own
    name_or_path, and with a task type it would pick peft's causal-LM wrapper, whose forward passes
    transformers' generation arguments that our CausalLM does not take; the generic wrapper keeps our forward
    as it is."""
    from peft import LoraConfig, get_peft_model
    lora = LoraConfig(r=train_cfg.lora_r, lora_alpha=train_cfg.lora_alpha, lora_dropout=train_cfg.lora_dropout,
                      target_modules=list(train_cfg.lora_target_modules), bias="none")
    model = get_peft_model(model, lora)
    saved = model.peft_config[model.active_adapter]
    saved.task_type, saved.base_model_name_or_path = "CAUSAL_LM", base_path
    return model


def keep_adapter_inputs_in_bf16(model: torch.nn.Module) -> None:
    """Stop peft casting each adapter's input to the fp32 adapter dtype. Under bf16 autocast the adapter
    matmuls run in bf16 anyway, so the cast only added a bf16->fp32->bf16 round trip over every projection's
    input, forward and backward (docs/PERFORMANCE.md, "Design choices measured"); the result is unchanged."""
    for module in model.modules():
        if hasattr(module, "cast_input_dtype_enabled"):
            module.cast_input_dtype_enabled = False


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts, counting tied tensors once and FP8 weights (buffers) too."""
    unique = {id(p): p for p in model.parameters()}.values()
    return (sum(p.numel() for p in unique if p.requires_grad),
            sum(p.numel() for p in unique) + fp8_weight_count(model))
