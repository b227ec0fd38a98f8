"""The `train` config group: what is trained, LoRA adapters or every parameter."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

from conf.capability import PRESET_COMPUTE_CAPABILITIES, gpu_capability
from conf.errors import ConfigError

TRAIN_MODES = ("lora", "full")
# train=full: where weights, gradients and AdamW state live, in the order train.full_state=auto tries them.
FULL_STATE_LAYOUTS = ("fp32", "bf16", "bf16_host_grads")
FULL_STATES = ("auto", *FULL_STATE_LAYOUTS)


@dataclass
class TrainConfig:
    """What is trained: `lora` (adapters through peft, base frozen) or `full` (every parameter)."""
    mode: str = "lora"
    # train=full: where weights, gradients and AdamW state live (bytes per parameter; offload/state_layouts.py):
    # fp32 (fp32 weights, torch AdamW; 16 on the GPU), bf16 (bf16 weights and moments updated with
    # stochastic rounding, gradients on the GPU; 8), bf16_host_grads (gradients streamed to pinned host
    # memory in the backward; 6 on the GPU + 2 on the host). auto: the first that fits this machine.
    full_state: str = "auto"
    # LoRA on GPUs with FP8 (H100/H200): the frozen base's projections held in float8 e4m3 and their products
    # run in FP8 (model/fp8.py); adapters, norms, attention, loss and optimizer as in bf16.
    fp8: bool = False
    lora_r: int = 16
    lora_alpha: float = 32.0
    lora_dropout: float = 0.0
    lora_target_modules: List[str] = field(default_factory=lambda: [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


def fp8_base(train_cfg) -> bool:
    """Whether the frozen base's projections are held in FP8 (model/fp8.py): train.fp8 with LoRA. Decided here
    alone: the planner counts the base's bytes by it, the build quantizes by it, the checks refuse by it."""
    return bool(getattr(train_cfg, "fp8", False)) and train_cfg.mode == "lora"


def check_train(train_cfg) -> None:
    if train_cfg.mode not in TRAIN_MODES:
        raise ConfigError(f"train.mode={train_cfg.mode!r} is not one of {TRAIN_MODES} "
                          f"(choose train=lora or train=full)")
    if train_cfg.full_state not in FULL_STATES:
        raise ConfigError(f"train.full_state={train_cfg.full_state!r} is not one of {FULL_STATES}")
    if train_cfg.mode == "lora" and train_cfg.lora_r < 1:
        raise ConfigError(f"train.lora_r={train_cfg.lora_r} must be at least 1")
    if train_cfg.fp8 and train_cfg.mode != "lora":
        raise ConfigError("train.fp8=true runs the frozen base of a LoRA run in FP8; train=full trains every "
                          "weight: set train.fp8=false (or train=lora)")


def check_fp8(cfg) -> None:
    """train.fp8 against the GPU planned for (the GPU present, and the architecture's widths: trainer.build)."""
    if not fp8_base(cfg.train):
        return
    if cfg.parallel.shard:
        raise ConfigError("train.fp8=true holds the base's weights as buffers, which parallel.shard=true (FSDP2) "
                          "would not shard: set parallel.shard=false or train.fp8=false")
    if cfg.memory.gpu is not None and not gpu_capability(cfg.memory.gpu).fp8:
        with_fp8 = [name for name in PRESET_COMPUTE_CAPABILITIES if gpu_capability(name).fp8]
        raise ConfigError(f"train.fp8=true needs FP8 tensor cores, which memory.gpu={cfg.memory.gpu} lacks: set "
                          f"train.fp8=false (or plan for memory.gpu={' or '.join(with_fp8)})")
