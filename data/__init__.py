"""Data sources: every source yields `Batch`es and has state_dict()/load_state_dict() for exact resume."""
from data.batch import IGNORE_INDEX, Batch
from data.config import DataConfig
from data.synthetic import RecallTask, check_recall_config


def check_data_config(cfg: DataConfig, seq_len: int, vocab_size: int) -> None:
    """Reject data settings that cannot work, before any model or file is loaded."""
    if cfg.name == "recall":
        check_recall_config(cfg, seq_len, vocab_size)
    elif cfg.name not in SOURCES:
        raise ValueError(f"unknown data source data.name={cfg.name!r}; available: {', '.join(SOURCES)}")


SOURCES = ("recall",)


def build_data(cfg: DataConfig, seq_len: int, batch_size: int, seed: int, vocab_size: int,
               tokenizer_path: str | None = None):
    """The batch stream named by `cfg.name`."""
    if cfg.name == "recall":
        return RecallTask(cfg, seq_len, batch_size, seed, vocab_size)
    raise ValueError(f"unknown data source data.name={cfg.name!r}; available: {', '.join(SOURCES)}")


__all__ = ["Batch", "DataConfig", "IGNORE_INDEX", "RecallTask", "build_data", "check_data_config"]
