"""What the checkpoint writers share: the source checkpoint as plans, and the run that writes a
tree of ``torch.save`` files through the output-folder transaction, led by the team protocol.

:class:`Source` holds every tensor an output needs, each as a :class:`TensorPlan` over one source
table: the full fp32 masters, the full optimizer moments, the frozen weights, and copies of any
tensor a pickle holds. :func:`write_checkpoint` runs the team protocol's steps
(:mod:`zerofast.output.team`) for a writer that yields ``(path, object, skeleton)`` per file:
every rank plans every file (metadata only), writes its share through the native executor
(:mod:`.torch_stream`), and the leader commits.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from ..discover import CheckpointFiles
from ..base.errors import UnsupportedCheckpointError
from ..execute import Executor
from ..load import LoadedCheckpoint
from ..load.stand_ins import DeepSpeedRecord
from ..output.team import ALONE, Alone, Team
from ..output.transaction import Folder, checkpoint_inputs
from ..output.windows import Progress, counter
from ..base import keys
from ..plan import FROZEN, SourceTable, TensorPlan, build_plan
from ..plan.builders import master_flat_groups
from ..plan.model import tensor_identity
from ..plan.optimizer import available_keys, whole_state_groups
from . import ds_pickle
from .torch_stream import Skeleton, write_torch_file

Produce = Callable[[], Iterable[tuple[str, Any, Skeleton]]]


@dataclass
class Source:
    ckpt: LoadedCheckpoint
    table: SourceTable
    executor: Executor
    masters: dict[str, TensorPlan]  # trainable name -> full fp32 master
    moments: dict[str, dict[str, TensorPlan]]  # per-element optimizer key -> name -> full state
    frozen: dict[str, TensorPlan]  # frozen name -> full value in the model dtype
    copies: dict[tuple, torch.Tensor]
    whole: dict[str, set[int]]  # key -> flat groups keeping it over whole parameters (Muon, ZeRO 1-2)

    @classmethod
    def read(cls, ckpt: LoadedCheckpoint, writer: str = "reshard") -> "Source":
        """``writer`` names the command in the refusal of a value no rule places."""
        if not ckpt.layout.writable and not (writer == "to-universal" and ckpt.layout.universal_fields(ckpt)):
            raise UnsupportedCheckpointError(
                f"checkpoints with {ckpt.layout.title} ({ckpt.layout.name}) cannot be written back at another world "
                "size yet; plain data-parallel ZeRO 0-3 saves can", ckpt.files.tag_dir)
        table = SourceTable()
        masters, moments, frozen, whole = {}, {}, {}, {}
        if ckpt.stage:
            _check_optimizer(ckpt)
            masters = _plans(ckpt.layout.trainable_from(ckpt, table, master_flat_groups(ckpt), "flat fp32 groups"))
            placed = available_keys(ckpt)
            ckpt.layout.refuse_unplaced(ckpt, placed, writer)  # never copied through to the new ranks
            moments = {key: _plans(entries) for key, entries in ckpt.layout.optimizer_entries(ckpt, table, placed).items()}
            whole = {key: whole_state_groups(ckpt, key) for key in placed}
            plan = build_plan(ckpt, table, None)
            frozen = {n: tp for n, tp in plan.tensors.items() if tp.kind == FROZEN}
        return cls(ckpt, table, Executor(table.tensors, streamable=table.mapped), masters, moments, frozen, {}, whole)

    def copy(self, value: Any, file: Path, where: str, skeleton: Skeleton) -> Any:
        """``value`` from a loaded pickle, made writable: tensors become placeholders filled from
        the source file (one output tensor per source tensor, so ties stay ties), DeepSpeed
        stand-ins become objects pickled under their DeepSpeed names."""
        if isinstance(value, torch.Tensor):
            ident = (str(file), tensor_identity(value))
            if ident not in self.copies:
                src = self.table.add(str(file), where, value)
                tp = TensorPlan(where, tuple(value.shape), "copy", value.dtype, value.dtype,
                                ((src, 0, 0, value.numel()),) if value.numel() else ())
                self.copies[ident] = skeleton.tensor(tp)
            return self.copies[ident]
        if isinstance(value, DeepSpeedRecord):
            fields = {k: self.copy(v, file, f"{where}.{k}", skeleton) for k, v in vars(value).items() if k != "args"}
            return ds_pickle.record_class(value.ds_name)(**fields)
        if isinstance(value, torch.Size):
            return value
        if isinstance(value, dict):
            items = [(k, self.copy(v, file, f"{where}[{k!r}]", skeleton)) for k, v in value.items()]
            return type(value)(items) if type(value) in (dict, OrderedDict) else dict(items)
        if isinstance(value, (list, tuple)):
            items = [self.copy(v, file, f"{where}[{i}]", skeleton) for i, v in enumerate(value)]
            return type(value)(items) if type(value) in (list, tuple) else list(items)
        return value

    def new_file(self) -> Skeleton:
        self.copies = {}  # ties are per file, as torch.save keeps them
        return Skeleton()


def _plans(entries: dict) -> dict[str, TensorPlan]:
    return {name: TensorPlan(name, shape, "state", dtype, dtype, tuple(segs))
            for name, (shape, dtype, segs) in entries.items()}


def _check_optimizer(ckpt: LoadedCheckpoint) -> None:
    inner_key = keys.inner_key(ckpt.stage)
    for o in ckpt.optim_states:
        inner = o.raw[keys.OPTIMIZER_STATE_DICT].get(inner_key)
        elastic = ckpt.stage in (1, 2) and isinstance(inner, (list, tuple))  # elastic_checkpoint
        if not elastic and (not isinstance(inner, dict) or not isinstance(inner.get(keys.PARAM_GROUPS), list)):
            raise UnsupportedCheckpointError(
                f"resharding needs the wrapped optimizer's state_dict() in {inner_key!r} (or, with "
                f"elastic_checkpoint, a list of group states); found {type(inner).__name__}", o.path)


def concat(name: str, length: int, dtype: torch.dtype, pieces: list[tuple[TensorPlan, int, int, int]]) -> TensorPlan:
    """A 1-D plan of ``length`` elements: elements [lo, hi) of each piece's plan at ``dst``; the rest
    is left as the file holds it (zeros)."""
    segments = []
    for tp, lo, hi, dst in pieces:
        for src, src_off, dst_off, n in tp.slice(lo, hi).segments:
            segments.append((src, src_off, dst + dst_off, n))
    return TensorPlan(name, (length,), "partition", dtype, dtype, tuple(segments))


@dataclass(frozen=True)
class FileWrite:
    """One output file as the ranks share them out (``Team.share`` reads ``file.name``,
    ``file.keys`` and ``nbytes``)."""

    name: str  # the path under the output folder
    nbytes: int
    keys: tuple = ()

    @property
    def file(self) -> "FileWrite":
        return self


@dataclass(frozen=True)
class Written:
    """What a checkpoint writer wrote: the folder it names, the files and tensor bytes (this
    rank's share), and the files of others it replaced (``overwrite``)."""

    path: Path
    files: int
    nbytes: int
    seconds: float
    replaced: tuple[str, ...] = ()


def write_checkpoint(out: Path, files: CheckpointFiles, produce: Produce, executor: Executor, *, command: str,
                     overwrite: bool, finish: Callable[[Folder], None], team: Team | Alone | None = None,
                     progress: Progress | None = None, started: float | None = None) -> Written:
    """Write the files ``produce()`` yields as (path under ``out``, object, skeleton) through the
    output-folder transaction of ``command``; ``finish(folder)`` runs on the leader once every
    rank's files are in, and commits."""
    team = team or ALONE
    started = time.monotonic() if started is None else started
    with team.output_dir(out, overwrite, command=command, inputs=checkpoint_inputs(files)) as folder:
        planned = [FileWrite(path, sum(tp.nbytes for tp in sk.plans.values())) for path, _, sk in produce()]
        mine = {w.name for w in team.share(planned, files.tag, out)}
        nbytes = sum(w.nbytes for w in planned if w.name in mine)
        advance = counter(progress, nbytes)
        with team.step("writing the files", out):
            for path, obj, skeleton in produce():
                if path in mine:
                    (folder.tmp / path).parent.mkdir(parents=True, exist_ok=True)
                    write_torch_file(folder.tmp / path, obj, skeleton, executor, advance)
        with team.step("committing", out):
            if team.leader:
                finish(folder)
    return Written(out, len(mine), nbytes, time.monotonic() - started, tuple(folder.replaced))
