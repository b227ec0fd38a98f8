"""Training-step benchmark of the trainer (or the peer HF stack) at one sequence length; one JSON line out.

    python scripts/bench_train.py --seq-len 131072 --steps 3 [override ...] >> results.jsonl
    python scripts/bench_train.py --seq-len 32768 --peer        # transformers+peft+Liger+HF ckpt+save_on_cpu
    python scripts/bench_train.py --seq-len 65536 --eval        # also time an evaluation of the same sequence

Overrides are the trainer's Hydra overrides (default model=llama3_8b train=lora, random init, bf16 base).
Each length runs in its own process so peak host memory (VmHWM) belongs to that length alone. The first
step is a warm-up (Triton compilation, allocator growth) unless --steps 1; pinned buffers are allocated
before it and timed apart. Reports tokens/s over the timed steps, MFU and the measured-ceiling figure
(trainer.metrics.step_flops over the GPU's peaks; docs/JOBS.md, "Metrics"),
peak GPU memory (allocated and reserved), peak host RSS and the planner's predictions. --eval then runs
trainer.evaluate's forward-only evaluation of the same sequence as many times (the first a warm-up too) and
reports its times beside the step's, its GPU peak and the planner's eval_peak.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

from trainer.allocator import cap_gpu_memory, gpu_memory_cap, prefer_expandable_segments

prefer_expandable_segments()

import torch  # noqa: E402

from offload.units import GIB  # noqa: E402

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def peak_host_gib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / GIB
    return float("nan")


def random_batch(seq_len: int, vocab: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(0, vocab, (1, seq_len + 1), device=device, generator=generator)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def trainer_config(seq_len: int, overrides: list[str], train: str = "lora"):
    """The trainer's config of this benchmark: the Llama-3-8B architecture unless the overrides name another
    model group (model=qwen3_8b), batch 1, then the overrides."""
    from hydra import compose, initialize_config_dir

    from conf.schema import register_configs

    from trainer.architecture import given_model_keys, record_architecture

    register_configs()
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"):
        model = [] if any(o.startswith("model=") for o in overrides) else ["model=llama3_8b"]
        cfg = compose("config", overrides=[*model, f"train={train}", "batch_size=1", f"seq_len={seq_len}",
                                           *overrides])
    record_architecture(cfg, given_keys=given_model_keys(overrides))
    return cfg


def cap_to_planned_gpu(cfg, device: torch.device) -> float | None:
    """The trainer's cap (trainer.allocator), for either stack: memory.gpu or memory.gpu_memory_gib naming a
    smaller GPU than this one (h100_80gb on an H200) holds the CUDA allocator to its size before anything is
    built. Returns the share of this GPU allowed (None: not capped)."""
    from conf.schema.memory import resolve_gpu_preset
    from offload.byte_model import Capacity
    resolve_gpu_preset(cfg.memory)
    planned = Capacity.detect(device, cfg.memory).gpu
    cap_gpu_memory(planned, device)
    return gpu_memory_cap(planned, device)


def build_ours(cfg):
    """The trainer's model (memory policy included), its optimizer and a step function."""
    import kernels
    from conf.validate import validate
    from model import unwrap_model
    from data import Batch
    from trainer.build import build_model, checked_plan
    from trainer.distributed import World
    from trainer.evaluate import Evaluator
    from trainer.optim import build_optimizer
    from trainer.step import clip_gradients

    validate(cfg)
    kernels.set_backend(cfg.kernels)
    device = torch.device("cuda")
    built = build_model(cfg, device, checked_plan(cfg, device))
    model, plan = built.model, built.plan
    optimizer = build_optimizer(model, cfg.optim, plan.full_state)
    lm = unwrap_model(model)

    def step(input_ids, labels):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = lm.loss(model(input_ids), labels)
        loss.backward()
        clip_gradients(model, optimizer, 1.0)     # full fine-tuning: StreamedAdamW's exact global norm
        optimizer.step()
        return loss

    pin_start = time.perf_counter()
    built.policy.pin_buffers(plan.shape)
    info = {"stack": "ours", "pin_s": time.perf_counter() - pin_start,
            "plan": {"placements": "".join(p[0] for p in plan.placements) if plan.placements else None,
                     "attention": "".join(p[0] for p in plan.attention) if plan.attention else None,
                     "mlp_tiles": plan.mlp_tiles, "full_state": plan.full_state, "gpu_peak_gib": plan.gpu_peak / GIB,
                     "attention_kernel": plan.attention_kernel,
                     "host_peak_gib": plan.host_peak / GIB}}
    info["plan"]["eval_peak_gib"] = plan.eval_peak / GIB

    def evaluate(input_ids, labels):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        batch = Batch(input_ids, labels, positions)
        return Evaluator(model, device, World.single(), cfg.seq_len, [batch], None).evaluate()

    return lm.config, step, built.policy.stats, info, evaluate


def build_peer(cfg):
    """transformers' class of the config's family (LlamaForCausalLM, Qwen3ForCausalLM) + peft LoRA + Liger-Kernel's
    patches for that family + HF gradient checkpointing + save_on_cpu."""
    import liger_kernel.transformers
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.architecture import model_architecture

    arch = model_architecture(cfg)
    values = arch.to_hf_dict()
    # Liger's rope, norms, SwiGLU and fused loss for the family (apply_liger_kernel_to_llama, ..._qwen3)
    getattr(liger_kernel.transformers, f"apply_liger_kernel_to_{values['model_type']}")()
    hf_config = AutoConfig.for_model(**{k: v for k, v in values.items() if k != "architectures"})
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16, attn_implementation="sdpa")
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)

    def step(input_ids, labels):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16), torch.autograd.graph.save_on_cpu(pin_memory=True):
            loss = model(input_ids=input_ids, labels=labels, shift_labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        return loss

    return arch, step, dict, {"stack": "transformers+peft+liger+hf-ckpt+save_on_cpu"}, None


def eval_timings(evaluate, input_ids, labels, runs: int, step_seconds: float) -> dict:
    """Times of `runs` evaluations of the benchmark's sequence (the first a warm-up unless alone), their
    median against the step's, and the evaluation's GPU peak."""
    times, peaks = [], []
    for _ in range(runs):
        figures = evaluate(input_ids, labels)
        times.append(figures["eval/time_s"])
        peaks.append(figures["eval/gpu_peak_gib"])
        print(f"eval: {times[-1]:.2f} s loss {figures['eval/loss']:.4f}", file=sys.stderr, flush=True)
    median = statistics.median(times[1:] if len(times) > 1 else times)
    return {"eval_s": times, "eval_to_step": median / step_seconds, "eval_peak_gpu_allocated_gib": max(peaks)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--steps", type=int, default=3, help="steps run; the first is a warm-up unless 1")
    parser.add_argument("--train", choices=("lora", "full"), default="lora",
                        help="full: every parameter (issue 6; the planner picks train.full_state)")
    parser.add_argument("--peer", action="store_true", help="benchmark the HF/peft/Liger stack instead")
    parser.add_argument("--profile", action="store_true", help="profile the last step: its top CUDA kernels and GPU "
                                                                "time by kind (scripts/step_profile.py)")
    parser.add_argument("--eval", action="store_true", help="also time trainer.evaluate's forward-only evaluation")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the trainer config")
    args = parser.parse_args()
    if args.eval and args.peer:
        parser.error("--eval times our evaluation: not with --peer")

    from scripts.step_profile import device_kernels, kind_table, time_by_kind
    from trainer.metrics import flop_peaks, mfu_metrics, step_flops

    started = time.perf_counter()
    torch.manual_seed(0)
    cfg = trainer_config(args.seq_len, args.overrides, args.train)
    gpu_memory_cap = cap_to_planned_gpu(cfg, torch.device("cuda"))
    arch, step, offload_stats, info, evaluate = build_peer(cfg) if args.peer else build_ours(cfg)
    info |= {"overrides": args.overrides, "gpu_memory_cap": gpu_memory_cap}
    input_ids, labels = random_batch(args.seq_len, arch.vocab_size, "cuda")
    torch.cuda.reset_peak_memory_stats()    # the step's peak, not model construction's
    times, losses = [], []
    for index in range(args.steps):
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) \
            if args.profile and index == args.steps - 1 else contextlib.nullcontext()
        torch.cuda.synchronize()
        start = time.perf_counter()
        with profiler:
            losses.append(float(step(input_ids, labels)))
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        copy = offload_stats()
        print(f"step {index}: {times[-1]:.2f} s loss {losses[-1]:.4f} {json.dumps(copy)}", file=sys.stderr, flush=True)
    by_kind = None
    if args.profile:
        print(profiler.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70),
              file=sys.stderr)
        by_kind = time_by_kind(device_kernels(profiler))
        print(kind_table(by_kind, times[-1] * 1e3), file=sys.stderr)
    timed = times[1:] if len(times) > 1 else times
    seconds = statistics.median(timed)
    mfu = mfu_metrics(step_flops(arch, cfg.train, args.seq_len, 1), seconds,
                      flop_peaks(torch.cuda.get_device_name(), cfg.logger.peak_tflops))
    result = {**info, "seq_len": args.seq_len, "device": torch.cuda.get_device_name(),
              "step_s": times, "warmup_skipped": len(times) == 1, "tokens_per_s": args.seq_len / seconds,
              **mfu, "loss": losses,
              "peak_gpu_allocated_gib": torch.cuda.max_memory_allocated() / GIB,
              "peak_gpu_reserved_gib": torch.cuda.max_memory_reserved() / GIB,
              "peak_host_gib": peak_host_gib(), "offload": copy, "profile_ms_by_kind": by_kind,
              "wall_s": time.perf_counter() - started}
    if args.eval:       # after the step's peaks are read: an evaluation starts its own peak window
        result["eval"] = eval_timings(evaluate, input_ids, labels, args.steps, seconds)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
