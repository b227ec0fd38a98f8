"""Typed configuration: one module per config group, each holding the group's dataclass and its check;
`JobConfig` composes them and `register_configs` registers it in Hydra's ConfigStore, so every YAML file
under conf/ is checked against these types. Defaults live in the dataclasses; the YAML group files only
select an option and set what differs from them."""
from __future__ import annotations

from dataclasses import dataclass, field

from conf.schema.data import DataConfig
from conf.schema.eval import EvalConfig, PasskeyConfig
from conf.schema.job import CheckpointConfig, LoggerConfig, WandbConfig
from conf.schema.memory import MemoryConfig
from conf.schema.model import MISSING, ModelConfig
from conf.schema.optim import OptimConfig
from conf.schema.parallel import ParallelConfig
from conf.schema.train import TrainConfig


@dataclass
class JobConfig:
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    optim: OptimConfig = MISSING
    train: TrainConfig = MISSING
    seq_len: int = 8192
    batch_size: int = 1
    # Seeds python, numpy, torch and the data order: an integer in [0, 2**32 - 1] (numpy's range).
    seed: int = 0
    max_steps: int = 1000
    output_dir: str = "outputs/${now:%Y-%m-%d}/${now:%H-%M-%S}"
    device: str = "auto"        # conf.schema.job.DEVICES
    kernels: str = "auto"       # conf.schema.job.KERNEL_BACKENDS
    # Bit-identical results run to run: attention's backward is our Triton two-kernel one, which adds no
    # atomics, instead of cuDNN's or (on Hopper) the one-pass Gluon one, which add dQ with atomics and are
    # faster (kernels.attention.choose_route; docs/PERFORMANCE.md, "Attention").
    deterministic: bool = False
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
    # Several processes (torchrun): the sequence-parallel degree, data parallel beyond it.
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    # Held-out loss, loss by position and passkey retrieval, during training and by scripts/evaluate.py.
    eval: EvalConfig = field(default_factory=EvalConfig)


def register_configs() -> None:
    from hydra.core.config_store import ConfigStore
    ConfigStore.instance().store(name="job_schema", node=JobConfig)


__all__ = ["CheckpointConfig", "DataConfig", "EvalConfig", "JobConfig", "LoggerConfig", "MemoryConfig", "ModelConfig",
           "OptimConfig", "ParallelConfig", "PasskeyConfig", "TrainConfig", "WandbConfig", "register_configs"]
