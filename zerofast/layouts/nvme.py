"""ZeRO-Infinity saves: ZeRO-3 with ``offload_optimizer: {device: nvme}``, the state in swap files.

On disk (DeepSpeed 0.19.8, ``engine.save_checkpoint``): the plain ZeRO-3 files, plus
``offloaded_tensors/rank{RR}/`` (``RR`` the data-parallel rank, two digits), a copy of the rank's
optimizer swap folder (``<nvme_path>/zero_stage_3/optimizer/rank{R}``) without its gradient files.
A sub-group whose fp32 partition holds at least ``max(1 MiB, aio.block_size)`` bytes is swapped:
- its ``fp32_flat_groups`` entry in the optimizer file is an empty tensor, and each of its
  per-element states (Adam's ``exp_avg``, ``exp_avg_sq``) in the inner ``state`` is one too; the
  scalar ``step`` stays in the file;
- ``{A}_{B}.tensor.swp`` holds the fp32 partition and ``{key}-{A}_{B}.tensor.swp`` each state:
  raw little-endian elements of the master dtype, no header, zero padded to a multiple of
  ``1024 * aio.intra_op_parallelism`` bytes. ``A`` and ``B`` are the ``ds_id`` of the sub-group's
  first and last parameter.

A ``ds_id`` is the order in which ``zero.Init`` converted the parameter, which the save does not
record: ``_post_init_method`` numbers a module's own parameters when its ``__init__`` ends, so
after its children's. So the ids are estimated from ``module`` in that post-order (and, as a
second guess, in the state dict's own pre-order), frozen ones included, all shifted alike; each
swapped sub-group gets the file its estimated ids name when the guesses that name a distinct
file for every sub-group agree on one pairing. Otherwise each gets the file of its byte size,
if the sizes single each one out; else the save is refused. Every file read must have its
sub-group's size.

Loading fills the empty entries with the swap files' elements (mapped copy-on-write, not read up
front), so planning, every reader and the writers see a plain ZeRO-3 save: reshard and to-universal
write plain (non-NVMe) saves. DeepSpeed's own load of an NVMe engine copies the swap files back
under the ``ds_id`` names of its model; writing those for another world size needs ids the save
does not hold, so that is refused.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..base import keys as K
from ..discover import CheckpointFiles, Found, plain_files
from ..base.errors import (IncompleteCheckpointError, InconsistentCheckpointError, UnplacedOptimizerStateError,
                      UnsupportedCheckpointError)
from ..load import LoadedCheckpoint, OptimStates
from ..load.unpickle import map_file
from ..plan.model import Plan, SourceTable, ceil_div, rank_share
from .zero import ZeroLayout

FOLDER = "offloaded_tensors"
_MASTER = re.compile(r"^(\d+)_(\d+)\.tensor\.swp$")
_ALIGN_BYTES = 1024  # DeepSpeed's AIO_ALIGNED_BYTES, times aio.intra_op_parallelism


@dataclass(frozen=True)
class SwapFiles(CheckpointFiles):
    swap_files: tuple[tuple[Path, ...], ...] = ()  # per rank, the files of offloaded_tensors/rank{RR}

    def paths(self) -> tuple[Path, ...]:
        return super().paths() + tuple(p for rank in self.swap_files for p in rank)


@dataclass
class SwappedCheckpoint(LoadedCheckpoint):
    unread: tuple[Path, ...] = ()  # swap files no optimizer state names (left by another run, planted)
    swapped: tuple[int, ...] = ()  # rank 0's sub-groups read from swap files
    files_read: int = 0

    @property
    def parallelism(self) -> dict:
        return {**super().parallelism, "offloaded": {"sub_groups": list(self.swapped), "files": self.files_read}}


class NvmeLayout(ZeroLayout):
    name = "nvme"
    title = "NVMe-offloaded optimizer state (ZeRO-Infinity)"
    writable = True  # as plain saves; see the module docstring

    def claims(self, found: Found) -> str | None:
        return f"{FOLDER}/" if (found.tag_dir / FOLDER).is_dir() else None

    def list_files(self, found: Found) -> CheckpointFiles:
        model_files, optim_files = plain_files(found)
        folders = [found.tag_dir / FOLDER / f"rank{r:02d}" for r in range(len(optim_files))]
        for folder in folders:
            if not folder.is_dir():
                raise IncompleteCheckpointError(
                    f"expected {FOLDER}/{folder.name}/ for each of the {len(optim_files)} optimizer files, "
                    f"found no {folder.name}", found.tag_dir)
        swap = tuple(tuple(sorted(p for p in folder.iterdir() if p.is_file())) for folder in folders)
        return SwapFiles(found.root, found.tag, found.tag_dir, model_files, optim_files, layout=self, swap_files=swap)

    def load(self, files: SwapFiles) -> LoadedCheckpoint:
        ckpt = super().load(files)
        if ckpt.stage != 3:
            raise UnsupportedCheckpointError(
                f"{FOLDER}/ next to a ZeRO stage {ckpt.stage} save: DeepSpeed swaps optimizer state to NVMe at "
                "stage 3 only", files.tag_dir)
        ids = _estimated_ids(ckpt)
        align = _ALIGN_BYTES * _intra_op_parallelism(ckpt)
        optim, used = [], set()
        for r, (o, rank) in enumerate(zip(ckpt.optim_states, files.swap_files)):
            optim.append(_swapped_in(o, ckpt, files.tag_dir / FOLDER / f"rank{r:02d}", rank, ids, align, used))
        unread = tuple(p for rank in files.swap_files for p in rank if p not in used)
        fields = {f.name: getattr(ckpt, f.name) for f in dataclasses.fields(ckpt)}
        before, after = ckpt.optim_states[0].flat_groups, optim[0].flat_groups
        swapped = tuple(i for i, (g, h) in enumerate(zip(before, after)) if g.numel() != h.numel())
        return SwappedCheckpoint(**{**fields, "optim_states": optim}, unread=unread, swapped=swapped,
                                 files_read=len(used))

    def plan(self, ckpt: LoadedCheckpoint, table: SourceTable, dtype: torch.dtype | None,
             exclude_frozen: bool) -> Plan:
        _refuse_swapped_frozen(ckpt)
        return super().plan(ckpt, table, dtype, exclude_frozen)

    def refuse_unplaced(self, ckpt: SwappedCheckpoint, placed, writer: str) -> None:
        super().refuse_unplaced(ckpt, placed, writer)
        if ckpt.unread:
            path = ckpt.unread[0]
            raise UnplacedOptimizerStateError(
                f"{writer} cannot place the swap file {path.parent.name}/{path.name}: no optimizer state of "
                f"{path.parent.name} names it ({len(ckpt.unread)} such files); refusing rather than dropping it", path)


def _refuse_swapped_frozen(ckpt: LoadedCheckpoint) -> None:
    """A frozen parameter on NVMe (``offload_param``) at save time is saved as a placeholder."""
    W = ckpt.world_size
    for name, shape in (ckpt.meta.frozen_param_shapes or {}).items():
        n = int(torch.Size(shape).numel())
        for r, ms in enumerate(ckpt.model_states):
            fragment, share = ms.frozen_param_fragments.get(name), rank_share(n, ceil_div(n, W), r)
            if fragment is not None and 0 < fragment.numel() < share:
                raise IncompleteCheckpointError(
                    f"the save does not hold frozen parameter {name!r}: its fragment is a {fragment.numel()}-element "
                    f"placeholder, not its {share} elements (DeepSpeed 0.19.8 saves a frozen parameter that "
                    "offload_param keeps on NVMe that way); its optimizer state can still be read", ms.path)


def _estimated_ids(ckpt: LoadedCheckpoint) -> list[dict[str, int]]:
    """Guesses of name -> ``ds_id`` (up to a shift): DeepSpeed's post-order, then the module's
    pre-order, over the names ``param_shapes`` or ``frozen_param_shapes`` list (a tied alias is
    in neither at stage 3)."""
    meta = ckpt.meta
    params = {n for group in meta.param_shapes for n in group} | set(meta.frozen_param_shapes or {})
    pre = [n for n in meta.module if n in params]
    guesses = [post_order(pre), pre]
    return [{name: i for i, name in enumerate(order)} for order in guesses]


def post_order(names: list[str]) -> list[str]:
    """``names`` (a state dict's order: a module's own parameters, then its children's) with
    every module's own parameters after its children's, as ``zero.Init`` converts them."""
    root: tuple[list, dict] = ([], {})
    for name in names:
        node = root
        for part in name.split(".")[:-1]:
            node = node[1].setdefault(part, ([], {}))
        node[0].append(name)
    out, stack = [], [(root, False)]
    while stack:  # iterative, so a deep module tree cannot hit the recursion limit
        (own, children), visited = stack.pop()
        if visited:
            out.extend(own)
            continue
        stack.append(((own, children), True))
        stack.extend((child, False) for child in reversed(list(children.values())))
    return out


def _intra_op_parallelism(ckpt: LoadedCheckpoint) -> int:
    cfg = ckpt.meta.raw.get(K.DS_CONFIG)
    aio = cfg.get("aio") if isinstance(cfg, dict) else None
    value = aio.get("intra_op_parallelism", 1) if isinstance(aio, dict) else 1
    if type(value) is not int or value < 1:
        raise UnsupportedCheckpointError(f"expected ds_config aio.intra_op_parallelism to be an int >= 1, "
                                         f"found {value!r}", ckpt.meta.path)
    return value


def _swapped_in(o: OptimStates, ckpt: LoadedCheckpoint, folder: Path, files: tuple[Path, ...],
                ids: list[dict[str, int]], align: int, used: set[Path]) -> OptimStates:
    """``o`` with every swapped sub-group's master and per-element states read from ``files`` in
    ``folder`` (each file read is added to ``used``)."""
    shapes, W = ckpt.meta.param_shapes, ckpt.world_size
    if len(o.flat_groups) != len(shapes):
        raise InconsistentCheckpointError(
            f"expected {len(shapes)} fp32_flat_groups (one per 'param_shapes' sub-group), found {len(o.flat_groups)}",
            o.path)
    sizes = [sum(ceil_div(int(torch.Size(s).numel()), W) for s in group.values()) for group in shapes]
    swapped = [i for i, g in enumerate(o.flat_groups) if g.numel() == 0 and sizes[i] > 0]
    dtype = next((g.dtype for g in o.flat_groups if g.numel() > 0), torch.float32)
    masters = {(int(m.group(1)), int(m.group(2))): p for p in files if (m := _MASTER.match(p.name))}
    stems = _pair(folder, swapped, masters, [sizes[i] * dtype.itemsize for i in swapped],
                  [[_id_range(shapes[i], guess) for i in swapped] for guess in ids], align)
    flat_groups = list(o.flat_groups)
    osd = dict(o.raw[K.OPTIMIZER_STATE_DICT])
    inner = dict(osd[K.ZERO3_INNER])
    state = dict(inner.get(K.STATE) or {})
    for i, stem in zip(swapped, stems):
        flat_groups[i] = _read(folder / f"{stem}.tensor.swp", sizes[i], dtype, align, used)
        entry = dict(state.get(i) or {})
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == 0:
                entry[key] = _read(folder / f"{key}-{stem}.tensor.swp", sizes[i], dtype, align, used)
        state[i] = entry
    inner[K.STATE] = state
    osd[K.ZERO3_INNER], osd[K.ZERO3_FLAT] = inner, flat_groups
    return dataclasses.replace(o, flat_groups=flat_groups, raw={**o.raw, K.OPTIMIZER_STATE_DICT: osd})


def _id_range(group: dict, ids: dict[str, int]) -> tuple[int, int] | None:
    names = list(group)
    first, last = ids.get(names[0]), ids.get(names[-1])
    return None if first is None or last is None else (first, last)


def _pair(folder: Path, swapped: list[int], masters: dict[tuple[int, int], Path], nbytes: list[int],
          guesses: list[list[tuple[int, int] | None]], align: int) -> list[str]:
    """The file stem (``A_B``) of each swapped sub-group, in ``swapped`` order (module docstring)."""
    if len(masters) != len(swapped):
        raise IncompleteCheckpointError(
            f"expected {len(swapped)} fp32 swap files ({{first}}_{{last}}.tensor.swp) for the sub-groups the rank's "
            f"optimizer file leaves empty ({swapped}), found {len(masters)}", folder)
    named = {tuple(p) for guess in guesses if None not in guess and (p := _by_name(set(masters), guess)) is not None}
    if len(named) == 1:  # every guess that names the files names the same ones
        return [f"{a}_{b}" for a, b in named.pop()]
    files = sorted(masters)
    fits = [[f for f in files if _fits(masters[f].stat().st_size, n, align)] for n in nbytes]
    if any(len(c) != 1 for c in fits) or len({c[0] for c in fits}) != len(fits):
        raise InconsistentCheckpointError(
            f"cannot tell which swap file holds which of the swapped sub-groups {swapped}: the parameters' order "
            f"does not name them ({[f'{a}_{b}' for a, b in files]}) and their sizes do not single them out", folder)
    return [f"{c[0][0]}_{c[0][1]}" for c in fits]


def _by_name(names: set[tuple[int, int]], estimates: list[tuple[int, int]]) -> list[tuple[int, int]] | None:
    """The files named by the estimated ids, shifted alike (``ds_id`` counts on across the models
    one process builds), when one shift names a distinct file for every sub-group."""
    for shift in sorted({a - first for a, _ in names for first, _ in estimates}):
        named = [(first + shift, last + shift) for first, last in estimates]
        if all(n in names for n in named) and len(set(named)) == len(named):
            return named
    return None


def _fits(size: int, nbytes: int, align: int) -> bool:
    return size == ceil_div(nbytes, align) * align


def _read(path: Path, numel: int, dtype: torch.dtype, align: int, used: set[Path]) -> torch.Tensor:
    if not path.is_file():
        raise IncompleteCheckpointError(f"expected the swap file {path.name} of a swapped sub-group, found none",
                                        path.parent)
    st = path.stat()
    size, nbytes = st.st_size, numel * dtype.itemsize
    if not _fits(size, nbytes, align):
        raise InconsistentCheckpointError(
            f"expected {ceil_div(nbytes, align) * align} bytes ({numel} {dtype} elements padded to {align}), found "
            f"{size}", path)
    used.add(path)
    # Through map_file: a mapping the executor knows, so its pages are dropped once read.
    return torch.empty(0, dtype=dtype).set_(map_file(path, st), 0, (numel,), (1,))


LAYOUT = NvmeLayout()
