"""zerofast.optimizer_state and `export --optimizer-states` on real DeepSpeed 0.19.8 checkpoints,
judged against DeepSpeed's own safe_get_full_optimizer_state, saved by the live engine."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

import zerofast
from zerofast.cli import main
from zerofast.hf.run import OPTIMIZER_JSON

from tests.conftest import needs_deepspeed
from tests.helpers import assert_bitwise_equal, expected_value
from tests.helpers import real_root as _root, real_truth as _truth

KEYS = ["exp_avg", "exp_avg_sq"]
SMALL = "s2_bf16_w2_frozen_tied"


def _partitioned(truth) -> bool:
    return truth["stage"] in (1, 2, 3)


def _check(got, want: dict, dtype) -> None:
    assert list(got) == list(want)
    for name, value in want.items():
        assert_bitwise_equal(got[name], expected_value(value, dtype), name)


@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize("dtype", [torch.float32, None, torch.bfloat16], ids=str)
def test_matches_safe_get_full_optimizer_state(real_ckpt, key, dtype):
    _, root, truth = real_ckpt
    if not _partitioned(truth):
        with pytest.raises(zerofast.UnsupportedCheckpointError, match="stage 0"):
            zerofast.optimizer_state(root, key)
        return
    _check(zerofast.optimizer_state(root, key, dtype=dtype), truth["optimizer_states"][key], dtype)


@pytest.mark.parametrize("key", KEYS)
def test_lazy_matches_and_describes_without_reading(real_ckpt, key):
    _, root, truth = real_ckpt
    if not _partitioned(truth):
        pytest.skip("stage 0 keeps no partitioned optimizer state")
    want = truth["optimizer_states"][key]
    lazy = zerofast.optimizer_state(root, key, lazy=True, tag=truth["tag"])
    assert isinstance(lazy, zerofast.LazyStateDict)
    for name, value in want.items():
        assert lazy.meta(name).shape == value.shape and lazy.meta(name).dtype == torch.float32
    _check(lazy, want, torch.float32)


def test_only_trainable_parameters_have_state(real_ckpt):
    _, root, truth = real_ckpt
    if not _partitioned(truth):
        pytest.skip("stage 0 keeps no partitioned optimizer state")
    names = set(zerofast.optimizer_state(root, "exp_avg", lazy=True))
    assert names == set(truth["trainable"])
    assert not names & (set(truth["frozen"]) | set(truth["tied"]) | set(truth["buffers"]))


@needs_deepspeed
@pytest.mark.parametrize("key,what", [("step", "is a scalar"), ("momentum_buffer", "is missing")])
def test_unknown_key_names_the_states_there_are(key, what):
    with pytest.raises(zerofast.MissingOptimizerStateError, match=what) as info:
        zerofast.optimizer_state(_root(SMALL), key)
    assert isinstance(info.value, KeyError)
    assert "['exp_avg', 'exp_avg_sq']" in str(info.value)


def _read_safetensors(out_dir, names):
    tensors = {}
    for name in names:
        with safe_open(out_dir / name, framework="pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    return tensors


def _expected_export(truth) -> dict:
    return {f"{name}.{key}": value for name in truth["trainable"] for key in KEYS
            for value in [truth["optimizer_states"][key][name]]}


@needs_deepspeed
@pytest.mark.parametrize("layout", ["s1_bf16_w2_fp32accum", "s2_fp32_w3_elastic", "s3_fp32_w3_3groups_subgroups"])
@pytest.mark.parametrize("shard", [2000, "5GB"], ids=["tiny", "one"])
def test_export_writes_every_state_and_the_scalars(tmp_path, layout, shard):
    truth = _truth(layout)
    result = zerofast.export(_root(layout), tmp_path, dtype=torch.bfloat16, max_shard_size=shard,
                             optimizer_states=True)
    shards = [n for n in result.optimizer_files if n.endswith(".safetensors")]
    if shard == "5GB":
        assert result.optimizer_files == ("optimizer.safetensors", OPTIMIZER_JSON)
    else:
        assert len(shards) > 1 and shards[0] == f"optimizer-00001-of-{len(shards):05d}.safetensors"
        index = json.loads((tmp_path / "optimizer.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(_expected_export(truth))
    got = _read_safetensors(tmp_path, shards)
    want = _expected_export(truth)
    assert set(got) == set(want)
    for name, value in want.items():
        assert_bitwise_equal(got[name], value, name)  # fp32 as stored, whatever the weights' dtype
    _check_scalars(json.loads((tmp_path / OPTIMIZER_JSON).read_text()), truth)


def _check_scalars(doc: dict, truth: dict) -> None:
    assert doc["keys"] == KEYS and doc["stage"] == truth["stage"] and doc["tag"] == truth["tag"]
    assert doc["state"] == {name: {"step": truth["optimizer_step"]} for name in truth["trainable"]}
    if doc["param_groups"]:  # an elastic checkpoint keeps none
        listed = [name for group in doc["param_groups"] for name in group["params"]]
        assert sorted(listed) == sorted(truth["trainable"])
        assert all("lr" in group and "betas" in group for group in doc["param_groups"])


@needs_deepspeed
def test_param_groups_carry_each_parameters_hyperparameters(tmp_path):
    layout = "s2_fp32_w4_odd_3groups"
    zerofast.export(_root(layout), tmp_path, optimizer_states=True)
    doc = json.loads((tmp_path / OPTIMIZER_JSON).read_text())
    by_name = {name: group for group in doc["param_groups"] for name in group["params"]}
    for g, names in enumerate(_truth(layout)["param_groups"]):  # models.param_groups sets these
        for name in names:
            assert by_name[name]["weight_decay"] == (0.01 if g == 0 else 0.0)
            assert by_name[name]["lr"] == (5e-3 if g == 2 else 1e-2)


@needs_deepspeed
def test_weights_are_the_same_with_or_without_optimizer_states(tmp_path):
    plain = zerofast.export(_root(SMALL), tmp_path / "plain")
    both = zerofast.export(_root(SMALL), tmp_path / "both", optimizer_states=["exp_avg"])
    assert both.files == plain.files
    assert (tmp_path / "both" / "model.safetensors").read_bytes() == (tmp_path / "plain" / "model.safetensors").read_bytes()
    got = _read_safetensors(tmp_path / "both", ["optimizer.safetensors"])
    assert set(got) == {f"{name}.exp_avg" for name in _truth(SMALL)["trainable"]}


@needs_deepspeed
def test_a_rerun_without_optimizer_states_removes_them(tmp_path):
    zerofast.export(_root(SMALL), tmp_path, optimizer_states=True)
    assert (tmp_path / "optimizer.safetensors").is_file()
    zerofast.export(_root(SMALL), tmp_path)
    assert not (tmp_path / "optimizer.safetensors").exists() and not (tmp_path / OPTIMIZER_JSON).exists()


@needs_deepspeed
def test_stage0_export_with_optimizer_states_writes_nothing(tmp_path):
    with pytest.raises(zerofast.UnsupportedCheckpointError):
        zerofast.export(_root("s0_bf16_w2"), tmp_path / "out", optimizer_states=True)
    assert not (tmp_path / "out").exists()


@needs_deepspeed
def test_cli_flag(tmp_path, capsys):
    assert main(["export", str(_root(SMALL)), str(tmp_path), "--optimizer-states"]) == 0
    assert capsys.readouterr().out.startswith("wrote 3 files ")
    got = _read_safetensors(tmp_path, ["optimizer.safetensors"])
    want = _expected_export(_truth(SMALL))
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    _check_scalars(json.loads((tmp_path / OPTIMIZER_JSON).read_text()), _truth(SMALL))
