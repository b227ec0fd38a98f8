"""Where the `files` source's records come from: data.path (or eval.path) resolved to local data files,
checked before anything is built, read with `datasets`, their format (text or chat), and a record's index
named by its file and 1-based record for messages.

Nothing here reaches the network: data.path must name something local, and data/__init__ switches
`datasets` and the hub client to offline mode before they are imported.
"""
from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path

from conf.schema.data import DataConfig
from data.file_problems import files_problem, has_records, record_place
from data.tokenize import DataError, check_tokenizer_files

BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text", ".text": "text", ".md": "text"}
# Files save_to_disk writes at the top of a Dataset / DatasetDict directory.
SAVED_DATASET_MARKERS = ("state.json", "dataset_dict.json")


@dataclass
class LocalSource:
    path: str
    files: list[Path]
    builder: str | None        # datasets builder for the files; None for a save_to_disk directory
    setting: str = "data.path"     # the setting that named `path`, for messages


def resolve_source(path: str, setting: str = "data.path") -> LocalSource:
    """What `setting` (data.path, eval.path) names on disk; a clear error for anything missing, remote or
    unsupported."""
    local = Path(path).expanduser()
    if local.is_dir() and any((local / marker).is_file() for marker in SAVED_DATASET_MARKERS):
        return LocalSource(path, [local], None, setting)
    if local.is_dir():
        files = sorted(p for p in local.rglob("*") if p.is_file() and not p.name.startswith("."))
        where = f"folder {setting}={path!r}"
    elif local.is_file():
        files, where = [local], f"{setting}={path!r}"
    elif glob.has_magic(str(local)):
        files = sorted(Path(p) for p in glob.glob(str(local), recursive=True) if Path(p).is_file())
        where = f"glob {setting}={path!r}"
    else:
        raise DataError(f"{setting}={path!r} is not an existing file, folder or glob. Hub datasets are never "
                        f"downloaded (training runs offline): save it on a machine with network "
                        f"(datasets.load_dataset(NAME).save_to_disk(DIR)) and set {setting}=DIR")
    supported = [file for file in files if file.suffix.lower() in BUILDERS]
    if local.is_file() and not supported:
        raise DataError(f"{where} has extension {local.suffix!r}; supported: {', '.join(BUILDERS)}")
    if not supported:
        raise DataError(f"{where} matches no data files ({', '.join(BUILDERS)})")
    builders = {BUILDERS[file.suffix.lower()] for file in supported}
    if len(builders) > 1:
        raise DataError(f"{where} mixes file kinds {sorted(builders)}: point {setting} at one kind (e.g. a glob "
                        f"like '{local / '*.jsonl'}')")
    unreadable = [str(file) for file in supported if not os.access(file, os.R_OK)]
    if unreadable:
        raise DataError(f"cannot read {unreadable[:3]} (permissions) under {where}")
    # datasets' readers fail obscurely on empty files, files of blank lines and parquet files without rows;
    # they hold no records anyway.
    builder = builders.pop()
    non_empty = [file for file in supported if file.stat().st_size > 0 and has_records(file, builder)]
    if not non_empty:
        raise DataError(f"{where} holds no records: {len(supported)} matching file(s), all empty or whitespace only "
                        f"(or an empty JSON array, a parquet file without rows)")
    return LocalSource(path, non_empty, builder, setting)


def preflight_files(cfg: DataConfig, tokenizer_path: str, eval_path: str | None = None) -> None:
    """Before the model is built: data.path (and eval.path) resolve to readable data files, none trained on
    and held out both, and model.path holds a tokenizer (the option values were checked by
    conf.schema.data.check_files)."""
    training = resolve_source(cfg.path)
    if eval_path:
        check_held_out_apart(training, resolve_source(eval_path, "eval.path"))
    check_tokenizer_files(tokenizer_path)


def check_held_out_apart(training: LocalSource, held_out: LocalSource) -> None:
    """DataError when eval.path names files data.path trains on: the held-out figures would measure recall of
    the training data, not generalization."""
    trained = {file.resolve() for file in training.files}
    shared = [file for file in held_out.files if file.resolve() in trained]
    if shared:
        raise DataError(f"eval.path={held_out.path!r} names {len(shared)} of the files data.path={training.path!r} "
                        f"trains on (first: {shared[0]}): give held-out files of their own, or eval.fraction=0.01 "
                        f"to hold out 1% of the training documents")


def load_records(source: LocalSource, cfg: DataConfig):
    """The raw records as a datasets.Dataset (converted to Arrow once, in the datasets cache)."""
    import datasets
    try:
        if source.builder is None:
            records = datasets.load_from_disk(str(source.files[0]))
            if isinstance(records, datasets.DatasetDict):
                if cfg.split not in records:
                    raise DataError(f"data.split={cfg.split!r} is not in {source.path}; splits: {list(records)}")
                records = records[cfg.split]
        else:
            options = {"sample_by": cfg.text_unit} if source.builder == "text" else {}
            records = datasets.load_dataset(source.builder, data_files=[str(f) for f in source.files], split="train",
                                            cache_dir=cfg.cache_dir, **options)
    except DataError:
        raise
    except Exception as error:
        problem = source.builder and files_problem(source.files, source.builder)
        raise DataError(f"could not read {source.setting}={source.path!r}: "
                        f"{problem or f'{type(error).__name__}: {error}'}") from error
    if len(records) == 0:
        raise DataError(f"{source.setting}={source.path!r} holds no records")
    return records


def record_format(cfg: DataConfig, records, source: LocalSource) -> tuple[str, str]:
    """(format, field) of the datasets.Dataset `records`: chat when asked for or when auto finds the messages
    field, else text."""
    columns = records.column_names
    chat = cfg.format == "chat" or (cfg.format == "auto" and cfg.messages_field in columns)
    option, field = ("messages_field", cfg.messages_field) if chat else ("text_field", cfg.text_field)
    if field not in columns:
        raise DataError(f"records in {source.setting}={source.path!r} have no field {field!r} (data.{option}); "
                        f"fields present: {columns}. Set data.{option}=<one of them>")
    if cfg.format == "auto" and chat and cfg.text_field in columns:
        check_one_kind(records, cfg, source)
    return ("chat" if chat else "text"), field


def check_one_kind(records, cfg: DataConfig, source: LocalSource) -> None:
    """DataError naming the first record of the fewer kind when chat records (a messages field) and text
    records (a text field and no messages) are mixed: auto reads them all as chat, and would name the first
    text record as a chat record without messages."""
    table = records.with_format("arrow", columns=[cfg.messages_field, cfg.text_field])[:]
    chat = table.column(cfg.messages_field).is_valid().to_numpy(zero_copy_only=False)
    text = ~chat & table.column(cfg.text_field).is_valid().to_numpy(zero_copy_only=False)
    if not chat.any() or not text.any():
        return
    kinds = [("chat", cfg.messages_field, chat), ("text", cfg.text_field, text)]
    (kind, field, fewer), (other, other_field, more) = sorted(kinds, key=lambda entry: entry[2].sum())
    raise DataError(f"{record_name(source, cfg, int(fewer.argmax()))} is a {kind} record ({field!r}) among "
                    f"{int(more.sum()):,} {other} records ({other_field!r}) in {source.setting}={source.path!r}: one "
                    f"data.path holds one kind of record: move the {kind} records to files of their own")


def record_name(source: LocalSource, cfg: DataConfig, index: int) -> str:
    """The file and 1-based record of the dataset's record `index` (0-based)."""
    if source.builder is None:
        return f"{source.setting}={source.path!r} record {index + 1}"
    return record_place(source.files, source.builder, cfg.text_unit, index)
