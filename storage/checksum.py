"""Checksums of written files, to tell a file whose bytes changed after it was written (same size, other
content) from the one written: zlib's CRC-32, computed while a file is written where the writer takes a file
object (ChecksumWriter), else read back (file_checksum). CRC-32 detects accidental corruption (any burst of
up to 32 bits, and all but 2^-32 of the others) and is the fastest of the standard library's checks; the
measurement that chose it: docs/JOBS.md ("Checksums")."""
from __future__ import annotations

import zlib
from pathlib import Path

ALGORITHM = "crc32"
CHUNK_BYTES = 16 << 20


def as_text(crc: int) -> str:
    return f"{crc:08x}"


def file_checksum(path: Path) -> str:
    """The CRC-32 of the file at `path`, read in chunks."""
    crc = 0
    with open(path, "rb") as file:
        while chunk := file.read(CHUNK_BYTES):
            crc = zlib.crc32(chunk, crc)
    return as_text(crc)


class ChecksumWriter:
    """A binary file opened for writing, wrapped so that every byte written also goes into a CRC-32
    (`checksum`): what torch.save or a text writer writes is checked without reading it back."""

    def __init__(self, file):
        self.file, self.crc = file, 0

    def write(self, data) -> int:
        self.crc = zlib.crc32(data, self.crc)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()

    @property
    def checksum(self) -> str:
        return as_text(self.crc)
