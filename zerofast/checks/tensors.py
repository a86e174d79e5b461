"""Tensors read in bounded chunks, from a checkpoint's plan or from an export's files.

Every check streams. Where both sides can say where their elements sit (``located``), and their
dtypes are ones the native op knows, the checks run in :mod:`.ranges`, inside the native reader;
otherwise a tensor is read ``CHUNK`` elements at a time (a checkpoint's through the native batch
reader, an export's by ``pread`` of its safetensors data) and checked here, with numpy and torch.
Both ways cut a tensor at the same element offsets and report per chunk, so they give the same
figures, and two sources can be walked in lockstep without holding either tensor.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Iterator, Protocol, Sequence, TypeVar

import numpy as np
import torch

from ..execute import Executor
from ..plan.columns import PlanTensors
from ..plan.model import TensorPlan
from .ranges import CHUNK, NATIVE_DTYPES, can_check, figures, plan_located
# At most this much output per native call. Two calls are in flight per source and two sources
# are compared at a time, and the allocator keeps some freed chunks: at 16 MiB a 500M-parameter
# verify stays near 200 MiB above the interpreter (``benchmarks/verify_bench.py``).
BATCH_BYTES = 16 << 20


@dataclass(frozen=True)
class Meta:
    """What a tensor is, known without reading it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str  # "trainable", "frozen", "buffer", "optimizer_state", or "stored" for an export's tensor

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


Chunk = tuple[str, int, torch.Tensor]  # (tensor name, first element, the 1-D chunk)
T = TypeVar("T")


class TensorSource(Protocol):
    """Anything whose tensors the checks read: ``order`` lists the stored names (no aliases)."""

    order: tuple[str, ...]
    aliases: dict[str, str]

    def meta(self, name: str) -> Meta: ...

    def chunks(self, names: Sequence[str]) -> Iterator[Chunk]: ...


def cuts(numel: int) -> list[tuple[int, int]]:
    """The element ranges a tensor is read in; a zero-element tensor is one empty chunk."""
    return [(lo, min(lo + CHUNK, numel)) for lo in range(0, numel, CHUNK)] or [(0, 0)]


def batches(source: TensorSource, names: Sequence[str]) -> Iterator[list[tuple[str, int, int]]]:
    """``(name, first element, past the last)`` of each chunk of ``names``, in batches of about
    :data:`BATCH_BYTES`: what one read hands :func:`ahead` (a tensor may span batches)."""
    batch, size = [], 0
    for name in names:
        meta = source.meta(name)
        for lo, hi in cuts(meta.numel):
            batch.append((name, lo, hi))
            size += (hi - lo) * meta.dtype.itemsize
            if size >= BATCH_BYTES:
                yield batch
                batch, size = [], 0
    if batch:
        yield batch


class PlanSource:
    """Tensors of a plan (a checkpoint's weights, optimizer states or stored model-dtype
    weights), read through ``executor``'s batch reader."""

    def __init__(self, plans: dict[str, TensorPlan], executor: Executor, aliases: dict[str, str] | None = None,
                 order: Iterable[str] | None = None):
        self.plans = plans
        self.executor = executor
        self.aliases = dict(aliases or {})
        self.order = tuple(order if order is not None else plans)

    def meta(self, name: str) -> Meta:
        tp = self.plans[name]
        return Meta(name, tuple(tp.shape), tp.out_dtype, tp.kind)

    def chunks(self, names: Sequence[str]) -> Iterator[Chunk]:
        return ahead(self._run, batches(self, names))

    def located(self, names: Sequence[str]):
        return plan_located(self.plans, self.executor, names)

    def _run(self, batch: list[tuple[str, int, int]]) -> list[Chunk]:
        pieces = [(name, lo, self._piece(name, lo, hi)) for name, lo, hi in batch]
        todo = [tp for _, _, tp in pieces if tp.numel and tp.segments]
        made = iter(self.executor.run_plan(PlanTensors.of(todo))) if todo else iter(())
        out = []
        for name, lo, tp in pieces:
            if tp.numel and tp.segments:
                out.append((name, lo, next(made).reshape(-1)))
            else:  # nothing stored for it (zero elements): zeros, as the executor would leave them
                out.append((name, lo, torch.zeros(tp.numel, dtype=tp.out_dtype)))
        return out

    def _piece(self, name: str, lo: int, hi: int) -> TensorPlan:
        tp = self.plans[name]
        return tp if (lo, hi) == (0, tp.numel) else tp.slice(lo, hi)


def ahead(read: Callable[[T], list[Chunk]], batches: Iterable[T]) -> Iterator[Chunk]:
    """``read`` of each batch, the next one read on a thread while the caller checks this one: the
    native reader and torch's reductions release the GIL, so reading and checking overlap. At most
    two batches are in memory."""
    with ThreadPoolExecutor(1, thread_name_prefix="zerofast-verify") as pool:
        pending = None
        for batch in batches:
            nxt = pool.submit(read, batch)
            if pending is not None:
                yield from pending.result()
            pending = nxt
        if pending is not None:
            yield from pending.result()


def paired(a: TensorSource, b: TensorSource, pairs: Sequence[tuple[str, str]]) -> Iterator[
        tuple[str, str, int, torch.Tensor, torch.Tensor]]:
    """Tensors of two sources (``(name in a, name in b)``, equal shapes), chunk by chunk in lockstep."""
    chunks_b = b.chunks([nb for _, nb in pairs])
    for na, lo, ca in a.chunks([na for na, _ in pairs]):
        nb, lob, cb = next(chunks_b)
        assert lo == lob and ca.numel() == cb.numel(), (na, nb, lo, lob)  # both cut at the same offsets
        yield na, nb, lo, ca, cb


def compare(a: TensorSource, b: TensorSource, pairs: Sequence[tuple[str, str]]) -> dict[tuple[str, str], "Difference"]:
    """How each pair's values differ (a :class:`Difference` per pair, zero counts when equal)."""
    out = {pair: Difference() for pair in pairs}
    native: dict[torch.dtype, list[tuple[str, str]]] = {}
    rest = []
    for na, nb in pairs:
        da, db = a.meta(na).dtype, b.meta(nb).dtype
        if can_check(a) and can_check(b) and da in NATIVE_DTYPES and db in NATIVE_DTYPES:
            # Two dtypes are compared as float64, as Difference.add compares them.
            native.setdefault(da if da == db else torch.float64, []).append((na, nb))
        else:
            rest.append((na, nb))
    for dtype, group in native.items():
        found = figures(a, [na for na, _ in group], [a.meta(na).numel for na, _ in group], b,
                        [nb for _, nb in group], dtype)
        for pair, f in zip(group, found):
            out[pair].add_figures(f.counts, f.maxima, retyped=a.meta(pair[0]).dtype != b.meta(pair[1]).dtype)
    for na, nb, _, ca, cb in paired(a, b, rest):
        out[(na, nb)].add(ca, cb)
    return out


def _raw(t: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous tensor as a numpy array (no copy). The checks reduce and compare
    with numpy: on this project's 2-core machine its single-pass reductions over a 1-D chunk were
    several times faster than torch's; numpy has no bfloat16, so it is handed bytes."""
    return t.reshape(-1).view(torch.uint8).numpy()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    x, y = _raw(a.contiguous()), _raw(b.contiguous())
    if x.nbytes % 8 == 0:  # eight bytes per comparison
        x, y = x.view(np.int64), y.view(np.int64)
    return bool(np.array_equal(x, y))


@dataclass
class Difference:
    """Running comparison of two tensors' values, chunk by chunk."""

    changed: int = 0
    max_abs: float = 0.0
    max_rel: float = 0.0
    differs: bool = False  # any bit differs (a signed zero or a NaN payload counts, though not in ``changed``)

    def add_figures(self, counts: Sequence[Sequence[int]], maxima: Sequence[Sequence[float]],
                    retyped: bool = False) -> None:
        """The native op's per-chunk figures (:mod:`.ranges`), folded as :meth:`add` folds a chunk;
        ``retyped``: the sides' dtypes differ, so their bits do too."""
        self.differs |= retyped
        for (*_, differs, changed), (max_abs, max_rel) in zip(counts, maxima):
            if differs:
                self.differs = True
                self.changed += changed
                self.max_abs, self.max_rel = nan_max(self.max_abs, max_abs), nan_max(self.max_rel, max_rel)

    def add(self, a: torch.Tensor, b: torch.Tensor) -> None:
        if same_bits(a, b):
            return
        self.differs = True
        if a.dtype == torch.bool or b.dtype == torch.bool:
            a, b = a.to(torch.int64), b.to(torch.int64)
        x, y = a.to(torch.float64), b.to(torch.float64)
        same = (x == y) | (x.isnan() & y.isnan())
        self.changed += int(same.numel() - same.sum())
        gap = (x - y).abs().masked_fill(same, 0)
        if gap.numel():
            self.max_abs = nan_max(self.max_abs, float(gap.max()))
            rel = gap / x.abs().clamp_min(torch.finfo(torch.float64).tiny)
            self.max_rel = nan_max(self.max_rel, float(rel.max()))


def nan_max(current: float, new: float) -> float:
    """The larger, a NaN winning: a value against a NaN is a change of unknown size, which
    Python's ``max`` would drop (``max(0.0, nan)`` is 0.0)."""
    return new if math.isnan(new) or new > current else current


# 16-bit floats: the bits of |x| are at least these exactly when x is an infinity or a NaN.
_SPECIAL_16 = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00}


_LOCAL = threading.local()


def _scratch(n: int) -> np.ndarray:
    """A reused uint16 buffer of ``n`` elements (per thread): one chunk's worth, not one per chunk."""
    buf = getattr(_LOCAL, "buf", None)
    if buf is None or buf.size < n:
        buf = _LOCAL.buf = np.empty(max(n, CHUNK), dtype=np.uint16)
    return buf[:n]


def extremes(t: torch.Tensor) -> tuple[bool, bool]:
    """(all elements finite, all elements zero) of a 1-D chunk, in one pass over it: float32's
    min and max propagate NaN and show an infinity; a 16-bit float's largest magnitude bits
    (sign dropped) reach the all-ones exponent exactly for an infinity or a NaN."""
    if t.numel() == 0:
        return True, True
    if t.dtype in _SPECIAL_16:
        raw = _raw(t).view(np.uint16)
        high = int(np.bitwise_and(raw, 0x7FFF, out=_scratch(raw.size)).max())
        return high < _SPECIAL_16[t.dtype], high == 0
    if t.dtype in (torch.float32, torch.float64):
        values = t.numpy()
        low, high = float(values.min()), float(values.max())
        return math.isfinite(low) and math.isfinite(high), low == 0 and high == 0
    if t.is_floating_point():  # other float formats: torch's own reduction
        low, high = (float(v) for v in torch.aminmax(t))
        return math.isfinite(low) and math.isfinite(high), low == 0 and high == 0
    return True, not bool(t.any())


def nonfinite(t: torch.Tensor) -> tuple[int, int]:
    """(NaN count, infinity count) of a chunk."""
    return int(t.isnan().sum()), int(t.isinf().sum())
