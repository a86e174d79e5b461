"""Run a plan's tensors through the native gather-and-cast op."""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from .. import ops
from ..devices import device_of
from ..plan.model import TensorPlan

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

    ``batch`` (a :class:`~zerofast.execute.read_batch.BatchReader`) lets whole passes on the CPU run as
    one native call that reads the checkpoint files instead of their mappings.
    """

    def __init__(self, sources: Sequence[torch.Tensor], device: str | torch.device = "cpu",
                 streamable: Sequence[bool] | None = None, compute: str | torch.device | None = None,
                 batch: BatchReader | None = None):
        self.sources = sources
        self.device = torch.device(device)
        self.compute = self.device if compute is None else torch.device(compute)
        self.streamable = streamable
        self.batch = batch if self.device.type == "cpu" and self.compute.type == "cpu" else None
        self._to_host = None  # the compute device's host copier, made on first use

    def run_all(self, tps: Sequence[TensorPlan]) -> list[torch.Tensor]:
        """Every tensor of ``tps`` in fresh memory, in its shape."""
        if self.batch is not None:
            return self.batch.read(tps)
        return [self.run(tp) for tp in tps]

    def run(self, tp: TensorPlan, out: torch.Tensor | None = None) -> torch.Tensor:
        """Write ``tp`` into ``out`` (a fresh tensor when None) and return it in its shape."""
        if out is None:
            out = torch.empty(tp.numel, dtype=tp.out_dtype, device=self.device)
        flat = out.view(-1)
        if flat.numel() != tp.numel or flat.dtype != tp.out_dtype:
            raise ValueError(f"out for {tp.name!r} must hold {tp.numel} x {tp.out_dtype}, got "
                             f"{flat.numel()} x {flat.dtype}")
        if tp.segments:
            sources, segments = self._local(tp)
            if self.compute.type != flat.device.type:
                self._gather_elsewhere(tp, sources, segments, flat)
            else:
                ops.gather_cast(sources, segments, flat, stream_sources=self._streams(tp))
        return out.view(tp.shape)

    def _gather_elsewhere(self, tp: TensorPlan, sources: list[torch.Tensor], segments: torch.Tensor,
                          flat: torch.Tensor) -> None:
        """Build the tensor on the compute device (a GPU), then bring it back into ``flat`` (host
        memory) with that device's host copier."""
        device = device_of(self.compute)
        with device.scope(self.compute):
            # Elements no segment writes must keep what ``flat`` holds, as on the CPU.
            covered = sum(s[3] for s in tp.segments) == tp.numel
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

    def view_or_run(self, tp: TensorPlan) -> torch.Tensor:
        """Like :meth:`run`, but a tensor stored whole in the requested dtype comes back as a view
        of its (memory-mapped) source: casting to the dtype a tensor already has copies nothing."""
        if self.device.type == "cpu" and self.may_view(tp):
            src, src_off, _, length = tp.segments[0]
            return self.sources[src][src_off:src_off + length].view(tp.shape)
        return self.run(tp)

    def _local(self, tp: TensorPlan) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Renumber the sources one tensor uses, so the op gets a short list."""
        index: dict[int, int] = {}
        rows = []
        for src, src_off, dst_off, length in tp.segments:
            rows.append((index.setdefault(src, len(index)), src_off, dst_off, length))
        sources = [self.sources[s] for s in index]
        return sources, torch.tensor(rows, dtype=torch.int64).reshape(-1, 4)
