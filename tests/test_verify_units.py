"""The chunk checks of zerofast.verify against torch's own definitions, on every dtype they see."""
from __future__ import annotations

import math

import pytest
import torch

from zerofast.checks import tensors as T

FLOATS = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("special", [None, "nan", "inf", "-inf", "zeros", "negzero", "huge"])
def test_extremes_match_torch(dtype, special):
    t = torch.randn(1001, generator=torch.Generator().manual_seed(3)).to(dtype)
    if special == "zeros":
        t.zero_()
    elif special == "negzero":
        t.fill_(-0.0)
    elif special == "huge":
        t[7] = torch.finfo(dtype).max
    elif special is not None:
        t[500] = float(special)
    finite, zero = T.extremes(t)
    assert finite == bool(torch.isfinite(t).all())
    assert zero == bool((t == 0).all())


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.int8])
def test_extremes_of_integers(dtype):
    assert T.extremes(torch.zeros(5, dtype=dtype)) == (True, True)
    assert T.extremes(torch.ones(5, dtype=dtype)) == (True, False)
    assert T.extremes(torch.empty(0, dtype=dtype)) == (True, True)


@pytest.mark.parametrize("n", [0, 1, 3, 8, 1001])
@pytest.mark.parametrize("dtype", FLOATS + [torch.int64, torch.bool])
def test_same_bits_is_bit_equality(n, dtype):
    a = (torch.arange(n) % 7).to(dtype)
    assert T.same_bits(a, a.clone())
    if n:
        b = a.clone()
        b[-1] = 1 if dtype == torch.bool and not bool(a[-1]) else 0 if dtype == torch.bool else b[-1] + 1
        assert not T.same_bits(a, b)
    assert not T.same_bits(a, a.to(torch.int32)) or dtype == torch.int32


def test_bits_not_values():
    assert not T.same_bits(torch.tensor([0.0]), torch.tensor([-0.0]))
    nan = torch.tensor([float("nan")])
    assert T.same_bits(nan, nan.clone())
    d = T.Difference()
    d.add(torch.tensor([0.0, 1.0]), torch.tensor([-0.0, 1.0]))
    assert d.differs and d.changed == 0  # equal values, different bits: reported, counted as no change
    d.add(torch.tensor([1.0, 2.0]), torch.tensor([1.5, 2.0]))
    assert (d.changed, d.max_abs, d.max_rel) == (1, 0.5, 0.5)


def test_chunks_cut_every_tensor_alike():
    assert T.cuts(0) == [(0, 0)]
    assert T.cuts(T.CHUNK + 1) == [(0, T.CHUNK), (T.CHUNK, T.CHUNK + 1)]


def test_batches_hold_every_chunk_once_and_close_at_the_byte_budget():
    """The one batching both sources read through: chunks in order, a batch closed once it holds
    BATCH_BYTES, the rest in a last batch (a plan's and an export's chunks line up by it)."""

    class Source:
        def meta(self, name):
            return T.Meta(name, shape, torch.float32, "stored")

    shape = (T.BATCH_BYTES // 4 * 3 // 2,)  # one and a half batches a tensor
    found = list(T.batches(Source(), ["a", "b", "c"]))
    assert [c for batch in found for c in batch] == [(n, lo, hi) for n in "abc" for lo, hi in T.cuts(shape[0])]
    sizes = [sum(hi - lo for _, lo, hi in batch) * 4 for batch in found]
    assert all(size >= T.BATCH_BYTES for size in sizes[:-1]) and all(size < T.BATCH_BYTES + T.CHUNK * 4
                                                                      for size in sizes)
    assert list(T.batches(Source(), [])) == []


def test_a_value_against_a_nan_reports_a_nan_difference():
    # Python's max(0.0, nan) is 0.0: a NaN gap must not come out as "max abs 0".
    from zerofast.checks.tensors import Difference

    d = Difference()
    d.add(torch.tensor([1.0, 2.0]), torch.tensor([1.0, float("nan")]))
    assert d.changed == 1 and math.isnan(d.max_abs) and math.isnan(d.max_rel)
    d.add(torch.tensor([1.0]), torch.tensor([5.0]))  # a later finite gap does not hide it
    assert math.isnan(d.max_abs)
    folded = Difference()
    folded.add_figures([(0, 0, 1, 1)], [(float("nan"), float("nan"))])
    assert folded.changed == 1 and math.isnan(folded.max_abs)
