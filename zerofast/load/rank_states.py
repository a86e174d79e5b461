"""ZeRO-3's per-rank model-states files, each repeated pickle read once.

ZeRO-3 writes one model-states file per rank, and their pickles are normally the same (the
partitioned parameters' placeholders, the same ``param_shapes`` and config). A file proven to
repeat one read before (:func:`~.reader.load_like`) is read as its twin: the earlier file's
checked metadata kept, and its tree copied onto this file's storages, the parts planning reads
(the frozen fragments) at once, the placeholders of ``module`` only if something asks for them
(``raw`` or ``module``): reconstructing never does.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from pathlib import Path
from typing import Any, Sequence

import torch

from .. import keys as K
from .parallel import read_all
from .reader import Template, Twin, TwinDeclined, load_file, load_like, read_errors
from .records import ModelStates, model_states_from, read_model_states

# Distinct pickles kept to compare rank files with: rank 0's, and the one other ranks share
# where rank 0 alone records something (DeepSpeed writes shared_params on rank 0 only).
MAX_TEMPLATES = 4


def read_rank_model_states(paths: Sequence[Path]) -> list[ModelStates]:
    """The files in order, each repeated pickle read once. Where two files in a row repeat none
    read before, the rest are read in full, several at a time."""
    known: list[tuple[Template, ModelStates]] = []
    later: dict[int, bool] = {}  # per template: whether its module may be copied later (asked once)
    states: list[ModelStates] = []
    misses = 0
    for i, path in enumerate(paths):
        if misses == 2:
            return states + read_all(read_model_states, paths[i:])
        one, how = _read_rank(path, known, later)
        states.append(one)
        misses = 0 if isinstance(how, int) else misses + (i > 0)
        if isinstance(how, Template) and len(known) < MAX_TEMPLATES:
            known.append((how, one))
    return states


def _read_rank(path: Path, known: list, later: dict) -> tuple[ModelStates, int | Template | None]:
    """One rank file's states, and how :func:`load_like` read it (None: its twin copy declined)."""
    with read_errors(path):
        raw, how = load_like(path, [t for t, _ in known])
        if isinstance(how, int):
            first = known[how][1]
            if how not in later:
                later[how] = type(first.raw) is dict and _copies_later(first.raw.get(K.MODULE))
            twin = _twin_states(first, raw, later[how])
            if twin is not None:
                return twin, how
            raw, how = load_file(path), None
    return model_states_from(path, raw), how


class TwinModelStates(ModelStates):
    """A twin's :class:`ModelStates`: ``module`` and ``raw`` are copied when first asked for."""

    def __getattr__(self, name: str) -> Any:  # only for attributes not set: module and raw
        pending = self.__dict__.get("_pending")
        if name not in ("module", "raw") or pending is None:
            raise AttributeError(name)
        twin, first, made = pending
        try:
            raw = {k: made[k] if k in made else twin.copy(v) for k, v in first.items()}
        except TwinDeclined:  # not expected (_copies_later checked it); the file then read in full
            raw = load_file(twin.path)
        self.raw, self.module = raw, raw[K.MODULE]
        del self.__dict__["_pending"]
        return getattr(self, name)


def _twin_states(first: ModelStates, twin: Twin, module_later: bool) -> ModelStates | None:
    """The twin's states from ``first``'s (the template's): its checks hold for the copy as they
    are, and its checked lists and dicts (param_shapes, ...) are shared, not copied (nothing
    changes them once read). ``module_later``: its module is copied when asked for. None where
    a part read now does not copy."""
    raw = first.raw
    later = K.MODULE if module_later else None
    try:
        made = {k: twin.copy(v) for k, v in raw.items() if k != later}
    except TwinDeclined:
        return None
    fields = {f.name: getattr(first, f.name) for f in dataclasses.fields(ModelStates)}
    fields.update(path=twin.path, frozen_param_fragments=dict(made.get(K.FROZEN_PARAM_FRAGMENTS) or {}))
    states = TwinModelStates.__new__(TwinModelStates)
    if later is None:
        states.__dict__.update(fields, raw=made, module=made[K.MODULE])
    else:
        del fields["raw"], fields["module"]
        states.__dict__.update(fields, _pending=(twin, raw, made))
    return states


def _copies_later(module: Any) -> bool:
    """Whether ``module`` surely copies (plain tensors under names, an OrderedDict's _metadata
    at most), so that it may be copied only when asked for, without a fallback to decide then."""
    if type(module) not in (dict, OrderedDict) or (type(module) is OrderedDict and set(vars(module)) - {"_metadata"}):
        return False
    return all(type(k) is str for k in module) and all(type(v) is torch.Tensor for v in module.values())
