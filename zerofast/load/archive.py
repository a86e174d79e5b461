"""The zip side of a ``torch.save`` archive, checked before any byte of it is mapped.

A ``torch.save`` file is a zip of stored (uncompressed) entries: ``<prefix>/data.pkl`` and one
``<prefix>/data/<key>`` per storage. The loader (``unpickle.py``) maps the whole file once and
cuts each storage out of the mapping at its entry's data offset; this module establishes those
offsets and checks the things a memory map would otherwise trust: every entry lies inside the
file, no name appears twice (torch's own reader matches names case-insensitively, so two copies
could be read differently by two readers), the pickle and the storages are stored, and each
storage has exactly the size the pickle declares for it.
"""
from __future__ import annotations

import os
import stat
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import CorruptCheckpointError, first_line

_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., file name length, extra field length


@dataclass(frozen=True)
class _Entry:
    name: str
    data_offset: int
    stored_size: int
    size: int
    compressed: bool


@dataclass(frozen=True)
class ArchiveIndex:
    path: Path
    file_size: int
    prefix: str
    entries: dict[str, _Entry]  # by lower-cased name
    pickle_bytes: bytes

    def storage_offset(self, key: str, nbytes: int) -> int:
        """File offset of storage ``key``, whose pickle declares ``nbytes`` for it."""
        entry = _find(self.path, self.entries, f"{self.prefix}/data/{key}")
        if entry.compressed:
            raise CorruptCheckpointError(
                f"expected storage entry {entry.name!r} stored uncompressed (torch.save does; a memory map would "
                "read the compressed bytes), found it compressed", self.path)
        if entry.stored_size != entry.size:
            raise CorruptCheckpointError(
                f"expected stored entry {entry.name!r} to have equal sizes, found {entry.stored_size} bytes stored "
                f"for {entry.size}", self.path)
        if entry.size != nbytes:
            raise CorruptCheckpointError(
                f"the pickle declares {nbytes} bytes for storage {entry.name!r}, but its zip entry holds "
                f"{entry.size}", self.path)
        return entry.data_offset


def index_archive(path: Path) -> ArchiveIndex:
    """Read and check the zip directory of ``path`` and the pickle it holds."""
    size = _regular_file_size(path)
    try:
        with zipfile.ZipFile(path) as zf:
            infos = zf.infolist()
            entries = _entries(path, infos, size)
            prefix = infos[0].filename.split("/", 1)[0]
            pkl = _find(path, entries, f"{prefix}/data.pkl")
            if pkl.compressed:
                # torch.save stores it; a compressed one could inflate to any size in memory.
                raise CorruptCheckpointError(f"expected {pkl.name!r} stored uncompressed, found it compressed", path)
            with open(path, "rb") as f:
                f.seek(pkl.data_offset)
                data = f.read(pkl.stored_size)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError, struct.error,
            NotImplementedError) as e:
        raise CorruptCheckpointError(
            f"expected a torch.save zip archive; the file is truncated or not one ({first_line(e)})", path) from None
    return ArchiveIndex(path, size, prefix, entries, data)


def _regular_file_size(path: Path) -> int:
    try:
        st = os.stat(path)
    except OSError as e:
        raise CorruptCheckpointError(f"expected a readable file, got: {e.strerror}", path) from None
    if not stat.S_ISREG(st.st_mode):
        # A FIFO or device would block or never end; DeepSpeed writes plain files.
        found = "a directory" if stat.S_ISDIR(st.st_mode) else "a special file (FIFO, device or socket)"
        raise CorruptCheckpointError(f"expected a regular file, found {found}", path)
    return st.st_size


def _entries(path: Path, infos: list[zipfile.ZipInfo], file_size: int) -> dict[str, _Entry]:
    """Entries by lower-cased name, each checked to lie inside the file."""
    if not infos or "/" not in infos[0].filename:
        raise CorruptCheckpointError("expected a torch.save archive (entries inside one folder), found "
                                     f"{[i.filename for i in infos[:5]]}", path)
    entries: dict[str, _Entry] = {}
    with open(path, "rb") as f:
        for info in infos:
            key = info.filename.lower()
            if key in entries:
                raise CorruptCheckpointError(f"expected unique zip entry names, found {info.filename!r} twice", path)
            f.seek(info.header_offset)
            header = f.read(_LOCAL_HEADER.size)
            if len(header) < _LOCAL_HEADER.size or header[:4] != b"PK\x03\x04":
                raise CorruptCheckpointError(
                    f"zip entry {info.filename!r}: expected a local header at offset {info.header_offset}, found "
                    f"{'the end of the file' if len(header) < _LOCAL_HEADER.size else 'other bytes'} "
                    f"(file size {file_size})", path)
            _, name_len, extra_len = _LOCAL_HEADER.unpack(header)
            data_offset = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
            if data_offset + info.compress_size > file_size:
                raise CorruptCheckpointError(
                    f"zip entry {info.filename!r} claims {info.compress_size} bytes at offset {data_offset}, but the "
                    f"file ends at {file_size}", path)
            entries[key] = _Entry(info.filename, data_offset, info.compress_size, info.file_size,
                                  info.compress_type != zipfile.ZIP_STORED)
    return entries


def _find(path: Path, entries: dict[str, _Entry], name: str) -> _Entry:
    entry = entries.get(name.lower())
    if entry is None:
        shown = sorted(e.name for e in entries.values())[:8]
        raise CorruptCheckpointError(f"expected zip entry {name!r}, found only {shown}", path)
    return entry
