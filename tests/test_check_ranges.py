"""The native check_ranges op (zerofast verify's checks) against its pure-torch reference, bit for
bit, on random plans full of NaN, infinities, signed zeros and subnormals; and its argument checks."""
import errno
import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zerofast.native import ops, reference
from zerofast.checks.tensors import Difference

FLOATS = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
INTS = [torch.int64, torch.int32, torch.uint8, torch.bool]
SPECIAL = [float("nan"), -float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, 1e-310, 9.2e-41, 3.4e38,
           65504.0, 65520.0, 1e-8, -2.5]


def _values(n: int, dtype: torch.dtype, seed: int, special: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if not dtype.is_floating_point:
        return torch.randint(0, 2 if dtype == torch.bool else 100, (n,), generator=g).to(dtype)
    values = torch.randn(n, generator=g, dtype=torch.float64) * 10 ** torch.randint(-6, 6, (n,), generator=g)
    pick = torch.rand(n, generator=g) < special
    values[pick] = torch.tensor(SPECIAL, dtype=torch.float64)[torch.randint(len(SPECIAL), (int(pick.sum()),),
                                                                            generator=g)]
    return values.to(dtype)


def _tile(draw, t: int, side: int, numel: int, sources: list, dtypes: list) -> list[list[int]]:
    """Rows covering tensor ``t`` of one side from random sources, with random gaps."""
    rows, at = [], 0
    while at < numel:
        length = draw(st.integers(1, numel - at))
        if draw(st.booleans()) or not sources:
            sources.append(_values(length + 5, draw(st.sampled_from(dtypes)), len(sources), draw(st.sampled_from(
                [0.0, 0.05, 0.5]))))
        src = draw(st.integers(0, len(sources) - 1))
        length = min(length, sources[src].numel())
        off = draw(st.integers(0, sources[src].numel() - length))
        if draw(st.integers(0, 5)):  # now and then a gap: elements no row covers are zeros
            rows.append([t, side, src, off, at, length])
        at += length
    return rows


@st.composite
def problems(draw):
    dtype = draw(st.sampled_from(FLOATS + INTS))
    compare = draw(st.booleans())
    source_dtypes = FLOATS if dtype.is_floating_point else [dtype]
    numels = [draw(st.integers(0, 400)) for _ in range(draw(st.integers(1, 3)))]
    sources, rows = [], []
    for t, n in enumerate(numels):
        rows += _tile(draw, t, 0, n, sources, source_dtypes)
        if compare and draw(st.booleans()):
            rows += _tile(draw, t, 1, n, sources, source_dtypes)
        elif compare:  # side 1 mostly equal to side 0: the same rows, one element changed now and then
            mine = [r for r in rows if r[0] == t and r[1] == 0]
            for r in mine:
                copy = sources[r[2]].clone()
                if draw(st.booleans()) and copy.numel():
                    copy[draw(st.integers(0, copy.numel() - 1))] = (draw(st.sampled_from([*SPECIAL, 1.0]))
                                                                   if copy.is_floating_point() else 1)
                sources.append(copy)
                rows.append([t, 1, len(sources) - 1, *r[3:]])
    order = draw(st.permutations(range(len(rows))))
    segments = torch.tensor([rows[i] for i in order], dtype=torch.int64).reshape(-1, 6)
    return sources, segments, torch.tensor(numels, dtype=torch.int64), dtype, compare, draw(st.integers(1, 150))


def _same(native, ref):
    """Equal counts; maxima equal as values, NaN exactly where the reference has one (of any sign
    or payload: the checks only ask whether it is NaN)."""
    counts, maxima = native
    want_counts, want_maxima = ref
    assert torch.equal(counts, want_counts), (counts, want_counts)
    assert torch.equal(maxima.isnan(), want_maxima.isnan()), (maxima, want_maxima)
    assert torch.equal(maxima.nan_to_num(0.0), want_maxima.nan_to_num(0.0)), (maxima, want_maxima)


def _run(sources, segments, numels, dtype, compare, chunk, fds=None, offsets=None):
    fds = [-1] * len(sources) if fds is None else fds
    offsets = torch.zeros(len(sources), dtype=torch.int64) if offsets is None else offsets
    ops.load_native()
    native = torch.ops.zerofast.check_ranges(sources, fds, offsets, segments, numels, dtype, compare, chunk, 3)
    return native, reference.check_ranges(sources, fds, offsets, segments, numels, dtype, compare, chunk)


@settings(max_examples=250, deadline=None)
@given(problems())
def test_native_matches_reference(problem):
    _same(*_run(*problem))


def test_reference_is_what_difference_add_computes():
    # The reference's comparison is the Python checks' own (Difference.add), chunk by chunk.
    x = torch.tensor([1.0, float("nan"), 0.0, 2.0, float("inf"), 3.0])
    y = torch.tensor([1.5, float("nan"), -0.0, float("nan"), 1.0, 3.0])
    counts, maxima = reference.check_ranges([x, y], [-1, -1], torch.zeros(2, dtype=torch.int64),
                                            torch.tensor([[0, 0, 0, 0, 0, 6], [0, 1, 1, 0, 0, 6]]),
                                            torch.tensor([6]), torch.float32, True, 4)
    folded = Difference()
    folded.add_figures(counts.tolist(), maxima.tolist())
    direct = Difference()
    direct.add(x[:4], y[:4])
    direct.add(x[4:], y[4:])
    assert (folded.differs, folded.changed) == (direct.differs, direct.changed)
    # 2.0 against a NaN: a change of unknown size, NaN in both folds (never dropped to a number)
    assert math.isnan(folded.max_abs) and math.isnan(direct.max_abs)
    assert math.isnan(folded.max_rel) and math.isnan(direct.max_rel)
    assert counts[:, :3].tolist() == [[1, 0, 3], [0, 1, 2]]  # side 0's NaN, Inf, non-zero (-0.0 is zero)


@pytest.mark.parametrize("src_dtype, dtype", [(torch.float32, torch.bfloat16), (torch.float32, torch.float16),
                                              (torch.bfloat16, torch.float32), (torch.float32, torch.float32)])
def test_many_items_from_files_match_reference(tmp_path, src_dtype, dtype):
    """Tensors of several reader items and chunks, read with pread from a file at an odd offset;
    one element changed far into the second tensor."""
    a = _values(300_001, src_dtype, 1, 0.01)
    b = a.to(dtype).clone()
    b[250_000] = 7.0
    path = tmp_path / "sources.bin"
    path.write_bytes(b"\0" * 3 + a.view(torch.uint8).numpy().tobytes() + b.view(torch.uint8).numpy().tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        offsets = torch.tensor([3, 3 + a.numel() * a.element_size()], dtype=torch.int64)
        rows = torch.tensor([[0, 0, 0, 0, 0, 100_000], [0, 1, 1, 0, 0, 100_000],
                             [1, 0, 0, 100_000, 0, 200_001], [1, 1, 1, 100_000, 0, 200_001]])
        native, ref = _run([a, b], rows, torch.tensor([100_000, 200_001]), dtype, True, 70_000, [fd, fd], offsets)
    finally:
        os.close(fd)
    _same(native, ref)
    assert int(native[0][:, 3].sum()) == 1  # the one changed chunk


def test_a_file_read_source_gives_only_dtype_and_length(tmp_path):
    values = torch.arange(10, dtype=torch.float32)
    path = tmp_path / "v.bin"
    path.write_bytes(values.numpy().tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        stand_in = torch.empty(1).expand(10)
        native, ref = _run([stand_in, values], torch.tensor([[0, 0, 0, 0, 0, 10], [0, 1, 1, 0, 0, 10]]),
                           torch.tensor([10]), torch.float32, True, 4, [fd, -1], torch.zeros(2, dtype=torch.int64))
    finally:
        os.close(fd)
    _same(native, ref)
    assert native[0][:, 3].tolist() == [0, 0, 0] and native[0][:, 2].tolist() == [3, 4, 2]


@pytest.mark.parametrize("rows, message", [
    ([[1, 0, 0, 0, 0, 1]], "names tensor 1 of 1"),
    ([[0, 1, 0, 0, 0, 1]], "without `compare` there is only side 0"),
    ([[0, 0, 0, 5, 0, 10]], "reaches outside"),
    ([[0, 0, 0, 0, 0, 6], [0, 0, 0, 0, 5, 5]], "overlap at element 5"),
])
def test_bad_rows_name_the_argument(rows, message):
    ops.load_native()
    with pytest.raises(RuntimeError, match=message):
        torch.ops.zerofast.check_ranges([torch.zeros(10)], [-1], torch.zeros(1, dtype=torch.int64), torch.tensor(rows),
                                        torch.tensor([10]), torch.float32, False, 4)


def test_a_file_that_ends_early_is_an_os_error_natively_and_in_the_reference(tmp_path, monkeypatch):
    # The loader checked the sizes; a file cut short since is EIO, never fewer elements counted.
    path = tmp_path / "v.bin"
    path.write_bytes(torch.arange(6, dtype=torch.float32).numpy().tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        args = ([torch.empty(1).expand(10)], [fd], torch.zeros(1, dtype=torch.int64),
                torch.tensor([[0, 0, 0, 0, 0, 10]]), torch.tensor([10]), torch.float32, False, 4)
        for native in (True, False):
            monkeypatch.setattr(ops, "native_enabled", lambda: native)
            with pytest.raises(OSError, match="truncated") as e:
                ops.check_ranges(*args)
            assert e.value.errno == errno.EIO
    finally:
        os.close(fd)


@pytest.mark.parametrize("fd, offset, message", [
    (2**31, 0, "is not an fd"),  # would wrap to another open file as an int
    (0, 2**63 - 8, "past any file"),  # offset + bytes past int64
])
def test_bad_file_arguments_are_refused_before_any_read(fd, offset, message):
    ops.load_native()
    args = ([torch.empty(1).expand(10)], [fd], torch.tensor([offset]), torch.tensor([[0, 0, 0, 0, 0, 10]]),
            torch.tensor([10]), torch.float32, False, 4)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.zerofast.check_ranges(*args)
