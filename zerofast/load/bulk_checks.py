"""The type checks of :mod:`.records`, over a whole collection at once.

A model-states file of a frontier model lists tens of thousands of tensors and shapes, once per
rank. Checking each with a Python loop costs more than reading the file natively, so these
answer "does every item pass?" with C-level passes (``map``, ``set``, ``min``, ``max``). They
never refuse anything themselves: where one says no, the caller runs its per-item check, which
finds the item at fault and words the error.
"""
from __future__ import annotations

import itertools
import math
from typing import Iterable

INT64_MAX = 2 ** 63 - 1
MAX_DIMS = 64


def all_instances(items: Iterable, cls: type | tuple[type, ...]) -> bool:
    """Whether every item is an instance of ``cls`` (judged by its exact type, one check per type)."""
    return all(issubclass(t, cls) for t in set(map(type, items)))


def all_shapes(shapes: Iterable) -> bool:
    """Whether every item is what records.py's shape check accepts: a tuple or list of at most 64
    ints (exactly int: never bool), each in [0, 2**63), their product below 2**63. A shape with a
    zero dimension says no here (its product skips the zeros), so the per-item check decides it."""
    shapes = list(shapes)
    if not shapes:
        return True
    if not all_instances(shapes, (tuple, list)):
        return False
    longest = max(map(len, shapes))
    if longest > MAX_DIMS:
        return False
    dims = list(itertools.chain.from_iterable(shapes))
    if not dims:
        return True
    if set(map(type, dims)) != {int} or min(dims) <= 0:
        return False
    largest = max(dims)
    # No product passes 2**63 where the largest dim to the most dims does not (the usual case:
    # then the products need not be taken).
    return largest <= INT64_MAX and (largest ** longest <= INT64_MAX or max(map(math.prod, shapes)) <= INT64_MAX)
