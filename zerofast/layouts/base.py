"""The :class:`Layout` protocol: one kind of DeepSpeed save, from its file names to its plan.

A layout is one module in this package holding one instance of a :class:`Layout` subclass, and
one line in the registry (:data:`zerofast.layouts.LAYOUTS`). Nothing outside the layout knows
what kind of save it reads: every later step asks ``ckpt.layout``.

Call order, for one checkpoint (:func:`zerofast.layouts.discover` and
:func:`zerofast.layouts.load_checkpoint` run steps 1-3; :mod:`zerofast.prepare` the rest):

1. :meth:`Layout.claims` ``(found)``: from the tag folder's names alone, the name that shows
   this save is of this layout, or None. The registry asks every layout; see
   :func:`zerofast.layouts.identify` for how several claims are settled.
2. :meth:`Layout.list_files` ``(found)``: the files the layout needs, checked as a set (every
   rank there, no two saves mixed), as a :class:`~zerofast.discover.CheckpointFiles` whose
   ``layout`` is this layout. Nothing is unpickled yet.
3. :meth:`Layout.load` ``(files)``: the records, read by the restricted loader
   (:mod:`zerofast.load.records`) and checked against each other: a
   :class:`~zerofast.load.LoadedCheckpoint`.
4. :meth:`Layout.plan` ``(ckpt, table, dtype, exclude_frozen)``: the state dict's
   :class:`~zerofast.plan.Plan`, over sources added to ``table``.
   :meth:`Layout.trainable_from` ``(ckpt, table, flats, what)`` places the trainable
   parameters from per-rank flat tensors laid out like the fp32 masters: the masters
   themselves, or one per-element optimizer state. Writers call it for both.
5. Optional, for the optimizer's state: :meth:`Layout.optimizer_keys`,
   :meth:`Layout.optimizer_entries`, :meth:`Layout.scalar_states`, and
   :meth:`Layout.refuse_unplaced` (writers call it before copying the rest of the optimizer's
   state through). The defaults read saves whose optimizer files partition every state like
   the masters, each key for the flat groups that keep it.

``writable`` says whether reshard and to-universal can write the save back at another world
size; their writers refuse the layouts that cannot. :meth:`Layout.universal_fields` lets
to-universal alone write one more (tensor-parallel saves, whose universal files say how to cut
each full tensor again).
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..discover import CheckpointFiles, Found
from ..base.errors import UnsupportedCheckpointError
from ..load import LoadedCheckpoint, PartitionedCheckpoint
from ..plan import optimizer
from ..plan.builders import master_flat_groups
from ..plan.columns import EntryTable
from ..plan.model import Entry, FlatGroups, Plan, SourceTable
from ..plan.partitioned import partition_entries, partitioned_plan


class Layout:
    """One kind of save; see the module docstring for the order of the calls."""

    name: str = ""  # short, stable: "zero", "universal", "moe", "pipeline", "autotp"
    title: str = ""  # what the save has, in messages: "mixture-of-experts", ...
    writable: bool = False  # reshard and to-universal can write it at another world size
    subsumes: tuple[str, ...] = ()  # layouts whose marks this one's saves carry too

    def claims(self, found: Found) -> str | None:
        raise NotImplementedError

    def list_files(self, found: Found) -> CheckpointFiles:
        raise NotImplementedError

    def load(self, files: CheckpointFiles) -> LoadedCheckpoint:
        raise NotImplementedError

    def plan(self, ckpt: LoadedCheckpoint, table: SourceTable, dtype: torch.dtype | None,
             exclude_frozen: bool) -> Plan:
        raise NotImplementedError

    def trainable_from(self, ckpt: LoadedCheckpoint, table: SourceTable, flats: FlatGroups,
                       what: str) -> EntryTable:
        raise UnsupportedCheckpointError(f"{self.name} checkpoints keep no flat partitions to place {what} from",
                                         ckpt.files.tag_dir)

    def optimizer_keys(self, ckpt: LoadedCheckpoint) -> list[str]:
        return optimizer.flat_keys(ckpt)

    def optimizer_entries(self, ckpt: LoadedCheckpoint, table: SourceTable,
                          keys: Sequence[str]) -> dict[str, dict[str, Entry]]:
        return optimizer.flat_state_entries(ckpt, table, keys)

    def scalar_states(self, ckpt: LoadedCheckpoint) -> dict:
        return optimizer.flat_scalar_states(ckpt)

    def optimizer_groups(self, ckpt: LoadedCheckpoint) -> list[dict]:
        """Per optimizer param group: name, flat groups, parameters and per-element state keys."""
        return optimizer.flat_group_keys(ckpt)

    def refuse_unplaced(self, ckpt: LoadedCheckpoint, placed: Sequence[str], writer: str) -> None:
        """Raise ``UnplacedOptimizerStateError`` for a partitioned optimizer value outside ``placed``."""
        optimizer.refuse_unplaced(ckpt, placed, writer)

    def universal_fields(self, ckpt: LoadedCheckpoint) -> dict[str, dict] | None:
        """For a layout that ``to-universal`` writes though ``reshard`` cannot (``writable`` is
        False): per trainable parameter, the fields ``ds_to_universal`` writes beside its
        ``param``, in its order (a tensor-parallel save's ``cat_dim``, ``vocab_tensor``,
        ``param_n_sub_params``). None: not such a layout."""
        return None

    def report(self, ckpt: LoadedCheckpoint, plan: Plan) -> dict | None:
        """``inspect``'s header of a save that is not DeepSpeed's (its own fields); None: the ZeRO one."""
        return None

    def __repr__(self) -> str:
        return f"<zerofast layout {self.name!r}>"


class PartitionedLayout(Layout):
    """A layout whose trainable masters are the partitions its loader lists
    (:class:`~zerofast.load.PartitionedCheckpoint`), each planned by the stage 1-2 builder; a save
    without ZeRO has no partitions, and the layout finds its masters in :meth:`stage0_masters`."""

    def stage0_masters(self, ckpt: PartitionedCheckpoint, table: SourceTable) -> dict[str, Entry]:
        raise UnsupportedCheckpointError(f"{self.title} checkpoints without ZeRO are not supported", ckpt.meta.path)

    def plan(self, ckpt: PartitionedCheckpoint, table: SourceTable, dtype: torch.dtype | None,
             exclude_frozen: bool) -> Plan:
        if ckpt.stage == 0:
            trainable = EntryTable.of_entries(self.stage0_masters(ckpt, table))
        else:
            trainable = self.trainable_from(ckpt, table, master_flat_groups(ckpt), "flat fp32 groups")
        return partitioned_plan(ckpt, table, dtype, exclude_frozen, trainable, self.stored_entries(ckpt, table))

    def stored_entries(self, ckpt: PartitionedCheckpoint, table: SourceTable) -> dict[str, Entry]:
        """The frozen tensors this layout puts together from several ranks' model states (a
        tensor-parallel save's frozen shards), by name; every other stored tensor is read whole
        from ``ckpt.stored``."""
        return {}

    def trainable_from(self, ckpt: PartitionedCheckpoint, table: SourceTable, flats: FlatGroups,
                       what: str) -> EntryTable:
        return partition_entries(ckpt, table, flats, what)
