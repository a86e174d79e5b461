"""``zerofast.reconstruct``: discover, load safely, plan, execute, and hand back a state dict."""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import torch

from . import ops
from .discover import discover
from .errors import FrozenWeightsAbsentWarning
from .execute import Executor
from .plan import Plan, SourceTable, build_plan, check_dtype
from .safe_load import LoadedCheckpoint, load_checkpoint
from .write import LazyStateDict, eager_state_dict


@dataclass
class Prepared:
    """A checkpoint read and planned: everything but the data movement."""

    checkpoint: LoadedCheckpoint
    plan: Plan
    sources: list[torch.Tensor]
    mapped: list[bool]  # per source: a view of a file mapping, not a copy

    def lazy_executor(self, device: str | torch.device = "cpu") -> Executor:
        """An executor for the lazy mapping: sources it may hand out as views are never dropped;
        the rest are streamed, so reading every tensor once keeps one tensor resident."""
        viewable = {tp.segments[0][0] for tp in self.plan.tensors.values() if Executor.may_view(tp)}
        streamable = [m and i not in viewable for i, m in enumerate(self.mapped)]
        return Executor(self.sources, device, streamable=streamable)

    def streaming_executor(self, device: str | torch.device = "cpu",
                           compute: str | torch.device | None = None) -> Executor:
        """An executor for one pass that hands no source views out (eager dict, export)."""
        return Executor(self.sources, device, streamable=self.mapped, compute=compute)


def prepare(ckpt_dir: str | os.PathLike, dtype: torch.dtype | None = torch.float32, *, tag: str | None = None,
            exclude_frozen: bool = False, warn_absent: bool = True) -> Prepared:
    check_dtype(dtype)
    ckpt = load_checkpoint(discover(ckpt_dir, tag))
    table = SourceTable()
    plan = build_plan(ckpt, table, dtype, exclude_frozen=exclude_frozen)
    if plan.metadata["frozen_excluded"] and not exclude_frozen and warn_absent:
        warn_frozen_absent(plan, ckpt.files.tag_dir)
    return Prepared(ckpt, plan, table.tensors, table.mapped)


def warn_frozen_absent(plan: Plan, where: os.PathLike) -> None:
    named = plan.metadata["absent_frozen"]
    detail = f" (among them {', '.join(named)})" if named else ""
    warnings.warn(FrozenWeightsAbsentWarning(
        f"{where}: saved without its frozen parameters (exclude_frozen_parameters=True, as the HF Trainer saves "
        f"PEFT models){detail}: returning only the {len(plan.tensors)} trainable parameters and buffers it holds"),
        stacklevel=4)


def reconstruct(ckpt_dir: str | os.PathLike, dtype: torch.dtype | None = torch.float32, *, tag: str | None = None,
                lazy: bool = False, exclude_frozen: bool = False, device: str | torch.device = "cpu"):
    """Consolidate a DeepSpeed ZeRO checkpoint into one state dict.

    Args:
        ckpt_dir: the checkpoint root (holding ``latest``) or a tag folder.
        dtype: ``torch.float32`` (default) returns every floating tensor as fp32, frozen weights
            included; ``torch.bfloat16``/``torch.float16`` cast every floating tensor once;
            ``None`` keeps what the checkpoint holds (fp32 masters, frozen weights in the model
            dtype, buffers as stored). Integer and bool buffers always keep their dtype.
        tag: which save to read when the root holds several.
        lazy: return a read-only mapping that builds each tensor when it is looked up.
        exclude_frozen: leave out parameters with ``requires_grad=False`` (e.g. a LoRA base).
        device: where the tensors are built and returned: ``"cpu"``, or ``"cuda"``/``"cuda:N"``
            (gathered and cast on the GPU; needs the extension built with CUDA).

    Returns:
        An ``OrderedDict`` in the model's own ``state_dict()`` order (tied parameters share
        storage), or a :class:`~zerofast.write.LazyStateDict` when ``lazy`` is set.
    """
    device = ops.resolve_device(device)
    prepared = prepare(ckpt_dir, dtype, tag=tag, exclude_frozen=exclude_frozen)
    if lazy:
        return LazyStateDict(prepared.plan, prepared.lazy_executor(device))
    return eager_state_dict(prepared.plan, prepared.streaming_executor(device))
