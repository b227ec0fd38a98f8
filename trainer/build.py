"""Turning a validated config into a model on its device, with the memory plan and policy it was built for."""
from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import OmegaConf

import kernels
from conf.schema.memory import GPU_PRESETS, HOPPER_PRESETS, PLANNING_GPU
from conf.schema.model import ARCHITECTURE_KEYS, GROUP_DIR, MISSING, ModelConfig
from conf.schema.parallel import world_size
from conf.validate import ConfigError
from kernels.attention import AttentionRoute
from model import Llama, LlamaConfig
from model.hf_checkpoint import (ROPE_OVERRIDE_KEYS, is_lora, read_config, save_linked_model, unwrap_llama,
                                 with_overrides)
from model.llama import Attention
from model.lora import fuse_adapter_products
from offload.byte_model import Capacity
from offload.plan import MemoryPlan, Ranks, plan_memory
from offload.units import GIB
from offload.policy import MemoryPolicy, apply_memory_policy
from trainer.console import script_command

log = logging.getLogger(__name__)

# In the run directory, not per checkpoint: the base of a LoRA run that export cannot find elsewhere (a random
# init, or model.path's files with the run's rope), kept once.
BASE_MODEL_DIR = "base_model"


def model_values(model_cfg) -> dict:
    return OmegaConf.to_container(model_cfg, resolve=True) if OmegaConf.is_config(model_cfg) else dict(model_cfg)


def group_values(name: str) -> dict:
    """The model settings conf/model/<name>.yaml gives ({} for a name no group file has)."""
    file = GROUP_DIR / f"{name}.yaml"
    values = OmegaConf.to_container(OmegaConf.load(file)) if file.is_file() else {}
    nested = values.get("model")           # a file in the global package sets model.* under `model:`
    return nested if isinstance(nested, dict) else values


def given_model_keys(overrides: list[str]) -> set[str]:
    """The model settings a list of Hydra overrides gives: model.rope_theta=1e6 and +model.rope_scaling.factor=8
    give rope_theta and rope_scaling; model=tiny (the group) gives none."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    keys = (override.key_or_group for override in OverridesParser.create().parse_overrides(overrides))
    return {key.split(".")[1] for key in keys if key.startswith("model.")}


def is_recorded(model_cfg) -> bool:
    """Whether model settings are a run's recorded architecture (record_architecture always writes an int
    head_dim; no model group sets one): then every value in them is the run's."""
    return model_cfg["head_dim"] is not None


def given_architecture(model_cfg: dict, given_keys: set[str] | None = None) -> dict:
    """The architecture settings of `model_cfg` (a plain dict) that were given rather than left to the model
    group or the schema: with model.path, these must agree with the checkpoint (or override its rope).
    `given_keys`: the model keys the command line gave (given_model_keys); without them a value equal to the
    group's counts as the group's, and record_architecture names those it drops."""
    values = {key: model_cfg[key] for key in ARCHITECTURE_KEYS if model_cfg[key] not in (None, MISSING)}
    if given_keys is not None:
        return {key: value for key, value in values.items() if key in given_keys}
    if is_recorded(model_cfg):
        return values
    group, defaults = group_values(model_cfg["name"]), ModelConfig()
    return {key: value for key, value in values.items() if value != group.get(key, getattr(defaults, key))}


def with_rope(base: LlamaConfig, values: dict) -> LlamaConfig:
    """`base` with the rope settings of `values` that are not None; ConfigError when they are not valid."""
    try:
        return with_overrides(base, {key: values.get(key) for key in ROPE_OVERRIDE_KEYS})
    except ValueError as error:
        raise ConfigError(f"model.rope_theta / model.rope_scaling / model.max_position_embeddings: {error} "
                          f"(docs/LONG_CONTEXT.md)") from None


def architecture(model_cfg) -> LlamaConfig:
    """The architecture the model settings describe on their own (random init, a run's recorded config); rope
    settings left None take LlamaConfig's defaults."""
    values = model_values(model_cfg)
    base = LlamaConfig.from_dict({key: values[key] for key in ARCHITECTURE_KEYS if key != "rope_scaling"})
    return with_rope(base, {"rope_scaling": values["rope_scaling"]})


def checkpoint_architecture(cfg) -> LlamaConfig:
    """model.path's own architecture, as its config.json says: read once while that file is unchanged (a
    start asks for it many times), a copy each time."""
    path = Path(cfg.model.path).expanduser()
    config_file = path / "config.json"
    stamp = (config_file.stat().st_mtime_ns, config_file.stat().st_size) if config_file.is_file() else None
    return dataclasses.replace(read_checkpoint_config(str(path.resolve()), stamp))


@functools.lru_cache(maxsize=16)
def read_checkpoint_config(path: str, stamp: tuple[int, int] | None) -> LlamaConfig:
    """read_config of `path`, cached by the config.json's modification time and size (`stamp`)."""
    return read_config(Path(path))


def model_architecture(cfg, given_keys: set[str] | None = None) -> LlamaConfig:
    """The architecture the model is built with: with model.path its config.json's, the rope settings given
    (model.rope_theta, model.rope_scaling, model.max_position_embeddings) applied and any other architecture
    setting given checked against it (given_architecture); else the model group's."""
    if not cfg.model.path:
        return architecture(cfg.model)
    checkpoint = checkpoint_architecture(cfg)
    given = given_architecture(model_values(cfg.model), given_keys)
    for key, value in given.items():
        if key not in ROPE_OVERRIDE_KEYS and value != getattr(checkpoint, key):
            raise ConfigError(f"model.{key}={value} differs from {getattr(checkpoint, key)} in model.path's "
                              f"config.json ({cfg.model.path}): with model.path only model.rope_theta, "
                              f"model.rope_scaling and model.max_position_embeddings change the architecture; "
                              f"drop model.{key}")
    return with_rope(checkpoint, given)


def rope_overrides(arch: LlamaConfig) -> dict:
    """The rope settings of `arch` as loader overrides (Llama.from_pretrained), the default rope spelled out: a
    None would keep the checkpoint's scaling."""
    return {"rope_theta": arch.rope_theta, "rope_scaling": arch.rope_scaling or {"rope_type": "default"},
            "max_position_embeddings": arch.max_position_embeddings}


def record_architecture(cfg, arch: LlamaConfig | None = None, given_keys: set[str] | None = None) -> LlamaConfig:
    """Write the architecture the model is built with (`arch`, default model_architecture with `given_keys`)
    into cfg.model (with model.path: the checkpoint's values and the overrides, not the model group's), so that
    config.yaml, every checkpoint and W&B record it, and a resume that would build another (a changed rope) is
    refused like a changed seq_len. The default rope is recorded as {rope_type: default}: null would mean
    model.path's scaling. Settings in cfg.model that the model built does not have are named in one line."""
    if arch is None:
        arch = model_architecture(cfg, given_keys)
        log_unused(cfg, arch, given_keys)
    recorded = {key: getattr(arch, key) for key in ARCHITECTURE_KEYS} | rope_overrides(arch)
    for key in ARCHITECTURE_KEYS:
        cfg.model[key] = recorded[key]
    return arch


def log_unused(cfg, arch: LlamaConfig, given_keys: set[str] | None) -> None:
    """One line naming the model group's settings that model.path's architecture replaces (a warning without
    the command line's keys: one of them may have been given, equal to the group's)."""
    if not cfg.model.path or is_recorded(cfg.model):
        return
    values = model_values(cfg.model)
    built = {key: getattr(arch, key) for key in ARCHITECTURE_KEYS} | {"rope_scaling": arch.rope_type}
    values["rope_scaling"] = (values["rope_scaling"] or {}).get("rope_type", "default")
    unused = [f"model.{key}={values[key]} (built: {built[key]})" for key in ARCHITECTURE_KEYS
              if values[key] not in (None, MISSING) and values[key] != built[key]]
    if unused:
        level = logging.INFO if given_keys is not None else logging.WARNING
        log.log(level, "model.path's config.json replaces model=%s's %s (docs/LONG_CONTEXT.md: only the rope "
                "settings override it)", cfg.model.name, ", ".join(unused))


def saved_config(saved_yaml: str):
    """A run's saved config.yaml with the architecture the run built recorded in it (record_architecture).
    Runs from before it was recorded (head_dim null: record_architecture always writes an int) saved their
    model group's and the schema's values beside model.path, and built model.path's config.json whatever they
    said (c729dfe): that is what is recorded for them, so that their max_position_embeddings 8192 or rope_theta
    500000 are not read as rope overrides."""
    saved = OmegaConf.create(saved_yaml)
    unrecorded = saved.model.path and saved.model.get("head_dim") is None
    record_architecture(saved, checkpoint_architecture(saved) if unrecorded else None)
    return saved


def rope_changes(arch: LlamaConfig, checkpoint: LlamaConfig) -> dict:
    """The rope settings in which `arch` differs from `checkpoint` ({} for none)."""
    return {key: getattr(arch, key) for key in ROPE_OVERRIDE_KEYS if getattr(arch, key) != getattr(checkpoint, key)}


def context_summary(cfg) -> str:
    """The startup summary's rope line: the rope built, what changed from model.path's, and when seq_len
    goes beyond the checkpoint's context with its rope unchanged, the overrides that would extend it."""
    arch = model_architecture(cfg)
    scaling = ", ".join(f"{key} {value}" for key, value in (arch.rope_scaling or {}).items() if key != "rope_type")
    line = (f"{arch.rope_type}{f' ({scaling})' if scaling else ''}, theta {arch.rope_theta:g}, "
            f"max_position_embeddings {arch.max_position_embeddings}")
    if not cfg.model.path:
        return line
    checkpoint = checkpoint_architecture(cfg)
    changed = rope_changes(arch, checkpoint)
    if changed:
        line += f"; changed from model.path's: {', '.join(f'model.{key}' for key in changed)}"
    context = checkpoint.max_position_embeddings
    if cfg.seq_len <= context or {"rope_theta", "rope_scaling"} & set(changed):
        return line
    dim = arch.head_dim
    theta = checkpoint.rope_theta * (cfg.seq_len / context) ** (dim / (dim - 2))     # NTK-aware base
    return (line + f"; WARNING: seq_len={cfg.seq_len} is beyond model.path's max_position_embeddings {context} with "
            f"its rope unchanged: to extend it, model.rope_scaling='{{rope_type: yarn, factor: "
            f"{cfg.seq_len / context:g}, original_max_position_embeddings: {context}}}' "
            f"model.max_position_embeddings={cfg.seq_len}, or model.rope_theta={theta:.3g} (docs/LONG_CONTEXT.md)")


def trained_context(cfg) -> int | None:
    """The context model.path was trained for (its max_position_embeddings); None for random init."""
    return checkpoint_architecture(cfg).max_position_embeddings if cfg.model.path else None


def plan_for(cfg, device: torch.device, per_host: int = 1, capacity: Capacity | None = None) -> MemoryPlan:
    """The memory plan of a validated `cfg` on `device`, for one of its ranks (parallel.sequence of them per
    sequence, so at least that many in the world; `per_host` sharing this host's memory), or for `capacity`
    (one rank's share, as trainer.loop agrees it over the ranks)."""
    arch = model_architecture(cfg)
    return plan_memory(arch, cfg.train, memory_settings(cfg, arch, device), cfg.seq_len, cfg.batch_size, device,
                       capacity=capacity,
                       attention_routes=attention_routes(cfg, arch, device),
                       ranks=Ranks(sequence=cfg.parallel.sequence, per_host=per_host,
                                   world=max(world_size(), cfg.parallel.sequence), shard=cfg.parallel.shard),
                       micro_batches=cfg.optim.grad_accum_steps)


def attention_routes(cfg, arch: LlamaConfig, device: torch.device) -> tuple[AttentionRoute, ...]:
    """The attention routes the planner tries for this job (kernels.attention.candidates): for the GPU named by
    memory.gpu, or by default (PLANNING_GPU) when none is visible, else for this machine's."""
    planned = cfg.memory.gpu or (PLANNING_GPU if device.type == "cuda" and not torch.cuda.is_available() else None)
    hopper = None if planned is None else planned in HOPPER_PRESETS
    return kernels.attention.candidates(device, arch.head_dim, cfg.kernels, cfg.deterministic, hopper)


def memory_settings(cfg, arch: LlamaConfig, device: torch.device):
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
        model = Llama.from_pretrained(cfg.model.path, dtype=dtype, device=device, overrides=rope_overrides(arch))
        log.info("loaded %s from %s", cfg.model.name, cfg.model.path)
    else:
        if resumed:
            log.info("model.path is not set: %s is built from random init, then resumed from the checkpoint's "
                     "weights", cfg.model.name)
        else:
            log.warning("model.path is not set: %s starts from RANDOM weights (fine for benchmarks and the demo; "
                        "give model.path=<local HF checkpoint> to fine-tune a real model)", cfg.model.name)
        model = Llama.from_config(arch, dtype=dtype, device=device)
    model.train_rope_at(cfg.seq_len)
    if cfg.train.mode == "lora":
        model = lora_model(model, cfg.train, lora_base_path(cfg))
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
        save_linked_model(Path(cfg.model.path).expanduser(), unwrap_llama(model).config.to_hf_dict(), base_dir)


def lora_model(model: Llama, train_cfg, base_path: str | None = None) -> torch.nn.Module:
    """`model` with LoRA adapters as training runs them (offload.byte_model counts what this keeps): peft's
    adapters (apply_lora) with the fused adapter forward, and over a bf16 base the adapter inputs left in bf16."""
    base_dtype = next(model.parameters()).dtype
    model = apply_lora(model, train_cfg, base_path)
    fuse_adapter_products(model)
    if base_dtype == torch.bfloat16:
        keep_adapter_inputs_in_bf16(model)
    return model


def apply_lora(model: Llama, train_cfg, base_path: str | None = None) -> torch.nn.Module:
    """Wrap in peft LoRA adapters; the base is frozen and the adapters are kept in fp32.

    The saved adapter_config.json names `base_path` and task_type CAUSAL_LM, so that
    peft.AutoPeftModelForCausalLM.from_pretrained(<adapter dir>) loads it onto transformers' Llama. Both are
    set after wrapping: get_peft_model would replace the path with the model's own name_or_path, and with a
    task type it would pick peft's causal-LM wrapper, whose forward passes transformers' generation
    arguments that our Llama does not take; the generic wrapper keeps our forward as it is."""
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
    """(trainable, total) parameter counts, counting tied tensors once."""
    unique = {id(p): p for p in model.parameters()}.values()
    return sum(p.numel() for p in unique if p.requires_grad), sum(p.numel() for p in unique)
