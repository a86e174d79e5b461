"""The native gather_cast op against its pure-torch reference, and its argument checks."""
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import zerofast
from zerofast.native import ops, reference
from zerofast.base.errors import DeviceError, NativeExtensionError
from tests.helpers import assert_bitwise_equal

FLOATS = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
SPECIAL = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, 3.4e38,
                        65504.0, 65520.0, 1e-8, -2.5])


def _source(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if not dtype.is_floating_point:
        return torch.randint(-1000, 1000, (n,), generator=g).to(dtype)
    values = torch.randn(n, generator=g, dtype=torch.float64) * 10 ** torch.randint(-6, 6, (n,), generator=g)
    values[: min(n, len(SPECIAL))] = SPECIAL[: min(n, len(SPECIAL))].double()
    return values.to(dtype)


@st.composite
def gather_problems(draw):
    out_dtype = draw(st.sampled_from(FLOATS))
    n_sources = draw(st.integers(1, 5))
    sizes = [draw(st.integers(0, 3000)) for _ in range(n_sources)]
    dtypes = [draw(st.sampled_from(FLOATS)) for _ in range(n_sources)]
    sources = [_source(n, d, seed=i) for i, (n, d) in enumerate(zip(sizes, dtypes))]
    rows, out_len = [], 0
    for _ in range(draw(st.integers(0, 12))):
        src = draw(st.integers(0, n_sources - 1))
        off = draw(st.integers(0, sizes[src]))
        length = draw(st.integers(0, sizes[src] - off))
        rows.append((src, off, out_len, length))
        out_len += length + draw(st.integers(0, 3))
    order = draw(st.permutations(range(len(rows))))  # segments need not come in output order
    segments = torch.tensor([rows[i] for i in order], dtype=torch.int64).reshape(-1, 4)
    return sources, segments, out_len, out_dtype


@settings(max_examples=300, deadline=None)
@given(gather_problems())
def test_native_matches_reference(problem):
    sources, segments, out_len, out_dtype = problem
    fill = torch.full((out_len,), 7, dtype=out_dtype)  # untouched gaps must stay as they were
    native, ref = fill.clone(), fill.clone()
    ops.load_native()
    torch.ops.zerofast.gather_cast(sources, segments, native)
    reference.gather_cast(sources, segments, ref)
    assert_bitwise_equal(native, ref)


@pytest.mark.parametrize("src_dtype", FLOATS, ids=str)
@pytest.mark.parametrize("out_dtype", FLOATS, ids=str)
def test_large_cast_equals_tensor_to(src_dtype, out_dtype):
    # Several parallel_for chunks, and every special value, through each dtype pair.
    src = _source(1_200_003, src_dtype, seed=1)
    out = torch.empty(1_200_000, dtype=out_dtype)
    ops.gather_cast([src], torch.tensor([[0, 3, 0, 1_200_000]]), out)
    assert_bitwise_equal(out, src[3:].to(out_dtype))


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.uint8, torch.int32], ids=str)
def test_non_floating_copies(dtype):
    src = _source(1000, dtype, seed=2)
    out = torch.empty(600, dtype=dtype)
    ops.gather_cast([src], torch.tensor([[0, 400, 0, 600]]), out)
    assert_bitwise_equal(out, src[400:])


@pytest.mark.parametrize("segments, message", [
    ([[1, 0, 0, 1]], "names source 1 but there are 1 sources"),
    ([[0, 5, 0, 10]], "past the end of `sources\\[0\\]`"),
    ([[0, 0, 5, 10]], "past the end of `out`"),
    ([[0, -1, 0, 1]], "negative offset or length"),
])
def test_bad_segments_name_the_argument(segments, message):
    ops.load_native()
    with pytest.raises(RuntimeError, match=message):
        torch.ops.zerofast.gather_cast([torch.zeros(10)], torch.tensor(segments), torch.zeros(10))


def test_bad_arguments_name_the_argument():
    ops.load_native()
    with pytest.raises(RuntimeError, match="`segments` must be a contiguous CPU int64 tensor"):
        torch.ops.zerofast.gather_cast([torch.zeros(4)], torch.zeros(1, 4), torch.zeros(4))
    with pytest.raises(RuntimeError, match="cannot cast `sources\\[0\\]` of dtype Long"):
        torch.ops.zerofast.gather_cast([torch.zeros(4, dtype=torch.int64)], torch.tensor([[0, 0, 0, 4]]),
                                       torch.zeros(4))
    with pytest.raises(RuntimeError, match="`out` must be contiguous"):
        torch.ops.zerofast.gather_cast([torch.zeros(4)], torch.tensor([[0, 0, 0, 2]]), torch.zeros(4, 2)[:, 0])


def test_extension_built_for_other_torch_is_a_typed_error(monkeypatch):
    from zerofast.native import loader

    ops.load_native()
    monkeypatch.setattr(loader, "_state", None)  # so that the next use looks at the cached core again
    monkeypatch.setattr(loader, "import_core", lambda path: loader.verify({"devices": ["cpu"], "stable_torch": "9.9"}))
    with pytest.raises(NativeExtensionError, match=r"serves torch >= 9\.9 but torch .* is running"):
        ops.load_native()


def test_reference_path_selected_by_env(monkeypatch):
    monkeypatch.setenv("ZEROFAST_NATIVE", "0")
    calls = []
    monkeypatch.setattr(reference, "gather_cast", lambda *a: calls.append(a))
    ops.gather_cast([torch.zeros(2)], torch.tensor([[0, 0, 0, 2]]), torch.zeros(2))
    assert len(calls) == 1


def test_native_is_the_default(monkeypatch):
    monkeypatch.delenv("ZEROFAST_NATIVE", raising=False)
    monkeypatch.setattr(reference, "gather_cast", lambda *a: pytest.fail("reference used by default"))
    out = torch.zeros(2)
    ops.gather_cast([torch.ones(2)], torch.tensor([[0, 0, 0, 2]]), out)
    assert out.tolist() == [1.0, 1.0]


@settings(max_examples=15, deadline=None)
@given(gather_problems())
def test_opcheck(problem):
    """torch's own operator checks: schema (the `out` mutation declared), fake kernel, autograd
    registration and AOT dispatch, on random problems."""
    sources, segments, out_len, out_dtype = problem
    ops.load_native()
    out = torch.zeros(out_len, dtype=out_dtype)
    torch.library.opcheck(torch.ops.zerofast.gather_cast.default, (sources, segments, out, False))


def test_built_devices_come_from_the_dispatcher():
    devices = ops.built_devices()
    assert "cpu" in devices
    assert ("cuda" in devices) == torch._C._dispatch_has_kernel_for_dispatch_key("zerofast::gather_cast", "CUDA")


def _kernel_devices(op: str) -> list[str]:
    """The built devices that have a kernel for ``op`` (the batched readers are CPU-only)."""
    ops.load_native()
    return [d for d in ops.built_devices()
            if torch._C._dispatch_has_kernel_for_dispatch_key(f"zerofast::{op}", d.upper())]


def _read_args(tmp_path, device: str):
    """A file holding a bf16 source, and an fp32 one read from memory. No NaNs: opcheck compares
    results with ==."""
    g = torch.Generator().manual_seed(5)
    sources = [torch.randn(64, generator=g).to(torch.bfloat16), torch.randn(48, generator=g)]
    path = tmp_path / "sources.bin"
    path.write_bytes(b"\0" * 3 + sources[0].view(torch.uint8).numpy().tobytes())
    fd = os.open(path, os.O_RDONLY)
    offsets = torch.tensor([3, 0], dtype=torch.int64)
    return fd, sources, [fd, -1], offsets


OPS = ["gather_cast", "read_cast", "read_cast_new", "read_cast_to_file", "check_ranges"]
CASES = [(op, d) for op in OPS for d in ("cpu", "cuda")]


@pytest.mark.parametrize("op, device", CASES, ids=[f"{op}-{d}" for op, d in CASES])
def test_opcheck_each_op_on_each_built_device(tmp_path, op, device):
    """torch's operator checks (schema and mutations, fake kernel, autograd registration, AOT
    dispatch) for every op on every device it was built for."""
    if device not in _kernel_devices(op):
        pytest.skip(f"zerofast::{op} has no {device} kernel in this build")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("a CUDA kernel was built but this machine has no GPU to run it")
    if op == "gather_cast":
        g = torch.Generator().manual_seed(1)
        sources = [torch.randn(100, generator=g).to(device), torch.randn(50, generator=g).to(torch.bfloat16).to(device)]
        segments = torch.tensor([[1, 5, 0, 40], [0, 10, 44, 50]], dtype=torch.int64)
        out = torch.zeros(100, dtype=torch.float16, device=device)
        torch.library.opcheck(torch.ops.zerofast.gather_cast.default, (sources, segments, out, False))
        return
    fd, sources, fds, offsets = _read_args(tmp_path, device)
    try:
        if op == "read_cast":
            rows = torch.tensor([[0, 0, 2, 0, 30], [1, 1, 0, 5, 40]], dtype=torch.int64)
            outs = [torch.zeros(30), torch.zeros(50, dtype=torch.bfloat16)]
            torch.library.opcheck(torch.ops.zerofast.read_cast.default, (sources, fds, offsets, rows, outs, 2, True))
        elif op == "check_ranges":  # its fake's chunk count is data-dependent (a dynamic size)
            rows = torch.tensor([[0, 0, 0, 0, 0, 40], [0, 1, 1, 0, 0, 40], [1, 0, 0, 40, 0, 24], [1, 1, 1, 8, 0, 24]])
            args = (sources, fds, offsets, rows, torch.tensor([40, 24]), torch.bfloat16, True, 16, 2)
            torch.library.opcheck(torch.ops.zerofast.check_ranges.default, args)
        elif op == "read_cast_new":
            rows = torch.tensor([[0, 0, 0, 0, 24], [1, 1, 8, 0, 20]], dtype=torch.int64)
            args = (sources, fds, offsets, rows, [4, 6, 20], [2, 1], torch.float32, 2, False)
            torch.library.opcheck(torch.ops.zerofast.read_cast_new.default, args)
        else:
            out = tmp_path / "out.bin"
            out.write_bytes(b"\0" * 400)
            out_fd = os.open(out, os.O_RDWR)
            try:
                rows = torch.tensor([[0, 0, 0, 0, 64], [1, 1, 0, 0, 48]], dtype=torch.int64)
                args = (sources, fds, offsets, rows, out_fd, torch.tensor([0, 200]), torch.tensor([64, 48]),
                        torch.float32, 2, True)
                torch.library.opcheck(torch.ops.zerofast.read_cast_to_file.default, args)
            finally:
                os.close(out_fd)
    finally:
        os.close(fd)
