"""Bytes of the files a node view is made of: skeletons, stubs, byte ranges and the reads and
writes of their pieces (pread, and the punch that frees a stub's filled holes again). Internal to
:mod:`.node_view`, which says what a view is and why, and to the team's transfers over it
(:mod:`zerofast.output.node_writes`)."""
from __future__ import annotations

import contextlib
import ctypes
import json
import os
import struct
from pathlib import Path
from typing import Sequence

from ..base import libc
from ..base.errors import ExportError, ZeroFastError
from ..base.settings import settings
from .archive import READ_WHOLE_BYTES, index_archive

# A file that is not a torch.save archive is sent whole, up to this size. Which storages stay holes
# in a stub and the bytes of one message are settings (ZEROFAST_NODES_HOLE_BYTES, _CHUNK_BYTES).
WHOLE_MAX = 64 << 20
# Storages below this size always come with the skeleton, whatever the setting: scalars (an
# optimizer's ``step``) and small tensors are read as values while planning and writing, not only
# through the plan's ranges.
HOLE_FLOOR = 256

# ---------------------------------------------------------------------------------------------
# Skeletons: a file's bytes less its holes, as one holder sends them to every rank at once.

_LENGTH = struct.Struct("<q")


def skeletons(tag_dir: Path, names: Sequence[str]) -> bytes:
    head, bodies = [], []
    for name in names:
        path = tag_dir / name
        size = os.stat(path).st_size
        file_holes = holes(path, size)
        kept = complement(file_holes, size)
        with open(path, "rb") as f:
            bodies += [pread_exact(f.fileno(), length, offset, path) for offset, length in kept]
        head.append({"name": name, "size": size, "holes": file_holes, "kept": kept})
    header = json.dumps(head).encode()
    return _LENGTH.pack(len(header)) + header + b"".join(bodies)


def parse_skeletons(data: bytes):
    if not data:
        return
    (n,) = _LENGTH.unpack_from(data)
    at = _LENGTH.size + n
    for item in json.loads(data[_LENGTH.size:at]):
        length = sum(l for _, l in item["kept"])
        yield item["name"], item["size"], [tuple(h) for h in item["holes"]], item["kept"], data[at:at + length]
        at += length


def holes(path: Path, size: int) -> list[tuple[int, int]]:
    """The large storages of a torch.save archive; none in a small file or another kind of file."""
    hole_min = max(settings().nodes_hole_bytes, HOLE_FLOOR)
    if size <= max(hole_min, READ_WHOLE_BYTES):  # a file that small is read whole, holes and all, when loaded
        return []
    try:
        index = index_archive(path)
    except ZeroFastError:
        if size <= WHOLE_MAX:
            return []
        raise ExportError(f"expected a torch.save archive to read across the nodes, found another kind of file of "
                          f"{size} bytes; copy it to every node", path) from None
    return sorted((e.data_offset, e.stored_size) for e in index.entries.values()
                  if "/data/" in e.name and e.stored_size >= hole_min)


def write_stub(path: Path, size: int, kept, body: bytes) -> None:
    with open(path, "xb") as f:
        f.truncate(size)  # sparse: the holes take no disk
        at = 0
        for offset, length in kept:
            os.pwrite(f.fileno(), body[at:at + length], offset)
            at += length


# ---------------------------------------------------------------------------------------------
# Ranges and files

def name_in(tag_dir: Path, path: str) -> str | None:
    p = Path(path)
    return p.name if p.parent == tag_dir else None


def merged(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for offset, length in sorted(ranges):
        if length <= 0:
            continue
        if out and offset <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][1], offset + length - out[-1][0])
        else:
            out.append([offset, length])
    return [(o, l) for o, l in out]


def intersect(a: Sequence[tuple[int, int]], b: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The overlap of two sorted, disjoint range lists."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo = max(a[i][0], b[j][0])
        hi = min(a[i][0] + a[i][1], b[j][0] + b[j][1])
        if lo < hi:
            out.append((lo, hi - lo))
        if a[i][0] + a[i][1] < b[j][0] + b[j][1]:
            i += 1
        else:
            j += 1
    return out


def complement(holes: Sequence[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    out, at = [], 0
    for offset, length in holes:
        if offset > at:
            out.append((at, offset - at))
        at = max(at, offset + length)
    if at < size:
        out.append((at, size - at))
    return out


def chunks(pieces: Sequence[tuple[str, int, int]]) -> list[list[tuple[str, int, int]]]:
    """``pieces`` cut into messages of at most ``ZEROFAST_NODES_CHUNK_BYTES``, a piece split where it must."""
    out: list[list[tuple[str, int, int]]] = []
    room, chunk = 0, settings().nodes_chunk_bytes
    for name, offset, length in pieces:
        while length:
            if room == 0:
                out.append([])
                room = chunk
            take = min(room, length)
            out[-1].append((name, offset, take))
            offset, length, room = offset + take, length - take, room - take
    return out


def by_name(chunk: Sequence[tuple[str, int, int]]):
    group: list[tuple[int, int]] = []
    name = None
    for n, offset, length in chunk:
        if n != name and group:
            yield name, group
            group = []
        name = n
        group.append((offset, length))
    if group:
        yield name, group


def pread_exact(fd: int, length: int, offset: int, path: Path) -> bytes:
    data = os.pread(fd, length, offset)
    if len(data) != length:
        raise ExportError(f"the file ended after {offset + len(data)} bytes while it was read for another node",
                          path)
    return data


def read_pieces(path: Path, pieces: Sequence[tuple[int, int]], view: memoryview) -> None:
    """The ``(offset, length)`` pieces of one file, back to back into ``view``: the file opened
    once for all of them (a chunk holds thousands of small pieces of a few files)."""
    with open(path, "rb") as f:
        at = 0
        for offset, length in pieces:
            _pread_into(f.fileno(), view[at:at + length], offset, path)
            at += length


def _pread_into(fd: int, view: memoryview, offset: int, path: Path) -> None:
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n <= 0:
            raise ExportError(f"the file ended after {offset + got} bytes while it was read for another node", path)
        got += n


@contextlib.contextmanager
def keeping_identity(path: Path):
    """Keep the stub's mtime: the reader takes a file whose identity changed since it was mapped
    for one rewritten underneath it (load.archive.file_identity)."""
    st = os.stat(path)
    try:
        yield
    finally:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


_FALLOC_PUNCH = 0x01 | 0x02  # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Free the range's disk blocks; where the filesystem cannot, the bytes stay (disk, not harm)."""
    fallocate = libc.function("fallocate", ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_longlong,
                              ctypes.c_longlong)
    if fallocate is not None:
        fallocate(fd, _FALLOC_PUNCH, offset, length)
