"""Run a plan's tensors through the native ops: the batched file reader where there is one, the
gather-and-cast op over the mappings otherwise."""
from __future__ import annotations

import functools
import operator
from typing import TYPE_CHECKING, Iterator, Sequence

import numpy as np
import torch

from ..native import ops
from ..devices import device_of
from ..plan.columns import PlanTensors
from ..plan.model import SegmentTable, TensorPlan

from .ring import Ring

if TYPE_CHECKING:
    from .read_batch import BatchReader


class Executor:
    """Materializes :class:`TensorPlan` entries from the source tensors they index.

    With ``streamable`` (one flag per source: is it a private file mapping nobody else holds?),
    the native op reads those sources ahead and drops their pages once read, so one pass over a
    checkpoint keeps only the output resident. A source that may be handed to the user as a view
    must not be marked streamable (see ``Prepared.lazy_executor``).

    ``compute`` (default: ``device``) is where the gather and cast run. A GPU computing results
    for host memory (``export(..., device="cuda")``) builds each tensor on the GPU and copies it
    back with its device's host copier (:mod:`zerofast.devices`: pinned buffers for CUDA).

    ``batch`` (a :class:`~zerofast.execute.read_batch.BatchReader`) makes every read run through
    native calls that ``pread`` the checkpoint files instead of touching their mappings: a whole
    pass (:meth:`run_all`) is a call per output dtype and ``read_batch.CALL_ROWS`` segment rows,
    one tensor (:meth:`run`) one call. On a
    GPU (``device`` and ``compute`` both one) the reads go through the device's upload ring
    (:mod:`.ring`): pinned slots read in their stored dtype, uploaded and cast there, the read of
    one slot overlapping the upload and cast of others. ``self.batch`` is set only where results
    are built in host memory (file writers use it to go straight from file to file).
    """

    def __init__(self, sources: Sequence[torch.Tensor], device: str | torch.device = "cpu",
                 streamable: Sequence[bool] | None = None, compute: str | torch.device | None = None,
                 batch: BatchReader | None = None, views: dict[str, tuple[int, int, int]] | None = None):
        self.sources = sources
        # plan name -> where it is viewed from (view_ranges), for the tensors this executor hands
        # out as views of their sources (the lazy mapping's; None: it hands out none)
        self.views = views
        self.device = torch.device(device)
        self.compute = self.device if compute is None else torch.device(compute)
        self.streamable = streamable
        self._files = batch  # the file reader, also where results are computed elsewhere (_gather_elsewhere)
        self.reader = batch if self.compute == self.device or self.compute.type == self.device.type == "cpu" else None
        self.batch = self.reader if self.device.type == "cpu" else None
        self._to_host = None  # the compute device's host copier, made on first use
        self._ring: Ring | None = None  # the device's upload ring, made on first use

    def run_all(self, tps: Sequence[TensorPlan]) -> list[torch.Tensor]:
        """Every tensor of ``tps`` (plans picked one by one: a lazy window, a staged run) in fresh
        memory, in its shape; the batched reader takes them as columns (``PlanTensors.of``)."""
        if self.reader is None:
            return [self.run(tp) for tp in tps]
        if self.device.type == "cpu":
            return self.reader.read(PlanTensors.of(tps))
        with device_of(self.device).scope(self.device):
            return self.ring().read(tps)

    def ring(self) -> Ring:
        """The upload ring of the compute device (kept: its pinned slots serve every pass)."""
        if self._ring is None:
            self._ring = Ring(device_of(self.compute).streams(self.compute), self._files)
        return self._ring

    def _on_ring(self, outs: Sequence[torch.Tensor]) -> bool:
        """Whether ``outs`` can be filled through the upload ring: contiguous, on this device."""
        return (self.reader is not None and self.device.type != "cpu" and device_of(self.device).streams is not None
                and all(o.device == self.device and o.is_contiguous() for o in outs))

    def run_plan(self, tensors: PlanTensors) -> list[torch.Tensor]:
        """Every tensor of a plan's ``tensors`` (or a selection of them), in its order, as
        :meth:`run_all` makes them; the batched reader reads them off the columns."""
        if self.reader is not None and self.device.type == "cpu":
            return self.reader.read(tensors)
        return self.run_all(list(tensors.values()))

    def file_ranges(self, tps: PlanTensors) -> dict[str, list[tuple[int, int]]]:
        """Which bytes of which files running ``tps`` reads (:meth:`BatchReader.file_ranges`);
        nothing for an executor without a file reader."""
        return self._files.file_ranges(tps) if self._files is not None else {}

    def run_into(self, tps: Sequence[TensorPlan], outs: Sequence[torch.Tensor]) -> None:
        """Each of ``tps`` into the tensor of ``outs`` beside it, as :meth:`run` with ``out``:
        contiguous CPU ``outs`` in one batched read, contiguous device ``outs`` through the ring."""
        on_host = self.reader is not None and all(o.device.type == "cpu" and o.is_contiguous() for o in outs)
        if not (on_host or self._on_ring(outs)):
            for tp, out in zip(tps, outs):
                self.run(tp, out)
            return
        for tp, out in zip(tps, outs):
            self._check_out(tp, out)  # its numel and dtype: no flat view needed to ask
        if on_host:
            self.reader.read_into(PlanTensors.of(tps), outs)
            return
        with device_of(self.device).scope(self.device):
            self.ring().read_into(tps, outs)

    def run(self, tp: TensorPlan, out: torch.Tensor | None = None) -> torch.Tensor:
        """Write ``tp`` into ``out`` (a fresh tensor when None) and return it in its shape."""
        if out is None and self.reader is not None:
            return self.run_all([tp])[0]
        if out is None:
            out = torch.empty(tp.numel, dtype=tp.out_dtype, device=self.device)
        flat = out.view(-1)
        self._check_out(tp, flat)
        if self.reader is not None and flat.device.type == "cpu" and out.is_contiguous():
            self.reader.read_into(PlanTensors.of([tp]), [flat])
        elif self._on_ring([out]):
            self.run_into([tp], [out])
        elif tp.segments:
            sources, segments = self._local(tp)
            if self.compute.type != flat.device.type:
                self._gather_elsewhere(tp, sources, segments, flat)
            else:
                ops.gather_cast(sources, segments, flat, stream_sources=self._streams(tp))
        return out.view(tp.shape)

    @staticmethod
    def _check_out(tp: TensorPlan, out: torch.Tensor) -> None:
        if out.numel() != tp.numel or out.dtype != tp.out_dtype:
            raise ValueError(f"out for {tp.name!r} must hold {tp.numel} x {tp.out_dtype}, got "
                             f"{out.numel()} x {out.dtype}")

    def _gather_elsewhere(self, tp: TensorPlan, sources: list[torch.Tensor], segments: torch.Tensor,
                          flat: torch.Tensor) -> None:
        """Build the tensor on the compute device (a GPU), then bring it back into ``flat`` (host
        memory) with that device's host copier."""
        device = device_of(self.compute)
        with device.scope(self.compute):
            # Elements no segment writes must keep what ``flat`` holds, as on the CPU.
            covered = sum(s[3] for s in tp.segments) == tp.numel
            if covered and self._files is not None and not ops.has_kernels(self.compute):
                # No kernels of ours there (a CUDA torch without nvcc): the ring, torch's copies.
                scratch = self.ring().streams.empty(tuple(flat.shape), flat.dtype)
                self.ring().read_into([tp], [scratch])
            else:
                scratch = torch.empty_like(flat, device=self.compute) if covered else flat.to(self.compute)
                ops.gather_cast(sources, segments, scratch, stream_sources=self._streams(tp))
            if self._to_host is None:
                self._to_host = device.host_copier()
            self._to_host(scratch, flat)

    def _streams(self, tp: TensorPlan) -> bool:
        return self.streamable is not None and all(self.streamable[s[0]] for s in tp.segments)

    @staticmethod
    def may_view(tp: TensorPlan) -> bool:
        """Whether ``tp`` is one whole range of one source, already in the requested dtype."""
        if len(tp.segments) != 1 or tp.stored_dtype != tp.out_dtype:
            return False
        _, _, dst_off, length = tp.segments[0]
        return dst_off == 0 and length == tp.numel

    def view(self, tp: TensorPlan, where: tuple[int, int, int]) -> torch.Tensor:
        """``tp`` as a view of ``where`` (source, offset, length: see :func:`view_ranges`), on the
        CPU: a tensor stored whole in the requested dtype needs no copy (casting to the dtype a
        tensor already has copies nothing). What ``source[offset:offset + length].view(shape)``
        makes, in one op, not two (a lazy mapping of tens of thousands of small tensors makes
        one per lookup)."""
        source = self.sources[where[0]]
        shape = tuple(tp.shape)
        return source.as_strided(shape, contiguous_strides(shape), source.storage_offset() + where[1])

    def _local(self, tp: TensorPlan) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Renumber the sources one tensor uses, so the op gets a short list."""
        index: dict[int, int] = {}
        rows = []
        for src, src_off, dst_off, length in tp.segments:
            rows.append((index.setdefault(src, len(index)), src_off, dst_off, length))
        sources = [self.sources[s] for s in index]
        return sources, torch.tensor(rows, dtype=torch.int64).reshape(-1, 4)


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
    """Per tensor of ``cols``, the ``(source, offset, length)`` it may be viewed from, where
    :meth:`Executor.may_view`, else None: read off the columns, the segment table whole, no
    TensorPlan made (a lazy mapping of tens of thousands of tensors asks this of all of them)."""
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


def in_runs(tps: Sequence[TensorPlan], budget: int) -> Iterator[list[TensorPlan]]:
    """``tps`` in order, in runs of at most ``budget`` bytes (a larger tensor is a run of its own)."""
    run: list[TensorPlan] = []
    size = 0
    for tp in tps:
        if run and size + tp.nbytes > budget:
            yield run
            run, size = [], 0
        run.append(tp)
        size += tp.nbytes
    if run:
        yield run
