"""Mixture-of-experts saves without ZeRO: the masters, matched by value per expert-parallel rank.

With ZeRO 1/2 the expert masters are ordinary partitions (:mod:`zerofast.load.families.moe` lists
them; :mod:`.family` plans them); only ZeRO off needs a builder of its own.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from ...load import LoadedCheckpoint, load_file
from ...load.checkpoint import expect_dict
from ...load.families import FamilyCheckpoint
from ...load.families.moe import EXPERT_NAME
from ..model import Entry, SourceTable
from . import stage0


def stage0_masters(ckpt: FamilyCheckpoint, table: SourceTable) -> dict[str, Entry]:
    """Each expert-parallel rank's masters sit unnamed in its ``expp_rank`` file. The dense
    masters are matched on ep rank 0, each rank's expert masters against its own experts, with
    the value matching of a plain stage-0 save."""
    out: dict[str, Entry] = {}
    dense = {n: s.tensor for n, s in ckpt.stored.items() if not EXPERT_NAME.match(n)}
    ep = ckpt.parallelism["ep"]
    for e, path in enumerate(ckpt.files.optim_files):
        raw = expect_dict(path, load_file(path), "an expp_rank optimizer file")
        mine = dict(dense)
        for experts, n in ckpt.extra["experts"].values():
            mine.update(t for expert, _, tensors in experts if expert // (n // ep) == e for t in tensors.items())
        meta = dataclasses.replace(ckpt.meta, path=Path(path), module=mine, param_shapes=None, raw=raw)
        view = LoadedCheckpoint(ckpt.files, 0, ckpt.world_size, [meta], [])
        found = stage0.trainable(view, table, exclude_frozen=False)
        out.update((n, v) for n, v in found.items() if e == 0 or EXPERT_NAME.match(n))
    ckpt.aliases.update(_copied_ties(ckpt, out))
    return out


def _copied_ties(ckpt: FamilyCheckpoint, masters: dict) -> dict[str, str]:
    """Tied weights of a ZeRO-off MoE save. It records no ``shared_params`` and saves the module
    as copies, so a tied alias is a second, bit-identical copy of a parameter that has a master,
    with no master of its own. (Two distinct parameters, one frozen, would have to be equal in
    every bit to be taken for a tie; the output values are the same either way in ``dtype=None``.)"""
    by_value: dict[tuple, str] = {}
    for name in masters:
        t = ckpt.stored[name].tensor if name in ckpt.stored else None
        if t is not None:
            by_value.setdefault((tuple(t.shape), t.dtype, _bits(t)), name)
    out = {}
    for name, s in ckpt.stored.items():
        if name in masters or name in ckpt.buffers or name in ckpt.aliases:
            continue
        source = by_value.get((tuple(s.tensor.shape), s.tensor.dtype, _bits(s.tensor)))
        if source is not None:
            out[name] = source
    return out


def _bits(t) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
