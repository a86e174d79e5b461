"""Pure-torch reference of every native op. Tests hold the native kernels to these."""
from __future__ import annotations

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
    for out, src, src_off, dst_off, length in segments.tolist():
        outs[out][dst_off:dst_off + length].copy_(sources[src][src_off:src_off + length])


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
