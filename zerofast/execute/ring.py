"""Step 4 onto a device (a GPU): file bytes through a ring of reused pinned host buffers.

A pass is a plan's columns (:class:`~zerofast.plan.columns.PlanTensors`), cut into chunks of at
most :data:`SLOT_BYTES` straight from them (element counts, stored dtypes); each slot's read table
is its tensors' rows of the segment table, a piece of a tensor too large for a slot cut from its
rows (:func:`piece_rows`). For chunk ``c`` in slot ``k = c % SLOTS``:

1. the host waits until slot ``k``'s last upload has landed, then the batched reader
   (:class:`~zerofast.execute.read_batch.BatchReader`: several ``pread`` threads) fills pinned
   slot ``k`` with the chunk's elements in their stored dtype, gathered and unpadded there
   (each piece of a partitioned tensor is read straight to its place);
2. the copy stream waits until the compute stream is done with device slot ``k``, then uploads
   the pinned slot into it;
3. the compute stream waits for that upload, then copies each tensor out of the device slot into
   its output, casting on the way (``copy_``: ``Tensor.to`` bit for bit).

Nothing waits for a whole run: while chunk ``c`` is uploaded and cast, the host reads chunk
``c + 1``. Host memory stays at the ring (``SLOTS * SLOT_BYTES`` pinned), device memory at the
outputs plus the ring. The device side is a :class:`~zerofast.devices.streams.Streams`, so the
same ring runs on a GPU and, in tests, on the CPU-backed fake device
(:mod:`zerofast.testing.fake_device`). No device kernel of zerofast's own is needed: a CUDA torch
without nvcc runs this too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np
import torch

from ..native import ops
from ..devices.streams import Streams
from ..plan.columns import PlanTensors
from .read_batch import BatchReader, sources_used

# Four 64 MiB slots: a chunk is large enough that the reader threads' fork and join is a small
# share of its read, and four in flight let the read of one overlap the upload and cast of others.
SLOT_BYTES = 64 << 20
SLOTS = 4
MIN_SLOT_BYTES = 1 << 20


@dataclass(frozen=True)
class Chunk:
    """What one slot holds: tensors ``which`` (indices into the pass) whole, each at its element
    offset ``at`` in the slot, all stored as ``dtype``; or one piece ``[lo, hi)`` of one tensor
    too large for a slot (``lo`` is not None)."""

    dtype: torch.dtype
    which: np.ndarray
    at: np.ndarray
    lo: int | None = None
    hi: int | None = None


def chunks(cols: PlanTensors, slot_bytes: int = SLOT_BYTES) -> Iterator[tuple[Chunk, int]]:
    """The pass ``cols`` cut into chunks in order, each with the bytes it fills: runs of whole
    tensors of one stored dtype, and pieces of a tensor larger than a slot. Read off the
    columns (element counts, stored dtypes): no TensorPlan made."""
    run: list[int] = []
    at: list[int] = []
    used, dtype = 0, None
    for i, (numel, stored) in enumerate(zip(cols.numels().tolist(), cols.stored)):
        item = stored.itemsize
        nbytes = numel * item
        if run and (stored != dtype or used + nbytes > slot_bytes):
            yield Chunk(dtype, np.array(run, dtype=np.int64), np.array(at, dtype=np.int64)), used
            run, at, used = [], [], 0
        if nbytes > slot_bytes:
            step = max(1, slot_bytes // item)
            for lo in range(0, numel, step):
                hi = min(numel, lo + step)
                yield Chunk(stored, np.array([i]), np.array([0]), lo, hi), (hi - lo) * item
            continue
        dtype = stored
        run.append(i)
        at.append(used // item)
        used += nbytes
    if run:
        yield Chunk(dtype, np.array(run, dtype=np.int64), np.array(at, dtype=np.int64)), used


def piece_rows(rows: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """One tensor's segment ``rows`` cut to its elements ``[lo, hi)``, as rows of a 1-D tensor of
    ``hi - lo`` elements (what :meth:`~zerofast.plan.tensor.TensorPlan.slice` makes, as an array)."""
    a = np.maximum(rows[:, 2], lo)
    b = np.minimum(rows[:, 2] + rows[:, 3], hi)
    keep = a < b
    out = rows[keep].copy()
    a, b = a[keep], b[keep]
    out[:, 1] += a - out[:, 2]
    out[:, 2] = a - lo
    out[:, 3] = b - a
    return out


class Ring:
    """The slots of one device and the reader that fills them; reused by every pass of one
    executor (a lazy mapping's lookups each make a pass), so pinned memory is allocated once."""

    def __init__(self, streams: Streams, reader: BatchReader, slots: int | None = None,
                 slot_bytes: int | None = None):
        self.streams = streams
        self.reader = reader
        self.slots = slots or SLOTS
        self.slot_bytes = slot_bytes or SLOT_BYTES
        self._host: list[torch.Tensor] = []
        self._dev: list[torch.Tensor] = []

    def read(self, cols: PlanTensors) -> list[torch.Tensor]:
        """Each tensor of ``cols`` in fresh device memory, in its shape and output dtype."""
        outs = [self.streams.empty(tuple(shape), dtype) for shape, dtype in zip(cols.shapes, cols.out)]
        self.read_into(cols, outs)
        return outs

    def read_into(self, cols: PlanTensors, outs: Sequence[torch.Tensor]) -> None:
        """Each tensor of ``cols`` into the contiguous device tensor of ``outs`` beside it (of its
        numel; any dtype: the copy casts). The chunks are cut from the columns, the slots' read
        tables from the plan's segment table as it is."""
        if not len(cols):
            return
        flats = [o.view(-1) for o in outs]
        table = cols.table
        numels = cols.numels()
        cut = list(chunks(cols, self.slot_bytes))
        self._allocate(max(nbytes for _, nbytes in cut))
        streams = self.streams
        try:
            with self.reader.opened(sources_used([table.rows[:, 0]])) as files:
                self._run(cut, flats, table.rows, table.starts, numels, files)
        finally:
            # Also after an error: no buffer may be dropped or refilled while a copy still uses it.
            streams.finish()

    def _run(self, cut, flats, rows, starts, numels, files) -> None:
        streams = self.streams
        uploaded: list[object | None] = [None] * self.slots
        copied: list[object | None] = [None] * self.slots
        for c, (chunk, nbytes) in enumerate(cut):
            k = c % self.slots
            if uploaded[k] is not None:
                streams.wait(uploaded[k])  # the pinned slot's last upload has landed
            host = self._host[k][:nbytes]
            self._fill(host.view(chunk.dtype), chunk, rows, starts, files)
            dev = self._dev[k][:nbytes]
            uploaded[k] = streams.upload(host, dev, copied[k])
            copied[k] = streams.compute(_casts(chunk, dev.view(chunk.dtype), flats, numels), uploaded[k])

    def _allocate(self, need: int) -> None:
        """Slots of at least ``need`` bytes: a lazy lookup of one small tensor pins a few MiB, not
        the whole ring; the first pass that needs more replaces them (after ``finish``)."""
        size = min(self.slot_bytes, max(min(MIN_SLOT_BYTES, self.slot_bytes), 1 << max(need - 1, 0).bit_length()))
        if not self._host or self._host[0].numel() < size:
            self._host = [self.streams.host_buffer(size) for _ in range(self.slots)]
            self._dev = [self.streams.device_buffer(size) for _ in range(self.slots)]

    def _fill(self, host: torch.Tensor, chunk: Chunk, rows: np.ndarray, starts: np.ndarray,
              files: tuple[list[int], torch.Tensor]) -> None:
        """Read the chunk's elements into ``host`` (the pinned slot, typed), in one batched call;
        its table is the chunk's rows of the pass's segment table, cut where it is a piece."""
        first, last = int(starts[chunk.which[0]]), int(starts[chunk.which[-1] + 1])
        if chunk.lo is not None:
            table = _table(piece_rows(rows[first:last], chunk.lo, chunk.hi), None, chunk.at)
        else:
            table = _table(rows[first:last], np.diff(starts[chunk.which[0]:chunk.which[-1] + 2]), chunk.at)
        if len(table):
            ops.read_cast(self.reader.sources, files[0], files[1], torch.from_numpy(table), [host])


def _table(rows: np.ndarray, counts: np.ndarray | None, at: np.ndarray) -> np.ndarray:
    """The read op's table for one slot as its single output: each tensor's rows with their
    output offsets moved to where the tensor sits in the slot (``counts`` None: one tensor's)."""
    table = np.zeros((len(rows), 5), dtype=np.int64)
    table[:, 1:] = rows
    table[:, 3] += at[0] if counts is None else np.repeat(at, counts)
    return table


def _casts(chunk: Chunk, dev: torch.Tensor, flats: Sequence[torch.Tensor], numels: np.ndarray):
    """The compute stream's work for a chunk: each tensor out of the device slot into its output."""
    def run() -> None:
        if chunk.lo is not None:
            flats[int(chunk.which[0])][chunk.lo:chunk.hi].copy_(dev)
            return
        which = chunk.which.tolist()
        ends = (chunk.at + numels[chunk.which]).tolist()
        # One foreach call, not a copy_ per tensor: a chunk may hold thousands of small tensors.
        torch._foreach_copy_([flats[i] for i in which], [dev[a:b] for a, b in zip(chunk.at.tolist(), ends)])
    return run
