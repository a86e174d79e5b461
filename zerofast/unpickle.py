"""zerofast's own ``torch.load``: restricted, single pass, memory-mapped.

torch's ``weights_only`` unpickler is written in Python and its storage loader does several
Python calls per storage; a stage-3 checkpoint of a 50k-tensor model spends tens of seconds
there. This loader runs CPython's C unpickler with two hooks of its own:

- ``find_class`` resolves only the globals a DeepSpeed checkpoint names (:data:`ALLOWED`);
  everything else is refused while unpickling, before anything is built, and every way a
  pickle can reach a global (GLOBAL, STACK_GLOBAL, INST, the EXT opcodes) goes through it;
- ``persistent_load`` cuts each storage out of one private mapping of the file, after checking
  that the pickle's byte count equals its zip entry, which lies inside the file.

The tensor rebuild functions are replaced by minimal ones that build a plain tensor view and
drop what zerofast never needs (autograd hooks, subclass state), so nothing a file supplies is
ever called.
"""
from __future__ import annotations

import _compat_pickle
import collections
import io
import pickle
from pathlib import Path
from typing import Any, Callable

import torch

from .archive import ArchiveIndex, index_archive
from .errors import CorruptCheckpointError
from .stand_ins import STAND_INS


class Refused(pickle.UnpicklingError):
    def __init__(self, global_name: str):
        super().__init__(f"refused global {global_name}")
        self.global_name = global_name


class _StorageType:
    """What ``torch.FloatStorage`` and friends resolve to: only their element dtype matters."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype


def _rebuild_tensor(storage, storage_offset, size, stride, *_ignored) -> torch.Tensor:
    if not isinstance(storage, torch.storage.TypedStorage):
        raise TypeError(f"expected a storage, got {type(storage).__name__}")
    # set_ checks that size/stride/offset stay inside the storage.
    t = torch.empty((0,), dtype=storage.dtype)
    return t.set_(storage._untyped_storage, storage_offset, tuple(size), tuple(stride))


def _rebuild_parameter(data, *_ignored) -> torch.Tensor:
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"expected a tensor, got {type(data).__name__}")
    return data  # the Parameter wrapper and its hooks matter only to training


def _rebuild_from_type_v2(func, new_type, args, state) -> torch.Tensor:
    # DeepSpeed's stage-3 flat groups carry a ``ds_id`` attribute, saved this way; only the
    # tensor matters here. ``func`` is an allowlisted rebuild function resolved by find_class.
    if func not in (_rebuild_tensor, _rebuild_parameter) or new_type is not torch.Tensor:
        raise TypeError("expected a plain tensor rebuild")
    return func(*args)


def _storage_types() -> dict[str, _StorageType]:
    return {f"torch.{name}": _StorageType(dtype)
            for dtype, name in torch.storage._dtype_to_storage_type_map().items()}


ALLOWED: dict[str, Any] = {
    "collections.OrderedDict": collections.OrderedDict,
    "builtins.set": set,
    "torch.Size": torch.Size,
    "torch.device": torch.device,
    "torch.Tensor": torch.Tensor,
    "torch._utils._rebuild_tensor": _rebuild_tensor,
    "torch._utils._rebuild_tensor_v2": _rebuild_tensor,
    "torch._utils._rebuild_parameter": _rebuild_parameter,
    "torch._tensor._rebuild_from_type_v2": _rebuild_from_type_v2,
    **{str(v): v for v in vars(torch).values() if isinstance(v, torch.dtype)},
    **_storage_types(),
    **STAND_INS,
}


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, load_storage: Callable[[object], torch.storage.TypedStorage]):
        self._stream = io.BytesIO(data)
        super().__init__(self._stream)
        self._load_storage = load_storage

    def consumed(self) -> int:
        return self._stream.tell()

    def find_class(self, module: str, name: str) -> Any:
        # Protocol-2 pickles spell Python 3 names the Python 2 way (``__builtin__.eval``);
        # translate as the stock unpickler does, so refusals quote the name that would run.
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        elif module in _compat_pickle.IMPORT_MAPPING:
            module = _compat_pickle.IMPORT_MAPPING[module]
        full = f"{module}.{name}"
        if full not in ALLOWED:
            raise Refused(full)
        return ALLOWED[full]

    def persistent_load(self, pid: object) -> torch.storage.TypedStorage:
        return self._load_storage(pid)


class _Storages:
    """Storage views of one file mapping, made once per key (tied tensors share them)."""

    def __init__(self, path: Path, index: ArchiveIndex):
        self.path = path
        self.index = index
        self.mapping = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=index.file_size) \
            if index.file_size else torch.UntypedStorage(0)
        self.made: dict[str, torch.storage.TypedStorage] = {}
        self.declared: dict[str, int] = {}

    def __call__(self, pid: object) -> torch.storage.TypedStorage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _StorageType)
                and isinstance(pid[2], str) and isinstance(pid[4], int) and pid[4] >= 0):
            raise CorruptCheckpointError(f"expected a torch storage reference in the pickle, found {pid!r:.80}",
                                         self.path)
        _, kind, key, _location, numel = pid
        nbytes = numel * kind.dtype.itemsize
        if self.declared.setdefault(key, nbytes) != nbytes:
            raise CorruptCheckpointError(
                f"the pickle declares storage {key!r} twice, with {self.declared[key]} and {nbytes} bytes", self.path)
        if key not in self.made:
            offset = self.index.storage_offset(key, nbytes)
            untyped = self.mapping[offset:offset + nbytes]
            self.made[key] = torch.storage.TypedStorage(wrap_storage=untyped, dtype=kind.dtype, _internal=True)
        made = self.made[key]
        if made.dtype != kind.dtype:
            raise CorruptCheckpointError(f"storage {key!r} is referenced with two dtypes", self.path)
        return made


def load_archive(path: Path) -> Any:
    """Unpickle one ``torch.save`` archive with only allowlisted globals and mapped storages."""
    index = index_archive(path)
    unpickler = _Unpickler(index.pickle_bytes, _Storages(path, index))
    result = unpickler.load()
    left = len(index.pickle_bytes) - unpickler.consumed()
    if left:
        # Another reader could parse the tail differently; torch.save writes nothing after STOP.
        raise CorruptCheckpointError(f"expected data.pkl to end with its pickle, found {left} more bytes", path)
    return result
