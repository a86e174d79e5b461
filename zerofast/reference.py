"""Pure-torch reference of every native op. Tests hold the native kernels to these."""
from __future__ import annotations

from typing import Sequence

import torch


def gather_cast(sources: Sequence[torch.Tensor], segments: torch.Tensor, out: torch.Tensor) -> None:
    """Reference for ``torch.ops.zerofast.gather_cast``: ``copy_`` casts exactly as ``Tensor.to``."""
    for src, src_off, dst_off, length in segments.tolist():
        out[dst_off:dst_off + length].copy_(sources[src][src_off:src_off + length])
