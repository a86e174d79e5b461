"""Plain data-parallel ZeRO saves, stages 0-3, and the BF16_Optimizer variant of stage 1.

On disk: ``mp_rank_00_model_states.pt`` (stages 0-2) or one
``zero_pp_rank_R_mp_rank_00_model_states.pt`` per rank (stage 3), and one
``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt`` per rank (none at stage 0). The stage and the
world size come from the files, checked against each other and against the run's ``ds_config``.

The registry reads with this layout whatever no other layout claims.
"""
from __future__ import annotations

import torch

from ..discover import CheckpointFiles, Found, plain_files
from ..load import LoadedCheckpoint
from ..load.parallel import read_all, read_meanwhile
from ..load.reader import native_core
from ..load.rank_states import read_rank_model_states
from ..load.records import (agree_with_config, check_flat_groups, check_parallelism, read_model_states,
                            read_optim_states, settle_stage, settle_world_size)
from ..plan.build import plain_plan
from ..plan.builders import flat_entries, master_flat_groups, stage0
from ..plan.columns import EntryTable
from ..plan.model import FlatGroups, Plan, SourceTable
from .base import Layout


class ZeroLayout(Layout):
    name = "zero"
    title = "data parallelism"
    writable = True

    def claims(self, found: Found) -> str | None:
        return None  # the registry's fallback: what no other layout claims

    def list_files(self, found: Found) -> CheckpointFiles:
        model_files, optim_files = plain_files(found)
        return CheckpointFiles(found.root, found.tag, found.tag_dir, model_files, optim_files, layout=self)

    def load(self, files: CheckpointFiles) -> LoadedCheckpoint:
        # The optimizer files are read while the model files are (their GIL-free parts overlap):
        # only with the native core, whose reader leaves the GIL for them; only for stages 0-2,
        # whose one model file does not put reader threads of its own in the way.
        overlap = native_core() is not None and not files.partitioned_model_states
        with read_meanwhile(read_optim_states, files.optim_files, overlap) as optim_states_read:
            if files.partitioned_model_states:
                model_states = read_rank_model_states(files.model_files)
            else:
                model_states = read_all(read_model_states, files.model_files)
            check_parallelism(model_states[0], universal=False)
            optim_states = optim_states_read()
        stage = settle_stage(files, model_states, optim_states)
        agree_with_config(files, model_states[0], stage, "the optimizer files")
        world_size = settle_world_size(files, stage, model_states, optim_states)
        check_flat_groups(stage, optim_states)
        return LoadedCheckpoint(files, stage, world_size, model_states, optim_states)

    def plan(self, ckpt: LoadedCheckpoint, table: SourceTable, dtype: torch.dtype | None,
             exclude_frozen: bool) -> Plan:
        if ckpt.stage == 0:
            trainable = EntryTable.of_entries(stage0.trainable(ckpt, table, exclude_frozen))
        else:
            trainable = self.trainable_from(ckpt, table, master_flat_groups(ckpt), "flat fp32 groups")
        return plain_plan(ckpt, table, dtype, exclude_frozen, trainable)

    def trainable_from(self, ckpt: LoadedCheckpoint, table: SourceTable, flats: FlatGroups,
                       what: str) -> EntryTable:
        return flat_entries(ckpt, table, flats, what)


LAYOUT = ZeroLayout()
