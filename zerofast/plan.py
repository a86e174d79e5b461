"""Step 3: the plan, a plain-data description of every output tensor.

For each output tensor the plan lists which ranges of which source tensors land where, and the
dtype they are stored in and the dtype they come out as. Building a plan reads only metadata;
executing it (``execute``) is the only step that moves bytes. The eager, lazy and export paths
all run the same plan through the same executor.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from .errors import InconsistentCheckpointError
from .safe_load import LoadedCheckpoint, ModelStates

TRAINABLE, FROZEN, BUFFER = "trainable", "frozen", "buffer"


@dataclass(frozen=True)
class SourceRef:
    """A 1-D tensor inside a checkpoint file, named by where it sits in the pickle."""

    file: str
    key: str
    dtype: torch.dtype
    numel: int


@dataclass(frozen=True)
class TensorPlan:
    """One output tensor: ``segments`` rows are (source index, source offset, output offset, length)."""

    name: str
    shape: tuple[int, ...]
    kind: str
    stored_dtype: torch.dtype
    out_dtype: torch.dtype
    segments: tuple[tuple[int, int, int, int], ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.out_dtype.itemsize

    def slice(self, lo: int, hi: int) -> "TensorPlan":
        """Elements ``[lo, hi)`` of this tensor (flattened) as a 1-D plan of their own."""
        segments = []
        for src, src_off, dst_off, length in self.segments:
            a, b = max(dst_off, lo), min(dst_off + length, hi)
            if a < b:
                segments.append((src, src_off + a - dst_off, a - lo, b - a))
        return dataclasses.replace(self, shape=(hi - lo,), segments=tuple(segments))


@dataclass(frozen=True)
class Plan:
    sources: tuple[SourceRef, ...]
    tensors: dict[str, TensorPlan]  # output name -> plan; aliases are not repeated here
    aliases: dict[str, str]  # tied name -> name in ``tensors``
    order: tuple[str, ...]  # every output key, the model's own state_dict() order
    stage: int
    world_size: int
    metadata: dict = field(default_factory=dict)


OUTPUT_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16)


def check_dtype(dtype: torch.dtype | None) -> None:
    """Refuse a requested dtype the policy has no meaning for."""
    if dtype not in OUTPUT_DTYPES:
        raise ValueError(f"dtype must be one of torch.float32, torch.bfloat16, torch.float16 or None, got {dtype!r}")


def out_dtype_for(stored: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype policy: floating tensors take ``dtype``; ``None`` and non-floating keep their own."""
    if dtype is None or not stored.is_floating_point:
        return stored
    return dtype


def tensor_identity(t) -> tuple:
    """Same value for two module entries exactly when they are one tensor saved under two names.

    Sharing a storage is not enough: fused fp16/bf16 optimizers keep every parameter as a view
    into one flat buffer, so distinct parameters share storages at different offsets.
    """
    if not isinstance(t, torch.Tensor):
        return ("object", id(t))
    return (t.untyped_storage()._cdata, t.storage_offset(), tuple(t.shape), tuple(t.stride()))


class SourceTable:
    """Collects the source tensors a plan refers to, each registered once."""

    def __init__(self) -> None:
        self.refs: list[SourceRef] = []
        self.tensors: list[torch.Tensor] = []
        self.mapped: list[bool] = []  # still a view of the file mapping (not copied to fit)
        self._index: dict[tuple[str, str], int] = {}

    def add(self, file: str, key: str, tensor: torch.Tensor) -> int:
        ident = (file, key)
        if ident not in self._index:
            flat = tensor.reshape(-1) if tensor.is_contiguous() else tensor.contiguous().reshape(-1)
            self._index[ident] = len(self.refs)
            self.refs.append(SourceRef(file, key, tensor.dtype, flat.numel()))
            self.tensors.append(flat)
            self.mapped.append(tensor.is_contiguous())
        return self._index[ident]


class VirtualBuffer:
    """Several source tensors seen end to end as one flat buffer."""

    def __init__(self, sources: Sequence[int], lengths: Sequence[int]):
        self.sources = list(sources)
        self.starts = [0]
        for n in lengths:
            self.starts.append(self.starts[-1] + n)

    @property
    def numel(self) -> int:
        return self.starts[-1]

    def pieces(self, offset: int, length: int, dst: int) -> list[tuple[int, int, int, int]]:
        """Segments that copy ``[offset, offset+length)`` of the buffer to output offset ``dst``."""
        out = []
        for i, src in enumerate(self.sources):
            lo, hi = max(offset, self.starts[i]), min(offset + length, self.starts[i + 1])
            if lo < hi:
                out.append((src, lo - self.starts[i], dst + lo - offset, hi - lo))
        return out


# ---------------------------------------------------------------------------------------------
# Building. Each stage contributes the segments of its trainable and frozen parameters; the
# classification of module entries, the dtype policy and the output order are shared.

Segments = list[tuple[int, int, int, int]]
_Entry = tuple[tuple[int, ...], torch.dtype, Segments]
# Per rank, per flat group: (where the tensor sits in its file's pickle, the 1-D tensor). The fp32
# masters and every per-element optimizer state (Adam's moments) are partitioned alike, so one set
# of builders lays out either; only the tensors they read differ.
FlatGroups = list[list[tuple[str, torch.Tensor]]]


def build_plan(ckpt: LoadedCheckpoint, table: SourceTable, dtype: torch.dtype | None,
               exclude_frozen: bool = False) -> Plan:
    trainable = _trainable_entries(ckpt, table, exclude_frozen)
    frozen = _declared_frozen_entries(ckpt, table)
    kinds, aliases, undeclared_frozen, buffers = _classify_module(ckpt, trainable, frozen)
    for name in undeclared_frozen:
        frozen[name] = _whole(table, ckpt.meta, "module", name, ckpt.meta.module[name])
    for name in buffers:
        buffers[name] = _whole(table, ckpt.meta, "module", name, ckpt.meta.module[name])
    entries = {**{n: (TRAINABLE, e) for n, e in trainable.items()}, **{n: (FROZEN, e) for n, e in frozen.items()},
               **{n: (BUFFER, e) for n, e in buffers.items()}}
    order = [n for n in kinds if n in entries or n in aliases]
    order += [n for n in entries if n not in kinds]  # parameters the module dict did not list
    if exclude_frozen:
        order = [n for n in order if entries.get(aliases.get(n, n), (None,))[0] != FROZEN]
    tensors = {}
    for name in order:
        if name in aliases:
            continue
        kind, (shape, stored, segs) = entries[name]
        tensors[name] = TensorPlan(name, shape, kind, stored, out_dtype_for(stored, dtype), tuple(segs))
    kept_aliases = {a: s for a, s in aliases.items() if a in order}
    return Plan(tuple(table.refs), tensors, kept_aliases, tuple(order), ckpt.stage, ckpt.world_size,
                {"tag": ckpt.files.tag, "ds_version": ckpt.ds_version})


def _whole(table: SourceTable, ms: ModelStates, where: str, name: str, tensor: torch.Tensor) -> _Entry:
    src = table.add(str(ms.path), f"{where}[{name!r}]", tensor)
    return tuple(tensor.shape), tensor.dtype, [(src, 0, 0, tensor.numel())]


def _trainable_entries(ckpt: LoadedCheckpoint, table: SourceTable, exclude_frozen: bool) -> dict[str, _Entry]:
    if ckpt.stage == 0:
        from .stage0 import stage0_trainable_entries  # the only layout that needs value matching

        return stage0_trainable_entries(ckpt, table, exclude_frozen)
    return partitioned_entries(ckpt, table, master_flat_groups(ckpt), "flat fp32 groups")


def master_flat_groups(ckpt: LoadedCheckpoint) -> FlatGroups:
    key = "fp32_flat_groups" if ckpt.stage == 3 else "single_partition_of_fp32_groups"
    return [[(f"optimizer_state_dict.{key}[{g}]", t) for g, t in enumerate(o.flat_groups)]
            for o in ckpt.optim_states]


def partitioned_entries(ckpt: LoadedCheckpoint, table: SourceTable, flats: FlatGroups,
                        what: str) -> dict[str, _Entry]:
    """Each trainable parameter of a stage 1-3 checkpoint, read from ``flats`` (laid out like the
    fp32 masters; ``what`` names them in errors)."""
    shapes = ckpt.meta.param_shapes
    if shapes is None:
        raise InconsistentCheckpointError("expected 'param_shapes' for a ZeRO stage 1-3 checkpoint, found None",
                                          ckpt.meta.path)
    for o, groups in zip(ckpt.optim_states, flats):
        if len(groups) != len(shapes):
            raise InconsistentCheckpointError(
                f"expected {len(shapes)} {what} (one per 'param_shapes' group), found {len(groups)}", o.path)
    build = _zero3_trainable if ckpt.stage == 3 else _zero12_trainable
    return build(ckpt, table, shapes, flats)


def _zero12_trainable(ckpt: LoadedCheckpoint, table: SourceTable, shapes, flats: FlatGroups) -> dict[str, _Entry]:
    """Group g's flat buffer is the ranks' partitions end to end; parameters follow in order."""
    out: dict[str, _Entry] = {}
    for g, group in enumerate(shapes):
        parts = [groups[g][1] for groups in flats]
        buf = VirtualBuffer([table.add(str(o.path), groups[g][0], groups[g][1])
                             for o, groups in zip(ckpt.optim_states, flats)], [p.numel() for p in parts])
        pads = _alignment_paddings(ckpt, g, len(group))
        offset = 0
        for i, (name, shape) in enumerate(group.items()):
            n = math.prod(shape)
            if offset + n > buf.numel:
                raise InconsistentCheckpointError(
                    f"'param_shapes' places {name!r} at elements [{offset}, {offset + n}) of group {g}, but the "
                    f"{ckpt.world_size} ranks' partitions hold only {buf.numel}", ckpt.optim_states[0].path)
            out[name] = (shape, parts[0].dtype, buf.pieces(offset, n, 0))
            offset += n + pads[i]
    return out


def _alignment_paddings(ckpt: LoadedCheckpoint, group: int, count: int) -> list[int]:
    o = ckpt.optim_states[0]
    pads = o.param_alignment_paddings
    if pads is None:
        return [0] * count
    if group >= len(pads) or len(pads[group]) != count:
        raise InconsistentCheckpointError(
            f"expected {count} 'param_alignment_paddings' for group {group}, found "
            f"{len(pads[group]) if group < len(pads) else 'none'}", o.path)
    return [int(p) for p in pads[group]]


def _zero3_trainable(ckpt: LoadedCheckpoint, table: SourceTable, shapes, flats: FlatGroups) -> dict[str, _Entry]:
    """Each rank holds ceil(n/W) elements of every parameter at one shared running offset."""
    W = ckpt.world_size
    rank_bufs = [VirtualBuffer([table.add(str(o.path), where, t) for where, t in groups],
                               [t.numel() for _, t in groups])
                 for o, groups in zip(ckpt.optim_states, flats)]
    dtype = flats[0][0][1].dtype if flats and flats[0] else torch.float32
    out: dict[str, _Entry] = {}
    offset = 0
    for group in shapes:
        for name, shape in group.items():
            n = math.prod(shape)
            k = -(-n // W)  # integers: n / W rounds past 2**53
            for r, buf in enumerate(rank_bufs):
                if offset + k > buf.numel:
                    raise InconsistentCheckpointError(
                        f"'param_shapes' needs {offset + k} elements per rank to reach {name!r}, but this rank's "
                        f"flat groups hold {buf.numel}", ckpt.optim_states[r].path)
            segs = [p for r, buf in enumerate(rank_bufs) for p in buf.pieces(offset, _rank_share(n, k, r), r * k)]
            out[name] = (shape, dtype, segs)
            offset += k
    return out


def _rank_share(n: int, k: int, rank: int) -> int:
    return max(0, min(k, n - rank * k))


def _declared_frozen_entries(ckpt: LoadedCheckpoint, table: SourceTable) -> dict[str, _Entry]:
    meta = ckpt.meta
    if not meta.frozen_param_shapes:
        return {}
    out: dict[str, _Entry] = {}
    for name, shape in meta.frozen_param_shapes.items():
        if ckpt.stage == 3:
            out[name] = _zero3_frozen(ckpt, table, name, shape)
            continue
        frag = meta.frozen_param_fragments.get(name)
        if frag is None or frag.numel() != math.prod(shape):
            frag = meta.module.get(name)
        if frag is None or frag.numel() != math.prod(shape):
            raise InconsistentCheckpointError(
                f"frozen parameter {name!r} of shape {shape} has no full tensor in 'frozen_param_fragments' or "
                "'module'", meta.path)
        out[name] = (shape, frag.dtype, _whole(table, meta, "frozen_param_fragments", name, frag)[2])
    return out


def _zero3_frozen(ckpt: LoadedCheckpoint, table: SourceTable, name: str, shape: tuple[int, ...]) -> _Entry:
    n = math.prod(shape)
    k = -(-n // ckpt.world_size)
    segs: Segments = []
    dtype = None
    for r, ms in enumerate(ckpt.model_states):
        frag = ms.frozen_param_fragments.get(name)
        if frag is None or frag.numel() < _rank_share(n, k, r):
            raise InconsistentCheckpointError(
                f"expected a fragment of at least {_rank_share(n, k, r)} elements for frozen parameter {name!r}, "
                f"found {'none' if frag is None else frag.numel()}", ms.path)
        dtype = frag.dtype
        src = table.add(str(ms.path), f"frozen_param_fragments[{name!r}]", frag)
        if _rank_share(n, k, r):
            segs.append((src, 0, r * k, _rank_share(n, k, r)))
    return shape, dtype or torch.float32, segs


def _classify_module(ckpt: LoadedCheckpoint, trainable: dict, frozen: dict):
    """Sort the module's keys into parameters, tied aliases, undeclared frozen params and buffers.

    Stage 3 records no ``shared_params`` even for tied weights; a tie then shows only as two
    module entries that share one storage, which torch.save preserves.
    """
    meta = ckpt.meta
    buffer_names = set(meta.buffer_names)
    aliases: dict[str, str] = {}
    undeclared_frozen: list[str] = []
    buffers: dict[str, None] = {}
    by_identity: dict[tuple, str] = {}
    kinds: dict[str, None] = {}
    for name, value in meta.module.items():
        kinds[name] = None
        identity = tensor_identity(value)
        if name in trainable or name in frozen:
            by_identity.setdefault(identity, name)
        elif name in meta.shared_params:
            aliases[name] = meta.shared_params[name]
        elif name in buffer_names:
            buffers[name] = None
        elif identity in by_identity:
            aliases[name] = by_identity[identity]
        elif ckpt.stage != 3 and isinstance(value, torch.Tensor):
            # Stage 1 saves no frozen_param_shapes; its frozen weights exist only here.
            undeclared_frozen.append(name)
            by_identity.setdefault(identity, name)
        else:
            raise InconsistentCheckpointError(
                f"module entry {name!r} has no data: it is not in 'param_shapes', 'frozen_param_shapes', "
                "'shared_params' or 'buffer_names'", meta.path)
    for alias, source in aliases.items():
        if source not in trainable and source not in frozen and source not in undeclared_frozen:
            raise InconsistentCheckpointError(f"tied parameter {alias!r} points to unknown parameter {source!r}",
                                              meta.path)
    return kinds, aliases, undeclared_frozen, buffers
