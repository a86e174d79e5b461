"""``zerofast.to_dcp``: a PyTorch Distributed Checkpoint (DCP) folder, straight from a ZeRO save.

torch plans the save and writes ``.metadata`` (its ``dcp.save`` and ``FileSystemWriter``), so
the format is torch's: ``__0_0.distcp`` holds the small items, and each tensor has a
``__0_<n>.distcp`` of its own, as torch's ``single_file_per_rank=False`` lays them out. What it holds is what
``torch.distributed.checkpoint.state_dict.get_state_dict(model, optim)`` returns, under the
keys the DCP tutorial (and ``dcp.load`` plus ``set_state_dict``) uses::

    {"model": {fqn: tensor, ...},                       # weights and buffers, tied names too
     "optim": {"state": {fqn: {"exp_avg": t, "exp_avg_sq": t, "step": t}},
               "param_groups": [{"lr": ..., ..., "params": [fqn, ...]}]}}

Nothing is built in memory: torch is handed meta tensors (shape and dtype only), and the
storage writer (:mod:`.dcp_storage`) has the executor write each tensor's bytes into its file
straight from the checkpoint files.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..base.errors import ExportError, UnplacedOptimizerStateError, UnsupportedCheckpointError
from ..discover import DCP_METADATA as METADATA
from ..execute import Executor
from ..base.keys import PARAMS
from ..output.transaction import checkpoint_inputs, os_error, output_dir
from ..prepare import Prepared, plan_checkpoint, prepare
from ..plan.model import TensorPlan
from ..plan.optimizer import available_keys, scalar_states
from .dcp_storage import storage_writer

MODEL, OPTIM = "model", "optim"  # the top-level keys of the DCP tutorial's app state
COMMAND = "to-dcp"  # what the output folder's marker records


@dataclass(frozen=True)
class DcpResult:
    """What :func:`to_dcp` wrote."""

    out_dir: Path
    files: tuple[str, ...]
    tensors: int
    nbytes: int


class _Lazy:
    """The flat DCP keys whose data the executor writes (:mod:`.dcp_storage`) when torch's save
    reaches them; torch itself only ever sees their shape and dtype."""

    def __init__(self) -> None:
        self.plans: dict[str, tuple[TensorPlan, Executor]] = {}

    def placeholder(self, key: str, tp: TensorPlan, executor: Executor) -> torch.Tensor:
        self.plans[key] = (tp, executor)
        return torch.empty(tp.shape, dtype=tp.out_dtype, device="meta")

    @property
    def nbytes(self) -> int:
        return sum(tp.nbytes for tp, _ in self.plans.values())


def to_dcp(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: torch.dtype | None = torch.float32,
           optimizer: bool = True, tag: str | None = None, overwrite: bool = False,
           follow_symlinks: bool | None = None) -> DcpResult:
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
        follow_symlinks: as for :func:`zerofast.reconstruct`: follow symbolic links that lead out
            of the checkpoint folder (None: ``ZEROFAST_FOLLOW_SYMLINKS``).
    """
    weights = prepare(ckpt_dir, dtype, tag=tag, follow_symlinks=follow_symlinks)
    lazy = _Lazy()
    state: dict[str, Any] = {MODEL: _model_state(weights, lazy)}
    if optimizer:
        state[OPTIM] = _optim_state(weights, lazy)
    out = Path(out_dir)
    with output_dir(out, overwrite, command=COMMAND, inputs=checkpoint_inputs(weights.checkpoint.files)) as folder:
        tmp = folder.tmp
        try:
            _save(state, tmp, lazy)
        except OSError as e:
            raise ExportError(f"could not write the DCP folder: {os_error(e)}; nothing was put in place", out) from e
        data = sorted(n for n in os.listdir(tmp) if n.endswith(".distcp"))
        folder.commit([*data, METADATA], pointer=lambda name: name == METADATA)
    return DcpResult(out, (*data, METADATA), len(lazy.plans), lazy.nbytes)


def _save(state: dict, tmp: Path, lazy: _Lazy) -> None:
    """``dcp.save`` into ``tmp``, in this process alone, with the errors it wraps unwrapped.

    torch wraps whatever a step raises (an ExportError for a full disk, Ctrl-C) in a
    ``CheckpointException``, a BaseException whose message is a traceback; the error itself is
    what the caller (and the CLI's one-line report) needs."""
    from torch.distributed.checkpoint import save
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():
            # torch warns that no process group is set up; one process writing is the point.
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            save(state, storage_writer=storage_writer(tmp, lazy.plans.get), no_dist=True)
    except CheckpointException as e:
        failures = [pair[0] if isinstance(pair, tuple) else pair for pair in e.failures.values()]
        if failures and isinstance(failures[0], BaseException):
            raise failures[0] from None
        raise


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
    if keys:
        ckpt.layout.refuse_unplaced(ckpt, keys, "to-dcp")  # never a partition copied through
    if not keys or not scalars["param_groups"]:
        # set_state_dict needs both: the per-parameter states and the groups that own them.
        missing = "no per-element state" if not keys else \
            "no param groups (an elastic_checkpoint save)"
        raise UnsupportedCheckpointError(f"the optimizer state has {missing}, which get_state_dict's layout "
                                         "needs; pass optimizer=False (--no-optimizer) for the weights alone",
                                         ckpt.files.tag_dir)
    states = plan_checkpoint(ckpt, None, optimizer_keys=keys, qualified=True)
    executor = states.streaming_executor()
    own = _group_keys(ckpt, scalars["param_groups"])
    per_param: dict[str, dict[str, Any]] = {}
    for name, values in scalars["state"].items():
        # Each parameter gets the keys of its own group (Muon's momentum_buffer, Adam's moments),
        # each in the dtype and shape the save keeps it in; one its group keeps but the plan
        # lacks is an error, never left out.
        entry = {}
        for k in own.get(name, ()):
            tp = states.plan.tensors.get(f"{name}.{k}")
            if tp is None:
                raise UnplacedOptimizerStateError(f"to-dcp found no place for {k!r} of {name!r}, which its param "
                                                  "group keeps", ckpt.files.tag_dir)
            entry[k] = lazy.placeholder(f"{OPTIM}.state.{name}.{k}", tp, executor)
        entry.update({k: _scalar(v) for k, v in values.items()})
        per_param[name] = entry
    return {"state": per_param, "param_groups": _param_groups(scalars["param_groups"])}


def _group_keys(ckpt, named: list[dict]) -> dict[str, list[str]]:
    """Parameter name -> the per-element state keys of its param group."""
    groups = ckpt.layout.optimizer_groups(ckpt)
    if len(groups) != len(named):
        raise UnplacedOptimizerStateError(f"to-dcp found {len(groups)} optimizer groups of state keys for "
                                          f"{len(named)} param groups", ckpt.files.tag_dir)
    return {name: list(g["keys"]) for g, group in zip(groups, named) for name in group[PARAMS]}


def _param_groups(named: list[dict]) -> list[dict]:
    """The param groups of ``scalar_states`` (JSON data) as torch keeps them: ``betas`` and other
    lists of numbers as tuples; ``params`` stays a list of names."""
    return [{k: tuple(v) if k != PARAMS and isinstance(v, list) else v for k, v in group.items()} for group in named]


def _scalar(value: Any) -> Any:
    """torch's optimizers keep ``step`` as a 0-d float32 tensor (not capturable, not fused)."""
    if type(value) in (int, float):
        return torch.tensor(float(value), dtype=torch.float32)
    return value
