"""Self-tests of zerofast.testing.synthesize.

* An independent reader (below, from the documented layout rules) reads synthesized checkpoints
  back without DeepSpeed and must give the ground truth, for random layouts (hypothesis).
* Structure facts taken from real DeepSpeed 0.19.8 checkpoints (file names, key order, pickled
  DeepSpeed globals) are asserted.
* Fidelity: real DeepSpeed (in a subprocess, skipped when it is not installed) must read the
  synthesized files: ``zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint`` gives the ground
  truth for stages 1-3, and every file unpickles into DeepSpeed's own classes.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings

import zerofast.testing.synthesize as synth
from zerofast.testing.strategies import layouts
from zerofast.testing.synthesize import BufferSpec, LayoutSpec, ParamSpec, synthesize

REPO = Path(__file__).resolve().parents[1]
HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None  # does not import it
needs_deepspeed = pytest.mark.skipif(not HAVE_DEEPSPEED, reason="deepspeed is not installed")

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --------------------------------------------------------------------------------------------
# Loading without DeepSpeed: local classes under DeepSpeed's names, weights_only=True
# --------------------------------------------------------------------------------------------


class _Enum:
    def __init__(self, value):
        self.value = value


class _Plain:
    pass


_STAND_INS = [
    (_Enum, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (type("fragment_address", (_Plain,), {}), "deepspeed.utils.tensor_fragment.fragment_address"),
    (type("LossScaler", (_Plain,), {}), "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (type("DynamicLossScaler", (_Plain,), {}), "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
]


def load(path):
    with torch.serialization.safe_globals(_STAND_INS):
        return torch.load(path, weights_only=True, map_location="cpu")


# --------------------------------------------------------------------------------------------
# An independent reader, written from docs/zero-checkpoint-format.md
# --------------------------------------------------------------------------------------------


def read_back(root: Path, spec: LayoutSpec) -> dict:
    tag = (root / "latest").read_text() if spec.write_latest else spec.tag
    d = root / tag
    w = spec.world_size
    prefix = "bf16_" if spec.model_dtype == torch.bfloat16 else ""
    out = {"trainable": {}, "frozen": {}}
    if spec.stage in (0, 1, 2):
        ms = load(d / "mp_rank_00_model_states.pt")
        module = ms["module"]
    if spec.stage == 0:
        owned = [[p for p in g if p.numel > 0] for g in spec.groups]
        opt = ms["optimizer"]
        if spec.model_dtype == torch.float32:
            for g in owned:
                for p in g:
                    out["trainable"][p.name] = module[p.name]
        elif "fp32_groups" in opt:
            for g, tensors in zip(owned, opt["fp32_groups"]):
                for p, t in zip(g, tensors):
                    out["trainable"][p.name] = t.detach()
        else:
            for g, flat in zip(owned, opt["fp32_groups_flat"]):
                off = 0
                for p in g:
                    out["trainable"][p.name] = flat.detach()[off:off + p.numel].view(p.shape)
                    off += p.numel
    elif spec.stage in (1, 2):
        optim = [load(d / f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
                 for r in range(w)]
        pads = optim[0].get("param_alignment_paddings")
        for g, shapes in enumerate(ms["param_shapes"]):
            flat = torch.cat([o["single_partition_of_fp32_groups"][g].detach() for o in optim])
            off = 0
            for i, (name, shape) in enumerate(shapes.items()):
                out["trainable"][name] = flat[off:off + shape.numel()].view(shape)
                off += shape.numel() + (pads[g][i] if pads else 0)
            assert flat.numel() - off < 2 * w  # only end padding left
    else:
        mss = [load(d / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt") for r in range(w)]
        optim = [load(d / f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
                 for r in range(w)]
        flats = [torch.cat([t.detach() for t in o["fp32_flat_groups"]]) for o in optim]
        off = 0
        for shapes in mss[0]["param_shapes"]:
            for name, shape in shapes.items():
                k = math.ceil(shape.numel() / w)
                full = torch.cat([f[off:off + k] for f in flats])[:shape.numel()]
                out["trainable"][name] = full.view(shape)
                off += k
        assert off == flats[0].numel()
        for name, shape in mss[0]["frozen_param_shapes"].items():
            full = torch.cat([m["frozen_param_fragments"][name] for m in mss])[:shape.numel()]
            out["frozen"][name] = full.view(shape)
        module = mss[0]["module"]
        ms = mss[0]
    if spec.stage in (0, 1):
        assert ms["frozen_param_shapes"] is None
        frozen_names = [p.name for p in spec.frozen] + [p.name for g in spec.groups for p in g if p.numel == 0]
        out["frozen"] = {n: module[n] for n in frozen_names}
    elif spec.stage == 2:
        out["frozen"] = {n: ms["frozen_param_fragments"][n] for n in ms["frozen_param_shapes"]}
    out["buffers"] = {n: module[n] for n in ms["buffer_names"]}
    out["module"] = module
    out["model_states"] = ms
    return out


def check_against_truth(root: Path, spec: LayoutSpec, gt) -> None:
    got = read_back(root, spec)
    assert got["trainable"].keys() == gt.trainable.keys()
    for name, value in gt.trainable.items():
        assert value.dtype == torch.float32
        assert torch.equal(got["trainable"][name], value), name
    assert got["frozen"].keys() == gt.frozen.keys()
    for name, value in gt.frozen.items():
        assert value.dtype == spec.model_dtype
        assert got["frozen"][name].dtype == spec.model_dtype
        assert torch.equal(got["frozen"][name], value), name
    assert got["buffers"].keys() == gt.buffers.keys()
    for name, value in gt.buffers.items():
        assert got["buffers"][name].dtype == value.dtype
        assert torch.equal(got["buffers"][name], value), name
    module = got["module"]
    assert list(module) == gt.state_dict_keys
    if spec.stage < 3:
        for name, master in gt.trainable.items():
            assert module[name].dtype == spec.model_dtype
            assert torch.equal(module[name], master.to(spec.model_dtype)), name
        for alias, source in gt.tied.items():
            assert module[alias] is module[source]
    else:
        assert all(module[n].numel() == 0 for n in module if n not in gt.buffers)
    expected_shared = None if spec.stage == 0 else gt.tied
    assert got["model_states"]["shared_params"] == expected_shared


# --------------------------------------------------------------------------------------------
# Fixed layouts
# --------------------------------------------------------------------------------------------


def small_spec(stage, world, dtype, **kw) -> LayoutSpec:
    """The model DeepSpeed was run on for the structure comparison (see the module docstring)."""
    defaults = dict(
        groups=[
            [ParamSpec("embed.weight", (11, 6)), ParamSpec("lin1.weight", (5, 6)), ParamSpec("scalar", (1,)),
             ParamSpec("empty", (0, 4))],
            [ParamSpec("lin1.bias", (5,)), ParamSpec("norm.weight", (5,)), ParamSpec("norm.bias", (5,))],
        ],
        frozen=[ParamSpec("frozen.weight", (3, 5)), ParamSpec("frozen.bias", (3,))],
        buffers=[BufferSpec("mask", (3,), torch.bool),
                 BufferSpec("stats.running", (4,), dtype if stage == 3 else torch.float32),
                 BufferSpec("stats.count", (), torch.int64)],
        tied={"head.weight": "embed.weight"},
        order=["scalar", "empty", "mask", "embed.weight", "lin1.weight", "lin1.bias", "norm.weight", "norm.bias",
               "stats.running", "stats.count", "frozen.weight", "frozen.bias", "head.weight"],
    )
    defaults.update(kw)
    return LayoutSpec(stage=stage, world_size=world, model_dtype=dtype, **defaults)


ALL_DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# What real DeepSpeed 0.19.8 writes (read off checkpoints it saved on a CPU, gloo, W=1..3).
MODEL_STATES_KEYS = [
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "skipped_steps", "global_steps",
    "global_samples", "dp_world_size", "mp_world_size", "checkpoint_parallel_dimensions", "ds_config",
    "ds_version",
]
ZERO12_KEYS = [
    "loss_scaler", "dynamic_loss_scale", "overflow", "clip_grad", "base_optimizer_state",
    "single_partition_of_fp32_groups", "zero_stage", "group_paddings", "param_alignment_paddings",
    "partition_count", "ds_version", "param_slice_mappings",
]
BF16_OPTIMIZER_KEYS = [
    "clip_grad", "base_optimizer_state", "single_partition_of_fp32_groups", "group_paddings", "partition_count",
    "ds_version", "param_slice_mappings",
]
ZERO3_KEYS = [
    "zero_stage", "loss_scaler", "dynamic_loss_scale", "overflow", "partition_count", "optimizer_state_dict",
    "fp32_flat_groups",
]
LOSS_SCALER = "deepspeed.runtime.fp16.loss_scaler.LossScaler"
DYNAMIC_LOSS_SCALER = "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"
ZERO_STAGE_ENUM = "deepspeed.runtime.zero.config.ZeroStageEnum"
FRAGMENT_ADDRESS = "deepspeed.utils.tensor_fragment.fragment_address"


def expected_files(spec: LayoutSpec) -> set[str]:
    prefix = "bf16_" if spec.model_dtype == torch.bfloat16 else ""
    files = {"latest"} if spec.write_latest else set()
    if spec.stage == 0:
        return files | {f"{spec.tag}/mp_rank_00_model_states.pt"}
    files |= {"zero_to_fp32.py", "zero_to_torch.py"}
    files |= {f"{spec.tag}/{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(spec.world_size)}
    if spec.stage == 3:
        return files | {f"{spec.tag}/zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(spec.world_size)}
    return files | {f"{spec.tag}/mp_rank_00_model_states.pt"}


def listing(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("world", [1, 3, 8])
def test_fixed_layouts_files_keys_globals(tmp_path, stage, dtype, world):
    spec = small_spec(stage, world, dtype)
    gt = synthesize(tmp_path, spec)
    assert listing(tmp_path) == expected_files(spec)
    assert (tmp_path / "latest").read_text() == "global_step1"
    check_against_truth(tmp_path, spec, gt)
    scaler = DYNAMIC_LOSS_SCALER if dtype == torch.float16 else LOSS_SCALER
    for rel in expected_files(spec):
        path = tmp_path / rel
        if not rel.endswith(".pt"):
            continue
        sd = load(path)
        found = set(torch.serialization.get_unsafe_globals_in_checkpoint(str(path)))
        if rel.endswith("model_states.pt"):
            assert list(sd) == MODEL_STATES_KEYS
            assert found == set()
            assert sd["ds_version"] == "0.19.8" and sd["dp_world_size"] == world and sd["mp_world_size"] == 1
            assert sd["global_steps"] == 1
        elif stage in (1, 2):
            assert list(sd) == ["optimizer_state_dict", "ds_config", "ds_version"]
            assert list(sd["optimizer_state_dict"]) == ZERO12_KEYS
            assert found == {scaler, ZERO_STAGE_ENUM, FRAGMENT_ADDRESS}
            assert sd["optimizer_state_dict"]["zero_stage"].value == stage
            assert sd["optimizer_state_dict"]["partition_count"] == [world, world]
        else:
            assert list(sd["optimizer_state_dict"]) == ZERO3_KEYS
            assert found == {scaler, ZERO_STAGE_ENUM}
            assert sd["optimizer_state_dict"]["zero_stage"].value == 3
            assert sd["optimizer_state_dict"]["partition_count"] == world
    if stage == 3:
        rank1 = tmp_path / "global_step1" / "zero_pp_rank_1_mp_rank_00_model_states.pt"
        if world > 1:
            assert load(rank1)["shared_params"] == {}  # only rank 0 records them
        frags = load(tmp_path / "global_step1" / "zero_pp_rank_0_mp_rank_00_model_states.pt")["frozen_param_fragments"]
        assert list(frags) == ["empty", "frozen.weight", "frozen.bias"]
        assert [t.numel() for t in frags.values()] == [0, math.ceil(15 / world), math.ceil(3 / world)]


def test_stage12_padding_and_mappings(tmp_path):
    # group 0: 66 + 30 + 1 = 97 elements -> aligned to 2*W = 4 -> 100, 50 per rank; rank 1 keeps 47.
    spec = small_spec(2, 2, torch.bfloat16)
    synthesize(tmp_path, spec)
    r0 = load(tmp_path / "global_step1" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
    r1 = load(tmp_path / "global_step1" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
    assert [t.numel() for t in r0["single_partition_of_fp32_groups"]] == [50, 8]
    assert [t.numel() for t in r1["single_partition_of_fp32_groups"]] == [47, 7]
    assert r1["single_partition_of_fp32_groups"][0].untyped_storage().nbytes() == 50 * 4  # a trimmed view
    assert r1["single_partition_of_fp32_groups"][0].requires_grad
    assert r0["group_paddings"] == [0, 0] and r1["group_paddings"] == [3, 1]
    assert r0["param_alignment_paddings"] == [[0, 0, 0], [0, 0, 0]]
    maps = [{n: (a.numel, a.start) for n, a in g.items()} for g in r1["param_slice_mappings"]]
    assert maps == [{"embed.weight": (16, 0), "lin1.weight": (30, 16), "scalar": (1, 46)},
                    {"norm.weight": (2, 0), "norm.bias": (5, 2)}]
    assert r0["base_optimizer_state"]["state"][0]["exp_avg"].numel() == 50  # not trimmed
    ms = load(tmp_path / "global_step1" / "mp_rank_00_model_states.pt")
    assert list(ms["frozen_param_shapes"]) == ["empty", "frozen.weight", "frozen.bias"]
    embed, lin1 = ms["module"]["embed.weight"], ms["module"]["lin1.weight"]
    assert lin1.storage_offset() == 66 and embed.untyped_storage().nbytes() == 100 * 2  # flat bf16 buffer


def test_bf16_optimizer_wrapper(tmp_path):
    spec = small_spec(1, 2, torch.bfloat16, bf16_optimizer_wrapper=True)
    gt = synthesize(tmp_path, spec)
    check_against_truth(tmp_path, spec, gt)
    for rank, pads in [(0, [0, 0]), (1, [3, 1])]:
        path = tmp_path / "global_step1" / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        osd = load(path)["optimizer_state_dict"]
        assert list(osd) == BF16_OPTIMIZER_KEYS
        assert osd["group_paddings"] == pads
        assert [t.numel() for t in osd["single_partition_of_fp32_groups"]] == [50, 8]  # untrimmed
        assert set(torch.serialization.get_unsafe_globals_in_checkpoint(str(path))) == {FRAGMENT_ADDRESS}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("flat", [False, True])
def test_stage0_mixed_precision_masters(tmp_path, dtype, flat):
    spec = small_spec(0, 2, dtype, stage0_flat_masters=flat)
    gt = synthesize(tmp_path, spec)
    check_against_truth(tmp_path, spec, gt)
    ms = load(tmp_path / "global_step1" / "mp_rank_00_model_states.pt")
    assert ms["param_shapes"] is None and ms["shared_params"] is None
    opt = ms["optimizer"]
    if flat:
        assert [t.numel() for t in opt["fp32_groups_flat"]] == [97, 15]
    else:
        assert [[tuple(t.shape) for t in g] for g in opt["fp32_groups"]] == [[(11, 6), (5, 6), (1,)], [(5,), (5,), (5,)]]
    assert opt.get("dynamic_loss_scale", False) == (dtype == torch.float16)


def test_zero3_sub_groups(tmp_path, monkeypatch):
    monkeypatch.setattr(synth, "ZERO3_SUB_GROUP_SIZE", 20)
    spec = small_spec(3, 3, torch.float16)
    gt = synthesize(tmp_path, spec)
    check_against_truth(tmp_path, spec, gt)
    ms = load(tmp_path / "global_step1" / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    assert [list(s) for s in ms["param_shapes"]] == [["embed.weight"], ["lin1.weight", "scalar"],
                                                      ["lin1.bias", "norm.weight", "norm.bias"]]
    osd = load(tmp_path / "global_step1" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
    assert [t.numel() for t in osd["fp32_flat_groups"]] == [22, 11, 6]
    assert [g["params"] for g in osd["optimizer_state_dict"]["param_groups"]] == [[0, 1], [2]]


def test_default_order_and_validation(tmp_path):
    spec = LayoutSpec(
        stage=2, world_size=2, model_dtype=torch.float32,
        groups=[[ParamSpec("a.weight", (2, 2)), ParamSpec("b.weight", (3,))],
                [ParamSpec("a.bias", (2,)), ParamSpec("b.bias", (3,))]],
        frozen=[ParamSpec("c.weight", (2,))],
        buffers=[BufferSpec("a.stat", (2,), torch.float32), BufferSpec("count", (), torch.int64)],
        tied={"head.weight": "a.weight", "a.alias": "c.weight"},
        write_latest=False, tag="final",
    )
    gt = synthesize(tmp_path, spec)
    assert gt.state_dict_keys == ["count", "a.weight", "a.bias", "a.stat", "b.weight", "b.bias", "c.weight",
                                  "a.alias", "head.weight"]
    assert not (tmp_path / "latest").exists()
    check_against_truth(tmp_path, spec, gt)
    assert load(tmp_path / "final" / "mp_rank_00_model_states.pt")["global_steps"] == 1

    bad = [
        dict(order=["a.alias"] + [k for k in gt.state_dict_keys if k != "a.alias"]),  # alias before source
        dict(order=gt.state_dict_keys[:-1]),
        dict(groups=[[ParamSpec("x", (0,))]]),
        dict(frozen=[ParamSpec("a.weight", (1,))]),
        dict(tied={"t": "nope"}),
        dict(stage=2, bf16_optimizer_wrapper=True),
        dict(stage0_flat_masters=True),
    ]
    for change in bad:
        kwargs = dict(spec.__dict__)
        kwargs.update(change)
        with pytest.raises(ValueError):
            synthesize(tmp_path / "bad", LayoutSpec(**kwargs))


def test_no_deepspeed_or_hypothesis_imported():
    code = textwrap.dedent(
        """
        import sys, tempfile, torch
        from zerofast.testing.synthesize import synthesize, LayoutSpec, ParamSpec, BufferSpec
        assert "hypothesis" not in sys.modules
        for stage in range(4):
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                with tempfile.TemporaryDirectory() as d:
                    synthesize(d, LayoutSpec(stage=stage, world_size=2, model_dtype=dtype,
                                             groups=[[ParamSpec("w", (3, 2))]], frozen=[ParamSpec("f", (3,))],
                                             buffers=[BufferSpec("b", (2,), torch.int64)]))
        bad = [m for m in sys.modules if m == "deepspeed" or m.startswith("deepspeed.")]
        assert not bad, bad
        print("clean")
        """
    )
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "clean" in res.stdout


def test_values_are_deterministic_and_varied(tmp_path):
    spec = small_spec(1, 2, torch.float16, seed=7)
    a = synthesize(tmp_path / "a", spec)
    b = synthesize(tmp_path / "b", spec)
    assert all(torch.equal(a.trainable[k], b.trainable[k]) for k in a.trainable)
    c = synthesize(tmp_path / "c", small_spec(1, 2, torch.float16, seed=8))
    assert not torch.equal(a.trainable["embed.weight"], c.trainable["embed.weight"])


@SETTINGS
@given(layouts())
def test_random_layouts_read_back(spec):
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        gt = synthesize(root, spec)
        assert listing(root) == expected_files(spec)
        check_against_truth(root, spec, gt)


# --------------------------------------------------------------------------------------------
# Fidelity against real DeepSpeed (subprocess; never imported here)
# --------------------------------------------------------------------------------------------

_WORKER = r"""
import json, os, sys, traceback, enum, dataclasses, contextlib, io
reply = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)  # DeepSpeed's prints and progress bars go to stderr
import torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

def plain(o):
    # The unpickled object with DeepSpeed objects turned into {"__class__": ..., fields}.
    if isinstance(o, torch.Tensor):
        return o.detach()
    if isinstance(o, enum.Enum):
        return {"__class__": type(o).__module__ + "." + type(o).__qualname__, "value": int(o.value),
                "is_int": isinstance(o, int)}
    if isinstance(o, dict):
        return {k: plain(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [plain(v) for v in o]
    if isinstance(o, (int, float, str, bool, type(None), torch.dtype, torch.Size)):
        return o if not isinstance(o, torch.Size) else list(o)
    d = {k: plain(v) for k, v in vars(o).items()}
    d["__class__"] = type(o).__module__ + "." + type(o).__qualname__
    return d

for line in sys.stdin:
    req = json.loads(line)
    try:
        if req["cmd"] == "zero_to_fp32":
            sd = get_fp32_state_dict_from_zero_checkpoint(req["root"], tag=req["tag"])
            torch.save(dict(sd), req["out"])
        else:
            torch.save({f: plain(torch.load(os.path.join(req["dir"], f), weights_only=False))
                        for f in sorted(os.listdir(req["dir"]))}, req["out"])
        reply.write(json.dumps({"ok": True}) + "\n")
    except Exception as e:
        reply.write(json.dumps({"ok": False, "error": repr(e), "tb": traceback.format_exc()}) + "\n")
    reply.flush()
"""


class DeepSpeedWorker:
    def __init__(self):
        env = dict(os.environ, DS_ACCELERATOR="cpu")
        self.proc = subprocess.Popen([sys.executable, "-c", _WORKER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)

    def ask(self, **req) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, "deepspeed worker died"
        return json.loads(line)

    def zero_to_fp32(self, root: Path, tag: str) -> dict:
        out = root.parent / (root.name + "_ds.pt")
        res = self.ask(cmd="zero_to_fp32", root=str(root), tag=tag, out=str(out))
        if not res["ok"]:
            return res
        return torch.load(out, weights_only=True)

    def unpickle(self, tag_dir: Path) -> dict:
        out = tag_dir.parent.parent / (tag_dir.parent.name + "_plain.pt")
        res = self.ask(cmd="unpickle", dir=str(tag_dir), out=str(out))
        assert res["ok"], res
        return torch.load(out, weights_only=True)

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def deepspeed_worker():
    worker = DeepSpeedWorker()
    yield worker
    worker.close()


def check_deepspeed_reads(worker: DeepSpeedWorker, root: Path, spec: LayoutSpec, gt) -> None:
    # 1. Every file unpickles with DeepSpeed's real classes.
    files = worker.unpickle(root / spec.tag)
    for name, sd in files.items():
        if "optim_states" in name:
            osd = sd["optimizer_state_dict"]
            if spec.bf16_optimizer_wrapper:
                assert "zero_stage" not in osd
            else:
                assert osd["zero_stage"] == {"__class__": ZERO_STAGE_ENUM, "value": spec.stage, "is_int": True}
                expected = DYNAMIC_LOSS_SCALER if spec.model_dtype == torch.float16 else LOSS_SCALER
                assert osd["loss_scaler"]["__class__"] == expected
            for mapping in osd.get("param_slice_mappings", []):
                for address in mapping.values():
                    assert address["__class__"] == FRAGMENT_ADDRESS
                    assert set(address) == {"__class__", "numel", "start"}
    if spec.stage == 0:
        ms = files["mp_rank_00_model_states.pt"]
        opt = ms["optimizer"]
        owned = [[p for p in g if p.numel > 0] for g in spec.groups]
        if spec.model_dtype == torch.float32:
            got = {p.name: ms["module"][p.name] for g in owned for p in g}
        elif spec.stage0_flat_masters:
            got = {}
            for g, flat in zip(owned, opt["fp32_groups_flat"]):
                for p, piece in zip(g, flat.split([p.numel for p in g])):
                    got[p.name] = piece.view(p.shape)
        else:
            got = {p.name: t for g, ts in zip(owned, opt["fp32_groups"]) for p, t in zip(g, ts)}
        assert got.keys() == gt.trainable.keys()
        assert all(torch.equal(got[k], v) for k, v in gt.trainable.items())
        return
    # 2. DeepSpeed's own converter gives the ground truth.
    sd = worker.zero_to_fp32(root, spec.tag)
    if spec.bf16_optimizer_wrapper:
        # Same as for a real BF16_Optimizer checkpoint: zero_to_fp32 needs a zero_stage key.
        assert not sd["ok"] and "is not a zero checkpoint" in sd["error"]
        return
    assert "error" not in sd, sd
    expected = set(gt.trainable) | set(gt.buffers)
    if spec.stage >= 2:  # stage 1 saves no frozen_param_shapes, so zero_to_fp32 skips frozen params
        expected |= set(gt.frozen)
    expected |= {alias for alias, source in gt.tied.items() if source in expected}
    assert set(sd) == expected
    for name, value in gt.trainable.items():
        assert sd[name].dtype == torch.float32 and torch.equal(sd[name], value), name
    if spec.stage >= 2:
        for name, value in gt.frozen.items():
            assert sd[name].dtype == spec.model_dtype and torch.equal(sd[name], value), name
    for name, value in gt.buffers.items():
        assert torch.equal(sd[name], value.float() if value.is_floating_point() else value), name
    for alias, source in gt.tied.items():
        if alias in expected:
            assert torch.equal(sd[alias], sd[source])


@needs_deepspeed
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_deepspeed_reads_fixed_layouts(deepspeed_worker, tmp_path, stage, dtype):
    spec = small_spec(stage, 3, dtype)
    gt = synthesize(tmp_path / "ckpt", spec)
    check_deepspeed_reads(deepspeed_worker, tmp_path / "ckpt", spec, gt)


@needs_deepspeed
def test_deepspeed_reads_variants(deepspeed_worker, tmp_path, monkeypatch):
    for i, spec in enumerate([
        small_spec(1, 2, torch.bfloat16, bf16_optimizer_wrapper=True),
        small_spec(0, 2, torch.float16, stage0_flat_masters=True),
        small_spec(2, 8, torch.float16, with_optimizer_states=False, tag="global_step0"),
    ]):
        gt = synthesize(tmp_path / f"c{i}", spec)
        check_deepspeed_reads(deepspeed_worker, tmp_path / f"c{i}", spec, gt)
    monkeypatch.setattr(synth, "ZERO3_SUB_GROUP_SIZE", 20)
    spec = small_spec(3, 3, torch.bfloat16)
    gt = synthesize(tmp_path / "sub", spec)
    check_deepspeed_reads(deepspeed_worker, tmp_path / "sub", spec, gt)


@needs_deepspeed
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=layouts())
def test_deepspeed_reads_random_layouts(deepspeed_worker, spec):
    with tempfile.TemporaryDirectory() as d:
        root = Path(d) / "ckpt"
        gt = synthesize(root, spec)
        check_deepspeed_reads(deepspeed_worker, root, spec, gt)
