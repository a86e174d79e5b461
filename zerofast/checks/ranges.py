"""The checks run natively: whole batches of tensors through ``zerofast.native.ops.check_ranges``.

A source that can say where its tensors' elements sit (:class:`Located`: the op's sources, file
descriptors and rows) is checked without materializing anything: the op's reader threads pread
each few hundred KiB, count NaN/Inf/non-zero elements and compare with the other side while the
bytes are in cache. It reports per chunk of ``CHUNK`` elements, the cut the Python path uses, so
folding its figures gives the very numbers that path gives (``Difference``, ``Health``).
"""
from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import ContextManager, Iterator, Protocol, Sequence

import torch

from ..native import ops

CHUNK = 1 << 22  # elements per chunk, as ``tensors.cuts``
# Source elements per native call: the op holds a few hundred KiB per reader thread whatever the
# batch, so a batch only bounds the rows built in Python and the per-chunk figures returned.
BATCH_ELEMENTS = 1 << 27
NATIVE_DTYPES = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                           torch.int16, torch.int8, torch.uint8, torch.bool})

Row = tuple[int, int, int, int]  # (source, source offset, tensor offset, length), in elements


@dataclass
class Located:
    """Where some tensors' elements are: the op's sources (with an fd >= 0, only their dtype and
    length count), each source's fd (-1: read the tensor) and byte offset, and each tensor's rows."""

    sources: list[torch.Tensor]
    fds: list[int]
    offsets: list[int]
    rows: dict[str, list[Row]]


class Locatable(Protocol):
    def located(self, names: Sequence[str]) -> ContextManager[Located]: ...


@dataclass
class Figures:
    """The op's per-chunk figures of one tensor: rows of (nan, inf, nonzero, differs, changed)
    and of (max abs, max rel)."""

    counts: list[list[int]]
    maxima: list[list[float]]


def can_check(source) -> bool:
    return hasattr(source, "located")


def figures(side0: Locatable, names0: Sequence[str], numels: Sequence[int], side1: Locatable | None = None,
            names1: Sequence[str] | None = None, dtype: torch.dtype = torch.float32) -> list[Figures]:
    """The op's figures for ``names0`` of ``side0`` (``numels`` elements each), compared element by
    element with ``names1`` of ``side1`` after casting both to ``dtype`` when a second side is given."""
    out: list[Figures] = []
    for lo, hi in _batches(numels):
        with ExitStack() as stack:
            a = stack.enter_context(side0.located(names0[lo:hi]))
            b = stack.enter_context(side1.located(names1[lo:hi])) if side1 is not None else None
            out += _call(a, names0[lo:hi], b, names1[lo:hi] if b else None, numels[lo:hi], dtype)
    return out


def _batches(numels: Sequence[int]) -> Iterator[tuple[int, int]]:
    lo, size = 0, 0
    for i, n in enumerate(numels):
        size += n
        if size >= BATCH_ELEMENTS:
            yield lo, i + 1
            lo, size = i + 1, 0
    if lo < len(numels):
        yield lo, len(numels)


def _call(a: Located, names_a, b: Located | None, names_b, numels, dtype) -> list[Figures]:
    rows = [(t, 0, *r) for t, n in enumerate(names_a) for r in a.rows[n]]
    sources, fds, offsets = list(a.sources), list(a.fds), list(a.offsets)
    if b is not None:
        shift = len(sources)
        rows += [(t, 1, s + shift, so, do, ln) for t, n in enumerate(names_b) for s, so, do, ln in b.rows[n]]
        sources, fds, offsets = sources + b.sources, fds + b.fds, offsets + b.offsets
    counts, maxima = ops.check_ranges(sources, fds, torch.tensor(offsets, dtype=torch.int64),
                                      torch.tensor(rows, dtype=torch.int64).reshape(-1, 6),
                                      torch.tensor(list(numels), dtype=torch.int64), dtype, b is not None, CHUNK)
    counts, maxima = counts.tolist(), maxima.tolist()
    out, pos = [], 0
    for n in numels:
        k = max(1, -(-n // CHUNK))
        out.append(Figures(counts[pos:pos + k], maxima[pos:pos + k]))
        pos += k
    return out


def merged(parts: Sequence[Located]) -> Located:
    """Several :class:`Located` as one, each one's sources after the previous ones'."""
    out = Located([], [], [], {})
    for part in parts:
        shift = len(out.sources)
        out.sources += part.sources
        out.fds += part.fds
        out.offsets += part.offsets
        out.rows.update({n: [(s + shift, so, do, ln) for s, so, do, ln in rows] for n, rows in part.rows.items()})
    return out


class Renumbered:
    """Rows over a long source list renumbered to the sources a batch uses, so each call gets a
    short list."""

    def __init__(self):
        self.index: dict[int, int] = {}

    def rows(self, segments: Sequence[Row]) -> list[Row]:
        return [(self.index.setdefault(s, len(self.index)), so, do, ln) for s, so, do, ln in segments]


@contextmanager
def plan_located(plans, executor, names: Sequence[str]) -> Iterator[Located]:
    """:class:`Located` of plan tensors read by ``executor`` (its batch reader's files where the
    sources are views of them, else the sources in memory)."""
    numbering = Renumbered()
    rows = {n: numbering.rows(plans[n].segments) for n in names}
    used = list(numbering.index)
    reader = executor.batch
    with (reader.opened() if reader is not None else _in_memory(len(executor.sources))) as (fds, offsets):
        yield Located([executor.sources[s].reshape(-1) for s in used], [fds[s] for s in used],
                      [int(offsets[s]) for s in used], rows)


@contextmanager
def _in_memory(n: int) -> Iterator[tuple[list[int], torch.Tensor]]:
    yield [-1] * n, torch.zeros(n, dtype=torch.int64)
