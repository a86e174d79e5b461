"""safetensors, streamed: the header is laid out first and the data region sized up front, then
the executor's batch reader writes each tensor at its offset straight from the checkpoint files
(``copy_file_range``, or ``pwrite`` with the cast fused; see ``zerofast.execute.read_batch``).
Executors without one (a GPU computing) fill a memory-mapped window of the file instead, one
window (``windows.WINDOW_BYTES``) at a time. The data is written once, and memory stays flat whatever
the model size.
"""
from __future__ import annotations

import errno
import json
import os
import struct
from pathlib import Path
from typing import Iterator, Sequence

import torch

from ...dtypes import SAFETENSORS_CODES
from ...errors import ExportError
from ...execute import Executor
from ...plan.model import TensorPlan
from ..outdir import writing
from ..shards import ShardFile
from ..windows import write_windows
from . import TIED_KEY, Advance, WeightFormat

_BATCH_BYTES = 256 << 20


def _code(tp: TensorPlan) -> str:
    try:
        return SAFETENSORS_CODES[tp.out_dtype]
    except KeyError:
        raise ExportError(f"{tp.name!r} has dtype {tp.out_dtype}, which safetensors cannot store; "
                          "use --format torch") from None


def header(items: Sequence[TensorPlan], metadata: dict[str, str]) -> tuple[bytes, list[tuple[TensorPlan, int]]]:
    """The file's first bytes (length prefix and JSON header) and each tensor's data offset.

    safetensors wants the data packed without gaps, so tensors go in by falling itemsize: every
    offset is then a multiple of its tensor's itemsize, and the typed views of the mapping are
    aligned (the header is padded so the data region starts at a multiple of 8).
    """
    head: dict = {"__metadata__": metadata}
    placed = []
    pos = 0
    for tp in sorted(items, key=lambda t: -t.out_dtype.itemsize):
        if tp.name == "__metadata__":
            # The name of the header's metadata entry: the file would lose one or the other.
            raise ExportError("a tensor named '__metadata__' cannot be stored in safetensors, whose header uses that "
                              "name for its metadata; use --format torch")
        head[tp.name] = {"dtype": _code(tp), "shape": list(tp.shape), "data_offsets": [pos, pos + tp.nbytes]}
        placed.append((tp, pos))
        pos += tp.nbytes
    raw = json.dumps(head, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, placed


def write(path: Path, file: ShardFile, metadata: dict[str, str] | None, executor: Executor,
          advance: Advance) -> None:
    head, placed = header(file.items, metadata or {})
    with writing(path), open(path, "w+b") as f:
        f.write(head)
        f.flush()
        _reserve(f.fileno(), len(head) + sum(tp.nbytes for tp, _ in placed))
        if executor.batch is not None:  # read and written by the native op, no mapping on either side
            for batch in _batches(placed, len(head)):
                executor.batch.write(f.fileno(), batch)
                advance(sum(tp.nbytes for tp, _ in batch))
            return
        write_windows(f.fileno(), placed, len(head), executor, advance)


def _reserve(fd: int, size: int) -> None:
    """Allocate the file's blocks up front: a full disk (ENOSPC) or a file-size limit (EFBIG) then
    fails here, as an OSError, rather than killing the process with SIGBUS when a mapped page finds
    no room."""
    try:
        os.posix_fallocate(fd, 0, size)
    except AttributeError:  # no posix_fallocate on this platform
        os.ftruncate(fd, size)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        os.ftruncate(fd, size)


def _batches(placed: Sequence[tuple[TensorPlan, int]], base: int) -> Iterator[list[tuple[TensorPlan, int]]]:
    """(tensor, file offset) in groups of about ``_BATCH_BYTES``: one native call each, and a
    progress report in between."""
    batch: list[tuple[TensorPlan, int]] = []
    size = 0
    for tp, off in placed:
        batch.append((tp, base + off))
        size += tp.nbytes
        if size >= _BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def read(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    # safetensors is an optional dependency (the ``export`` extra): import it only to read.
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(path, framework="pt") as f:
        metadata = f.metadata() or {}
    return load_file(path), metadata


def file_metadata(tied: dict[str, str], count: int) -> dict[str, str]:
    # transformers refuses a safetensors file whose metadata lacks format "pt"
    metadata = {"format": "pt"}
    if tied and count == 1:
        metadata[TIED_KEY] = json.dumps(tied, sort_keys=True)
    return metadata


def index_metadata(tied: dict[str, str]) -> dict:
    return {TIED_KEY: json.dumps(tied, sort_keys=True)} if tied else {}


FORMAT = WeightFormat("safetensors", "model.safetensors", "model-{:05d}-of-{:05d}.safetensors",
                      "model.safetensors.index.json", aliases_in_files=False, write=write, read=read,
                      file_metadata=file_metadata, index_metadata=index_metadata)
