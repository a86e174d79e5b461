"""How an export splits a plan into files: pure functions of the plan and the size limit.

Nothing here touches the disk; :mod:`.run` writes what :func:`layout` returns through the
writer of the chosen format (:mod:`.formats`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from typing import Iterable

import numpy as np

from ..plan.columns import PlanTensors, columns_of
from ..plan.model import Plan

# huggingface_hub's and transformers' units: decimal KB/MB/GB/TB (also written K/M/G/T), binary KiB...
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """Bytes in a size limit as huggingface_hub reads it: ``"5GB"`` (or ``"5G"``) is 5*10**9,
    ``"5GiB"`` 5*2**30, and an int (or a string of digits) is a count of bytes."""
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise ValueError(f"max_shard_size must be an int or a string such as '5GB', got {size!r}")
    if isinstance(size, int):
        value = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*", size)
        unit = m.group(2).upper() if m else None
        if unit not in _UNITS:
            raise ValueError(f"max_shard_size {size!r}: expected a number of bytes or a size such as '500MB', "
                             "'5G', '5GB' or '4GiB'")
        value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"max_shard_size must be positive, got {size!r}")
    return value


def plan_shards(sizes: Iterable[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Group ``(name, nbytes)`` into shards as huggingface_hub does.

    Names stay in order; a shard closes when the next tensor would take it over ``max_bytes``; a
    tensor larger than the limit gets a shard of its own (appended as soon as it is met, while the
    open shard stays open). There is always at least one shard.
    """
    shards: list[list[str]] = []
    current: list[str] = []
    used = 0
    for name, nbytes in sizes:
        if nbytes > max_bytes:
            shards.append([name])
            continue
        if used + nbytes > max_bytes:
            shards.append(current)
            current, used = [], 0
        current.append(name)
        used += nbytes
    if current or not shards:
        shards.append(current)
    return shards


@dataclass(frozen=True)
class ShardFile:
    name: str
    # stored with their own data, in the model's order, as columns (a file of a 200k-tensor
    # save makes no object per tensor); their names are those in the file
    tensors: PlanTensors
    aliases: tuple[tuple[str, str], ...]  # (alias, source) the file holds sharing the source's storage
    keys: tuple[str, ...]  # every key of the file, in the model's order

    @cached_property  # asked by the writer, the progress bar, the index and the result
    def nbytes(self) -> int:
        return int(self.tensors.nbytes().sum())


def shard_names(single: str, pattern: str, count: int) -> list[str]:
    """``model.safetensors`` alone, or ``model-00001-of-00003.safetensors``, ... for several."""
    return [single] if count == 1 else [pattern.format(i + 1, count) for i in range(count)]


def _stored_entries(plan: Plan, cols: PlanTensors, duplicate_tied: bool) -> tuple[np.ndarray, list[str]]:
    """Every tensor that gets its own data, in model order (tied aliases too when duplicated):
    its number in ``cols`` and its name."""
    if plan.aliases:
        aliases = plan.aliases
        names = [n for n in plan.order if duplicate_tied or n not in aliases]
        sources = [aliases.get(n, n) for n in names]
    else:
        names = sources = list(plan.order)
    numbers = np.fromiter(map(cols.index.__getitem__, sources), dtype=np.int64, count=len(sources))
    return numbers, names


def layout(plan: Plan, names: tuple[str, str], max_bytes: int, *, aliases_in_files: bool,
           duplicate_tied: bool = False) -> tuple[list[ShardFile], dict[str, str]]:
    """The files an export writes (named by ``names``: single file, shard pattern), and the tied
    names it records instead of storing them again.

    An alias costs no bytes: with ``aliases_in_files`` (torch) a file holds it next to its source
    so that the two keep sharing storage; otherwise (safetensors) only the metadata lists it.
    """
    cols = columns_of(plan.tensors)
    numbers, stored = _stored_entries(plan, cols, duplicate_tied)
    groups = plan_shards(zip(range(len(stored)), cols.nbytes()[numbers].tolist()), max_bytes)
    tied = {} if duplicate_tied else {a: plan.aliases[a] for a in plan.order if a in plan.aliases}
    files = []
    for name, group in zip(shard_names(*names, len(groups)), groups):
        at = np.array(group, dtype=np.int64)
        renamed = stored if len(group) == len(stored) else [stored[i] for i in group]
        tensors = cols.select(numbers[at], None if renamed == cols.names else renamed)
        members = set(tensors.names)
        aliases = tuple((a, s) for a, s in tied.items() if s in members) if aliases_in_files else ()
        members.update(a for a, _ in aliases)
        keys = tuple(k for k in plan.order if k in members)
        files.append(ShardFile(name, tensors, aliases, keys))
    return files, tied


def index_doc(files: Iterable[ShardFile], metadata: dict) -> dict:
    """The ``*.index.json`` document: ``metadata`` (``total_size`` first) and the weight map."""
    return {"metadata": metadata, "weight_map": {key: f.name for f in files for key in f.keys}}
