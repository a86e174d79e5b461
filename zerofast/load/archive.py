"""The zip side of a ``torch.save`` archive, checked before any byte of it is mapped.

A ``torch.save`` file is a zip of stored (uncompressed) entries: ``<prefix>/data.pkl`` and one
``<prefix>/data/<key>`` per storage. The loader (``unpickle.py``) maps the whole file once and
cuts each storage out of the mapping at its entry's data offset; this module establishes those
offsets and checks the things a memory map would otherwise trust: every entry lies inside the
file, no name appears twice (torch's own reader matches names case-insensitively, so two copies
could be read differently by two readers), the pickle and the storages are stored, and each
storage has exactly the size the pickle declares for it.

The native core reads the directory the same way (csrc/load/zip_directory.cpp) without a Python
object per entry. Wherever it declines (a failed check, a name that is not ASCII, and also two
entries sharing bytes, which torch.save never writes), this module's reader decides and words
the verdict.
"""
from __future__ import annotations

import mmap
import os
import stat
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

from . import legacy
from ..native import ops
from ..base.errors import CorruptCheckpointError, NativeExtensionError, first_line, mapping_limit_error, mapping_refused

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
    entries: Mapping[str, _Entry]  # by lower-cased name
    pickle_bytes: bytes
    directory: Any = None  # the native core's ZipDirectory, when it read the zip directory
    stat: os.stat_result | None = None  # the file's, taken before its directory was read
    # The file's bytes, read whole (a file of at most READ_WHOLE_BYTES, by index_archives): the
    # storages are cut from them instead of from a mapping of the file.
    whole: Any = None
    legacy: bool = False  # torch.save's non-zip format (legacy.py): read by the Python reader only

    def storage_offset(self, key: str, nbytes: int) -> int:
        """File offset of storage ``key``, whose pickle declares ``nbytes`` for it."""
        if self.directory is not None:
            offset = self.directory.storage_offset(key, nbytes)
            if offset >= 0:
                return offset
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


def index_archive(path: Path, start: int = 0, length: int | None = None) -> ArchiveIndex:
    """Read and check the zip directory of ``path`` and the pickle it holds. With ``start`` and
    ``length``, the archive is the bytes ``[start, start + length)`` of the file (a DCP ``.distcp``
    file holds one ``torch.save`` archive per item back to back); offsets stay the file's."""
    st = _regular_file(path)
    size = st.st_size
    if start == 0 and length is None and legacy.is_legacy(path):
        return _legacy_index(path, st)
    end = size if length is None else start + length
    native = _native_directory(path, start, end) if 0 <= start <= end <= size else None
    if native is not None:
        directory, data = native
        return ArchiveIndex(path, size, directory.prefix, _NativeEntries(directory), data, directory, st)
    try:
        if not 0 <= start <= end <= size:
            raise _BadZip(f"the archive's bytes [{start}, {end}) are not inside the file ({size} bytes)")
        with open(path, "rb") as f:
            entries = _entries(path, f, _central_directory(f, start, end), start, end)
            prefix = next(iter(entries.values())).name.split("/", 1)[0]
            pkl = _find(path, entries, f"{prefix}/data.pkl")
            if pkl.compressed:
                # torch.save stores it; a compressed one could inflate to any size in memory.
                raise CorruptCheckpointError(f"expected {pkl.name!r} stored uncompressed, found it compressed", path)
            data = os.pread(f.fileno(), pkl.stored_size, pkl.data_offset)
            if len(data) != pkl.stored_size:
                raise EOFError(f"data.pkl ends after {len(data)} of {pkl.stored_size} bytes")
    except (_BadZip, OSError, EOFError, ValueError, struct.error, UnicodeDecodeError) as e:
        if mapping_refused(e):
            raise mapping_limit_error(path) from None
        raise CorruptCheckpointError(
            f"expected a torch.save zip archive; the file is truncated or not one ({first_line(e)})", path) from None
    return ArchiveIndex(path, size, prefix, entries, data, stat=st)


def _legacy_index(path: Path, st: os.stat_result) -> ArchiveIndex:
    """A legacy (non-zip) ``torch.save`` file indexed as an archive whose storages are entries."""
    data, storages = legacy.read_layout(path, st.st_size)
    entries = {}
    for key, (offset, nbytes) in storages.items():
        name = f"{legacy.PREFIX}/data/{key}"
        entries[name.lower()] = _Entry(name, offset, nbytes, nbytes, False)
    return ArchiveIndex(path, st.st_size, legacy.PREFIX, entries, data, stat=st, legacy=True)


# Files of at most this many bytes are read whole by index_archives, not mapped: at that size
# mapping a file, faulting its pages in and unmapping it cost several times the copy (a 4 KiB
# expert file: 14 us against 3 us here), and a file read whole holds no kernel mapping, of which
# a process may hold only vm.max_map_count (65530 by default). What it costs: those files'
# bytes are resident while their trees are alive, at most this much a file.
READ_WHOLE_BYTES = 16 << 10


def index_archives(paths: Sequence[Path]) -> list[ArchiveIndex | None]:
    """:func:`index_archive` of many whole files at once: the native core opens, reads and
    checks them on its threads, without the GIL. None for a file it declines, one that changed
    since its stat, or every file where the core is not there (or fails as a whole): then
    :func:`index_archive` of that file decides, and words the verdict."""
    read = _native("zip_directories")
    if read is None:
        return [None] * len(paths)
    stats = list(map(_stat_or_none, paths))
    wanted = [i for i, st in enumerate(stats) if st is not None and stat.S_ISREG(st.st_mode)]
    try:
        found = read([os.fsencode(paths[i]) for i in wanted], READ_WHOLE_BYTES, _threads())
    except (MemoryError, RuntimeError):
        return [None] * len(paths)
    out: list[ArchiveIndex | None] = [None] * len(paths)
    for i, (ok, directory, data, whole, identity) in zip(wanted, found):
        st = stats[i]
        if ok and identity == file_identity(st):
            out[i] = ArchiveIndex(paths[i], st.st_size, directory.prefix, _NativeEntries(directory), data, directory,
                                  st, whole)
    return out


def _threads() -> int:
    """How many threads the native core reads directories on: torch's intra-op count, as when it
    ran on torch's own pool (torch is loaded wherever the core is)."""
    import torch

    return torch.get_num_threads()


def file_identity(st: os.stat_result) -> tuple[int, int, int, int]:
    """What must not change between reading a file's directory (or mapping it) and reading it
    again: (dev, inode, size, mtime in ns)."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _stat_or_none(path: Path) -> os.stat_result | None:
    try:
        return os.stat(path)
    except (OSError, ValueError):  # ValueError: a NUL in the name
        return None  # index_archive says what is wrong with it


class _BadZip(Exception):
    pass


def _native_directory(path: Path, start: int, end: int) -> tuple[Any, bytes] | None:
    """``(ZipDirectory, data.pkl bytes)`` from the native core, or None where it declines or is not there."""
    read = _native("zip_directory")
    if read is None:
        return None
    ok, directory, data = read(os.fsencode(path), start, end)
    return (directory, data) if ok else None


def _native(name: str) -> Any:
    try:
        return getattr(ops.native_module(), name, None)
    except NativeExtensionError:
        return None


class _NativeEntries(Mapping):
    """A native ZipDirectory's entries as :func:`_entries` returns them, made only when asked for
    (error messages, the Python reader after the native one declines)."""

    def __init__(self, directory: Any) -> None:
        self._directory = directory
        self._made: dict[str, _Entry] | None = None

    def _all(self) -> dict[str, _Entry]:
        if self._made is None:
            self._made = {name.lower(): _Entry(name, offset, stored, size, compressed)
                          for name, offset, stored, size, compressed in self._directory.entries()}
        return self._made

    def __getitem__(self, key: str) -> _Entry:
        return self._all()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._directory)


_EOCD = struct.Struct("<4s4H2LH")  # signature, disks, entries here, entries, directory size, offset, comment
_ZIP64_LOCATOR = struct.Struct("<4sLQL")  # signature, disk, offset of the zip64 end record, disks
_ZIP64_EOCD = struct.Struct("<4sQ2H2L4Q")  # ..., entries here, entries, directory size, directory offset
_CENTRAL = struct.Struct("<4s4H2H3L5H2L")  # one directory entry's fixed part (46 bytes)
_MAX_COMMENT = 0xFFFF


def _central_directory(f, start: int, file_size: int) -> list[tuple[str, int, int, int, bool]]:
    """The zip's central directory, read in one go: ``(name, local header offset, stored size,
    size, compressed)`` per entry. (zipfile parses it entry by entry in Python, which is most of
    the metadata time of a checkpoint with 50k tensors.) Offsets come back relative to ``start``,
    where the archive begins; ``file_size`` is where it ends."""
    tail_size = min(file_size - start, _EOCD.size + _MAX_COMMENT)
    tail = os.pread(f.fileno(), tail_size, file_size - tail_size)
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 or at + _EOCD.size > len(tail):
        raise _BadZip("File is not a zip file: no end of central directory record")
    eocd_pos = file_size - tail_size + at
    _, _, _, _, count, cd_size, cd_offset, _ = _EOCD.unpack_from(tail, at)
    end = eocd_pos
    # torch.save always writes the zip64 records; a saturated field needs them.
    if _has_zip64_locator(f, start, eocd_pos) or count == 0xFFFF or 0xFFFFFFFF in (cd_size, cd_offset):
        count, cd_size, cd_offset, end = _zip64_end(f, start, eocd_pos)
    end -= start
    if cd_offset + cd_size != end:
        raise _BadZip(f"the central directory ({cd_size} bytes at {cd_offset}) does not end where its end record "
                      f"starts ({end})")
    directory = os.pread(f.fileno(), cd_size, start + cd_offset)
    if len(directory) != cd_size:
        raise EOFError("the central directory is cut short")
    out, pos = [], 0
    for _ in range(count):
        (sig, _made, _needed, flags, method, _time, _date, _crc, csize, usize, name_len, extra_len, comment_len,
         _disk, _iattr, _eattr, offset) = _CENTRAL.unpack_from(directory, pos)
        if sig != b"PK\x01\x02":
            raise _BadZip(f"expected a central directory entry at offset {cd_offset + pos}")
        name_at = pos + _CENTRAL.size
        name = directory[name_at:name_at + name_len].decode("utf-8" if flags & 0x800 else "cp437")
        extra = directory[name_at + name_len:name_at + name_len + extra_len]
        if 0xFFFFFFFF in (csize, usize, offset):
            usize, csize, offset = _zip64_fields(extra, usize, csize, offset)
        out.append((name, offset, csize, usize, method != 0))
        pos = name_at + name_len + extra_len + comment_len
    if pos != cd_size:
        raise _BadZip(f"the central directory holds {cd_size - pos} bytes past its {count} entries")
    return out


def _has_zip64_locator(f, start: int, eocd_pos: int) -> bool:
    at = eocd_pos - _ZIP64_LOCATOR.size
    return at >= start and os.pread(f.fileno(), 4, at) == b"PK\x06\x07"


def _zip64_end(f, start: int, eocd_pos: int) -> tuple[int, int, int, int]:
    at = eocd_pos - _ZIP64_LOCATOR.size
    locator = os.pread(f.fileno(), _ZIP64_LOCATOR.size, at) if at >= start else b""
    if len(locator) != _ZIP64_LOCATOR.size or locator[:4] != b"PK\x06\x07":
        raise _BadZip("the end record asks for zip64 but there is no zip64 locator")
    _, _, record_at, _ = _ZIP64_LOCATOR.unpack(locator)
    record_at += start
    record = os.pread(f.fileno(), _ZIP64_EOCD.size, record_at)
    if len(record) != _ZIP64_EOCD.size or record[:4] != b"PK\x06\x06" or record_at + _ZIP64_EOCD.size > at:
        raise _BadZip("expected a zip64 end of central directory record where the locator points")
    *_, count, cd_size, cd_offset = _ZIP64_EOCD.unpack(record)
    return count, cd_size, cd_offset, record_at


def _zip64_fields(extra: bytes, usize: int, csize: int, offset: int) -> tuple[int, int, int]:
    """The 64-bit values of the fields saturated at 0xFFFFFFFF, in the order the format lists them."""
    pos = 0
    while pos + 4 <= len(extra):
        tag, length = struct.unpack_from("<2H", extra, pos)
        if tag == 1:
            values = iter(struct.unpack_from(f"<{length // 8}Q", extra, pos + 4))
            try:
                usize = next(values) if usize == 0xFFFFFFFF else usize
                csize = next(values) if csize == 0xFFFFFFFF else csize
                offset = next(values) if offset == 0xFFFFFFFF else offset
            except StopIteration:
                raise _BadZip("a zip64 extra field is shorter than the fields it replaces") from None
            return usize, csize, offset
        pos += 4 + length
    raise _BadZip("an entry's sizes or offset need a zip64 extra field, and it has none")


def _regular_file(path: Path) -> os.stat_result:
    try:
        st = os.stat(path)
    except OSError as e:
        raise CorruptCheckpointError(f"expected a readable file, got: {e.strerror}", path) from None
    if not stat.S_ISREG(st.st_mode):
        # A FIFO or device would block or never end; DeepSpeed writes plain files.
        found = "a directory" if stat.S_ISDIR(st.st_mode) else "a special file (FIFO, device or socket)"
        raise CorruptCheckpointError(f"expected a regular file, found {found}", path)
    return st


def _entries(path: Path, f, directory: list[tuple[str, int, int, int, bool]], start: int,
             file_size: int) -> dict[str, _Entry]:
    """Entries by lower-cased name, each checked to lie inside the file."""
    if not directory or "/" not in directory[0][0]:
        raise CorruptCheckpointError("expected a torch.save archive (entries inside one folder), found "
                                     f"{[d[0] for d in directory[:5]]}", path)
    entries: dict[str, _Entry] = {}
    # The local headers sit next to their data all over the file: one mapping reads them all
    # without a system call each.
    with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
        for name, header_offset, stored_size, size, compressed in directory:
            header_offset += start
            key = name.lower()
            if key in entries:
                raise CorruptCheckpointError(f"expected unique zip entry names, found {name!r} twice", path)
            if header_offset + _LOCAL_HEADER.size > file_size or view[header_offset:header_offset + 4] != b"PK\x03\x04":
                short = header_offset + _LOCAL_HEADER.size > file_size
                raise CorruptCheckpointError(
                    f"zip entry {name!r}: expected a local header at offset {header_offset}, found "
                    f"{'the end of the file' if short else 'other bytes'} (file size {file_size})", path)
            _, name_len, extra_len = _LOCAL_HEADER.unpack_from(view, header_offset)
            data_offset = header_offset + _LOCAL_HEADER.size + name_len + extra_len
            if data_offset + stored_size > file_size:
                raise CorruptCheckpointError(
                    f"zip entry {name!r} claims {stored_size} bytes at offset {data_offset}, but the "
                    f"file ends at {file_size}", path)
            entries[key] = _Entry(name, data_offset, stored_size, size, compressed)
    return entries


def _find(path: Path, entries: dict[str, _Entry], name: str) -> _Entry:
    entry = entries.get(name.lower())
    if entry is None:
        shown = sorted(e.name for e in entries.values())[:8]
        raise CorruptCheckpointError(f"expected zip entry {name!r}, found only {shown}", path)
    return entry
