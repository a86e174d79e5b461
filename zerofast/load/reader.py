"""Which reader unpickles a rank file: the native one (csrc/load/) when the extension has it,
the Python reference (:mod:`.unpickle`) otherwise, and whenever the native one declines.

The native reader bounds the pickle without the GIL (a port of :mod:`.pickle_bounds`), then
builds the container tree in C++, keeping storage references native and cutting each tensor
out of the file mapping there: no Python call per storage or tensor. It resolves globals
through the reference's own :func:`~.unpickle.resolve_global` and storages through the same
zip index (the native one of csrc/load/zip_directory.cpp where it read the directory), and accepts only what it builds exactly as the reference would. Anything else (an
opcode outside ``torch.save``'s subset, a global off the allowlist, any failed bound or check)
declines, and the reference reads the file and words the verdict: the exceptions and their
messages are the reference's by construction. ``ZEROFAST_NATIVE=0`` selects the reference.
"""
from __future__ import annotations

import gc
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from .. import ops
from ..errors import NativeExtensionError
from .archive import ArchiveIndex, index_archive
from .stand_ins import DeepSpeedRecord
from .unpickle import ALLOWED, REBUILD_PARAMETER, REBUILD_TENSOR, load_indexed, map_file, resolve_global, \
    tensor_byte_limit


def native_core() -> Callable | None:
    """The native core's reader, or None: ``ZEROFAST_NATIVE=0``, no core, or one built without it."""
    try:
        return getattr(ops.native_module(), "unpickle", None)
    except NativeExtensionError:
        return None  # the first reconstruct says what is missing; reading needs no core


def _hooks(index: ArchiveIndex) -> tuple:
    # The order csrc/load/unpickle.cpp's Hooks expects. A native zip directory is looked up in
    # C++, without a Python call per storage.
    storages = index.storage_offset if index.directory is None else index.directory
    return (resolve_global, storages, REBUILD_TENSOR, REBUILD_PARAMETER,
            ALLOWED["torch._tensor._rebuild_from_type_v2"], ALLOWED["torch.Tensor"],
            type(ALLOWED["torch.FloatStorage"]), DeepSpeedRecord, ALLOWED["collections.OrderedDict"],
            tensor_byte_limit(index))


def read_native(path: Path, index: ArchiveIndex, core: Callable) -> tuple[bool, Any]:
    """``(True, result)``, or ``(False, why)`` where the native reader declines."""
    mapping = map_file(path, index.stat)
    whole = torch.empty(0, dtype=torch.uint8).set_(mapping)
    return core(index.pickle_bytes, whole, _hooks(index))


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


def load_archive(path: Path) -> Any:
    """Unpickle one ``torch.save`` archive with only allowlisted globals and mapped storages."""
    index = index_archive(path)
    core = native_core()
    with collector_paused():
        if core is not None:
            ok, result = read_native(path, index, core)
            if ok:
                return result
        return load_indexed(path, index)
