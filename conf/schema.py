"""Typed configuration: one dataclass per config group, composed into `JobConfig` and registered in
Hydra's ConfigStore so every YAML file under conf/ is checked against these types."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from data.config import DataConfig
from offload.config import MemoryConfig


@dataclass
class ModelConfig:
    name: str = MISSING
    # Local Hugging Face checkpoint directory; None trains from random init (benchmarks, demos).
    path: Optional[str] = None
    # Architecture, used for random init; with `path` set, the checkpoint's config.json decides.
    vocab_size: int = MISSING
    hidden_size: int = MISSING
    intermediate_size: int = MISSING
    num_hidden_layers: int = MISSING
    num_attention_heads: int = MISSING
    num_key_value_heads: int = MISSING
    head_dim: Optional[int] = None
    max_position_embeddings: int = 8192
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: Optional[Dict[str, Any]] = None
    tie_word_embeddings: bool = False


@dataclass
class OptimConfig:
    name: str = "adamw"
    lr: float = 3e-4
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.0
    warmup_steps: int = 20
    # Cosine decay ends at lr * min_lr_ratio.
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    grad_accum_steps: int = 1


@dataclass
class TrainConfig:
    """What is trained: `lora` (adapters through peft, base frozen) or `full` (every parameter)."""
    mode: str = "lora"
    # train=full: where weights, gradients and AdamW state live (bytes per parameter; trainer/full_finetune.py):
    # fp32 (fp32 weights, torch AdamW; 16 on the GPU), bf16 (bf16 weights and moments updated with
    # stochastic rounding, gradients on the GPU; 8), bf16_host_grads (gradients streamed to pinned host
    # memory in the backward; 6 on the GPU + 2 on the host). auto: the first that fits this machine.
    full_state: str = "auto"
    lora_r: int = 16
    lora_alpha: float = 32.0
    lora_dropout: float = 0.0
    lora_target_modules: List[str] = field(default_factory=lambda: [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


@dataclass
class CheckpointConfig:
    """When checkpoints are written to <output_dir>/checkpoints/step-<N>/ (0 disables a trigger)."""
    every_steps: int = 200
    every_minutes: float = 30.0
    # Complete checkpoints kept; older ones are deleted only after a newer one is complete. 0 keeps all.
    keep_last: int = 3
    # LoRA on a random-init base: save the base once in <output_dir>/base_model/ so scripts/export.py can
    # merge into it. False skips the copy (export is then refused for the run).
    save_random_base: bool = True


@dataclass
class WandbConfig:
    # offline (default: no account needed, `wandb sync <output_dir>/wandb/offline-run-*` later) | online |
    # disabled. Files go to <output_dir>/wandb/.
    mode: str = "offline"
    project: str = "longctx"
    entity: Optional[str] = None
    name: Optional[str] = None
    tags: List[str] = field(default_factory=list)


@dataclass
class LoggerConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    # Peak bf16 TFLOP/s of the accelerator, the MFU denominator (795 for an H100); no MFU on CPU.
    peak_tflops: float = 795.0
    # tqdm progress bar on an interactive terminal; log lines every `log_every` steps either way.
    progress_bar: bool = True


@dataclass
class JobConfig:
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    optim: OptimConfig = MISSING
    train: TrainConfig = MISSING
    seq_len: int = 8192
    batch_size: int = 1
    seed: int = 0
    max_steps: int = 1000
    output_dir: str = "outputs/${now:%Y-%m-%d}/${now:%H-%M-%S}"
    device: str = "auto"        # auto | cuda | cpu
    kernels: str = "auto"       # auto | triton | reference
    log_every: int = 10
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    # auto: continue from the newest complete checkpoint in output_dir (the default output_dir is a new
    # timestamped directory, so pass output_dir=<previous run dir> to continue a run); <path>: from that
    # checkpoint directory; false: start fresh.
    resume: str = "auto"
    # Resume even when model/train/data/seq_len/batch_size/seed differ from the checkpoint's config.
    resume_force: bool = False
    # Non-finite loss or gradients skip the update; this many in a row stop the job.
    max_bad_steps: int = 5
    # Activation checkpointing, host offload and MLP tiling, planned to fit the GPU and host (offload/).
    memory: MemoryConfig = field(default_factory=MemoryConfig)


def register_configs() -> None:
    store = ConfigStore.instance()
    store.store(name="job_schema", node=JobConfig)
