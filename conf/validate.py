"""`validate(cfg)`: every config group's check, run once on the composed config before anything heavy is
built. Each check lives beside its group's dataclass in conf/schema/."""
from __future__ import annotations

from conf.errors import ConfigError
from conf.schema.data import check_data
from conf.schema.job import check_job
from conf.schema.memory import check_memory
from conf.schema.model import check_model
from conf.schema.optim import check_optim
from conf.schema.train import check_train

__all__ = ["ConfigError", "validate"]


def validate(cfg) -> None:
    """Raise ConfigError naming the fix for the first invalid setting found."""
    check_job(cfg)
    check_optim(cfg.optim, cfg.max_steps)
    check_train(cfg.train)
    check_model(cfg.model)
    check_memory(cfg.memory)
    check_data(cfg.data, cfg.seq_len, cfg.model.vocab_size, cfg.model.path)
