"""DeepSpeed AutoEP saves (``expert_parallel``, a tiny transformers Qwen3-MoE) that real DeepSpeed 0.19.8
wrote on the CPU (tests/dsgen/train_autoep.py), judged bit for bit against the live engine's own values,
ZeRO-3's ``zero3_partitioned`` saves (no expert files) among them; the parts zerofast does not read
(AutoEP+AutoTP folding) are refused by name."""
from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch
from safetensors.torch import load_file

import zerofast
from zerofast.cli import describe, main

from tests.conftest import HAVE_DEEPSPEED
from tests.dsgen.families import AUTOEP_LAYOUTS
from tests.helpers import assert_bitwise_equal, expected_value, real_root, real_truth

HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
pytestmark = pytest.mark.skipif(not (HAVE_DEEPSPEED and HAVE_TRANSFORMERS),
                                reason="DeepSpeed 0.19.8 makes the real AutoEP saves from a transformers Qwen3-MoE")

READ = sorted(AUTOEP_LAYOUTS)
ZERO3 = sorted(n for n, spec in AUTOEP_LAYOUTS.items() if spec["stage"] == 3)
DTYPES = [None, torch.float32, torch.bfloat16]


def _stored(truth) -> dict:
    return {**truth["trainable"], **truth["frozen"], **truth["buffers"]}


def _check_state_dict(sd, truth, dtype) -> None:
    assert list(sd) == truth["state_dict_keys"]
    want = _stored(truth)
    for name in truth["state_dict_keys"]:
        assert_bitwise_equal(sd[name], expected_value(want[truth["tied"].get(name, name)], dtype), name)


def test_the_saves_are_what_the_tests_assume():
    """Every AutoEP layer's experts in full, the router twice (``mlp.gate`` is ``mlp.router``), a
    frozen expert tensor in the frozen save."""
    truth = real_truth("autoep_s1_bf16_w2_ep2_frozen")
    assert truth["tied"] == {f"model.layers.{i}.mlp.gate.gate.weight": f"model.layers.{i}.mlp.router.gate.weight"
                             for i in range(2)}
    assert tuple(truth["frozen"]["model.layers.1.mlp.experts.w2"].shape) == (4, 16, 8)
    assert tuple(truth["trainable"]["model.layers.0.mlp.experts.w1"].shape) == (4, 8, 16)
    assert "model.layers.0.mlp.experts.gate_up_proj" in truth["hf_state_dict_keys"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", READ)
def test_reconstruct_matches_deepspeed(layout, dtype):
    truth = real_truth(layout)
    sd = zerofast.reconstruct(real_root(layout), dtype=dtype)
    _check_state_dict(sd, truth, dtype)
    for alias, source in truth["tied"].items():
        assert sd[alias] is sd[source]


@pytest.mark.parametrize("layout", READ)
def test_lazy_matches_deepspeed(layout):
    truth = real_truth(layout)
    lazy = zerofast.reconstruct(real_root(layout), dtype=None, lazy=True)
    want = _stored(truth)
    for name in truth["state_dict_keys"]:
        value = want[truth["tied"].get(name, name)]
        assert lazy.meta(name).shape == value.shape and lazy.meta(name).dtype == value.dtype
    _check_state_dict(lazy, truth, None)


@pytest.mark.parametrize("layout", READ)
def test_exclude_frozen(layout):
    truth = real_truth(layout)
    sd = zerofast.reconstruct(real_root(layout), exclude_frozen=True)
    assert list(sd) == [n for n in truth["state_dict_keys"] if truth["tied"].get(n, n) not in truth["frozen"]]


@pytest.mark.parametrize("key", ["exp_avg", "exp_avg_sq"])
@pytest.mark.parametrize("layout", READ)
def test_optimizer_state_matches_the_engine(layout, key):
    truth = real_truth(layout)
    if truth["stage"] == 0:
        with pytest.raises(zerofast.UnsupportedCheckpointError, match="stage 0"):
            zerofast.optimizer_state(real_root(layout), key)
        return
    want = truth["optimizer_states"][key]
    for lazy in (False, True):
        got = zerofast.optimizer_state(real_root(layout), key, lazy=lazy)
        assert list(got) == [n for n in truth["state_dict_keys"] if n in want]
        for name, value in want.items():
            assert_bitwise_equal(got[name], value, name)


@pytest.mark.parametrize("layout", READ)
def test_export_loads_with_plain_safetensors(layout, tmp_path):
    truth = real_truth(layout)
    opt = truth["stage"] != 0
    zerofast.export(real_root(layout), tmp_path / "out", dtype=torch.bfloat16, max_shard_size="2KB",
                    optimizer_states=opt)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    loaded = {}
    for shard in sorted(set(index["weight_map"].values())):
        loaded.update(load_file(tmp_path / "out" / shard))
    want = _stored(truth)
    assert sorted(loaded) == sorted(n for n in truth["state_dict_keys"] if n not in truth["tied"])
    for name, value in loaded.items():
        assert_bitwise_equal(value, expected_value(want[name], torch.bfloat16), name)
    assert json.loads(index["metadata"].get("zerofast_tied", "{}")) == truth["tied"]
    if not opt:
        return
    states = {}
    for shard in (tmp_path / "out").glob("optimizer*.safetensors"):
        states.update(load_file(shard))
    assert len(states) == 2 * len(truth["optimizer_states"]["exp_avg"])
    for name, value in truth["optimizer_states"]["exp_avg_sq"].items():
        assert_bitwise_equal(states[f"{name}.exp_avg_sq"], value, name)


@pytest.mark.parametrize("layout", READ)
def test_inspect_shows_the_expert_parallel_layout(layout, capsys):
    truth = real_truth(layout)
    p = describe(real_root(layout))["parallelism"]
    assert p["family"] == "mixture-of-experts (AutoEP)"
    assert (p["dp"], p["ep"]) == (truth["layout"]["dp"], truth["layout"]["ep"])
    assert p["experts_per_layer"] == truth["layout"]["experts"]
    assert main(["inspect", str(real_root(layout))]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("parallelism"))
    assert "AutoEP" in line and "ep 2" in line


@pytest.mark.parametrize("layout", READ)
def test_verify_is_clean(layout):
    """The dense masters are compared with their saved bf16 copies; an expert tensor's copy is spread
    over its experts' files, so its master counts among those without one."""
    report = zerofast.verify(real_root(layout))
    assert report.ok, "\n".join(report.lines())
    if real_truth(layout)["stage"] == 3:  # ZeRO-3 keeps no model-dtype copy of any parameter
        assert any("holds no model-dtype copy" in line for line in report.checks), report.checks
        return
    experts = sum(".experts.w" in n for n in real_truth(layout)["trainable"])
    assert any(f"({experts} have none" in line for line in report.checks), report.checks


@pytest.mark.parametrize("layout", READ)
def test_deepspeeds_own_converter_cannot_read_them(layout):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    # ZeRO-3: "zero_to_fp32 does not support AutoEP ZeRO-3 partition-native checkpoints"
    with pytest.raises((ValueError, AttributeError, NotImplementedError)):
        get_fp32_state_dict_from_zero_checkpoint(str(real_root(layout)))


@pytest.mark.parametrize("layout", ZERO3)
def test_zero3_saves_hold_no_expert_files(layout):
    """What the ZeRO-3 tests read: per-rank files only, the experts in the optimizer's expert group,
    partitioned over each ep rank's expert-data-parallel ranks."""
    truth = real_truth(layout)
    tag = real_root(layout) / truth["tag"]
    assert not list(tag.glob("layer_*_expert_*")) and not list(tag.glob("mp_rank_*"))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    raw = torch.load(tag / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", weights_only=False)
    groups = raw["optimizer_state_dict"]["ds_zero_partition_groups"]
    edp = truth["world_size"] // truth["layout"]["ep"]
    assert [g["families"] for g in groups] == [["replicated"], ["autoep_expert"]]
    assert groups[1]["partition_count"] == edp and len(groups[1]["partition_ranks"]) == edp
    assert tuple(truth["trainable"]["model.layers.1.mlp.experts.w2"].shape) == (4, 16, 8)


@pytest.mark.parametrize("layout", ZERO3)
def test_zero3_frozen_parameters_are_refused(layout, tmp_path):
    """A frozen parameter's ZeRO-3 fragments are not placed: refused by name (planted)."""
    import shutil

    root = tmp_path / "ckpt"
    shutil.copytree(real_root(layout), root)
    path = root / real_truth(layout)["tag"] / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    state = torch.load(path, weights_only=False)
    state["frozen_param_shapes"]["model.norm.weight"] = (16,)
    torch.save(state, path)
    with pytest.raises(zerofast.UnsupportedCheckpointError, match="frozen parameters of an AutoEP ZeRO-3 save"):
        zerofast.reconstruct(root)


# -- planted variants of a real save: metadata zerofast must not read past ---------------------------

def _planted(tmp_path, edit):
    """A copy of the ZeRO-1 save whose mp_rank_00_model_states.pt ``edit`` changed."""
    import shutil

    src = real_root("autoep_s1_bf16_w2_ep2_frozen")
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    tag = (dst / "latest").read_text().strip()
    path = dst / tag / "mp_rank_00_model_states.pt"
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    state = torch.load(path, weights_only=False)
    edit(state)
    torch.save(state, path)
    return dst, path


def test_folding_metadata_is_refused(tmp_path):
    root, path = _planted(tmp_path, lambda s: s.__setitem__("folding", {"version": 1, "tp_size": 2}))
    with pytest.raises(zerofast.UnsupportedCheckpointError, match="AutoEP\\+AutoTP folding") as e:
        zerofast.reconstruct(root)
    assert str(path) in str(e.value)


def test_zero3_partitioned_record_beside_expert_files_is_refused(tmp_path):
    def edit(state):
        state["ds_autoep_layers"][1]["checkpoint_format"] = "zero3_partitioned"

    root, path = _planted(tmp_path, edit)
    with pytest.raises(zerofast.UnsupportedCheckpointError, match=r"ds_autoep_layers\[1\].*'zero3_partitioned'"):
        zerofast.reconstruct(root)


def test_a_missing_record_field_is_named(tmp_path):
    root, path = _planted(tmp_path, lambda s: s["ds_autoep_layers"][0].pop("affine_maps"))
    with pytest.raises(zerofast.CorruptCheckpointError, match=r"ds_autoep_layers\[0\] lacks affine_maps") as e:
        zerofast.reconstruct(root)
    assert str(path) in str(e.value)


def test_a_router_alias_that_differs_is_refused(tmp_path):
    def edit(state):
        state["module"]["model.layers.0.mlp.gate.gate.weight"] = state["module"][
            "model.layers.0.mlp.gate.gate.weight"].clone() + 1

    root, _ = _planted(tmp_path, edit)
    with pytest.raises(zerofast.InconsistentCheckpointError, match="differs from its router twin"):
        zerofast.reconstruct(root)


def test_an_expert_file_missing_is_named(tmp_path):
    root, path = _planted(tmp_path, lambda s: None)
    (path.parent / "layer_1_expert_3_mp_rank_00_model_states.pt").unlink()
    with pytest.raises(zerofast.InconsistentCheckpointError, match=r"expected experts 0\.\.3 of AutoEP layer 1"):
        zerofast.reconstruct(root)


def test_the_affine_map_is_checked(tmp_path):
    def edit(state):
        amap = state["ds_autoep_layers"][0]["affine_maps"]["params"]["model.layers.0.mlp.experts.w1"]
        amap["ranks"][1]["pieces"] = []

    root, _ = _planted(tmp_path, edit)
    with pytest.raises(zerofast.InconsistentCheckpointError, match=r"pieces of 'model.layers.0.mlp.experts.w1' cover "
                                                                   r"256 of its 512"):
        zerofast.reconstruct(root)


def test_the_moe_layout_refuses_an_autoep_save_it_is_handed(tmp_path):
    """Should the AutoEP layout's look at the pickle miss a save, the native MoE layout refuses it by name
    instead of reading AutoEP's expert files as native ones."""
    from zerofast.discover import locate
    from zerofast.layouts import moe

    root, path = _planted(tmp_path, lambda s: None)
    files = moe.LAYOUT.list_files(locate(root, None, None))
    with pytest.raises(zerofast.UnsupportedCheckpointError, match="DeepSpeed AutoEP's \\('ds_autoep_layers'\\)") as e:
        moe.LAYOUT.load(files)
    assert str(path) in str(e.value)


def test_native_moe_and_plain_saves_are_not_claimed():
    from zerofast.layouts import autoep, identify
    from zerofast.discover import locate

    for name in ("moe_s2_bf16_w2_ep2", "moe_s0_bf16_w2_ep2"):
        found = locate(real_root(name), None, None)
        assert autoep.LAYOUT.claims(found) is None and identify(found).name == "moe"
    found = locate(real_root("autoep_s3_bf16_w2_ep2"), None, None)
    assert identify(found).name == "autoep"


@pytest.mark.parametrize("layout", ZERO3)
def test_zero3_expert_group_out_of_order_is_refused(layout, tmp_path):
    """The expert group's ``ds_zero_partition_groups`` record must put the rank where its
    ``ds_autoep_layers`` records say (planted: rank 0 claims partition rank 5)."""
    import shutil

    root = tmp_path / "ckpt"
    shutil.copytree(real_root(layout), root)
    path = root / real_truth(layout)["tag"] / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    state = torch.load(path, weights_only=False)
    state["optimizer_state_dict"]["ds_zero_partition_groups"][1]["partition_rank"] = 5
    torch.save(state, path)
    with pytest.raises(zerofast.InconsistentCheckpointError, match="expert group 1 is not cut over") as e:
        zerofast.reconstruct(root)
    assert str(path) in str(e.value)
