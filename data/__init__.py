"""Data sources: every source yields `Batch`es and has state_dict()/load_state_dict(state, force) for exact
resume (force: continue at the saved position even where the state was saved for different data).

The `data` settings are typed and value-checked in conf.schema.data; `preflight_data` adds the checks that
need the disk, before the model is built."""
import os

# Training never downloads: these must be set before `datasets` or `huggingface_hub` is first imported.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from conf.schema.data import DataConfig  # noqa: E402
from data.batch import IGNORE_INDEX, Batch  # noqa: E402
from data.files import build_file_source  # noqa: E402
from data.records import preflight_files  # noqa: E402
from data.synthetic import RecallTask  # noqa: E402
from data.tokenize import DataError  # noqa: E402


def preflight_data(cfg: DataConfig, tokenizer_path: str | None, eval_path: str | None = None) -> None:
    """DataError when the files source's data.path, eval.path or tokenizer (model.path) is not there, or
    eval.path names training files, before any model is built or file read; `cfg` has passed conf's
    validate."""
    if cfg.name == "files":
        preflight_files(cfg, tokenizer_path, eval_path)


def build_data(cfg: DataConfig, seq_len: int, batch_size: int, seed: int, vocab_size: int,
               tokenizer_path: str | None = None, trained_context: int | None = None, held_out: float = 0.0):
    """The batch stream named by `cfg.name` (recall or files: conf checked it); tokenizer_path is the
    checkpoint directory (model.path), trained_context the context it was trained for (the data summary
    reports how much of the data trains positions beyond it); `held_out` (eval.fraction) of the files'
    documents are left out."""
    if cfg.name == "recall":
        return RecallTask(cfg, seq_len, batch_size, seed, vocab_size)
    return build_file_source(cfg, seq_len, batch_size, seed, vocab_size, tokenizer_path, trained_context, held_out)


__all__ = ["Batch", "DataError", "IGNORE_INDEX", "RecallTask", "build_data", "preflight_data"]
