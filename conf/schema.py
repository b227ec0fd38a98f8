"""Typed configuration: one dataclass per config group, composed into `JobConfig` and registered in
Hydra's ConfigStore so every YAML file under conf/ is checked against these types."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from data.config import DataConfig


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
    lora_r: int = 16
    lora_alpha: float = 32.0
    lora_dropout: float = 0.0
    lora_target_modules: List[str] = field(default_factory=lambda: [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


@dataclass
class JobConfig:
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    optim: OptimConfig = MISSING
    train: TrainConfig = MISSING
    seq_len: int = 1024
    batch_size: int = 1
    seed: int = 0
    max_steps: int = 1000
    output_dir: str = "outputs/${now:%Y-%m-%d}/${now:%H-%M-%S}"
    device: str = "auto"        # auto | cuda | cpu
    kernels: str = "auto"       # auto | triton | reference
    log_every: int = 10


def register_configs() -> None:
    store = ConfigStore.instance()
    store.store(name="job_schema", node=JobConfig)
