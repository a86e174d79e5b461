"""Run a plan's tensors through the native ops, by one path chosen per executor from its
device's registry entry (:mod:`zerofast.devices`):

- :class:`HostPath`: results in host memory, read by the batched ``pread`` reader
  (:class:`~zerofast.execute.read_batch.BatchReader`), which also writes files straight from files;
- :class:`RingPath`: results in a device's memory, through its upload ring (:mod:`.ring`);
- :class:`MappedGather`: the native gather-and-cast op over the source tensors (their mappings),
  a tensor at a time: the path where there is no file reader (an executor over sources alone) or
  where results are built on one device for another's memory (``export(..., device="cuda")``),
  and every path's fallback for an output it does not take (not contiguous, elsewhere).

Every path takes the plan as columns (:class:`~zerofast.plan.columns.PlanTensors`). Nothing here
names a device type: what a device can do is its entry's (``host``, ``streams``).
"""
from __future__ import annotations

import functools
import operator
from typing import TYPE_CHECKING, Callable, Iterator, Protocol, Sequence

import numpy as np
import torch

from ..native import ops
from ..devices import HOST, device_of
from ..plan.columns import PlanTensors
from ..plan.model import SegmentTable, TensorPlan

from .download import Download
from .ring import Ring

if TYPE_CHECKING:
    from .read_batch import BatchReader


class DataPath(Protocol):
    """How an executor makes its results: chosen once, at its construction (:func:`choose_path`)."""

    batch: BatchReader | None  # the file reader where results are host memory (file to file), else None

    def read(self, cols: PlanTensors) -> list[torch.Tensor]:
        """Each tensor of ``cols`` in fresh memory on the executor's device, in its shape."""

    def takes(self, out: torch.Tensor) -> bool:
        """Whether :meth:`read_into` fills ``out`` (else the executor's :class:`MappedGather` does)."""

    def read_into(self, cols: PlanTensors, outs: Sequence[torch.Tensor]) -> None:
        """Each tensor of ``cols`` into the tensor of ``outs`` beside it (each one it :meth:`takes`)."""


class HostPath:
    """Results in host memory: whole passes through the batched reader, a call per output dtype
    and ``read_batch.CALL_ROWS`` segment rows."""

    def __init__(self, reader: BatchReader, device: torch.device):
        self.batch = reader
        self.device = device

    def read(self, cols: PlanTensors) -> list[torch.Tensor]:
        return self.batch.read(cols)

    def takes(self, out: torch.Tensor) -> bool:
        return out.device.type == self.device.type and out.is_contiguous()

    def read_into(self, cols: PlanTensors, outs: Sequence[torch.Tensor]) -> None:
        self.batch.read_into(cols, outs)


class RingPath:
    """Results in a device's memory: pinned slots read in their stored dtype, uploaded and cast
    there (:class:`~.ring.Ring`), the work run in the device's scope."""

    batch = None

    def __init__(self, ring: Callable[[], Ring], device: torch.device):
        self.ring = ring
        self.device = device
        self.scope = device_of(device).scope

    def read(self, cols: PlanTensors) -> list[torch.Tensor]:
        with self.scope(self.device):
            return self.ring().read(cols)

    def takes(self, out: torch.Tensor) -> bool:
        return out.device == self.device and out.is_contiguous()

    def read_into(self, cols: PlanTensors, outs: Sequence[torch.Tensor]) -> None:
        with self.scope(self.device):
            self.ring().read_into(cols, outs)


class MappedGather:
    """The native gather-and-cast op over the source tensors, one tensor at a time, computed on
    ``compute``; a result for another device's memory (a GPU's for host memory) is built on
    ``compute`` and brought back through that device's host buffers (:class:`~.download.Download`)."""

    batch = None

    def __init__(self, sources: Sequence[torch.Tensor], device: torch.device, compute: torch.device,
                 streamable: Sequence[bool] | None, ring: Callable[[], Ring] | None):
        self.sources = sources
        self.device = device
        self.compute = compute
        self.streamable = streamable
        self.ring = ring  # the compute device's upload ring (None: no file reader, or no ring there)
        self._to_host: Download | None = None  # downloads from the compute device, made on first use

    def read(self, cols: PlanTensors) -> list[torch.Tensor]:
        outs = []
        for tp in cols.values():
            out = torch.empty(tp.numel, dtype=tp.out_dtype, device=self.device)
            self.into(tp, out)
            outs.append(out.view(tp.shape))
        return outs

    def takes(self, out: torch.Tensor) -> bool:
        return False

    def read_into(self, cols: PlanTensors, outs: Sequence[torch.Tensor]) -> None:
        for tp, out in zip(cols.values(), outs):
            self.into(tp, out.view(-1))

    def into(self, tp: TensorPlan, flat: torch.Tensor) -> None:
        """``tp`` into ``flat`` (1-D, of its numel and output dtype); elements no segment writes
        keep what they held."""
        if not tp.segments:
            return
        sources, segments = self._local(tp)
        if self.compute.type != flat.device.type:
            self._elsewhere(tp, sources, segments, flat)
        else:
            ops.gather_cast(sources, segments, flat, stream_sources=self._streams(tp))

    def _elsewhere(self, tp: TensorPlan, sources: list[torch.Tensor], segments: torch.Tensor,
                   flat: torch.Tensor) -> None:
        """Build the tensor on the compute device, then bring it back into ``flat`` (host memory)
        through that device's host buffers (:class:`~.download.Download`)."""
        device = device_of(self.compute)
        with device.scope(self.compute):
            # Elements no segment writes must keep what ``flat`` holds, as on the host.
            covered = sum(s[3] for s in tp.segments) == tp.numel
            if covered and self.ring is not None and not ops.has_kernels(self.compute):
                # No kernels of ours there (a CUDA torch without nvcc): the ring, torch's copies.
                ring = self.ring()
                scratch = ring.streams.empty(tuple(flat.shape), flat.dtype)
                ring.read_into(PlanTensors.of([tp]), [scratch])
            else:
                scratch = torch.empty_like(flat, device=self.compute) if covered else flat.to(self.compute)
                ops.gather_cast(sources, segments, scratch, stream_sources=self._streams(tp))
            if self._to_host is None:
                self._to_host = Download(device.streams(self.compute))
            self._to_host(scratch, flat)

    def _streams(self, tp: TensorPlan) -> bool:
        return self.streamable is not None and all(self.streamable[s[0]] for s in tp.segments)

    def _local(self, tp: TensorPlan) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Renumber the sources one tensor uses, so the op gets a short list."""
        index: dict[int, int] = {}
        rows = []
        for src, src_off, dst_off, length in tp.segments:
            rows.append((index.setdefault(src, len(index)), src_off, dst_off, length))
        sources = [self.sources[s] for s in index]
        return sources, torch.tensor(rows, dtype=torch.int64).reshape(-1, 4)


class RingOf:
    """The upload ring of one device over one file reader, made on first use and kept (its pinned
    slots serve every pass); shared by an executor's paths, and holding none of them."""

    def __init__(self, device: torch.device, reader: BatchReader):
        self.device = device
        self.reader = reader
        self.made: Ring | None = None

    def __call__(self) -> Ring:
        if self.made is None:
            self.made = Ring(device_of(self.device).streams(self.device), self.reader)
        return self.made


def choose_path(device: torch.device, compute: torch.device, reader: BatchReader | None,
                gather: MappedGather, ring: RingOf | None) -> DataPath:
    """The one path of an executor, from the registry entries of its ``device`` (where results
    live) and ``compute`` (where they are made): the batched reader where both are host memory,
    the upload ring where both are one device that has one, the mapped gather otherwise (no file
    reader; results made on one device for another)."""
    place, where = device_of(device), device_of(compute)
    if reader is None:
        return gather
    if place.host and where.host:
        return HostPath(reader, device)
    if compute == device and ring is not None:  # a ring there: the entry has streams
        return RingPath(ring, device)
    return gather


class Executor:
    """Materializes :class:`TensorPlan` entries from the source tensors they index, by the one
    :class:`DataPath` its device's registry entry gives it (:func:`choose_path`, at construction).

    With ``streamable`` (one flag per source: is it a private file mapping nobody else holds?),
    the native gather op reads those sources ahead and drops their pages once read, so one pass
    over a checkpoint keeps only the output resident. A source that may be handed to the user as
    a view must not be marked streamable (see ``Prepared.lazy_executor``).

    ``compute`` (default: ``device``) is where the results are made. A GPU computing results
    for host memory (``export(..., device="cuda")``) builds each tensor there and copies it back
    through its device's host buffers (:class:`MappedGather`).

    ``batch`` (a :class:`~zerofast.execute.read_batch.BatchReader`, kept as :attr:`reader`) makes
    reads run through native calls that ``pread`` the checkpoint files instead of touching their
    mappings: in host memory a whole pass (:meth:`run_plan`) is a call per output dtype and
    ``read_batch.CALL_ROWS`` segment rows (:class:`HostPath`); on a device it goes through the
    device's upload ring (:class:`RingPath`). :attr:`batch` is that reader only where results
    are built in host memory by it (file writers use it to go straight from file to file).
    """

    def __init__(self, sources: Sequence[torch.Tensor], device: str | torch.device | None = None,
                 streamable: Sequence[bool] | None = None, compute: str | torch.device | None = None,
                 batch: BatchReader | None = None, views: dict[str, tuple[int, int, int]] | None = None):
        self.sources = sources
        # plan name -> where it is viewed from (view_ranges), for the tensors this executor hands
        # out as views of their sources (the lazy mapping's; None: it hands out none)
        self.views = views
        self.device = HOST if device is None else torch.device(device)  # None: the host's memory
        self.compute = self.device if compute is None else torch.device(compute)
        self.streamable = streamable
        self.reader = batch  # the file reader (None: the sources' mappings are all there is)
        # the compute device's upload ring, made on first use (None: no file reader, or no ring there)
        rings = batch is not None and device_of(self.compute).streams is not None
        self._ring = RingOf(self.compute, batch) if rings else None
        self.gather = MappedGather(sources, self.device, self.compute, streamable, self._ring)
        self.path: DataPath = choose_path(self.device, self.compute, batch, self.gather, self._ring)

    @property
    def batch(self) -> BatchReader | None:
        """The file reader where it builds the results in host memory (:class:`HostPath`), else
        None: writers with it write files straight from the checkpoint's files."""
        return self.path.batch

    @property
    def host(self) -> bool:
        """Whether results are host memory (the device's entry says so)."""
        return device_of(self.device).host

    def ring(self) -> Ring:
        """The upload ring of the compute device (kept: its pinned slots serve every pass)."""
        if self._ring is None:
            raise ValueError(f"no upload ring: {'no file reader' if self.reader is None else self.compute}")
        return self._ring()

    def run_plan(self, tensors: PlanTensors) -> list[torch.Tensor]:
        """Every tensor of a plan's ``tensors`` (or a selection of them) in fresh memory, in its
        shape and order, read off the columns."""
        return self.path.read(tensors)

    def file_ranges(self, tps: PlanTensors) -> dict[str, list[tuple[int, int]]]:
        """Which bytes of which files running ``tps`` reads (:meth:`BatchReader.file_ranges`);
        nothing for an executor without a file reader."""
        return self.reader.file_ranges(tps) if self.reader is not None else {}

    def run_into(self, cols: PlanTensors, outs: Sequence[torch.Tensor]) -> None:
        """Each tensor of ``cols`` into the tensor of ``outs`` beside it, as :meth:`run` with
        ``out``: the outputs the path takes (contiguous, in its memory) in one pass, the rest one
        by one through the mapped gather."""
        numels = cols.numels().tolist()
        for name, numel, dtype, out in zip(cols.names, numels, cols.out, outs):
            _check_out(name, numel, dtype, out)  # no flat view needed to ask
        takes = self.path.takes
        mine = [i for i, out in enumerate(outs) if takes(out)]
        if len(mine) == len(outs):
            if outs:
                self.path.read_into(cols, outs)
            return
        if mine:
            self.path.read_into(cols.select(np.array(mine, dtype=np.int64)), [outs[i] for i in mine])
        taken = set(mine)
        for i, out in enumerate(outs):
            if i not in taken:
                self.gather.into(cols.plan_of(i), out.view(-1))

    def run(self, tp: TensorPlan, out: torch.Tensor | None = None) -> torch.Tensor:
        """Write ``tp`` into ``out`` (a fresh tensor when None) and return it in its shape."""
        if out is None:
            return self.path.read(PlanTensors.of([tp]))[0]
        flat = out.view(-1)
        _check_out(tp.name, tp.numel, tp.out_dtype, flat)
        if self.path.takes(out):
            self.path.read_into(PlanTensors.of([tp]), [flat])
        else:
            self.gather.into(tp, flat)
        return out.view(tp.shape)

    def view(self, tp: TensorPlan, where: tuple[int, int, int]) -> torch.Tensor:
        """``tp`` as a view of ``where`` (source, offset, length: see :func:`view_ranges`), on the
        CPU: a tensor stored whole in the requested dtype needs no copy (casting to the dtype a
        tensor already has copies nothing). What ``source[offset:offset + length].view(shape)``
        makes, in one op, not two (a lazy mapping of tens of thousands of small tensors makes
        one per lookup)."""
        source = self.sources[where[0]]
        shape = tuple(tp.shape)
        return source.as_strided(shape, contiguous_strides(shape), source.storage_offset() + where[1])


def _check_out(name: str, numel: int, dtype: torch.dtype, out: torch.Tensor) -> None:
    if out.numel() != numel or out.dtype != dtype:
        raise ValueError(f"out for {name!r} must hold {numel} x {dtype}, got {out.numel()} x {out.dtype}")


@functools.lru_cache(maxsize=4096)
def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``, as torch gives them (a dim of size 0 or 1
    steps as if it were 1)."""
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


def view_ranges(cols: PlanTensors) -> list[tuple[int, int, int] | None]:
    """Per tensor of ``cols``, the ``(source, offset, length)`` it may be viewed from, else None:
    a tensor may be a view where it is one whole range of one source (one row, from its first
    element, of its numel), already in the requested dtype. Read off the columns, the segment
    table whole, no TensorPlan made (a lazy mapping of tens of thousands of tensors asks this of
    all of them)."""
    n = len(cols)
    out: list[tuple[int, int, int] | None] = [None] * n
    same = np.fromiter(map(operator.eq, cols.stored, cols.out), dtype=bool, count=n)
    ok, rows = _whole_rows(cols.table, np.arange(n, dtype=np.int64), cols.numels())
    at = np.flatnonzero(ok & same)
    for i, (src, offset, _, length) in zip(at.tolist(), rows[at].tolist()):
        out[i] = (src, offset, length)
    return out


def _whole_rows(table: SegmentTable, which: np.ndarray, numels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For tensors ``which`` of ``table`` (of ``numels`` elements): whether each is one row that
    fills it from its start, and each one's first row (some row, unused, where it has none)."""
    if not len(table.rows):
        return np.zeros(len(which), dtype=bool), np.zeros((len(which), 4), dtype=np.int64)
    first = table.starts[which]
    one = table.starts[which + 1] - first == 1
    rows = table.rows[np.minimum(first, len(table.rows) - 1)]
    return one & (rows[:, 2] == 0) & (rows[:, 3] == numels), rows


# Host memory a batch read for a GPU (or staged for a model that is not written in place) holds at once.
STAGING_BYTES = 256 << 20


def in_runs(cols: PlanTensors, budget: int) -> Iterator[PlanTensors]:
    """``cols`` in order, in spans of at most ``budget`` bytes (a larger tensor is a span of its own)."""
    lo, size = 0, 0
    for i, nbytes in enumerate(cols.nbytes().tolist()):
        if i > lo and size + nbytes > budget:
            yield cols.span(lo, i)
            lo, size = i, 0
        size += nbytes
    if lo < len(cols):
        yield cols.span(lo, len(cols))
