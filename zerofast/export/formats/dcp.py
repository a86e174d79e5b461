"""``zerofast.to_dcp``: a PyTorch Distributed Checkpoint (DCP) folder, straight from a ZeRO save.

The folder is written by torch's own ``FileSystemWriter``, so the format is torch's: a
``.metadata`` file and ``__0_0.distcp``, ``__0_1.distcp`` (one per writer thread). What it holds is what
``torch.distributed.checkpoint.state_dict.get_state_dict(model, optim)`` returns, under the
keys the DCP tutorial (and ``dcp.load`` plus ``set_state_dict``) uses::

    {"model": {fqn: tensor, ...},                       # weights and buffers, tied names too
     "optim": {"state": {fqn: {"exp_avg": t, "exp_avg_sq": t, "step": t}},
               "param_groups": [{"lr": ..., ..., "params": [fqn, ...]}]}}

Nothing is built ahead: the planner hands torch meta tensors (shape and dtype only), and when
the writer asks for a tensor's data (``resolve_data``, called once per tensor as it is written)
zerofast's executor builds that one tensor from the checkpoint files. Peak memory is one
tensor per writer thread plus torch's write buffer.

Measured against copying the save's files (benchmarks/, ``run.py --dcp``): the time goes to
torch's ``write`` of each item's bytes through ``torch.save`` and to the gather before it, two
copies where ``copy_file_range`` makes one; the two writer threads overlap them.
"""
from __future__ import annotations

import os
import threading
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...errors import ExportError, UnsupportedCheckpointError
from ...execute import Executor
from ...keys import PARAMS
from ...pipeline import Prepared, plan_checkpoint, prepare
from ...plan.model import TensorPlan
from ...plan.optimizer import available_keys, scalar_states
from ..outdir import commit, os_error, output_dir

MODEL, OPTIM = "model", "optim"  # the top-level keys of the DCP tutorial's app state
METADATA = ".metadata"
# Two files written by two threads: one gathers a tensor while the other writes one (both calls
# release the GIL), which hides most of the gather behind the disk writes.
WRITER_THREADS = 2


@dataclass(frozen=True)
class DcpResult:
    """What :func:`to_dcp` wrote."""

    out_dir: Path
    files: tuple[str, ...]
    tensors: int
    nbytes: int


class _Lazy:
    """The flat DCP keys whose data the executor builds when the writer asks for it.

    Each writer thread asks for one tensor at a time and is done with it before it asks for the
    next, so each thread keeps one buffer per size of tensor, filled again for the next tensor of
    that size: fresh memory for every tensor would cost a page fault per 4 KiB."""

    def __init__(self) -> None:
        self.plans: dict[str, tuple[TensorPlan, Executor]] = {}
        self._local = threading.local()

    def build(self, key: str) -> torch.Tensor | None:
        found = self.plans.get(key)
        if found is None:
            return None
        tp, executor = found
        buffers = self._local.__dict__.setdefault("buffers", {})
        buffer = buffers.get((tp.numel, tp.out_dtype))
        if buffer is None:
            buffer = buffers[(tp.numel, tp.out_dtype)] = torch.empty(tp.numel, dtype=tp.out_dtype)
        return executor.run(tp, buffer)

    def placeholder(self, key: str, tp: TensorPlan, executor: Executor) -> torch.Tensor:
        self.plans[key] = (tp, executor)
        return torch.empty(tp.shape, dtype=tp.out_dtype, device="meta")

    @property
    def nbytes(self) -> int:
        return sum(tp.nbytes for tp, _ in self.plans.values())


def _planner(lazy: _Lazy):
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class LazySavePlanner(DefaultSavePlanner):
        """torch's planner, except that a tensor's data is made only when it is written."""

        def resolve_data(self, write_item):
            built = lazy.build(write_item.index.fqn)
            return super().resolve_data(write_item) if built is None else built

    return LazySavePlanner()


def to_dcp(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: torch.dtype | None = torch.float32,
           optimizer: bool = True, tag: str | None = None, overwrite: bool = False) -> DcpResult:
    """Write the checkpoint at ``ckpt_dir`` as a DCP folder in ``out_dir``.

    Args:
        ckpt_dir: the checkpoint root (holding ``latest``) or a tag folder.
        out_dir: the DCP folder; written into a temporary folder inside it and moved into place
            once complete, ``.metadata`` last.
        dtype: the weights' dtype policy, as for :func:`zerofast.reconstruct` (fp32 by default,
            ``None`` keeps what the checkpoint holds). Optimizer states stay as stored (fp32).
        optimizer: also write the optimizer state (ZeRO stage 1-3) in ``get_state_dict``'s layout.
        tag: which save to read when the root holds several.
        overwrite: write into a folder that holds files zerofast did not write.
    """
    from torch.distributed.checkpoint import FileSystemWriter, save

    weights = prepare(ckpt_dir, dtype, tag=tag)
    lazy = _Lazy()
    state: dict[str, Any] = {MODEL: _model_state(weights, lazy)}
    if optimizer:
        state[OPTIM] = _optim_state(weights, lazy)
    out = Path(out_dir)
    with output_dir(out, overwrite) as (tmp, previous):
        try:
            with warnings.catch_warnings(), _without_crc32():
                # torch warns that no process group is set up; one process writing is the point.
                warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
                # No fsync, like every other zerofast writer: the files reach their final names by
                # rename only once complete.
                writer = FileSystemWriter(tmp, thread_count=WRITER_THREADS, sync_files=False)
                save(state, storage_writer=writer, planner=_planner(lazy), no_dist=True)
        except OSError as e:
            raise ExportError(f"could not write the DCP folder: {os_error(e)}; nothing was put in place", out) from e
        data = sorted(n for n in os.listdir(tmp) if n.endswith(".distcp"))
        commit(out, tmp, data, METADATA, previous)
    return DcpResult(out, (*data, METADATA), len(lazy.plans), lazy.nbytes)


@contextmanager
def _without_crc32():
    """torch.save without the zip CRC of each entry (torch's own ``set_crc32_options`` switch;
    ``torch.load`` does not check it): computing it costs as much as writing the bytes. The
    switch is torch's process-wide setting; it is put back as it was when the writing ends."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


def _model_state(prepared: Prepared, lazy: _Lazy) -> dict[str, torch.Tensor]:
    """Every key of the model's ``state_dict()``, tied names each with their own copy (DCP keeps
    one entry per name, as ``get_state_dict`` returns them)."""
    executor = prepared.streaming_executor()
    plan = prepared.plan
    return {name: lazy.placeholder(f"{MODEL}.{name}", plan.tensors[plan.aliases.get(name, name)], executor)
            for name in plan.order}


def _optim_state(weights: Prepared, lazy: _Lazy) -> dict[str, Any]:
    """``get_state_dict``'s optimizer layout: per-parameter states by name, and the param groups
    with their parameters' names."""
    ckpt = weights.checkpoint
    keys = available_keys(ckpt)
    scalars = scalar_states(ckpt)
    if not keys or not scalars["param_groups"]:
        # set_state_dict needs both: the per-parameter states and the groups that own them.
        missing = "no per-element state kept for every param group" if not keys else \
            "no param groups (an elastic_checkpoint save)"
        raise UnsupportedCheckpointError(f"the optimizer state has {missing}, which get_state_dict's layout "
                                         "needs; pass optimizer=False (--no-optimizer) for the weights alone",
                                         ckpt.files.tag_dir)
    states = plan_checkpoint(ckpt, None, optimizer_keys=keys, qualified=True)
    executor = states.streaming_executor()
    per_param: dict[str, dict[str, Any]] = {}
    for name, values in scalars["state"].items():
        entry = {k: lazy.placeholder(f"{OPTIM}.state.{name}.{k}", states.plan.tensors[f"{name}.{k}"], executor)
                 for k in keys}
        entry.update({k: _scalar(v) for k, v in values.items()})
        per_param[name] = entry
    return {"state": per_param, "param_groups": _param_groups(scalars["param_groups"])}


def _param_groups(named: list[dict]) -> list[dict]:
    """The param groups of ``scalar_states`` (JSON data) as torch keeps them: ``betas`` and other
    lists of numbers as tuples; ``params`` stays a list of names."""
    return [{k: tuple(v) if k != PARAMS and isinstance(v, list) else v for k, v in group.items()} for group in named]


def _scalar(value: Any) -> Any:
    """torch's optimizers keep ``step`` as a 0-d float32 tensor (not capturable, not fused)."""
    if type(value) in (int, float):
        return torch.tensor(float(value), dtype=torch.float32)
    return value
