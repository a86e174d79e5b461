"""``zerofast.export``: write a checkpoint out in the Hugging Face layout, streaming.

The export runs as the steps of the team protocol (:mod:`zerofast.output.team`: read, open the
folder, write the data files, commit), led by one process alone or by the ranks of
:mod:`.distributed`, which share the data files out and agree after each step. The files are laid
out by :mod:`.shards`, written by the format's writer (:mod:`.formats`) into the temporary folder
of the output-folder transaction (:mod:`zerofast.output.transaction`), and committed there.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from ..base import dtypes
from ..base.errors import ExportError
from ..base.settings import overriding
from ..execute import Executor
from ..load import LoadedCheckpoint
from ..load.reader import collector_paused
from ..native.ops import resolve_device
from ..prepare import Prepared, plan_checkpoint, prepare
from ..plan.optimizer import available_keys, scalar_states
from ..output.team import opening
from ..output.windows import Progress, counter
from ..output.transaction import EXPORT, checkpoint_inputs, write_bytes, write_text
from . import formats, trainer
from .formats import WeightFormat
from .shards import ShardFile, index_doc, layout, parse_size

if TYPE_CHECKING:
    from ..output.team import Team

# Files an export replaces even in a folder it did not write (``overwrite``): model weights, so
# that no index of an older set of shards is left next to the new files.
WEIGHT_FILE = re.compile(r"^(model(-\d{5,}-of-\d{5,})?\.safetensors|pytorch_model(-\d{5,}-of-\d{5,})?\.bin)"
                         r"(\.index\.json)?$")


@dataclass(frozen=True)
class ExportResult:
    """What an export wrote. ``files`` are the data files in shard order; ``index`` is None for one file."""

    out_dir: Path
    format: str
    dtype: torch.dtype | None
    files: tuple[str, ...]
    index: str | None
    total_size: int  # tensor bytes written, as the index's metadata counts them
    tensors: int  # entries stored with their own data
    aliases: dict[str, str]  # tied names recorded as {alias: source} rather than stored again
    seconds: float
    optimizer_files: tuple[str, ...] = ()  # optimizer-state shards, their index, the scalars' JSON
    other_files: tuple[str, ...] = ()  # copied config, tokenizer and adapter config files
    optimizer_size: int = 0  # tensor bytes of the optimizer-state shards
    replaced: tuple[str, ...] = ()  # files of others the export replaced (``overwrite``)
    merge_base: trainer.MergeBase | None = None  # merge_adapters: which base the adapter was merged onto

    @property
    def paths(self) -> list[Path]:
        names = (*self.files, *([self.index] if self.index else []), *self.optimizer_files, *self.other_files)
        return [self.out_dir / n for n in names]


# The collector stays off for the writing too: a thousand-file save's records make hundreds of
# thousands of objects, none of them garbage, and a full collection over them and torch's own
# takes 70-130 ms on 2 busy cores (ds_moe_1k; the whole export is about 0.35 s in-process).
@collector_paused()
def export(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: torch.dtype | None = torch.float32,
           format: str = "safetensors", max_shard_size: int | str = "5GB", tag: str | None = None,
           exclude_frozen: bool = False, duplicate_tied: bool = False, overwrite: bool = False,
           optimizer_states: bool | Sequence[str] = False, progress: Progress | None = None,
           device: str | torch.device = "cpu", team: Team | None = None, adapter: bool = False,
           merge_adapters: bool = False, base_model: str | os.PathLike | None = None,
           base_dtype: str | None = None, hf_files: bool = True,
           follow_symlinks: bool | None = None, tp_rules: str | os.PathLike | dict | None = None,
           tp_replicated: str | None = None, unstack_layers: bool | None = None) -> ExportResult:
    """Write a DeepSpeed ZeRO checkpoint out as Hugging Face-layout weight files.

    Args:
        ckpt_dir: the checkpoint root (holding ``latest``) or a tag folder.
        out_dir: the folder to write; created if missing. A folder holding files zerofast did not
            write, or another command's output (a resharded checkpoint), is refused unless
            ``overwrite`` is set; a previous export is replaced. It may not be, lie inside or
            hold the checkpoint (nor the ``base_model`` folder of a merge).
        dtype: as for :func:`zerofast.reconstruct` (``None`` keeps the checkpoint's dtypes); a name
            in any spelling (``"bf16"``, ``"bfloat16"``, ``"torch.bfloat16"``) is taken too.
        format: a name from :data:`zerofast.hf.formats.FORMATS`: ``"safetensors"`` (streamed
            into the files) or ``"torch"`` (``torch.save``, one shard in memory at a time).
        max_shard_size: per-file limit, an int of bytes or a string such as ``"5GB"``/``"4GiB"``.
        tag, exclude_frozen: as for :func:`zerofast.reconstruct`.
        duplicate_tied: write tied weights as real copies instead of recording the aliases.
        overwrite: write into such a folder anyway; only the names the export writes and model
            weight files (``model*.safetensors``, ``pytorch_model*.bin`` and their indexes) are
            replaced, and ``ExportResult.replaced`` lists those it found.
        optimizer_states: also write the wrapped optimizer's per-element states (stages 1-3):
            ``True`` for all of them, or a list of keys such as ``["exp_avg"]``. They go to
            ``optimizer.safetensors`` (sharded like the weights) as ``<param>.<key>``, as stored
            (fp32) whatever ``dtype`` is, and their scalars (``step``) and hyperparameters to
            ``optimizer_state.json``.
        progress: called as ``progress(bytes_done, bytes_total)``, first with 0, then as data lands.
        device: where the weights are gathered and cast: ``"cpu"``, or ``"cuda"``/``"cuda:N"``, which
            builds each tensor on the GPU and copies it back through pinned buffers to the writer.
        team: the ranks sharing this export (:class:`zerofast.output.team.Team`); None writes every
            file here. Use :func:`zerofast.hf.distributed.shared_export` rather than passing one.
        adapter: for a PEFT checkpoint, write only the adapter, as ``adapter_model.safetensors`` plus
            ``adapter_config.json`` under the names ``PeftModel.from_pretrained`` expects.
        merge_adapters: for a PEFT (LoRA) checkpoint, write the base model with the LoRA deltas
            merged, under the base model's names, as peft's ``merge_and_unload()`` computes them.
        base_model: the base model's ``save_pretrained`` folder, for merging an adapter whose
            checkpoint holds no frozen weights (the HF Trainer's PEFT saves); by default the
            adapter config's ``base_model_name_or_path`` when that is a folder.
        base_dtype: with ``merge_adapters`` and such a base folder, which base the adapter is merged
            onto: ``"as-stored"`` (the default) takes the folder's weights as saved, which is what
            ``merge_and_unload()`` on ``PeftModel.from_pretrained(base)`` gives; ``"as-trained"``
            first rounds each base parameter to the dtype the run held the model in (the DeepSpeed
            config's bf16/fp16 mode, recorded in the checkpoint; an ExportError naming the file
            where it does not settle that), as the trained model's base was. A checkpoint that kept
            its frozen weights is merged onto those, as trained, either way.
            ``ExportResult.merge_base`` says which base was used.
        hf_files: copy ``config.json`` (its dtype set to the exported dtype), the generation
            config and tokenizer files found next to the checkpoint, so that ``from_pretrained``
            loads the folder as it is.
        follow_symlinks: as for :func:`zerofast.reconstruct`: follow symbolic links that lead out
            of the checkpoint folder (None: ``ZEROFAST_FOLLOW_SYMLINKS``).
        tp_rules, tp_replicated, unstack_layers: as for :func:`zerofast.reconstruct`.
    """
    fmt = formats.get(format)
    limit = parse_size(max_shard_size)
    dtype = dtypes.output_dtype(dtype)
    compute = resolve_device(device)
    if merge_adapters and (adapter or exclude_frozen):
        raise ValueError("merge_adapters writes the whole base model: it excludes adapter and exclude_frozen")
    if base_dtype is not None and not merge_adapters:
        raise ValueError("base_dtype chooses the base of merge_adapters: it needs merge_adapters=True")
    base_dtype = trainer.AS_STORED if base_dtype is None else base_dtype
    with overriding(tp_rules=tp_rules, tp_replicated=tp_replicated, unstack_layers=unstack_layers), \
            opening(ckpt_dir, out_dir, tag, follow_symlinks, team) as run:  # the plans are made in here
        prepared = prepare(run.ckpt_dir, dtype, tag=run.tag, exclude_frozen=exclude_frozen or adapter,
                           warn_absent=not merge_adapters, follow_symlinks=run.follow_symlinks)
        prepared, names, extras, merge_base = _hf_view(prepared, fmt, dtype, adapter, merge_adapters, base_model,
                                                       base_dtype, hf_files)
        if names != fmt.names:  # peft reads one adapter file
            limit = max(limit, sum(tp.nbytes for tp in prepared.plan.tensors.values()) + 1)
        files, tied = layout(prepared.plan, names, limit, aliases_in_files=fmt.aliases_in_files,
                             duplicate_tied=duplicate_tied)
        optim = _optimizer_layout(prepared.checkpoint, optimizer_states, limit)
        writes = _data_writes(files, tied, fmt, prepared.streaming_executor(compute=compute), optim)
    team, out = run.team, run.out
    index = fmt.index if len(files) > 1 else None
    extra = _optimizer_names(optim) if optim else []
    ckpt_files = prepared.checkpoint.files
    # The base model's weights are read (mapped) while the merged files are written.
    base = [Path(base_model) / "model.safetensors"] if merge_adapters and base_model is not None else []
    with team.output_dir(out, overwrite, command=EXPORT, inputs=checkpoint_inputs(ckpt_files) + base,
                         replaces=WEIGHT_FILE.match) as folder:
        mine = team.share(writes, ckpt_files.tag, out)
        advance = counter(progress, sum(w.nbytes for w in mine))
        with team.step("writing the files", out):
            for w in mine:
                w.write(folder.tmp, advance)
        with team.step("committing the export", out):
            if team.leader:
                _write_indexes(folder.tmp, fmt, files, tied, index, optim)
                for name, content in extras.items():
                    write_bytes(folder.tmp / name, content)
                folder.commit([f.name for f in files] + extra + list(extras) + ([index] if index else []),
                              pointer=lambda n: n.endswith(".index.json"))
    return ExportResult(out, fmt.name, dtype, tuple(f.name for f in files), index, sum(f.nbytes for f in files),
                        sum(len(f.tensors) for f in files), tied, time.monotonic() - run.started, tuple(extra),
                        tuple(extras), sum(f.nbytes for f in optim.files) if optim else 0, tuple(folder.replaced),
                        merge_base)


def _hf_view(prepared: Prepared, fmt: WeightFormat, dtype, adapter: bool, merge: bool, base_model,
             base_dtype: str, hf_files: bool):
    """The plan to write for a Hugging Face folder, the (single, pattern) file names, the
    config/tokenizer files to copy next to the weights, and which base a merge is made on."""
    folder = trainer.trainer_folder(prepared)
    names, folders, merge_base = fmt.names, [folder], None
    if adapter:
        trainer.read_adapter_config(folder)
        prepared = dataclasses.replace(prepared, plan=trainer.adapter_plan(prepared.plan, folder))
        names = (trainer.ADAPTER_FILES[fmt.name], fmt.pattern)
    elif merge:
        prepared, folders, merge_base = trainer.merged_view(prepared, dtype, base_model, folder, base_dtype)
    elif hf_files and trainer.is_peft(prepared.plan, folder):
        trainer.warn_peft_as_is(prepared.plan, folder)
    extras = trainer.extra_files(folders, prepared.plan, dtype, adapter) if hf_files or adapter else {}
    return prepared, names, extras, merge_base


@dataclass(frozen=True)
class _Write:
    """One data file to write: the unit the ranks of a distributed export share out."""

    file: ShardFile
    fmt: WeightFormat
    executor: Executor
    metadata: dict[str, str] | None  # the file's own metadata, where the format keeps any

    @property
    def nbytes(self) -> int:
        return self.file.nbytes

    def write(self, tmp: Path, advance: Callable[[int], None]) -> None:
        self.fmt.write(tmp / self.file.name, self.file, self.metadata, self.executor, advance)

    def reads(self) -> dict[str, list[tuple[int, int]]]:
        """The bytes of the checkpoint's files this file is made of (a team spread over the nodes
        moves those to the writer)."""
        return self.executor.file_ranges(self.file.tensors)


def _data_writes(files: Sequence[ShardFile], tied: dict[str, str], fmt: WeightFormat, executor: Executor,
                 optim: _OptimizerFiles | None) -> list[_Write]:
    metadata = fmt.file_metadata(tied, len(files))
    writes = [_Write(f, fmt, executor, metadata) for f in files]
    if optim:
        st = formats.get("safetensors")
        states = optim.prepared.streaming_executor()
        writes += [_Write(f, st, states, st.file_metadata({}, len(optim.files))) for f in optim.files]
    return writes


def _write_index(tmp: Path, fmt: WeightFormat, name: str, files: Sequence[ShardFile], tied: dict[str, str]) -> None:
    metadata = {"total_size": sum(f.nbytes for f in files), **fmt.index_metadata(tied)}
    write_text(tmp / name, json.dumps(index_doc(files, metadata), indent=2, sort_keys=True) + "\n")


def _write_indexes(tmp: Path, fmt: WeightFormat, files: Sequence[ShardFile], tied: dict[str, str],
                   index: str | None, optim: _OptimizerFiles | None) -> None:
    """What only rank 0 writes, once every data file is in: the indexes and the optimizer's JSON."""
    if index:
        _write_index(tmp, fmt, index, files, tied)
    if optim:
        _write_optimizer_index(tmp, optim)


# ---------------------------------------------------------------------------------------------
# Optimizer states: the same shard layout and safetensors writer as the weights, under their own
# names, next to them in the output folder.

OPTIMIZER_NAMES = ("optimizer.safetensors", "optimizer-{:05d}-of-{:05d}.safetensors", "optimizer.safetensors.index.json")
OPTIMIZER_JSON = "optimizer_state.json"


@dataclass(frozen=True)
class _OptimizerFiles:
    prepared: Prepared
    files: list[ShardFile]
    keys: list[str]
    scalars: dict  # step per parameter and param groups, read under the export's tp settings


def _optimizer_layout(ckpt: LoadedCheckpoint, wanted: bool | Sequence[str], max_bytes: int) -> _OptimizerFiles | None:
    if wanted is False or (not isinstance(wanted, bool) and not wanted):
        return None
    keys = available_keys(ckpt) if wanted is True else list(wanted)
    if wanted is True:  # all of them: none may be left behind unsaid
        ckpt.layout.refuse_unplaced(ckpt, keys, "export --optimizer-states")
    if not keys:
        raise ExportError("optimizer_states: the optimizer keeps no per-element state in this checkpoint",
                          ckpt.files.tag_dir)
    prepared = plan_checkpoint(ckpt, None, optimizer_keys=keys, qualified=True)
    files, _ = layout(prepared.plan, OPTIMIZER_NAMES[:2], max_bytes, aliases_in_files=False)
    return _OptimizerFiles(prepared, files, keys, scalar_states(ckpt))


def _optimizer_names(optim: _OptimizerFiles) -> list[str]:
    """The files the optimizer states take: shards, their index when there are several, the JSON."""
    names = [f.name for f in optim.files]
    if len(optim.files) > 1:
        names.append(OPTIMIZER_NAMES[2])
    return [*names, OPTIMIZER_JSON]


def _write_optimizer_index(tmp: Path, optim: _OptimizerFiles) -> None:
    """Everything but the shards: the index when there are several, and the JSON."""
    names = _optimizer_names(optim)
    if len(optim.files) > 1:
        _write_index(tmp, formats.get("safetensors"), OPTIMIZER_NAMES[2], optim.files, {})
    ckpt = optim.prepared.checkpoint
    doc = {"keys": optim.keys, "tensors": names[-2], "stage": ckpt.stage, "world_size": ckpt.world_size,
           "tag": ckpt.files.tag, **optim.scalars}
    write_text(tmp / OPTIMIZER_JSON, json.dumps(doc, indent=2) + "\n")
