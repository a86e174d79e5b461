"""PyTorch Distributed Checkpoint folders (``torch.distributed.checkpoint.save``: FSDP2, torchtitan).

Claimed by the ``.metadata`` file and the ``__<rank>_<n>.distcp`` files in the folder. The folder is its own tag (a root holding one
such folder per step, as torchtitan keeps them, picks one like a DeepSpeed root picks a tag).
The records are read by :mod:`zerofast.load.dcp` (``.metadata`` through the restricted
unpickler, chunks by offset) and the model's tensors planned by :mod:`zerofast.plan.dcp`.

DCP records no ``requires_grad`` and keeps the optimizer state as plain DTensors, not ZeRO
partitions: ``exclude_frozen`` and the optimizer-state readers are refused, and so are the
writers that write a ZeRO save back (``writable`` is False).

Megatron-Core's ``dist_checkpointing`` (``torch_dist`` backend) writes such a folder plus a
``metadata.json`` naming the backend and a ``common.pt`` (never read). Its weights are the
top-level tensors; its ``optimizer.*`` tensors are kept out of them (the optimizer-state readers
read the per-parameter ``optimizer.state.<key>.<param>`` ones and refuse the flat
``dp_reshardable`` buffers, naming the type), stacked layers come out per layer with
``--unstack-layers``, and ``inspect`` says the backend and the layer stacking.
"""
from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..discover import CheckpointFiles, Found
from ..base.errors import UnsupportedCheckpointError
from ..base.settings import settings
from ..load import LoadedCheckpoint
from ..load.dcp import METADATA, ChunkReader, DcpRecords, read_dcp
from ..plan.dcp import (MCORE_DISTRIBUTED, STACKED, build_dcp_plan, layer_slices, mcore_states, model_tensors,
                         optimizer_tensors, tensor_segments)
from ..plan.model import Plan, SourceTable
from .base import Layout

_DATA_FILE = re.compile(r"^__\d+_\d+\.distcp$")
FORMAT = "PyTorch DCP"
MCORE_FORMAT = "Megatron-Core dist_checkpointing"


@dataclass(frozen=True)
class DcpFiles(CheckpointFiles):
    data_files: tuple[Path, ...] = ()

    def paths(self) -> tuple[Path, ...]:
        return (self.tag_dir / METADATA, *self.data_files)


@dataclass
class DcpCheckpoint(LoadedCheckpoint):
    records: DcpRecords | None = None
    # No model-dtype weights stored beside the tensors (verify compares none; it reads each whole).
    stored: dict = field(default_factory=dict)

    @property
    def meta(self):
        raise UnsupportedCheckpointError("a PyTorch DCP folder has no DeepSpeed model states", self.files.tag_dir)

    @property
    def module_names(self) -> list[str]:
        return list(model_tensors(self.records))

    @property
    def ds_version(self) -> str | None:
        return None

    @property
    def parallelism(self) -> dict:
        return {"family": FORMAT if self.records.mcore is None else MCORE_FORMAT, "dp": self.world_size}


class DcpLayout(Layout):
    name = "dcp"
    title = "a PyTorch Distributed Checkpoint"
    subsumes = ("universal", "moe", "pipeline", "autotp")  # its own names say nothing of those

    def claims(self, found: Found) -> str | None:
        # Both: a stray .metadata next to DeepSpeed's files (another tool's) claims nothing.
        if METADATA in found.names and any(_DATA_FILE.match(n) for n in found.names):
            return METADATA
        return None

    def list_files(self, found: Found) -> DcpFiles:
        data = tuple(found.tag_dir / n for n in found.names if _DATA_FILE.match(n))
        return DcpFiles(found.root, found.tag, found.tag_dir, (), (), layout=self, data_files=data)

    def load(self, files: CheckpointFiles) -> DcpCheckpoint:
        records = read_dcp(files.tag_dir)
        return DcpCheckpoint(files, 0, records.ranks, [], [], records=records)

    def plan(self, ckpt: DcpCheckpoint, table: SourceTable, dtype: torch.dtype | None,
             exclude_frozen: bool) -> Plan:
        if exclude_frozen:
            raise UnsupportedCheckpointError("a PyTorch DCP folder records no requires_grad; read it without "
                                             "exclude_frozen", ckpt.files.tag_dir)
        return build_dcp_plan(ckpt.records, table, dtype, unstack=settings().unstack_layers)

    def optimizer_keys(self, ckpt: LoadedCheckpoint) -> list[str]:
        """Megatron-Core's per-parameter optimizer state (``fully_sharded_model_space``); its flat
        ``dp_reshardable`` buffers say nothing of which parameter an element belongs to without the
        model's bucket layout, so they are refused (alone) or left out with a warning (beside)."""
        optim = optimizer_tensors(ckpt.records) if isinstance(ckpt, DcpCheckpoint) and ckpt.records else {}
        if not optim:
            raise UnsupportedCheckpointError("the optimizer state of a PyTorch DCP folder is not read (only ZeRO "
                                             "optimizer partitions and Megatron-Core's per-parameter state are)",
                                             ckpt.files.tag_dir)
        states = mcore_states(ckpt.records)
        if not states:
            raise UnsupportedCheckpointError(
                f"the optimizer state of this Megatron-Core save ({mcore_optimizer_sharding(optim)}) is not mapped to "
                "parameters: only fully_sharded_model_space (optimizer.state.<name>.<param>) is; it is kept out of "
                "the weights", ckpt.files.tag_dir)
        flat = [k for k in optim if k.startswith(MCORE_DISTRIBUTED)]
        if flat:
            warnings.warn(f"left out {len(flat)} flat dp_reshardable optimizer buffers (optimizer.distributed.*): "
                          "they are not mapped to parameters", stacklevel=2)
        return list(states)

    def optimizer_entries(self, ckpt, table, keys):
        self.optimizer_keys(ckpt)  # refused, or the flat buffers left out with their warning
        states = mcore_states(ckpt.records)
        reader = ChunkReader(ckpt.records)
        out = {}
        for key in keys:
            if key not in states:
                raise UnsupportedCheckpointError(f"expected optimizer state {key!r} in this Megatron-Core save, found "
                                                 f"{sorted(states)}", ckpt.files.tag_dir)
            out[key] = {}
            for param, t in states[key].items():
                segments = tensor_segments(ckpt.records, reader, table, t)
                if settings().unstack_layers and STACKED.search(param) and len(t.shape) >= 1:
                    out[key].update((layer, (t.shape[1:], t.dtype, part))
                                    for layer, part in layer_slices(param, t.shape, segments))
                else:
                    out[key][param] = (t.shape, t.dtype, segments)
        return out

    def scalar_states(self, ckpt: LoadedCheckpoint) -> dict:
        """Megatron-Core keeps the step and the param groups in ``common.pt`` (a pickle of the run's
        arguments, not read): none here."""
        self.optimizer_keys(ckpt)
        return {"state": {}, "param_groups": []}

    def report(self, ckpt: DcpCheckpoint, plan: Plan) -> dict:
        """What ``inspect`` says besides the tensor table: format, ranks, how the model is cut."""
        records = ckpt.records
        model = list(model_tensors(records).values())
        out = {"format": FORMAT, "checkpoint": str(records.folder), "ranks": records.ranks,
               "sharding": sharding(model), "dcp_version": records.version,
               "other_tensors": len(records.tensors) - len(model), "other_items": len(records.others),
               "tied": {}, "frozen_excluded": False, "absent_frozen": []}
        if records.mcore is not None:
            optim = optimizer_tensors(records)
            out.update(backend=f"{MCORE_FORMAT} ({records.mcore.get('sharded_backend')})",
                       layers=layer_stacking(list(model_tensors(records))),
                       optimizer_state=mcore_optimizer_sharding(optim) if optim else "none saved",
                       flattened=sorted(t.key for t in model if t.real_size is not None))
        return out


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+\.)?")


def layer_stacking(names: list[str]) -> str:
    """How a Megatron-Core save keeps its transformer layers: stacked (one key per layer type,
    a leading layer dimension) or one key per layer (``singleton_local_shards``)."""
    found = [m.group(1) is not None for m in map(_LAYER.search, names) if m]
    if not found:
        return "no transformer layers"
    if all(found):
        return "per layer (decoder.layers.<i>.*)"
    return "stacked (decoder.layers.*: leading layer dimension)" if not any(found) else "mixed"


def mcore_optimizer_sharding(optim: dict) -> str:
    """Which of Megatron-Core's optimizer sharding types the optimizer-state keys are."""
    kinds = []
    if any(k.startswith("optimizer.state.") for k in optim):
        kinds.append("fully_sharded_model_space: optimizer.state.<name>.<param>")
    if any(k.startswith("optimizer.distributed.") for k in optim):
        kinds.append("dp_reshardable: flat optimizer.distributed.* buffers")
    rest = len(optim) - sum(k.startswith(("optimizer.state.", "optimizer.distributed.")) for k in optim)
    if rest:
        kinds.append(f"{rest} other optimizer.* tensors")
    return "; ".join(kinds)


def sharding(tensors) -> str:
    """How the model's tensors are cut: FSDP2 (and FSDP1's sharded state dict) cut along dim 0."""
    split = [t for t in tensors if sum(1 for c in t.chunks if c.numel) > 1]
    if not split:
        return "unsharded (one chunk per tensor)"
    if all(all(o == 0 for c in t.chunks for o in c.offsets[1:]) and all(c.sizes[1:] == t.size[1:] for c in t.chunks)
           for t in split):
        return "FSDP2 shards (dim 0)"
    return "DTensor shards (chunked on several dims)"


LAYOUT = DcpLayout()
