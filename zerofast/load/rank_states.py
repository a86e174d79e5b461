"""ZeRO-3's per-rank model-states files, each repeated pickle read once.

ZeRO-3 writes one model-states file per rank, and their pickles are normally the same (the
partitioned parameters' placeholders, the same ``param_shapes`` and config). A file proven to
repeat one read before (:func:`~.reader.load_like`) is read as its twin: the earlier file's
checked metadata kept, and its tree copied onto this file's storages, the parts planning reads
(the frozen fragments) at once, the placeholders of ``module`` only if something asks for them
(``raw`` or ``module``): reconstructing never does.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Sequence

from ..base import keys as K
from .archive import index_archive
from .parallel import read_ahead, read_all
from .reader import Template, Twin, TwinDeclined, load_file, load_like, native_core, read_errors
from .records import ModelStates, model_states_from, read_model_states

# Distinct pickles kept to compare rank files with: rank 0's, and the one other ranks share
# where rank 0 alone records something (DeepSpeed writes shared_params on rank 0 only).
MAX_TEMPLATES = 4
# Rank files whose zip directories are read ahead of the one being unpickled.
READ_AHEAD = 4


def read_rank_model_states(paths: Sequence[Path]) -> list[ModelStates]:
    """The files in order, each repeated pickle read once. Where two files in a row repeat none
    read before, the rest are read in full, several at a time. The zip directories of the files
    ahead are read on threads meanwhile (without the GIL, while this one unpickles)."""
    known: list[tuple[Template, ModelStates]] = []
    later: dict[int, frozenset] = {}  # per template: the keys that may be copied later (asked once)
    states: list[ModelStates] = []
    misses = 0
    # Ahead only where the native core reads the directories (without the GIL): the Python
    # reference's would only contend for it.
    ahead = READ_AHEAD if native_core() is not None else 0
    with contextlib.closing(read_ahead(_index, paths, ahead)) as indexes:
        for i, (path, index) in enumerate(zip(paths, indexes)):
            if misses == 2:
                break
            one, how = _read_rank(path, index, known, later)
            states.append(one)
            misses = 0 if isinstance(how, int) else misses + (i > 0)
            if isinstance(how, Template) and len(known) < MAX_TEMPLATES:
                known.append((how, one))
    return states + read_all(read_model_states, paths[len(states):])


def _index(path: Path):
    with read_errors(path):
        return index_archive(path)


def _read_rank(path: Path, index: Callable, known: list, later: dict) -> tuple[ModelStates, int | Template | None]:
    """One rank file's states (``index()``: its archive index), and how :func:`load_like` read
    it (None: its twin copy declined)."""
    with read_errors(path):
        raw, how = load_like(path, [t for t, _ in known], index())
        if isinstance(how, int):
            first = known[how][1]
            if how not in later:
                later[how] = _later_keys(first.raw)
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
        except TwinDeclined:  # not expected (_later_keys checked what is left): the file read in full
            raw = load_file(twin.path)
        self.raw, self.module = raw, raw[K.MODULE]
        del self.__dict__["_pending"]
        return getattr(self, name)


def _twin_states(first: ModelStates, twin: Twin, later: frozenset) -> ModelStates | None:
    """The twin's states from ``first``'s (the template's): its checks hold for the copy as they
    are, and its checked lists and dicts (param_shapes, ...) are shared, not copied (nothing
    changes them once read). The parts in ``later`` (the placeholders of ``module`` and the
    shapes, which planning does not read from a twin) are copied when ``raw`` or ``module`` is
    asked for, the rest now. None where a part read now does not copy."""
    raw = first.raw
    try:
        made = {k: twin.copy(v) for k, v in raw.items() if k not in later}
    except TwinDeclined:
        return None
    fields = {f.name: getattr(first, f.name) for f in dataclasses.fields(ModelStates)}
    fields.update(path=twin.path, frozen_param_fragments=dict(made.get(K.FROZEN_PARAM_FRAGMENTS) or {}))
    states = TwinModelStates.__new__(TwinModelStates)
    if not later:
        states.__dict__.update(fields, raw=made, module=made[K.MODULE])
    else:
        del fields["raw"], fields["module"]
        states.__dict__.update(fields, _pending=(twin, raw, made))
    return states


def _later_keys(raw: Any) -> frozenset:
    """The parts of a template's tree that surely copy, so that a twin may copy them only when
    asked for, without a fallback to decide then: ``module`` and ``param_shapes``. The template's
    own checks (:func:`~.records.model_states_from`) proved that ``module`` maps str names to
    tensors (plain ``torch.Tensor``: the only kind the native reader builds) and each shapes
    group str names to tuples or lists of ints, all of which the copy knows; what is left to ask
    is that their containers are plain. Empty unless ``module`` is one of them."""
    if type(raw) is not dict or not _plain_mapping(raw.get(K.MODULE)):
        return frozenset()
    shapes = raw.get(K.PARAM_SHAPES)
    plain = type(shapes) is list and all(_plain_mapping(group) for group in shapes)
    return frozenset((K.MODULE, K.PARAM_SHAPES) if plain else (K.MODULE,))


def _plain_mapping(mapping: Any) -> bool:
    """A dict, or an OrderedDict with no attribute but _metadata (others could hide its methods)."""
    return type(mapping) is dict or (type(mapping) is OrderedDict and not set(vars(mapping)) - {"_metadata"})
