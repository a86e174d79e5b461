"""Pure-torch reference of every native op. Tests hold the native kernels to these."""
from __future__ import annotations

import errno
import os
from typing import Sequence

import torch


def gather_cast(sources: Sequence[torch.Tensor], segments: torch.Tensor, out: torch.Tensor) -> None:
    """Reference for ``torch.ops.zerofast.gather_cast``: ``copy_`` casts exactly as ``Tensor.to``."""
    for src, src_off, dst_off, length in segments.tolist():
        out[dst_off:dst_off + length].copy_(sources[src][src_off:src_off + length])


def read_cast(sources: Sequence[torch.Tensor], source_fds: Sequence[int], source_offsets: torch.Tensor,
              segments: torch.Tensor, outs: Sequence[torch.Tensor]) -> None:
    """Reference for ``torch.ops.zerofast.read_cast``: reads the tensors, which hold the same bytes
    as the files the native kernel reads."""
    flat = [o.view(-1) for o in outs]  # the kernel indexes each output by element, whatever its shape
    for out, src, src_off, dst_off, length in segments.tolist():
        flat[out][dst_off:dst_off + length].copy_(sources[src][src_off:src_off + length])


def read_cast_to_file(sources: Sequence[torch.Tensor], source_fds: Sequence[int], source_offsets: torch.Tensor,
                      segments: torch.Tensor, out_fd: int, out_offsets: torch.Tensor, out_numels: torch.Tensor,
                      out_dtype: torch.dtype) -> None:
    """Reference for ``torch.ops.zerofast.read_cast_to_file``: each output built in memory, then written."""
    rows: dict[int, list[list[int]]] = {}
    for out, *rest in segments.tolist():
        rows.setdefault(out, []).append([0, *rest])
    for i, mine in rows.items():
        offset, numel = int(out_offsets[i]), int(out_numels[i])
        nbytes = numel * out_dtype.itemsize
        # What the file already holds stays where no row writes, as the native kernel leaves it.
        held = bytearray(os.pread(out_fd, nbytes, offset).ljust(nbytes, b"\0"))
        out = torch.frombuffer(held, dtype=torch.uint8).view(out_dtype) if nbytes else torch.empty(0, dtype=out_dtype)
        read_cast(sources, source_fds, source_offsets, torch.tensor(mine, dtype=torch.int64), [out])
        os.pwrite(out_fd, bytes(held), offset)


def read_cast_new(sources: Sequence[torch.Tensor], source_fds: Sequence[int], source_offsets: torch.Tensor,
                  segments: torch.Tensor, dims: Sequence[int], ranks: Sequence[int],
                  dtype: torch.dtype) -> list[torch.Tensor]:
    """Reference for ``torch.ops.zerofast.read_cast_new``."""
    shapes, pos = [], 0
    flat = list(dims)
    for r in ranks:
        shapes.append(flat[pos:pos + r])
        pos += r
    outs = [torch.empty(s, dtype=dtype) for s in shapes]
    read_cast(sources, source_fds, source_offsets, segments, [o.view(-1) for o in outs])
    return outs


def check_ranges(sources: Sequence[torch.Tensor], source_fds: Sequence[int], source_offsets: torch.Tensor,
                 segments: torch.Tensor, numels: torch.Tensor, dtype: torch.dtype, compare: bool,
                 chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for ``torch.ops.zerofast.check_ranges``: each chunk of each side built whole (from
    the file where a source has one), then counted and compared with torch's own reductions."""
    rows: dict[tuple[int, int], list[list[int]]] = {}
    for t, side, *rest in segments.tolist():
        rows.setdefault((t, side), []).append(rest)
    counts, maxima = [], []
    for t, numel in enumerate(numels.tolist()):
        for lo in range(0, numel, chunk) or [0]:
            hi = min(lo + chunk, numel)
            pieces = [_source_piece(sources, source_fds, source_offsets, r, lo, hi) for r in rows.get((t, 0), [])]
            c, m = _chunk_counts([p for _, p in pieces]), [0.0, 0.0]
            if compare:
                x = _built(pieces, hi - lo, dtype)
                y = _built([_source_piece(sources, source_fds, source_offsets, r, lo, hi)
                            for r in rows.get((t, 1), [])], hi - lo, dtype)
                c[3:], m = _compared(x, y)
            counts.append(c)
            maxima.append(m)
    return (torch.tensor(counts, dtype=torch.int64).reshape(-1, 5),
            torch.tensor(maxima, dtype=torch.float64).reshape(-1, 2))


def _source_piece(sources, fds, offsets, row, lo: int, hi: int) -> tuple[int, torch.Tensor]:
    """(offset in the chunk, the source elements) of one row's part of chunk ``[lo, hi)``."""
    src, src_off, dst_off, length = row
    a, b = max(lo, dst_off), min(hi, dst_off + length)
    if b <= a:
        return 0, sources[src][:0]
    first, n, dtype = src_off + a - dst_off, b - a, sources[src].dtype
    if fds[src] < 0:
        return a - lo, sources[src].reshape(-1)[first:first + n]
    at = int(offsets[src]) + first * dtype.itemsize
    raw = os.pread(fds[src], n * dtype.itemsize, at)
    if len(raw) < n * dtype.itemsize:  # as the native kernel says it, not fewer elements counted
        raise OSError(errno.EIO, f"a checkpoint file ended at offset {at + len(raw)} while reading it: it was "
                                 "truncated after it was opened")
    return a - lo, torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype) if n else sources[src][:0]


def _chunk_counts(pieces: Sequence[torch.Tensor]) -> list[int]:
    nan = sum(int(p.isnan().sum()) for p in pieces if p.is_floating_point())
    inf = sum(int(p.isinf().sum()) for p in pieces if p.is_floating_point())
    nonzero = sum(int(((p != 0) | p.isnan()).sum()) for p in pieces)
    return [nan, inf, nonzero, 0, 0]


def _built(pieces, n: int, dtype: torch.dtype) -> torch.Tensor:
    out = torch.zeros(n, dtype=dtype)
    for at, p in pieces:
        out[at:at + p.numel()].copy_(p)
    return out


def _compared(x: torch.Tensor, y: torch.Tensor) -> tuple[list[int], list[float]]:
    """([differs, changed], [max abs, max rel]) of two chunks, as ``zerofast verify`` defines them."""
    if torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
        return [0, 0], [0.0, 0.0]
    if x.dtype == torch.bool:
        x, y = x.to(torch.int64), y.to(torch.int64)
    x, y = x.to(torch.float64), y.to(torch.float64)
    same = (x == y) | (x.isnan() & y.isnan())
    gap = (x - y).abs().masked_fill(same, 0)
    rel = gap / x.abs().clamp_min(torch.finfo(torch.float64).tiny)
    return [1, int((~same).sum())], [float(gap.max()), float(rel.max())]
