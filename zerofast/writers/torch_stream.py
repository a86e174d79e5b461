"""Write a ``torch.save`` file whose tensors are filled by the native executor, streaming.

``torch.save`` needs every tensor in memory. Here the pickle is written first, under
``torch.serialization.skip_data``, with unwritten (never touched, so never resident) tensors
standing for the real ones: torch reserves each storage's bytes in the zip without reading them.
Each storage is then gathered and cast by the executor straight into a memory-mapped window of
its zip entry, one bounded window at a time (:mod:`zerofast.output.windows`, each reserved on
disk before it is mapped), so memory stays flat
whatever the tensor sizes. The pickle names DeepSpeed's classes through :mod:`ds_pickle`.
"""
from __future__ import annotations

import mmap
import struct
import sys
import types
import zipfile
from pathlib import Path
from typing import Any, Callable

import torch
from torch.serialization import skip_data

from ..base.errors import ExportError
from ..execute import Executor
from ..output.transaction import torch_save, writing
from ..output.windows import write_windows
from ..plan import TensorPlan
from . import ds_pickle

_LOCAL_HEADER = struct.Struct("<4s5H3I2H")
_MAPPED_FROM = 1 << 20
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)


class Skeleton:
    """The tensors of one file that the executor fills, keyed by their (fresh) storage."""

    def __init__(self) -> None:
        self.plans: dict[int, TensorPlan] = {}
        self.keep: list[torch.Tensor] = []  # holds the storages alive until the file is written

    def tensor(self, tp: TensorPlan) -> torch.Tensor:
        """A placeholder for ``tp``: its own storage, never written in memory."""
        t = _placeholder(tp.shape, tp.out_dtype, tp.nbytes)
        if tp.numel:
            self.plans[t.untyped_storage().data_ptr()] = tp
            self.keep.append(t)
        return t


def _placeholder(shape: tuple[int, ...], dtype: torch.dtype, nbytes: int) -> torch.Tensor:
    """Memory that is never touched. Large ones are mapped without reserving swap: a tensor larger
    than RAM (a whole model's fp32 partition on one rank) is refused by ``torch.empty`` under the
    kernel's default overcommit heuristic, but not as a mapping nobody writes."""
    if nbytes < _MAPPED_FROM:
        return torch.empty(shape, dtype=dtype)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
    return torch.frombuffer(mapping, dtype=torch.uint8).view(dtype).view(shape)


def write_torch_file(path: Path, obj: Any, skeleton: Skeleton, executor: Executor,
                     advance: Callable[[int], None] | None = None) -> None:
    """Save ``obj`` to ``path`` and fill every placeholder tensor of ``skeleton`` in the file;
    ``advance(nbytes)`` is told of the bytes as they land."""
    keys: dict[str, int] = {}

    def hook(storage, pid) -> None:
        untyped = storage._untyped_storage if hasattr(storage, "_untyped_storage") else storage
        keys[str(pid[2])] = untyped.data_ptr()

    pickler = type("Pickler", (ds_pickle.DeepSpeedNamePickler,), {"storage_hook": staticmethod(hook)})
    module = types.ModuleType(ds_pickle.PICKLE_MODULE.__name__)
    module.Pickler = pickler
    with skip_data():
        torch_save(obj, path, pickle_module=module, pickle_protocol=2)
    with writing(path):
        entries = _entry_offsets(path)
        placed = []
        for key, ptr in keys.items():
            offset, size = entries[key]
            tp = skeleton.plans.get(ptr)
            if tp is None:
                if size:
                    raise ExportError(f"storage {key} ({size} bytes) has no plan to fill it", path)
                continue
            if size != tp.nbytes:
                raise ExportError(f"storage {key} of {tp.name!r} holds {size} bytes, expected {tp.nbytes}", path)
            placed.append((tp, offset))
        placed.sort(key=lambda p: p[1])
        with open(path, "r+b") as f:
            write_windows(f.fileno(), placed, 0, executor, advance)


def _entry_offsets(path: Path) -> dict[str, tuple[int, int]]:
    """Storage key -> (file offset of its bytes, byte count), from the zip's local headers."""
    out = {}
    try:
        with open(path, "rb") as f, zipfile.ZipFile(f) as z:
            for info in z.infolist():
                parts = info.filename.split("/")
                if len(parts) != 3 or parts[1] != "data":
                    continue
                f.seek(info.header_offset)
                header = _LOCAL_HEADER.unpack(f.read(_LOCAL_HEADER.size))
                name_len, extra_len = header[-2], header[-1]
                out[parts[2]] = (info.header_offset + _LOCAL_HEADER.size + name_len + extra_len, info.file_size)
    except (OSError, zipfile.BadZipFile) as e:
        raise ExportError(f"cannot read back the file just written: {e}", path) from e
    return out

