"""The CUDA kernels and ``device="cuda"``, bit for bit against the CPU path and torch's own casts.

The GPU tests are marked ``cuda`` and skip, saying why, without a GPU or without the CUDA build of
the extension. They need torch and pytest only (no hypothesis, safetensors or DeepSpeed), so they
run on a bare GPU machine (tools/gpu_check.sh); the real-checkpoint case needs DeepSpeed.

What "bit for bit" means on the GPU: the op must equal torch's CUDA ``Tensor.to`` on a GPU copy of
the source. torch casts a CPU source on the CPU before an upload (``out.copy_(cpu_src)``), and the
two differ in the bits of NaNs, so the reference always gets GPU sources.
"""
from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import pytest
import torch

import zerofast
from zerofast.native import ops, proof, reference
from zerofast.base.errors import DeviceError, NativeExtensionError
from zerofast.testing.synthesize import BufferSpec, LayoutSpec, ParamSpec, synthesize
from zerofast.hf import export
from tests.helpers import assert_bitwise_equal

HAVE_GPU = torch.cuda.is_available()
HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def _cuda_kernels() -> bool:
    try:
        return "cuda" in proof.kernel_devices()
    except NativeExtensionError:
        return False


def on_gpu(test):
    test = pytest.mark.skipif(HAVE_GPU and not _cuda_kernels(), reason="the extension was built without its "
                              "CUDA kernels; rebuild with nvcc on the PATH: FORCE_CUDA=1 zerofast build --force")(test)
    test = pytest.mark.skipif(not HAVE_GPU, reason="no CUDA GPU (torch.cuda.is_available() is False)")(test)
    return pytest.mark.cuda(test)


FLOATS = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
OTHERS = [torch.int64, torch.int32, torch.int16, torch.uint8, torch.bool]
DTYPE_MODES = [torch.float32, None, torch.bfloat16, torch.float16]
SPECIAL = [float("nan"), -float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, -1e-45, 3.4e38, 65504.0,
           65520.0, 1e-8, 6e-8, -2.5, 1.00390625, 1.0039062500001]


def _values(n: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if not dtype.is_floating_point:
        return torch.randint(-100, 100, (n,), generator=g).to(dtype)
    v = torch.randn(n, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(-8, 8, (n,), generator=g)
    k = min(n, len(SPECIAL))
    v[torch.randint(0, max(n, 1), (k,), generator=g)] = torch.tensor(SPECIAL[:k], dtype=torch.float64)
    return v.to(dtype)


@functools.lru_cache(maxsize=None)
def _large(n: int, dtype: torch.dtype) -> torch.Tensor:
    return _values(n, dtype, torch.Generator().manual_seed(3))


def _random_problem(seed: int):
    """Sources of mixed dtypes and places (host and GPU), segments in any order with gaps between
    them, odd offsets and empty ones."""
    g = torch.Generator().manual_seed(seed)
    pick = lambda seq: seq[int(torch.randint(len(seq), (1,), generator=g))]
    floating = seed % 4 != 3
    out_dtype = pick(FLOATS) if floating else pick(OTHERS)
    sources = []
    for _ in range(int(torch.randint(1, 6, (1,), generator=g))):
        n = int(torch.randint(0, 50_000, (1,), generator=g))
        s = _values(n, pick(FLOATS) if floating else out_dtype, g)
        sources.append(s.cuda() if torch.rand(1, generator=g) < 0.4 else s)
    rows, end = [], 0
    for _ in range(int(torch.randint(0, 40, (1,), generator=g))):
        src = int(torch.randint(len(sources), (1,), generator=g))
        n = sources[src].numel()
        off = int(torch.randint(0, n + 1, (1,), generator=g))
        length = int(torch.randint(0, n - off + 1, (1,), generator=g))
        rows.append((src, off, end, length))
        end += length + int(torch.randint(0, 4, (1,), generator=g))
    order = torch.randperm(len(rows), generator=g).tolist()
    segments = torch.tensor([rows[i] for i in order], dtype=torch.int64).reshape(-1, 4)
    return sources, segments, end, out_dtype


def _run_both(sources, segments, out_len, out_dtype):
    # Untouched gaps must keep what `out` held.
    fill = torch.full((out_len,), 7, dtype=out_dtype, device="cuda")
    native, expected = fill.clone(), fill.clone()
    torch.ops.zerofast.gather_cast(sources, segments, native)
    reference.gather_cast([s.cuda() for s in sources], segments, expected)
    return native, expected


@on_gpu
@pytest.mark.parametrize("seed", range(60))
def test_op_matches_torch_on_random_segments(seed):
    native, expected = _run_both(*_random_problem(seed))
    assert_bitwise_equal(native, expected)


@on_gpu
@pytest.mark.parametrize("resident", [False, True], ids=["host", "gpu"])
@pytest.mark.parametrize("src_dtype", FLOATS, ids=str)
@pytest.mark.parametrize("out_dtype", FLOATS, ids=str)
def test_large_cast_equals_tensor_to(src_dtype, out_dtype, resident):
    # Over 3 staging slots of 32 MB for 4-byte sources, so the slots are reused.
    n = 24_000_003
    src = _large(n + 5, src_dtype)
    src = src.cuda() if resident else src
    out = torch.empty(n, dtype=out_dtype, device="cuda")
    torch.ops.zerofast.gather_cast([src], torch.tensor([[0, 5, 0, n]]), out)
    assert_bitwise_equal(out, src.cuda()[5:].to(out_dtype))


@on_gpu
@pytest.mark.parametrize("resident", [False, True], ids=["host", "gpu"])
@pytest.mark.parametrize("dtype", OTHERS + [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("src_off, dst_off", [(0, 0), (3, 0), (0, 5), (1, 3)])
def test_copies_any_alignment(dtype, src_off, dst_off, resident):
    src = _values(100_003, dtype, torch.Generator().manual_seed(4))
    src = src.cuda() if resident else src
    out = torch.zeros(100_000, dtype=dtype, device="cuda")
    n = 100_000 - dst_off - 1
    torch.ops.zerofast.gather_cast([src], torch.tensor([[0, src_off, dst_off, n]]), out)
    expected = torch.zeros_like(out)
    expected[dst_off:dst_off + n] = src.cuda()[src_off:src_off + n]
    assert_bitwise_equal(out, expected)


@on_gpu
def test_many_tiny_segments_fill_several_slots():
    src = _values(30_000, torch.float32, torch.Generator().manual_seed(5))
    rows = [(0, i * 3, i * 2, 2) for i in range(10_000)]
    out = torch.full((20_000,), 7, dtype=torch.bfloat16, device="cuda")
    torch.ops.zerofast.gather_cast([src], torch.tensor(rows), out)
    expected = src.cuda().view(-1, 3)[:, :2].reshape(-1).to(torch.bfloat16)
    assert_bitwise_equal(out, expected)


@on_gpu
def test_runs_on_the_current_stream():
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        # Made on this stream just before: the op must be ordered after it, not race it.
        src = torch.randn(8_000_000, device="cuda")
        out = torch.empty(8_000_000, dtype=torch.float16, device="cuda")
        torch.ops.zerofast.gather_cast([src], torch.tensor([[0, 0, 0, 8_000_000]]), out)
        expected = src.to(torch.float16)
    side.synchronize()
    assert_bitwise_equal(out, expected)


@on_gpu
def test_wrong_places_are_refused():
    seg = torch.tensor([[0, 0, 0, 4]])
    with pytest.raises(RuntimeError, match="is on cuda:0 but `out` is on cpu"):
        torch.ops.zerofast.gather_cast([torch.zeros(4, device="cuda")], seg, torch.zeros(4))
    with pytest.raises(RuntimeError, match="`segments` must be a contiguous CPU int64 tensor"):
        torch.ops.zerofast.gather_cast([torch.zeros(4)], seg.cuda(), torch.zeros(4, device="cuda"))
    with pytest.raises(RuntimeError, match="past the end of `out`"):
        torch.ops.zerofast.gather_cast([torch.zeros(8)], torch.tensor([[0, 0, 2, 4]]), torch.zeros(4, device="cuda"))


# ---------------------------------------------------------------------------------------------
# reconstruct / export on the GPU against the CPU path

def _p(name: str, *shape: int) -> ParamSpec:
    return ParamSpec(name, shape)


def _buffers(*dtypes: torch.dtype) -> list[BufferSpec]:
    return [BufferSpec(f"buf_{str(d).split('.')[-1]}", (3, 5), d) for d in dtypes]


SYNTH = {
    "s3_bf16_w4_frozen_tied": LayoutSpec(
        stage=3, world_size=4, model_dtype=torch.bfloat16,
        groups=[[_p("embed.weight", 50, 33), _p("l0.weight", 33, 17), _p("l0.bias", 17)],
                [_p("l1.weight", 17, 9), _p("odd", 7)]],
        frozen=[_p("base.weight", 20, 11)], buffers=_buffers(torch.int64, torch.bool, torch.float32),
        tied={"lm_head.weight": "embed.weight"}),
    "s2_fp16_w3_frozen": LayoutSpec(
        stage=2, world_size=3, model_dtype=torch.float16,
        groups=[[_p("a.weight", 31, 7), _p("a.bias", 7)], [_p("b.weight", 5, 5)]],
        frozen=[_p("lora_base", 13, 3)], buffers=_buffers(torch.float64, torch.int64)),
    "s1_fp32_w2": LayoutSpec(
        stage=1, world_size=2, model_dtype=torch.float32,
        groups=[[_p("w", 101, 3), _p("v", 1)], [_p("u", 64)]], buffers=_buffers(torch.bool)),
    "s0_bf16_w1": LayoutSpec(
        stage=0, world_size=1, model_dtype=torch.bfloat16,
        groups=[[_p("x.weight", 12, 12), _p("y.weight", 12)]], frozen=[_p("z", 4, 4)]),
    # One tensor larger than a staging slot, and a few hundred small ones.
    "s3_bf16_w2_big_and_many": LayoutSpec(
        stage=3, world_size=2, model_dtype=torch.bfloat16,
        groups=[[_p("big.weight", 4096, 3001)] + [_p(f"small.{i}", 17, i % 5 + 1) for i in range(300)]],
        with_optimizer_states=False),
}


@pytest.fixture(scope="module", params=sorted(SYNTH))
def synth_ckpt(request, tmp_path_factory):
    if not (HAVE_GPU and _cuda_kernels()):
        pytest.skip("no CUDA GPU, or the extension has no CUDA kernels")
    root = tmp_path_factory.mktemp(request.param)
    synthesize(root, SYNTH[request.param])
    return root


def _same_dicts(gpu: dict, cpu: dict) -> None:
    assert list(gpu) == list(cpu)
    for name, t in gpu.items():
        assert t.device.type == "cuda", name
        assert_bitwise_equal(t, cpu[name], name)


@on_gpu
@pytest.mark.parametrize("dtype", DTYPE_MODES, ids=str)
@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_reconstruct_on_gpu_equals_cpu(synth_ckpt, dtype, lazy):
    cpu = zerofast.reconstruct(synth_ckpt, dtype=dtype)
    gpu = zerofast.reconstruct(synth_ckpt, dtype=dtype, lazy=lazy, device="cuda")
    _same_dicts({k: gpu[k] for k in gpu}, cpu)


@on_gpu
def test_tied_weights_share_gpu_storage(synth_ckpt):
    sd = zerofast.reconstruct(synth_ckpt, device="cuda")
    if "lm_head.weight" in sd:
        assert sd["lm_head.weight"] is sd["embed.weight"]


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file() and not p.name.startswith(".")}


@on_gpu
@pytest.mark.parametrize("dtype", DTYPE_MODES, ids=str)
def test_export_on_gpu_writes_the_same_bytes(synth_ckpt, dtype, tmp_path):
    kw = dict(dtype=dtype, max_shard_size="20KB")
    export(synth_ckpt, tmp_path / "cpu", **kw)
    export(synth_ckpt, tmp_path / "gpu", device="cuda", **kw)
    cpu, gpu = _files(tmp_path / "cpu"), _files(tmp_path / "gpu")
    assert list(gpu) == list(cpu)
    for name in cpu:
        assert gpu[name] == cpu[name], name


@on_gpu
def test_export_torch_format_on_gpu_holds_cpu_tensors(synth_ckpt, tmp_path):
    export(synth_ckpt, tmp_path / "cpu", format="torch", dtype=torch.bfloat16)
    export(synth_ckpt, tmp_path / "gpu", format="torch", dtype=torch.bfloat16, device="cuda")
    for path in sorted((tmp_path / "cpu").glob("*.bin")):
        cpu = torch.load(path, weights_only=True)
        gpu = torch.load(tmp_path / "gpu" / path.name, weights_only=True)
        assert list(gpu) == list(cpu)
        for name, t in gpu.items():
            assert t.device.type == "cpu", name
            assert_bitwise_equal(t, cpu[name], name)


REAL = ["s3_bf16_w2_frozen_tied", "s2_fp32_w4_odd_3groups", "s1_bf16_w2_fp32accum", "s0_bf16_w2"]


@on_gpu
@pytest.mark.deepspeed
@pytest.mark.skipif(not HAVE_DEEPSPEED, reason="real checkpoints are made by DeepSpeed 0.19.8, not installed")
@pytest.mark.parametrize("name", REAL)
@pytest.mark.parametrize("dtype", DTYPE_MODES, ids=str)
def test_real_checkpoints_on_gpu_equal_cpu(name, dtype):
    from tests.dsgen.catalog import ensure_checkpoint

    root = ensure_checkpoint(name)
    _same_dicts(zerofast.reconstruct(root, dtype=dtype, device="cuda"), zerofast.reconstruct(root, dtype=dtype))


# ---------------------------------------------------------------------------------------------
# Without a GPU (or without the CUDA build) the errors say what is missing.

@pytest.mark.skipif(HAVE_GPU, reason="checks the message given when there is no GPU")
def test_cuda_without_a_gpu_says_so(tmp_path):
    with pytest.raises(RuntimeError, match="sees no CUDA GPU"):
        zerofast.reconstruct(tmp_path, device="cuda")
    with pytest.raises(RuntimeError, match="sees no CUDA GPU"):
        export(tmp_path, tmp_path / "out", device="cuda")
    assert not (tmp_path / "out").exists()


def test_other_devices_are_refused(tmp_path):
    with pytest.raises(DeviceError, match="runs on 'cpu' or 'cuda'"):
        zerofast.reconstruct(tmp_path, device="meta")


@pytest.mark.skipif(not HAVE_GPU, reason="needs a GPU to reach the build check")
def test_cpu_only_build_on_a_gpu_machine_runs_on_torchs_ops(monkeypatch, ring_ckpt):
    """A core without CUDA kernels (a CUDA torch without nvcc) is no error: device="cuda" runs
    the upload ring on torch's own GPU copies, with the CPU's results."""
    monkeypatch.setattr(proof, "kernel_devices", lambda: ["cpu"])
    assert not ops.has_kernels(torch.device("cuda"))
    _same_dicts(zerofast.reconstruct(ring_ckpt, device="cuda"), zerofast.reconstruct(ring_ckpt))


# ---------------------------------------------------------------------------------------------
# The upload ring (zerofast/execute/ring.py) on a real GPU: with zerofast's CUDA kernels and
# without them (a CUDA torch without nvcc), into fresh tensors and into a model's own.

@pytest.fixture(scope="module")
def ring_ckpt(tmp_path_factory):
    if not HAVE_GPU:
        pytest.skip("no CUDA GPU (torch.cuda.is_available() is False)")
    root = tmp_path_factory.mktemp("ring")
    synthesize(root, SYNTH["s3_bf16_w2_big_and_many"])
    return root


@pytest.fixture(params=["kernels", "no-kernels"])
def kernels(request, monkeypatch):
    """Run as built, and as if the core had no CUDA kernels (nvcc absent when it was built)."""
    if request.param == "no-kernels":
        monkeypatch.setattr(ops, "has_kernels", lambda device: device.type in ("cpu", "meta"))
    return request.param


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPE_MODES, ids=str)
def test_ring_reconstruct_equals_cpu(ring_ckpt, kernels, dtype, monkeypatch):
    from zerofast.execute import ring

    monkeypatch.setattr(ring, "SLOT_BYTES", 1 << 16)  # many chunks: every slot reused
    cpu = zerofast.reconstruct(ring_ckpt, dtype=dtype)
    _same_dicts(zerofast.reconstruct(ring_ckpt, dtype=dtype, device="cuda"), cpu)
    lazy = zerofast.reconstruct(ring_ckpt, dtype=dtype, device="cuda", lazy=True)
    _same_dicts({k: lazy[k] for k in lazy}, cpu)


@pytest.mark.cuda
def test_ring_export_without_kernels_writes_the_same_bytes(ring_ckpt, kernels, tmp_path):
    export(ring_ckpt, tmp_path / "cpu", dtype=torch.bfloat16, max_shard_size="20KB")
    export(ring_ckpt, tmp_path / "gpu", dtype=torch.bfloat16, max_shard_size="20KB", device="cuda")
    assert _files(tmp_path / "gpu") == _files(tmp_path / "cpu")


@pytest.mark.cuda
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_ring_load_into_a_gpu_model(ring_ckpt, model_dtype):
    cpu = zerofast.reconstruct(ring_ckpt, dtype=None)
    model = torch.nn.Module()
    for name, value in cpu.items():
        model.register_parameter(name.replace(".", "_"), torch.nn.Parameter(
            torch.zeros(value.shape, dtype=model_dtype, device="cuda"), requires_grad=False))
    renamed = {name.replace(".", "_"): value for name, value in cpu.items()}

    class Named(torch.nn.Module):  # the checkpoint's dotted names, as state_dict() gives them
        def state_dict(self, *args, **kwargs):
            return {k: getattr(model, k.replace(".", "_")) for k in cpu}

    zerofast.load_into(Named(), ring_ckpt)
    for name, value in renamed.items():
        got = getattr(model, name)
        assert got.device.type == "cuda"
        assert_bitwise_equal(got.detach(), value.cuda().to(model_dtype), name)
