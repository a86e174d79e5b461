"""The batched file-reading ops (read_cast, read_cast_to_file) against their pure-torch references.

Each source's bytes are written into a scratch file at an arbitrary (unaligned) offset; the
native op reads them from there with pread while the reference copies the in-memory tensor, so
agreement means the op read the right bytes and cast them as Tensor.to does.
"""
import errno
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import assert_bitwise_equal
from tests.test_ops import FLOATS, _source
from zerofast.native import ops, reference

DTYPES = FLOATS + [torch.int64]


@st.composite
def batch_problems(draw):
    n_sources = draw(st.integers(1, 4))
    sizes = [draw(st.integers(0, 3000)) for _ in range(n_sources)]
    dtypes = [draw(st.sampled_from(DTYPES)) for _ in range(n_sources)]
    sources = [_source(n, d, seed=i) for i, (n, d) in enumerate(zip(sizes, dtypes))]
    gaps = [draw(st.integers(0, 9)) for _ in range(n_sources)]
    in_file = [draw(st.booleans()) for _ in range(n_sources)]  # False: copied from memory (fd -1)
    n_outs = draw(st.integers(1, 4))
    out_dtypes = [draw(st.sampled_from(DTYPES)) for _ in range(n_outs)]
    rows, out_len = [], [0] * n_outs
    for _ in range(draw(st.integers(0, 12))):
        out = draw(st.integers(0, n_outs - 1))
        castable = [i for i in range(n_sources)
                    if dtypes[i] == out_dtypes[out] or (dtypes[i].is_floating_point and out_dtypes[out].is_floating_point)]
        if not castable:
            continue
        src = draw(st.sampled_from(castable))
        off = draw(st.integers(0, sizes[src]))
        length = draw(st.integers(0, sizes[src] - off))
        rows.append((out, src, off, out_len[out], length))
        out_len[out] += length + draw(st.integers(0, 3))
    order = draw(st.permutations(range(len(rows))))
    segments = torch.tensor([rows[i] for i in order], dtype=torch.int64).reshape(-1, 5)
    return sources, gaps, in_file, segments, list(zip(out_len, out_dtypes))


def _source_file(tmp_path, sources, gaps, in_file):
    """Every source's bytes in one file, each after a gap of junk: (fd, fds, offsets)."""
    path = tmp_path / "sources.bin"
    offsets, blob = [], bytearray()
    for src, gap in zip(sources, gaps):
        blob += os.urandom(gap)
        offsets.append(len(blob))
        blob += src.view(torch.uint8).numpy().tobytes() if src.numel() else b""
    path.write_bytes(bytes(blob))
    fd = os.open(path, os.O_RDONLY)
    fds = [fd if f else -1 for f in in_file]
    return fd, fds, torch.tensor(offsets, dtype=torch.int64)


@pytest.fixture(params=[1, 3, 16], ids=["1 reader", "3 readers", "16 readers (the default floor)"])
def readers(request):
    return request.param  # the ops' `readers` argument


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch_problems())
def test_read_cast_matches_reference(tmp_path_factory, readers, problem):
    sources, gaps, in_file, segments, outs = problem
    fd, fds, offsets = _source_file(tmp_path_factory.mktemp("rc"), sources, gaps, in_file)
    try:
        fill = [torch.full((n,), 7, dtype=d) for n, d in outs]  # what no row writes must stay as it was
        native, ref = [f.clone() for f in fill], [f.clone() for f in fill]
        ops.load_native()
        torch.ops.zerofast.read_cast(sources, fds, offsets, segments, native, readers)
        reference.read_cast(sources, fds, offsets, segments, ref)
    finally:
        os.close(fd)
    for a, b in zip(native, ref):
        assert_bitwise_equal(a, b)


@pytest.fixture(params=[True, False], ids=["copy_file_range", "pread+pwrite"])
def copy_mode(request):
    return request.param  # read_cast_to_file's `copy_file_range` argument


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch_problems(), st.data())
def test_read_cast_to_file_matches_reference(tmp_path_factory, readers, copy_mode, problem, data):
    sources, gaps, in_file, segments, outs = problem
    tmp = tmp_path_factory.mktemp("rcf")
    fd, fds, offsets = _source_file(tmp, sources, gaps, in_file)
    # One output dtype per call, as the export makes them: rows of other outputs are dropped.
    out_dtype = outs[0][1]
    keep = [i for i, (out, src, *_rest) in enumerate(segments.tolist()) if outs[out][1] == out_dtype]
    segments = segments[keep] if keep else segments[:0]
    out_offsets, pos = [], data.draw(st.integers(0, 5))
    for n, _ in outs:
        out_offsets.append(pos)
        pos += n * out_dtype.itemsize + data.draw(st.integers(0, 5))
    native, ref = _to_file_both(tmp, (sources, fds, offsets, segments), fd, pos, out_offsets, [n for n, _ in outs],
                                out_dtype, readers, copy_mode)
    assert native == ref


def _to_file_both(tmp, batch, fd, size, out_offsets, numels, out_dtype, readers, copy_mode) -> tuple[bytes, bytes]:
    """read_cast_to_file of ``batch`` (sources, fds, offsets, segments) natively and by the
    reference, each into its own copy of ``size`` junk bytes: both files' bytes. Closes ``fd``."""
    junk = os.urandom(size)
    paths = [tmp / "native.bin", tmp / "reference.bin"]
    for p in paths:
        p.write_bytes(junk)
    out_fds = [os.open(p, os.O_RDWR) for p in paths]
    try:
        args = (torch.tensor(out_offsets, dtype=torch.int64), torch.tensor(numels, dtype=torch.int64), out_dtype)
        ops.load_native()
        torch.ops.zerofast.read_cast_to_file(*batch, out_fds[0], *args, readers, copy_mode)
        reference.read_cast_to_file(*batch, out_fds[1], *args)
    finally:
        for f in (fd, *out_fds):
            os.close(f)
    return paths[0].read_bytes(), paths[1].read_bytes()


@pytest.mark.parametrize("src_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16], ids=str)
def test_large_read_equals_tensor_to(tmp_path, src_dtype, out_dtype):
    # Many items and bounce-buffer refills per thread, every special value, unaligned in the file.
    src = _source(1_500_001, src_dtype, seed=3)
    fd, fds, offsets = _source_file(tmp_path, [src], [3], [True])
    out = torch.empty(1_500_000, dtype=out_dtype)
    try:
        ops.read_cast([src], fds, offsets, torch.tensor([[0, 0, 1, 0, 1_500_000]]), [out])
    finally:
        os.close(fd)
    assert_bitwise_equal(out, src[1:].to(out_dtype))


def test_file_shorter_than_the_plan_is_an_os_error(tmp_path):
    # A file truncated after it was loaded: an error, where reading its mapping would be SIGBUS.
    src = torch.arange(100, dtype=torch.float32)
    fd, fds, offsets = _source_file(tmp_path, [src], [0], [True])
    os.truncate(tmp_path / "sources.bin", 200)
    try:
        with pytest.raises(OSError, match="truncated") as info:
            ops.read_cast([src], fds, offsets, torch.tensor([[0, 0, 0, 0, 100]]), [torch.empty(100)])
    finally:
        os.close(fd)
    assert info.value.errno == errno.EIO


def test_write_error_is_an_os_error(tmp_path):
    src = torch.arange(100, dtype=torch.float32)
    read_only = os.open(tmp_path / "out.bin", os.O_RDONLY | os.O_CREAT)
    try:
        with pytest.raises(OSError) as info:
            ops.read_cast_to_file([src], [-1], torch.zeros(1, dtype=torch.int64), torch.tensor([[0, 0, 0, 0, 100]]),
                                  read_only, torch.tensor([0]), torch.tensor([100]), torch.float32)
    finally:
        os.close(read_only)
    assert info.value.errno == errno.EBADF


@pytest.mark.parametrize("segments, message", [
    ([[1, 0, 0, 0, 1]], "names output 1 but there are 1 outputs"),
    ([[0, 1, 0, 0, 1]], "names source 1 but there are 1 sources"),
    ([[0, 0, 5, 0, 10]], "past the end of `sources\\[0\\]`"),
    ([[0, 0, 0, 5, 10]], "past the end of output 0"),
    ([[0, 0, -1, 0, 1]], "negative offset or length"),
])
def test_bad_rows_name_the_argument(segments, message):
    ops.load_native()
    out = torch.full((10,), 3.0)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.zerofast.read_cast([torch.zeros(10)], [-1], torch.zeros(1, dtype=torch.int64),
                                     torch.tensor(segments), [out])
    assert (out == 3.0).all()  # checked before anything moved


def test_bad_arguments_name_the_argument():
    ops.load_native()
    one = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="`source_fds` must hold one entry per source"):
        torch.ops.zerofast.read_cast([torch.zeros(4)], [], one, torch.zeros(0, 5, dtype=torch.int64), [])
    with pytest.raises(RuntimeError, match="cannot cast `sources\\[0\\]` of dtype Long"):
        torch.ops.zerofast.read_cast([torch.zeros(4, dtype=torch.int64)], [-1], one,
                                     torch.tensor([[0, 0, 0, 0, 4]]), [torch.zeros(4)])
    with pytest.raises(RuntimeError, match="`segments` must be a contiguous CPU int64 tensor of shape \\[N, 5\\]"):
        torch.ops.zerofast.read_cast([torch.zeros(4)], [-1], one, torch.zeros(1, 4, dtype=torch.int64), [])


def test_reference_path_selected_by_env(monkeypatch):
    monkeypatch.setenv("ZEROFAST_NATIVE", "0")
    calls = []
    monkeypatch.setattr(reference, "read_cast", lambda *a: calls.append(a))
    ops.read_cast([torch.zeros(2)], [-1], torch.zeros(1, dtype=torch.int64), torch.tensor([[0, 0, 0, 0, 2]]),
                  [torch.zeros(2)])
    assert len(calls) == 1


@st.composite
def covering_problems(draw):
    """Outputs of one dtype, every element written by some row (read_cast_new leaves the rest
    uninitialized), with shapes of any rank."""
    out_dtype = draw(st.sampled_from(DTYPES))
    src_dtypes = [d for d in DTYPES if d == out_dtype or (d.is_floating_point and out_dtype.is_floating_point)]
    sources = [_source(4000, draw(st.sampled_from(src_dtypes)), seed=i) for i in range(draw(st.integers(1, 3)))]
    shapes, rows = [], []
    for out in range(draw(st.integers(0, 5))):
        shape = draw(st.lists(st.integers(0, 6), max_size=3))
        shapes.append(shape)
        numel, pos = int(torch.Size(shape).numel()), 0
        while pos < numel:
            length = draw(st.integers(1, numel - pos))
            src = draw(st.integers(0, len(sources) - 1))
            rows.append((out, src, draw(st.integers(0, 4000 - length)), pos, length))
            pos += length
    return sources, torch.tensor(rows, dtype=torch.int64).reshape(-1, 5), shapes, out_dtype


def _new_both(folder, sources, gaps, in_file, segments, shapes, dtype, readers):
    """read_cast_new natively and on the reference, the sources in one file of ``folder``."""
    fd, fds, offsets = _source_file(folder, sources, gaps, in_file)
    dims, ranks = [d for s in shapes for d in s], [len(s) for s in shapes]
    try:
        ops.load_native()
        native = torch.ops.zerofast.read_cast_new(sources, fds, offsets, segments, dims, ranks, dtype, readers)
        return native, reference.read_cast_new(sources, fds, offsets, segments, dims, ranks, dtype)
    finally:
        os.close(fd)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(covering_problems())
def test_read_cast_new_matches_reference(tmp_path_factory, readers, problem):
    sources, segments, shapes, dtype = problem
    native, ref = _new_both(tmp_path_factory.mktemp("rcn"), sources, [1] * len(sources), [True] * len(sources),
                            segments, shapes, dtype, readers)
    assert [tuple(t.shape) for t in native] == [tuple(s) for s in shapes]
    for a, b in zip(native, ref):
        assert a.dtype == dtype and a.is_contiguous()
        assert_bitwise_equal(a, b)
    assert len({t.data_ptr() for t in native if t.numel()}) == sum(1 for t in native if t.numel())  # independent


def test_read_cast_new_checks_shapes():
    ops.load_native()
    args = ([torch.zeros(4)], [-1], torch.zeros(1, dtype=torch.int64), torch.zeros(0, 5, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="reaches past the end of `dims`"):
        torch.ops.zerofast.read_cast_new(*args, [2], [2], torch.float32)
    with pytest.raises(RuntimeError, match="sizes past the last output"):
        torch.ops.zerofast.read_cast_new(*args, [2, 3], [1], torch.float32)
    with pytest.raises(RuntimeError, match="negative size"):
        torch.ops.zerofast.read_cast_new(*args, [-2], [1], torch.float32)


@st.composite
def end_to_end_problems(draw):
    """Sources cut into consecutive pieces, as a ZeRO-3 rank's share of many small parameters
    lies in its flat group: the op reads runs of them with one pread (runs end at 1 MiB, at a
    piece over 64 KiB, at a cast, at a source copied from memory) and copies the pieces out."""
    sizes = [draw(st.sampled_from([0, 7, 3000, 300_000])) for _ in range(draw(st.integers(1, 3)))]
    dtypes = [draw(st.sampled_from([torch.float32, torch.bfloat16])) for _ in sizes]
    sources = [_source(n, d, seed=i) for i, (n, d) in enumerate(zip(sizes, dtypes))]
    rows, shapes = [], []
    out_dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    for src, n in enumerate(sizes):
        pos, cuts = 0, draw(st.lists(st.sampled_from([1, 5, 300] if n < 10_000 else [3000, 9000, 20_000, 70_000]),
                                     min_size=1, max_size=4))
        while pos < n:
            length = min(n - pos, cuts[len(shapes) % len(cuts)])
            rows.append((len(shapes), src, pos, 0, length))
            shapes.append((length,))
            pos += length
    order = draw(st.permutations(range(len(rows))))
    segments = torch.tensor([rows[i] for i in order], dtype=torch.int64).reshape(-1, 5)
    gaps = [draw(st.sampled_from([0, 3])) for _ in sizes]  # 0: the next source continues the run
    return sources, gaps, [draw(st.booleans()) for _ in sizes], segments, shapes, out_dtype


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(end_to_end_problems())
def test_runs_of_adjacent_pieces_match_reference(tmp_path_factory, readers, problem):
    sources, gaps, in_file, segments, shapes, dtype = problem
    native, ref = _new_both(tmp_path_factory.mktemp("runs"), sources, gaps, in_file, segments, shapes, dtype, readers)
    assert len(native) == len(ref) == len(shapes)
    for a, b in zip(native, ref):
        assert_bitwise_equal(a, b)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(end_to_end_problems(), st.data())
def test_runs_written_end_to_end_match_reference(tmp_path_factory, readers, copy_mode, problem, data):
    """The same pieces written to a file, each output after the one before it (or after a gap):
    where consecutive pieces of a source land end to end, the op writes them as one run (one
    copy_file_range, or one pwrite from memory), and the file must equal the reference's."""
    sources, gaps, in_file, segments, shapes, out_dtype = problem
    tmp = tmp_path_factory.mktemp("runs_to_file")
    fd, fds, offsets = _source_file(tmp, sources, gaps, in_file)
    out_offsets, pos = [], 0
    for (n,) in shapes:
        out_offsets.append(pos)
        pos += n * out_dtype.itemsize + data.draw(st.sampled_from([0, 0, 0, 4]))
    native, ref = _to_file_both(tmp, (sources, fds, offsets, segments), fd, pos, out_offsets, [n for (n,) in shapes],
                                out_dtype, readers, copy_mode)
    assert native == ref
