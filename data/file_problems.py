"""Why `datasets` could not read a set of json, parquet or text files, in words that name the file: one not in
UTF-8, the first malformed JSON line (1-based), or the files whose records have different fields; and which
file and record (1-based) a record index of the loaded dataset is.

Only called after something has failed (datasets' errors name neither the file nor the line; a record's
index names no file), so reading the files again here costs nothing on the normal path.
"""
from __future__ import annotations

import codecs
import json
import string
from pathlib import Path
from typing import Iterator

# Files named per group of fields in a message, before "and N more".
SHOWN_FILES = 3
WHITESPACE = string.whitespace.encode()


class MalformedJson(ValueError):
    def __init__(self, line: int, reason: str):
        super().__init__(f"line {line}: not valid JSON ({reason})")


def is_json_array(file: Path) -> bool:
    with file.open(encoding="utf-8") as text:
        return text.read(4096).lstrip().startswith("[")


def json_records(file: Path) -> Iterator:
    """The records of a JSON array file or a JSON-lines file (datasets' json builder reads both), one at a
    time: only their field names are kept, so explaining a failure never holds a large file's records."""
    if is_json_array(file):
        try:
            yield from json.loads(file.read_text(encoding="utf-8"))
        except json.JSONDecodeError as error:
            raise MalformedJson(error.lineno, error.msg) from error
        return
    with file.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as error:
                    raise MalformedJson(number, error.msg) from error


def file_fields(file: Path, builder: str) -> tuple[str, ...]:
    if builder == "parquet":
        import pyarrow.parquet
        return tuple(sorted(pyarrow.parquet.read_schema(file).names))
    return tuple(sorted({name for record in json_records(file) if isinstance(record, dict) for name in record}))


def not_utf8(file: Path, chunk: int = 1 << 20) -> str | None:
    """What is wrong with a json or text `file` that is not UTF-8 (the only encoding datasets reads them in),
    with the fix; None when it is UTF-8."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with file.open("rb") as data:
        while True:
            block = data.read(chunk)
            try:
                decoder.decode(block, final=not block)
            except UnicodeDecodeError as error:
                converted = file.with_name(f"{file.stem}.utf8{file.suffix}")
                return (f"{file} is not UTF-8 text (byte 0x{error.object[error.start]:02x} at offset "
                        f"{offset + error.start}): convert it, e.g. iconv -f latin1 -t utf-8 {file} > {converted}")
            if not block:
                return None
            offset += len(block)


def files_problem(files: list[Path], builder: str) -> str | None:
    """A file that is not UTF-8, a malformed JSON line, an unreadable file, or files whose fields differ; None
    when none of these explains the failure."""
    if builder != "parquet":
        problem = next((problem for file in files if (problem := not_utf8(file))), None)
        if problem or builder != "json":
            return problem
    by_fields: dict[tuple[str, ...], list[Path]] = {}
    for file in files:
        try:
            by_fields.setdefault(file_fields(file, builder), []).append(file)
        except MalformedJson as error:
            return f"{file} {error}: fix or remove that line"
        except (ValueError, OSError) as error:
            return f"{file} cannot be read: {type(error).__name__}: {error}"
    if len(by_fields) < 2:
        return None
    groups = "; ".join(f"{shown(group)}: {list(fields)}" for fields, group in by_fields.items())
    return (f"the files have records with different fields: {groups}. Every file of one data.path needs the "
            f"same fields (text and chat records cannot be mixed): point data.path at files of one kind")


def shown(files: list[Path]) -> str:
    more = f" and {len(files) - SHOWN_FILES} more" if len(files) > SHOWN_FILES else ""
    return ", ".join(map(str, files[:SHOWN_FILES])) + more


def has_records(file: Path, builder: str) -> bool:
    """Whether `file` may hold records: a parquet file has rows (datasets' reader fails on one without: 'An
    error occurred while generating the dataset'), a json file is not an empty array ('corresponds to no
    data'), any file holds anything but whitespace (has_text)."""
    if builder == "json" and has_text(file):
        with file.open("rb") as data:
            start = data.read(4096).lstrip(WHITESPACE)
        return not (start.startswith(b"[") and start[1:].lstrip(WHITESPACE).startswith(b"]"))
    if builder != "parquet":
        return has_text(file)
    import pyarrow.parquet
    try:
        return pyarrow.parquet.read_metadata(file).num_rows > 0
    except (OSError, ValueError):       # not parquet at all: files_problem names it when datasets fails
        return True


def has_text(file: Path, chunk: int = 1 << 20) -> bool:
    """Whether `file` holds anything but whitespace (datasets' json reader fails on a file of blank lines:
    'corresponds to no data'). Reads only up to the first other byte: at once for a data file."""
    with file.open("rb") as data:
        while block := data.read(chunk):
            if block.strip(WHITESPACE):
                return True
    return False


def records_in(file: Path, builder: str, text_unit: str) -> int:
    """How many records datasets' `builder` reads from `file` (text: one per document, line or non-empty
    paragraph, as its text builder splits them)."""
    if builder == "parquet":
        import pyarrow.parquet
        return pyarrow.parquet.read_metadata(file).num_rows
    if builder == "json":
        return sum(1 for _ in json_records(file))
    if text_unit == "document":
        return 1
    with file.open(encoding="utf-8") as text:
        if text_unit == "line":
            return sum(1 for _ in text)
        return sum(1 for paragraph in text.read().split("\n\n") if paragraph)


def record_place(files: list[Path], builder: str, text_unit: str, index: int) -> str:
    """'<file> record <n>' (1-based within its file) of the record at `index` of the dataset datasets read
    from `files` in order; the files are counted up to the one holding it."""
    first = 0
    for file in files:
        count = records_in(file, builder, text_unit)
        if index < first + count:
            return f"{file} record {index - first + 1}"
        first += count
    return f"record {index + 1} of {shown(files)}"
