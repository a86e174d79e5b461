"""The native shape pass (csrc/load/shapes.cpp) against records.py's per-shape check.

Where the pass answers, its dict must be the Python check's: the same keys in the same order,
each shape an exact tuple equal to it. Where the Python check refuses a shape, the pass must
not answer. On mappings of exact types only (what the unpicklers make), it must answer
wherever the Python check accepts.
"""
from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zerofast.native import ops
from zerofast.base.errors import InconsistentCheckpointError
from zerofast.load import records

CORE = ops.native_module()
pytestmark = pytest.mark.skipif(CORE is None, reason="no native core to test: it could not be built here "
                                                     "(`zerofast doctor` says why) or ZEROFAST_NATIVE=0")
PATH = Path("mp_rank_00_model_states.pt")
INT64_MAX = 2 ** 63 - 1


class Dims(tuple):
    """A tuple subclass the pass does not know: the Python check decides it."""


class Name(str):
    pass


edge = st.sampled_from([0, 1, 2, 3, 2 ** 31, 2 ** 32 + 1, 2 ** 62, INT64_MAX, INT64_MAX + 1, 2 ** 64, -1, -2 ** 63])
dim = st.one_of(st.integers(0, 9), edge, st.booleans(), st.just(2.0), st.just(None))
dims = st.lists(dim, max_size=4) | st.lists(st.integers(1, 3), min_size=60, max_size=70)
shape = st.one_of(dims.map(tuple), dims, dims.map(Dims), dims.filter(lambda d: all(type(x) is int and
                  -2 ** 63 <= x <= INT64_MAX for x in d)).map(torch.Size), st.just("12"), st.just(None))
plain_shape = st.one_of(dims.map(tuple), dims, dims.filter(lambda d: all(type(x) is int and -2 ** 63 <= x <= INT64_MAX
                                                                      for x in d)).map(torch.Size))
key = st.text(max_size=5) | st.text(max_size=3).map(Name)


def _python(mapping) -> dict | None:
    try:
        return {name: records._shape(PATH, name, s) for name, s in mapping.items()}
    except InconsistentCheckpointError:
        return None


def _same(got: dict, want: dict) -> None:
    assert type(got) is dict and list(got) == list(want)
    for name, s in want.items():
        assert type(got[name]) is tuple and got[name] == s, name


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(key, shape), max_size=6), st.booleans())
def test_the_pass_answers_only_what_the_check_accepts(items, ordered):
    mapping = (OrderedDict if ordered else dict)(items)
    got, want = CORE.plain_shapes(mapping), _python(mapping)
    if got is not None:
        assert want is not None
        _same(got, want)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(st.text(max_size=5), plain_shape), max_size=6), st.booleans())
def test_on_exact_types_the_pass_answers_wherever_the_check_accepts(items, ordered):
    mapping = (OrderedDict if ordered else dict)(items)
    got, want = CORE.plain_shapes(mapping), _python(mapping)
    assert (got is None) == (want is None)
    if want is not None:
        _same(got, want)


def test_order_is_the_mappings_own():
    mapping = OrderedDict((f"p{i}", torch.Size([i, 2])) for i in range(5))
    mapping.move_to_end("p1")
    mapping.move_to_end("p3", last=False)
    _same(CORE.plain_shapes(mapping), _python(mapping))
    assert list(CORE.plain_shapes(mapping)) == ["p3", "p0", "p2", "p4", "p1"]


def test_records_refuses_through_the_python_check():
    """A shape the pass declines still gets the check's error, naming the parameter."""
    with pytest.raises(InconsistentCheckpointError, match="'bad'"):
        records._shapes(PATH, OrderedDict(good=torch.Size([2]), bad=(2 ** 40, 2 ** 40)), "'param_shapes'")
    assert records._shapes(PATH, OrderedDict(a=torch.Size([2, 0]), b=[3]), "x") == {"a": (2, 0), "b": (3,)}
