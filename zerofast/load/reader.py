"""Which reader unpickles a rank file: the native one (csrc/load/) when the extension has it,
the Python reference (:mod:`.unpickle`) otherwise, and whenever the native one declines.

The native reader bounds the pickle without the GIL (a port of :mod:`.pickle_bounds`), then
builds the container tree in C++, keeping storage references native and making each tensor
through torch's own API without a Python frame: one DLPack import for a storage's first tensor
where it spans its entry, else ``mapping[offset:offset + nbytes]`` and ``set_`` as the
reference does (csrc/load/ includes no torch header; see native/torch_kit.py). It resolves globals
through the reference's own :func:`~.unpickle.resolve_global` and storages through the same
zip index (the native one of csrc/load/zip_directory.cpp where it read the directory), and accepts only what it builds exactly as the reference would. Anything else (an
opcode outside ``torch.save``'s subset, a global off the allowlist, any failed bound or check)
declines, and the reference reads the file and words the verdict: the exceptions and their
messages are the reference's by construction. ``ZEROFAST_NATIVE=0`` selects the reference.
"""
from __future__ import annotations

import collections
import ctypes
import functools
import gc
import pickle
import struct
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, TypeVar

import torch

from ..native import ops
from ..base.errors import (CorruptCheckpointError, NativeExtensionError, UnsafeCheckpointError, ZeroFastError,
                      first_line, mapping_limit_error, mapping_refused)
from .archive import ArchiveIndex, index_archive, index_archives
from .pickle_bounds import BoundsExceeded
from .stand_ins import DeepSpeedRecord, RefusedState
from .unpickle import ALLOWED, REBUILD_PARAMETER, REBUILD_TENSOR, Refused, load_indexed, map_file, resolve_global, \
    tensor_byte_limit


T = TypeVar("T")


def native_core() -> Callable | None:
    """The native core's reader, or None: ``ZEROFAST_NATIVE=0``, no core, or one built without it."""
    try:
        return getattr(ops.native_module(), "unpickle", None)
    except NativeExtensionError:
        return None  # the first reconstruct says what is missing; reading needs no core


def bounded_natively(data: bytes) -> bool:
    """Whether the native core's bounds pass (the port of :mod:`.pickle_bounds`) passes ``data``:
    then the Python pass need not run before the Python unpickler. False without a core, or
    where it declines (the Python pass then decides and words the verdict)."""
    try:
        bounded = getattr(ops.native_module(), "pickle_bounded", None)
    except NativeExtensionError:
        return False
    return bounded is not None and bounded(data)[0]


def _hooks(index: ArchiveIndex) -> tuple:
    # The order csrc/load/unpickle.cpp's Hooks expects. A native zip directory is looked up in
    # C++, without a Python call per storage.
    storages = index.storage_offset if index.directory is None else index.directory
    return (resolve_global, storages, *_fixed_hooks(), tensor_byte_limit(index))


@functools.cache
def _fixed_hooks() -> tuple:
    """The hooks that are the same for every file (looked up once, not per file of thousands)."""
    return (REBUILD_TENSOR, REBUILD_PARAMETER, ALLOWED["torch._tensor._rebuild_from_type_v2"], ALLOWED["torch.Tensor"],
            type(ALLOWED["torch.FloatStorage"]), DeepSpeedRecord, ALLOWED["collections.OrderedDict"])


def read_native(path: Path, index: ArchiveIndex, core: Callable) -> tuple[bool, Any]:
    """``(True, result)``, or ``(False, why)`` where the native reader declines."""
    return core(index.pickle_bytes, _whole_file(path, index), _hooks(index))


def _whole_file(path: Path, index: ArchiveIndex) -> torch.UntypedStorage:
    """The file's bytes as a storage, which the native reader cuts each tensor's storage out of
    (``mapping[offset:offset + nbytes]``, as the reference does): those
    :func:`~.archive.index_archives` read whole, else its one private mapping (remembered by
    :func:`map_file`)."""
    if index.whole is not None:
        return index.whole.untyped_storage()
    return map_file(path, index.stat)


@contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off meanwhile (nests). A rank file makes hundreds of
    thousands of tuples, dicts and tensors, none of them garbage; while they are alive, every
    full collection walks them all again (a fifth of the native read, and a third of planning
    and building the eager dict of a 50k-tensor save). Nothing here makes reference cycles."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


# Where a plan has at least this many tensors, the heap its rank files' trees left is trimmed.
TRIM_TENSORS = 32768


def release_freed_heap(tensors: int) -> None:
    """Hand the memory the dropped rank-file trees left free back to the system, where the plan
    has ``tensors >= TRIM_TENSORS`` (small trees leave little, and the trim walks the whole heap).

    The C library keeps freed blocks resident for reuse, but blocks freed in a reader thread's
    own arena are never reused by the outputs the main thread makes next, and small holes rarely
    fit them, so without this the peak can hold both. A 200k-tensor ZeRO-3 save, when the zip
    directories were a string per entry: peak RSS 1462 MiB without, 1277 MiB with, for 51 ms;
    since the directory keeps its names in one block, about 20 MiB. A no-op where the C library
    has no ``malloc_trim`` (it is glibc's)."""
    if tensors >= TRIM_TENSORS and (trim := _malloc_trim()) is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Callable | None:
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError, TypeError):  # TypeError: no CDLL(None) where there is no libc to name
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def load_file(path: Path) -> Any:
    """Unpickle one ``torch.save`` file with memory-mapped tensors and only allowlisted globals."""
    with read_errors(path):
        return load_archive(path)


@contextmanager
def read_errors(path: Path) -> Iterator[None]:
    """What reading ``path`` raises, as zerofast's errors naming the file."""
    try:
        yield
    except ZeroFastError:
        raise  # already names its file; some are builtin errors too (OSError, KeyError, ...)
    except _READ_FAILURES as e:
        raise read_error(path, e) from None


# A malformed pickle fails inside the unpickler or a rebuild function with any of the builtin
# ones (bad opcodes, bad arguments, a storage too small for its tensor, ...).
_READ_FAILURES = (Refused, RefusedState, BoundsExceeded, RecursionError, pickle.UnpicklingError, RuntimeError,
                  EOFError, ValueError, OSError, TypeError, IndexError, KeyError, AttributeError, AssertionError,
                  struct.error, UnicodeDecodeError, OverflowError, MemoryError)


def read_error(path: Path, e: BaseException) -> BaseException:
    """The error to raise, naming ``path``, for ``e`` (one of ``_READ_FAILURES``, not a
    zerofast error) raised while reading it."""
    if isinstance(e, Refused):
        return UnsafeCheckpointError(f"refused pickle global {e.global_name!r}: DeepSpeed checkpoints do not need "
                                     "it; nothing was executed", path)
    if isinstance(e, RefusedState):
        return UnsafeCheckpointError(f"refused pickle global {e.global_name!r}: {e.reason}; nothing was executed",
                                     path)
    if isinstance(e, BoundsExceeded):
        return UnsafeCheckpointError(f"refused data.pkl: {e}; nothing was executed", path)
    if isinstance(e, RecursionError):
        return UnsafeCheckpointError("refused data.pkl: its objects nest too deeply; nothing was executed", path)
    if mapping_refused(e):
        return mapping_limit_error(path)
    return CorruptCheckpointError(f"expected a valid pickle in data.pkl, got: {first_line(e)}", path)


def load_archive(path: Path) -> Any:
    """Unpickle one ``torch.save`` archive with only allowlisted globals and mapped storages."""
    return _read(path, index_archive(path))


def load_files(paths: Sequence[Path], then: Callable[[Path, Any], T] | None = None) -> list[T]:
    """``[then(p, load_file(p)) for p in paths]`` (``then`` by default returns the tree) for saves
    of thousands of files: their zip directories are read and checked at once, on the native
    core's threads, small files read whole (:func:`~.archive.index_archives`); then each is
    unpickled in turn. The first file in order that fails (in the reading or in ``then``)
    raises its own error, as the plain loop would."""
    out = []
    indexes = index_archives(paths)
    core = native_core()
    with collector_paused():
        for i, path in enumerate(paths):
            index, indexes[i] = indexes[i], None  # each file's pickle and bytes held only meanwhile
            try:  # as read_errors, without a context manager per file of thousands
                tree = _read_with(core, path, index_archive(path) if index is None else index)
            except ZeroFastError:
                raise
            except _READ_FAILURES as e:
                raise read_error(path, e) from None
            out.append(tree if then is None else then(path, tree))
    return out


def _read(path: Path, index: ArchiveIndex) -> Any:
    with collector_paused():
        return _read_with(native_core(), path, index)


def _read_with(core: Callable | None, path: Path, index: ArchiveIndex) -> Any:
    if core is not None and not index.legacy:
        ok, result = read_native(path, index, core)
        if ok:
            return result
    return load_indexed(path, index)


@dataclass(frozen=True)
class Template:
    """A file the native reader read, kept so that files repeating it can be read as its twins."""

    index: ArchiveIndex
    mapping: torch.UntypedStorage  # the whole file, which the result's storages are cut from
    result: Any
    recipes: Any = None  # the native core's Recipes: what the read made each tensor from, for the twins


# What the copy of a template's tree shares with it: the allowlisted objects, which the
# reference resolves to the same objects too; and the types it knows beyond the builtins.
_SHARED = tuple(ALLOWED.values())
_TYPES = (torch.Size, collections.OrderedDict, DeepSpeedRecord)


class TwinDeclined(Exception):
    """A part of a template's tree that the twin copy does not know (the file is read in full)."""


@dataclass(frozen=True)
class Twin:
    """A file proven to repeat a template's pickle: copies of parts of the template's tree onto
    this file's storages, one memo for all of them, so that parts copied at different times
    make one tree."""

    path: Path
    template: Template
    copier: Any  # the native core's Twin

    def copy(self, part: Any) -> Any:
        """The copy of ``part`` of ``template.result``; :class:`TwinDeclined` where it holds what
        the copy does not know."""
        ok, result = self.copier.copy(part)
        if not ok:
            raise TwinDeclined(result)
        return result

    def tree(self) -> Any:
        """The whole tree: what reading the file would build."""
        return self.copy(self.template.result)


def load_like(path: Path, templates: Sequence[Template], index: ArchiveIndex | None = None
              ) -> tuple[Any, int | Template | None]:
    """Read ``path`` as the twin of the first template it repeats outside its storages, else in full.

    A twin's zip directory, read and checked as any other, holds the template's entries but for
    the archive's folder name, and its data.pkl is the template's but for the storages' device
    strings, which no reader uses (ZeRO-3's per-rank model-states files; ``cuda:<rank>`` on a
    GPU). Its tree is the template's copied, each storage cut from this file's entry of the same
    key: what reading the file would build. Returns ``(Twin, i)`` for a twin of ``templates[i]``
    (the caller copies what it needs); else ``(tree, Template)`` where the native reader read it
    in full (a template for the files after it), or ``(tree, None)``. ``index``: the file's
    :func:`~.archive.index_archive`, where the caller read it already."""
    index = index_archive(path) if index is None else index
    core = ops.native_module() if native_core() is not None and index.directory is not None else None
    if core is None:
        return _read(path, index), None
    whole = _whole_file(path, index)
    with collector_paused():
        for i, t in enumerate(templates):
            # Not smaller than the template: the file's own bound on its tensors' bytes (a
            # multiple of its size) is then at least the bound the template's tree was read under.
            if (index.file_size >= t.index.file_size and core.same_archive(t.index.directory, index.directory)
                    and core.same_pickle(t.index.pickle_bytes, index.pickle_bytes)):
                ok, copier = core.twin(t.mapping, whole, t.index.directory, index.directory, _SHARED, _TYPES,
                                       t.recipes)
                if ok:
                    return Twin(path, t, copier), i
        ok, result, recipes = core.unpickle(index.pickle_bytes, whole, _hooks(index), True)
        if ok:
            return result, Template(index, whole, result, recipes)
        return load_indexed(path, index), None
