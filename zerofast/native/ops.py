"""The rest of the package's door to the native core: the ops ``torch.ops.zerofast.*``, each
through its wrapper here (or the reference when asked for), and :func:`native_module` for the
core's plain functions (the rank-file readers of :mod:`zerofast.load`). Only :mod:`zerofast.native`
(building, loading and checking the core: ``zerofast build``, ``zerofast doctor``) reaches the
core without it.

Each op has its wrapper here and, beside it, its fake (the meta kernel FakeTensor tracing,
``torch.compile`` and ``opcheck`` use); ``restrided`` alone has neither: only the native reader
calls it (csrc/load/unpickle.cpp, handed it by :mod:`.torch_kit`), and its outputs' shapes are its
layout's values, so no fake can know them. A fake needs its op's schema, which exists only once the
core is loaded, so the fakes are declared at module scope but registered when the core first
loads (:func:`load_native`, also reached through :func:`native_module`), not at import as in
``pytorch/extension-cpp``, whose import loads its library. Each wrapper asks for the core once
per call (:func:`native_enabled`). The kernels' knobs (reader threads, huge pages,
copy_file_range) are op arguments, filled from :func:`zerofast.base.settings.settings` here, so an op
is a function of its arguments.

The native core is found, or built for the running torch, on first use (:mod:`.loader`),
so ``import zerofast`` never fails for lack of it. Where it cannot be built, the ops run on the
pure-torch reference (same bytes, slower), with one warning; ``ZEROFAST_NATIVE=1`` makes that an
error instead, and ``ZEROFAST_NATIVE=0`` selects the reference.
"""
from __future__ import annotations

import re
import threading
from contextlib import contextmanager
from typing import Sequence

import torch

from . import reference
from ..devices import device_of
from ..base.errors import DeviceError
from . import loader, proof
from ..base.settings import reader_count, settings

_loaded = False
_FAKES_LOCK = threading.Lock()  # files are read on a pool's threads; fakes are registered once


def native_enabled() -> bool:
    """Whether the ops run natively: the core loads (or builds), and ZEROFAST_NATIVE is not 0."""
    return native_module() is not None


def native_module():
    """The native core's module where the ops run natively (as :func:`load_native`), else None:
    one call for the readers that ask it of every file."""
    core = loader.load()
    if core is None:
        return None
    if not _loaded:
        load_native()
    return core.module


def load_native():
    """The native core's module (built on first use), with ``torch.ops.zerofast`` registered; a
    :class:`NativeExtensionError` that says why if it cannot be had."""
    global _loaded
    module = loader.load(required=True).module
    if not _loaded:
        with _FAKES_LOCK:
            if not _loaded:
                _register_fakes()
                _loaded = True
    return module


def built_devices() -> list[str]:
    """Device types the loaded extension has sound kernels for (``["cpu"]``, ``["cpu", "cuda"]``):
    those it was built with, less any whose check failed at its first call (:func:`resolve_device`)."""
    unsound = loader.unsound_devices()
    load_native()
    return [d for d in proof.kernel_devices() if d not in unsound]


def has_kernels(device: torch.device) -> bool:
    """Whether the native core runs on ``device`` (meta: the fakes)."""
    return device.type in ("cpu", "meta") or (native_enabled() and device.type in built_devices())


def resolve_device(device: str | torch.device) -> torch.device:
    """``device`` as a place the executor can run, or a :class:`DeviceError` that says what is missing.

    A core without kernels for a GPU device is no error: the executor then runs there on torch's
    own operations. The first GPU call of a process checks the core's kernels for it where its
    build could not (no GPU visible then)."""
    entry = device_of(device)
    device = torch.device(device)
    if device.type == "cpu":
        return device
    if not entry.available():
        raise DeviceError(f"device={str(device)!r}: this torch ({torch.__version__}) sees no {device.type.upper()} GPU")
    if native_module() is not None and device.type in proof.kernel_devices():
        loader.device_problem(device.type)
    return device


# ---------------------------------------------------------------------------------------------
# The ops, each wrapper beside its fake. The fakes are registered once the library that defines
# the ops is loaded (a fake needs its op's schema).

_FAKES: list[tuple[str, object]] = []


def _fake(op: str):
    def register(fn):
        _FAKES.append((f"zerofast::{op}", fn))
        return fn
    return register


def _register_fakes() -> None:
    for name, fn in _FAKES:
        if not torch._C._dispatch_has_kernel_for_dispatch_key(name, "Meta"):
            torch.library.register_fake(name)(fn)


def gather_cast(sources: Sequence[torch.Tensor], segments: torch.Tensor, out: torch.Tensor,
                stream_sources: bool = False) -> None:
    """See the schema in csrc/zerofast.cpp. ``stream_sources`` only changes memory behaviour.
    On a device the core has no kernels for (a CUDA torch without nvcc), torch's own copies."""
    if not native_enabled() or not has_kernels(out.device):
        reference.gather_cast(sources, segments, out)
        return
    torch.ops.zerofast.gather_cast(list(sources), segments, out, stream_sources)


@_fake("gather_cast")
def _gather_cast_fake(sources, segments, out, stream_sources=False) -> None:
    # Writes only into ``out``: nothing to compute for a fake tensor.
    return None


def read_cast(sources: Sequence[torch.Tensor], source_fds: Sequence[int], source_offsets: torch.Tensor,
              segments: torch.Tensor, outs: Sequence[torch.Tensor], readers: int | None = None) -> None:
    """See the schema in csrc/zerofast.cpp. ``readers``: the reader threads (default:
    :func:`~zerofast.base.settings.reader_count` for a batch of unknown residency)."""
    if not native_enabled():  # loads (or builds) the core once, and registers the fakes
        reference.read_cast(sources, source_fds, source_offsets, segments, outs)
        return
    knobs = settings()
    with _os_errors():
        torch.ops.zerofast.read_cast(list(sources), list(source_fds), source_offsets, segments, list(outs),
                                     readers or reader_count(knobs), knobs.hugepages)


@_fake("read_cast")
def _read_cast_fake(sources, source_fds, source_offsets, segments, outs, readers=0, hugepages=True) -> None:
    return None


def read_cast_new(sources: Sequence[torch.Tensor], source_fds: Sequence[int], source_offsets: torch.Tensor,
                  segments: torch.Tensor, dims: Sequence[int], ranks: Sequence[int],
                  dtype: torch.dtype, readers: int | None = None) -> list[torch.Tensor]:
    """See the schema in csrc/zerofast.cpp; ``readers`` as :func:`read_cast`'s."""
    if not native_enabled():  # loads (or builds) the core once, and registers the fakes
        return reference.read_cast_new(sources, source_fds, source_offsets, segments, dims, ranks, dtype)
    knobs = settings()
    with _os_errors():
        return torch.ops.zerofast.read_cast_new(list(sources), list(source_fds), source_offsets, segments,
                                                list(dims), list(ranks), dtype, readers or reader_count(knobs),
                                                knobs.hugepages)


@_fake("read_cast_new")
def _read_cast_new_fake(sources, source_fds, source_offsets, segments, dims, ranks, dtype, readers=0,
                        hugepages=True) -> list[torch.Tensor]:
    shapes, pos = [], 0
    for r in ranks:
        shapes.append(dims[pos:pos + r])
        pos += r
    return [torch.empty(shape, dtype=dtype, device=segments.device) for shape in shapes]


def read_cast_to_file(sources: Sequence[torch.Tensor], source_fds: Sequence[int], source_offsets: torch.Tensor,
                      segments: torch.Tensor, out_fd: int, out_offsets: torch.Tensor, out_numels: torch.Tensor,
                      out_dtype: torch.dtype, readers: int | None = None) -> None:
    """See the schema in csrc/zerofast.cpp; ``readers`` as :func:`read_cast`'s. A failed read or
    write raises OSError, as Python's would."""
    if not native_enabled():  # loads (or builds) the core once, and registers the fakes
        reference.read_cast_to_file(sources, source_fds, source_offsets, segments, out_fd, out_offsets, out_numels,
                                    out_dtype)
        return
    knobs = settings()
    with _os_errors():
        torch.ops.zerofast.read_cast_to_file(list(sources), list(source_fds), source_offsets, segments, out_fd,
                                             out_offsets, out_numels, out_dtype, readers or reader_count(knobs),
                                             knobs.copy_file_range)


@_fake("read_cast_to_file")
def _read_cast_to_file_fake(sources, source_fds, source_offsets, segments, out_fd, out_offsets, out_numels,
                            out_dtype, readers=0, copy_file_range=True) -> None:
    return None


def check_ranges(sources: Sequence[torch.Tensor], source_fds: Sequence[int], source_offsets: torch.Tensor,
                 segments: torch.Tensor, numels: torch.Tensor, dtype: torch.dtype, compare: bool,
                 chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """See the schema in csrc/zerofast.cpp: per chunk, ``(counts [C, 5], maxima [C, 2])``."""
    if not native_enabled():  # loads (or builds) the core once, and registers the fakes
        return reference.check_ranges(sources, source_fds, source_offsets, segments, numels, dtype, compare, chunk)
    # Not reader_count: verify's compares are CPU work, and the floor of 16 readers was measured
    # on copies only; unset, this stays torch's thread count, as before.
    with _os_errors():
        return torch.ops.zerofast.check_ranges(list(sources), list(source_fds), source_offsets, segments, numels,
                                               dtype, compare, chunk, settings().readers)


@_fake("check_ranges")
def _check_ranges_fake(sources, source_fds, source_offsets, segments, numels, dtype, compare, chunk,
                       readers=0) -> tuple[torch.Tensor, torch.Tensor]:
    # The chunk count depends on the values of `numels`: a size the fake cannot know.
    chunks = torch.library.get_ctx().new_dynamic_size()
    return (torch.empty((chunks, 5), dtype=torch.int64, device=numels.device),
            torch.empty((chunks, 2), dtype=torch.float64, device=numels.device))


_ERRNO = re.compile(r"^zerofast: (.*) \[errno (\d+)\]$", re.M)


@contextmanager
def _os_errors():
    # The kernels tag I/O failures with their errno, so callers can handle a full disk or a
    # file-size limit as they would from os.write.
    try:
        yield
    except RuntimeError as e:
        m = _ERRNO.search(str(e))
        if m is None:
            raise
        raise OSError(int(m.group(2)), m.group(1)) from None
