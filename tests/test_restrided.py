"""zerofast::restrided (csrc/cpu/restrided.cpp), the op the native reader makes a file's tensors
that share a storage with: each output must be what ``Tensor.set_`` makes over its base's
storage (same storage, sizes, strides and offset; no autograd view), and a layout that reaches
outside a base, or is not a layout, must be a RuntimeError naming the record, never a crash."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zerofast.native import ops

try:
    ops.load_native()
    OP = torch.ops.zerofast.restrided.default
except Exception as e:  # noqa: BLE001 - the reason goes into the skip
    OP, WHY = None, f"no native core to test: {e}"
else:
    WHY = ""

pytestmark = pytest.mark.skipif(OP is None, reason=WHY or "no native core")

DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool, torch.complex64]


def _layout(records: list[tuple[int, int, list[int], list[int]]]) -> torch.Tensor:
    flat: list[int] = []
    for base, offset, size, stride in records:
        flat += [base, offset, len(size), *size, *stride]
    return torch.tensor(flat, dtype=torch.int64)


def _set_(base: torch.Tensor, offset: int, size: list[int], stride: list[int]) -> torch.Tensor:
    """What the reference reader makes: torch.empty(0).set_(storage, offset, size, stride)."""
    return torch.empty(0, dtype=base.dtype).set_(base.untyped_storage(), offset, size, stride)


@st.composite
def problems(draw):
    bases = []
    for i in range(draw(st.integers(1, 4))):
        n = draw(st.integers(0, 200))
        dtype = draw(st.sampled_from(DTYPES))
        whole = torch.arange(n + 8).to(dtype)
        start = draw(st.integers(0, 8))  # a base may itself sit at an offset into its storage
        bases.append(whole[start:])
    records = []
    for _ in range(draw(st.integers(0, 12))):
        b = draw(st.integers(0, len(bases) - 1))
        capacity = bases[b].untyped_storage().nbytes() // bases[b].element_size()
        ndim = draw(st.integers(0, 4))
        size = [draw(st.integers(0, 6)) for _ in range(ndim)]
        stride = [draw(st.integers(0, 9)) for _ in range(ndim)]
        reach = 0 if 0 in size else sum((s - 1) * t for s, t in zip(size, stride)) + 1
        offset = draw(st.integers(0, max(capacity - reach, 0)))
        if reach and offset + reach > capacity:
            continue  # does not fit anywhere in this base
        records.append((b, offset, size, stride))
    return bases, records


@settings(max_examples=300, deadline=None)
@given(problems())
def test_each_output_is_what_set_makes(problem):
    bases, records = problem
    made = OP(bases, _layout(records))
    assert len(made) == len(records)
    for t, (b, offset, size, stride) in zip(made, records):
        want = _set_(bases[b], offset, size, stride)
        assert (t.dtype, tuple(t.shape), t.stride(), t.storage_offset()) == \
            (want.dtype, tuple(want.shape), want.stride(), want.storage_offset())
        assert t.untyped_storage().data_ptr() == bases[b].untyped_storage().data_ptr()
        assert t.untyped_storage().nbytes() == bases[b].untyped_storage().nbytes()
        assert not t._is_view() and t._base is None and not t.requires_grad
        assert torch.equal(t, want)


def test_outputs_share_the_storage_and_hold_it():
    base = torch.arange(10.0)
    a, b = OP([base], _layout([(0, 2, [2, 3], [3, 1]), (0, 0, [4], [2])]))
    a[0, 0] = 99.0  # the storage itself, as with set_
    assert base[2] == 99.0 and b[1] == 99.0
    storage = base.untyped_storage()
    del base, storage
    assert b.tolist() == [0.0, 99.0, 4.0, 6.0]


@pytest.mark.parametrize("flat, message", [
    ([0, 5, 1, 6, 1], "the record at 0 reaches past base 0's storage"),
    ([0, 0, 1, 2, 1, 0, 10, 1, 1, 1], "the record at 5 reaches past base 0's storage"),
    ([1, 0, 1, 2, 1], "the record at 0 names base 1 of 1"),
    ([-1, 0, 0], "names base -1"),
    ([0, 0, 2, 3], "the record at 0 has 2 dimensions, past `layout`'s end"),
    ([0, 0, 65] + [1] * 130, "has 65 dimensions"),
    ([0, 0, -1], "has -1 dimensions"),
    ([0, 0], "`layout` ends inside the record at 0"),
    ([0, -1, 1, 1, 1], "negative offset, size or stride"),
    ([0, 0, 1, -1, 1], "negative offset, size or stride"),
    ([0, 0, 1, 2, -1], "negative offset, size or stride"),
    ([0, 0, 2, 2 ** 62, 2 ** 62, 2 ** 62, 2 ** 62], "reaches past base 0's storage"),
])
def test_bad_layouts_name_the_record(flat, message):
    base = torch.arange(6, dtype=torch.float32)
    with pytest.raises(RuntimeError, match=message.replace("`", ".").replace("(", ".").replace(")", ".")):
        OP([base], torch.tensor(flat, dtype=torch.int64))
    assert torch._C._storage_Use_Count(base.untyped_storage()._cdata) <= 2, "a failed call kept a tensor"


@pytest.mark.parametrize("layout", [torch.zeros(3, dtype=torch.int32), torch.zeros(2, 3, dtype=torch.int64),
                                    torch.zeros(6, dtype=torch.int64)[::2]], ids=["int32", "2-D", "strided"])
def test_a_layout_that_is_not_one_is_refused(layout):
    with pytest.raises(RuntimeError, match="restrided: `layout` must be a contiguous 1-D int64 tensor"):
        OP([torch.arange(4.0)], layout)


def test_empty_empties():
    assert OP([], torch.empty(0, dtype=torch.int64)) == []
    (t,) = OP([torch.empty(0)], _layout([(0, 0, [0, 3], [3, 1])]))
    assert t.shape == (0, 3)


def test_opcheck():
    """torch's schema (aliasing: the outputs alias the bases, as declared) and autograd checks.
    Its fake is not checked: it has none, since its outputs' shapes are the layout's values."""
    base = torch.arange(12.0)
    torch.library.opcheck(OP, ([base, base[2:]], _layout([(0, 1, [2, 2], [2, 1]), (1, 3, [3], [1])])),
                          test_utils=("test_schema", "test_autograd_registration"))
