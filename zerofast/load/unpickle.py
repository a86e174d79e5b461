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
import bisect
import collections
import io
import math
import os
import pickle
import weakref
from pathlib import Path
from typing import Any, Callable

import torch

from .archive import ArchiveIndex, file_identity, index_archive
from ..base.errors import CorruptCheckpointError, UnsafeCheckpointError, mapping_limit_error, mapping_refused, short_repr
from .pickle_bounds import BoundsExceeded, check_pickle
from .stand_ins import STAND_INS, DeepSpeedRecord, Frozen

INT64_MAX = 2 ** 63 - 1


class Refused(pickle.UnpicklingError):
    def __init__(self, global_name: str):
        super().__init__(f"refused global {global_name}")
        self.global_name = global_name


class _Immutable:
    """No attribute can be set or deleted once made. BUILD (``setattr`` for a slot state) acts
    on whatever the pickle put on the stack, without asking ``find_class``; what it reaches
    must not change: an allowlisted object outlives the load, a storage reference guards the
    bounds of its tensors."""

    __slots__ = ()

    def __setattr__(self, name, value):
        raise AttributeError(f"{type(self).__name__} is read-only")

    __delattr__ = __setattr__


class _StorageType(_Immutable):
    """What ``torch.FloatStorage`` and friends resolve to: only their element dtype matters."""

    __slots__ = ("dtype",)

    def __init__(self, dtype: torch.dtype):
        object.__setattr__(self, "dtype", dtype)


class _Built:
    """Every tensor rebuilt in one file, and their bytes: a file may not rebuild more bytes than
    a small multiple of its own size (320 views of one storage would otherwise each be
    materialized by the consolidation)."""

    def __init__(self, limit: int):
        self.tensors: list[tuple] = []
        self.nbytes = 0
        self.limit = limit


class _StorageRef(_Immutable):
    """A storage as the rebuild functions see it: its bytes (a slice of the file mapping) and
    dtype. Lighter than a TypedStorage, which the rebuild functions do not need."""

    __slots__ = ("mapping", "dtype", "numel", "built")

    def __init__(self, mapping: torch.UntypedStorage, dtype: torch.dtype, numel: int, built: _Built):
        for name, value in (("mapping", mapping), ("dtype", dtype), ("numel", numel),
                            ("built", built)):  # built: shared by the file's storages
            object.__setattr__(self, name, value)


def _rebuild_tensor(storage, storage_offset, size, stride, *_ignored) -> torch.Tensor:
    if not isinstance(storage, _StorageRef):
        raise TypeError(f"expected a storage, got {type(storage).__name__}")
    size, stride = _dims(size), _dims(stride)
    if len(size) != len(stride) or type(storage_offset) is not int or not 0 <= storage_offset <= INT64_MAX:
        raise ValueError(f"expected matching sizes and strides and an offset >= 0, got {short_repr(size)} "
                         f"{short_repr(stride)} {short_repr(storage_offset)}")
    extent = storage_offset + 1 + sum((n - 1) * st for n, st in zip(size, stride)) if all(size) else 0
    numel = math.prod(size)
    if numel > storage.numel:
        # Overlapping strides would let an 18 KB file demand terabytes once anything copies it;
        # saved parameters and buffers never repeat elements.
        raise ValueError(f"a tensor of size {short_repr(size)} has more elements than its {storage.numel}-element "
                         "storage")
    if extent > storage.numel:
        # set_ only checks against the whole mapping; the tensor must stay inside its own entry.
        raise ValueError(f"a tensor of size {short_repr(size)} and stride {short_repr(stride)} at offset "
                         f"{storage_offset} reaches element {extent}, past the end of its {storage.numel}-element "
                         "storage")
    built = storage.built
    built.nbytes += numel * storage.dtype.itemsize
    if built.nbytes > built.limit:
        raise _TooManyViews(built.limit)
    t = torch.empty(0, dtype=storage.dtype)
    t.set_(storage.mapping, storage_offset, size, stride)
    built.tensors.append((t, t.data_ptr(), t.shape, t.stride()))
    return t


class _TooManyViews(BoundsExceeded):
    def __init__(self, limit: int):
        super().__init__(f"its tensors hold more than {limit} bytes in all, more than a small multiple of the file "
                         "(many tensors over one storage)")


def _dims(value) -> tuple[int, ...]:
    # Called twice per tensor: a plain loop, no generator (a quarter of the metadata time of a
    # 50k-tensor checkpoint went here).
    if isinstance(value, (tuple, list)) and len(value) <= 64:
        for d in value:
            if type(d) is not int or not 0 <= d <= INT64_MAX:
                break
        else:
            return tuple(value)
    raise ValueError(f"expected a tuple of at most 64 ints in [0, 2**63), got {short_repr(value)}")


def _rebuild_parameter(data, *_ignored) -> torch.Tensor:
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"expected a tensor, got {type(data).__name__}")
    return data  # the Parameter wrapper and its hooks matter only to training


def _rebuild_from_type_v2(func, new_type, args, state) -> torch.Tensor:
    # DeepSpeed's stage-3 flat groups carry a ``ds_id`` attribute, saved this way; only the
    # tensor matters here. ``func`` is an allowlisted rebuild function resolved by find_class.
    if func not in (REBUILD_TENSOR, REBUILD_PARAMETER) or new_type is not _TENSOR_TYPE \
            or not isinstance(args, tuple):
        raise TypeError("expected a plain tensor rebuild")
    return func(*args)


_TENSOR_TYPE = object()  # what the name ``torch.Tensor`` resolves to
# The pickle sees the rebuild functions through read-only wrappers: BUILD could otherwise
# rewrite a function's ``__defaults__`` or ``__class__`` for every later load in the process.
REBUILD_TENSOR = Frozen(_rebuild_tensor)
REBUILD_PARAMETER = Frozen(_rebuild_parameter)


def _storage_types() -> dict[str, _StorageType]:
    # Quantized storages (QInt8Storage, ...) hold scales that a plain view would drop; DeepSpeed
    # never writes them, so their names are refused like any other global.
    return {f"torch.{name}": _StorageType(dtype)
            for dtype, name in torch.storage._dtype_to_storage_type_map().items() if not name.startswith("Q")}


ALLOWED: dict[str, Any] = {
    # Types CPython defines in C: their attributes cannot be set.
    "collections.OrderedDict": collections.OrderedDict,
    "builtins.set": set,
    "torch.Size": torch.Size,
    "torch.device": torch.device,
    # Only ever compared against: the real class is callable and would build tensors of any size.
    "torch.Tensor": _TENSOR_TYPE,
    "torch._utils._rebuild_tensor": REBUILD_TENSOR,
    "torch._utils._rebuild_tensor_v2": REBUILD_TENSOR,
    "torch._utils._rebuild_parameter": REBUILD_PARAMETER,
    "torch._tensor._rebuild_from_type_v2": Frozen(_rebuild_from_type_v2),
    **{str(v): v for v in vars(torch).values() if isinstance(v, torch.dtype)},
    **_storage_types(),
    **STAND_INS,
}


def resolve_global(module: str, name: str, allowed: dict[str, Any] = ALLOWED) -> Any:
    """The allowlisted object a pickle's global ``module.name`` stands for, or :class:`Refused`.
    Shared by this reader and the native one (``reader.py``)."""
    # Protocol-2 pickles spell Python 3 names the Python 2 way (``__builtin__.eval``);
    # translate as the stock unpickler does, so refusals quote the name that would run.
    if (module, name) in _compat_pickle.NAME_MAPPING:
        module, name = _compat_pickle.NAME_MAPPING[(module, name)]
    elif module in _compat_pickle.IMPORT_MAPPING:
        module = _compat_pickle.IMPORT_MAPPING[module]
    full = f"{module}.{name}"
    if full not in allowed:
        raise Refused(full)
    return allowed[full]


def tensor_byte_limit(index: ArchiveIndex, span: int | None = None) -> int:
    """The bytes all of one archive's tensors may hold together (``span``: the archive's length
    inside a larger file). Tied weights make two names for one tensor; the limit leaves room for
    that and more."""
    return 4 * (index.file_size if span is None else span) + (1 << 20)


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, load_storage: Callable[[object], _StorageRef], allowed: dict[str, Any] = ALLOWED):
        self._stream = io.BytesIO(data)
        super().__init__(self._stream)
        self._load_storage = load_storage
        self._allowed = allowed

    def consumed(self) -> int:
        return self._stream.tell()

    def find_class(self, module: str, name: str) -> Any:
        return resolve_global(module, name, self._allowed)

    def persistent_load(self, pid: object) -> _StorageRef:
        return self._load_storage(pid)


class _Storages:
    """Resolves the pickle's storage references against one private mapping of the file."""

    def __init__(self, path: Path, index: ArchiveIndex, mapping: torch.UntypedStorage | None = None,
                 span: int | None = None):
        self.path = path
        self.index = index
        self.mapping = map_file(path, index.stat) if mapping is None else mapping
        self.made: dict[str, _StorageRef] = {}
        self.declared: dict[str, int] = {}
        self.built = _Built(tensor_byte_limit(index, span))

    def __call__(self, pid: object) -> _StorageRef:
        # A legacy (non-zip) file's references carry a sixth field, a view of another storage,
        # which torch has not written since 0.4 (legacy.py refuses any that is not None).
        if not (isinstance(pid, tuple) and (len(pid) == 5 or len(pid) == 6 and self.index.legacy and pid[5] is None)
                and pid[0] == "storage" and isinstance(pid[1], _StorageType)
                and isinstance(pid[2], str) and type(pid[4]) is int and pid[4] >= 0):
            raise CorruptCheckpointError(f"expected a torch storage reference in the pickle, found {short_repr(pid)}",
                                         self.path)
        _, kind, key, _location, numel = pid[:5]
        dtype = kind.dtype
        if numel > INT64_MAX:
            raise CorruptCheckpointError(f"expected a storage of fewer than 2**63 elements, found {short_repr(numel)}",
                                         self.path)
        nbytes = numel * dtype.itemsize
        if self.declared.setdefault(key, nbytes) != nbytes:
            raise CorruptCheckpointError(
                f"the pickle declares storage {short_repr(key)} twice, with {self.declared[key]} and {nbytes} bytes",
                self.path)
        made = self.made.get(key)
        if made is None:
            made = self.made[key] = self._ref(key, dtype, numel, nbytes)
        elif made.dtype != dtype:
            raise CorruptCheckpointError(f"storage {short_repr(key)} is referenced with two dtypes", self.path)
        return made

    def _ref(self, key: str, dtype: torch.dtype, numel: int, nbytes: int) -> _StorageRef:
        # One storage object per entry, not views of the whole mapping: tensors that share one
        # storage cannot be saved together by torch.save (mixed dtypes) or safetensors.
        offset = self.index.storage_offset(key, nbytes)
        return _StorageRef(self.mapping[offset:offset + nbytes], dtype, numel, self.built)


# The latest mapping of each file, so that the executor can read a mapped tensor's bytes from the
# file itself (csrc/cpu/read_cast.cpp) rather than through the mapping. Weak: this table never
# keeps a mapping alive; the tensors cut out of it do.
_MAPPINGS: dict[str, tuple[weakref.ref, tuple[int, int, int, int]]] = {}


def _remember_mapping(path: Path, mapping: torch.UntypedStorage, st: os.stat_result | None = None) -> None:
    global _ranges
    try:
        _MAPPINGS[str(path)] = (weakref.ref(mapping), file_identity(st or os.stat(path)))
    except (OSError, TypeError):
        _MAPPINGS.pop(str(path), None)
    _ranges = None  # after the insert: a rebuild in between would miss it


def in_file_mapping(path: str, tensor: torch.Tensor) -> bool:
    """Whether contiguous ``tensor`` lies inside a live private mapping of a file made here
    (:func:`map_file`): that of ``path``, or of any other file (a source filed under another
    file than the one it was cut from: NVMe swap files, an expert file). Such memory may have its
    pages dropped once read, since they come back from the file; memory of a file read whole
    (archive.READ_WHOLE_BYTES) or copied must not: dropping it would zero it."""
    if file_location(path, tensor) is not None:
        return True
    if not tensor.is_contiguous():
        return False
    lo = tensor.data_ptr()
    hi = lo + tensor.numel() * tensor.element_size()
    starts, mappings = _mapping_ranges()
    at = bisect.bisect_right(starts, lo) - 1
    if at < 0:
        return False
    # Alive and still where it was: memory freed since the ranges were listed may hold anything now.
    m = mappings[at]()
    return m is not None and m.data_ptr() == starts[at] and hi <= starts[at] + m.nbytes()


# The live mappings' starts, sorted, and a weak reference to each; None once a file is mapped again.
_ranges: tuple[list[int], list[weakref.ref]] | None = None


def _mapping_ranges() -> tuple[list[int], list[weakref.ref]]:
    global _ranges
    ranges = _ranges
    if ranges is None:
        live = []
        for key, (ref, _) in list(_MAPPINGS.items()):  # a snapshot: reader threads may map meanwhile
            m = ref()
            if m is None and _MAPPINGS.get(key, (None,))[0] is ref:
                _MAPPINGS.pop(key, None)  # dead, and not replaced since the snapshot
            elif m is not None and m.nbytes():
                live.append((m.data_ptr(), ref))
        live.sort(key=lambda item: item[0])
        ranges = _ranges = ([lo for lo, _ in live], [ref for _, ref in live])
    return ranges


def file_location(path: str, tensor: torch.Tensor) -> tuple[int, tuple[int, int, int, int]] | None:
    """``(byte offset in the file, file identity)`` of a contiguous ``tensor`` that is a view of
    the live mapping of ``path``; None for anything else (a copy, an older mapping of the file)."""
    entry = _MAPPINGS.get(str(path))
    mapping = entry[0]() if entry else None
    if mapping is None or not tensor.is_contiguous():
        return None
    offset = tensor.data_ptr() - mapping.data_ptr()
    if offset < 0 or offset + tensor.numel() * tensor.element_size() > mapping.nbytes():
        return None
    return offset, entry[1]


def load_archive(path: Path) -> Any:
    """Unpickle one ``torch.save`` archive with only allowlisted globals and mapped storages."""
    return load_indexed(path, index_archive(path))


def load_indexed(path: Path, index: ArchiveIndex) -> Any:
    """:func:`load_archive` of a file whose zip directory is already read and checked."""
    return _load(path, index, _Storages(path, index))


def map_file(path: Path, st: os.stat_result | None = None) -> torch.UntypedStorage:
    """One private mapping of ``path``, for :func:`load_embedded_archive` (remembered, so that the
    executor may read the file by offset instead). ``st``: the file's stat, taken before (its zip
    directory's, not two more system calls per file of a thousand-file save): a file changed since
    then no longer matches it, and is read through the mapping, never by offset."""
    st = st or os.stat(path)
    size = st.st_size
    try:
        mapping = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=size) if size else \
            torch.UntypedStorage(0)
    except RuntimeError as e:
        if mapping_refused(e):
            raise mapping_limit_error(path) from None
        raise
    _remember_mapping(path, mapping, st)
    return mapping


def load_embedded_archive(path: Path, start: int, length: int, mapping: torch.UntypedStorage) -> Any:
    """Unpickle the ``torch.save`` archive stored in bytes ``[start, start + length)`` of ``path``
    (``mapping``: :func:`map_file` of it), like :func:`load_archive`: its tensors are views of
    the mapping; nothing else of the file is read."""
    index = index_archive(path, start, length)
    return _load(path, index, _Storages(path, index, mapping, length))


def load_pickle(data: bytes, allowed: dict[str, Any], bounded: bool = False) -> Any:
    """Unpickle ``data`` (a pickle without tensors) resolving globals only through ``allowed``,
    after the same bounds pre-pass (unless ``bounded``: the native core's port of it passed
    ``data``): for metadata files that are plain pickles."""
    if not bounded:
        check_pickle(data)

    def no_storages(pid: object):
        raise pickle.UnpicklingError(f"expected no tensor storages in this pickle, found {short_repr(pid)}")

    unpickler = _Unpickler(data, no_storages, allowed)
    result = unpickler.load()
    if unpickler.consumed() != len(data):
        raise pickle.UnpicklingError(f"expected the file to end with its pickle, found "
                                     f"{len(data) - unpickler.consumed()} more bytes")
    return result


def _load(path: Path, index: ArchiveIndex, storages: _Storages) -> Any:
    check_pickle(index.pickle_bytes)
    unpickler = _Unpickler(index.pickle_bytes, storages)
    result = unpickler.load()
    _check_tensors(path, result, storages.built.tensors)
    left = len(index.pickle_bytes) - unpickler.consumed()
    if left:
        # Another reader could parse the tail differently; torch.save writes nothing after STOP.
        raise CorruptCheckpointError(f"expected data.pkl to end with its pickle, found {left} more bytes", path)
    return result


def _check_tensors(path: Path, result: Any, built: list[tuple]) -> None:
    """Every tensor in ``result`` must be one ``_rebuild_tensor`` made, still as it made it.

    The C unpickler's BUILD opcode calls ``__setstate__`` on whatever is on its stack without
    asking ``find_class``; on a tensor that is ``Tensor.set_`` with pickle-supplied sizes, which
    would undo the bounds checks above. There is no hook for BUILD, so the result is checked.
    """
    made = {id(t): (ptr, shape, stride) for t, ptr, shape, stride in built}
    for t in _tensors(result):
        expected = made.get(id(t))
        if expected is None or expected != (t.data_ptr(), t.shape, t.stride()) or t.requires_grad \
                or t._backward_hooks:
            raise UnsafeCheckpointError(
                "refused a tensor the pickle altered after building it (BUILD on a tensor); nothing was executed",
                path)


def _tensors(root: Any):
    """Every tensor reachable from ``root``, however deep; the memo can make cycles."""
    stack, seen = [root], set()
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            yield obj
        elif isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif isinstance(obj, DeepSpeedRecord):
            stack.append(vars(obj))
