"""Data sources: every source yields `Batch`es and has state_dict()/load_state_dict() for exact resume."""
import os

# Training never downloads: these must be set before `datasets` or `huggingface_hub` is first imported.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from data.batch import IGNORE_INDEX, Batch  # noqa: E402
from data.config import DataConfig  # noqa: E402
from data.files import build_file_source, check_files_config  # noqa: E402
from data.synthetic import RecallTask, check_recall_config  # noqa: E402
from data.tokenize import DataError  # noqa: E402

SOURCES = ("recall", "files")


def check_data_config(cfg: DataConfig, seq_len: int, vocab_size: int, tokenizer_path: str | None = None) -> None:
    """Reject data settings that cannot work, before any model is built (files: before any is read)."""
    if cfg.name == "recall":
        check_recall_config(cfg, seq_len, vocab_size)
    elif cfg.name == "files":
        check_files_config(cfg, tokenizer_path)
    else:
        raise DataError(f"unknown data source data.name={cfg.name!r}; available: {', '.join(SOURCES)}")


def build_data(cfg: DataConfig, seq_len: int, batch_size: int, seed: int, vocab_size: int,
               tokenizer_path: str | None = None):
    """The batch stream named by `cfg.name`; tokenizer_path is the checkpoint directory (model.path)."""
    if cfg.name == "recall":
        return RecallTask(cfg, seq_len, batch_size, seed, vocab_size)
    if cfg.name == "files":
        return build_file_source(cfg, seq_len, batch_size, seed, vocab_size, tokenizer_path)
    raise DataError(f"unknown data source data.name={cfg.name!r}; available: {', '.join(SOURCES)}")


__all__ = ["Batch", "DataConfig", "DataError", "IGNORE_INDEX", "RecallTask", "build_data", "check_data_config"]
