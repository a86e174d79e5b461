"""DeepSpeed's Muon at ZeRO-1, 2 and 3: optimizer state kept per param group (issue 25, item 2).

Real saves from tests/dsgen/train_muon.py (world 2, bf16, frozen params, a tied weight): group 0
(Muon, the 2-D parameters) keeps ``momentum_buffer``, group 1 (Adam) ``exp_avg``/``exp_avg_sq``.
At ZeRO-1/2 the momentum is bf16 and laid out over the whole parameters that touch a rank's
partition. Everything is judged against DeepSpeed's own values taken in the training run, and
reshard by DeepSpeed loading the result at the new world size (tests/dsgen/resume.py: masters,
every optimizer key, steps, frozen params and buffers); to-dcp by torch's own converter reading
every key back. to-universal refuses these saves: see
test_to_universal_refuses_what_deepspeed_cannot_load.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import zerofast
from zerofast.cli import describe, main
from zerofast.writers.reshard import reshard
from zerofast.writers.universal import to_universal

from tests.conftest import needs_deepspeed
from tests.helpers import assert_bitwise_equal, real_root, real_truth
from tests.test_reshard import _case, _resume

SOURCES = {1: "s1_bf16_w2_muon", 2: "s2_bf16_w2_muon", 3: "s3_bf16_w2_muon"}
GROUP_KEYS = [["momentum_buffer"], ["exp_avg", "exp_avg_sq"]]

pytestmark = needs_deepspeed


def _stored(truth: dict, key: str) -> torch.dtype:
    return getattr(torch, truth["state_dtypes"][key])


def _check_states(root, truth: dict, what: str) -> None:
    for key, want in truth["optimizer_states"].items():
        got = zerofast.optimizer_state(root, key, dtype=None)
        assert list(got) == [n for n in truth["state_dict_keys"] if n in want], f"{what} {key}"
        for name, value in want.items():
            # The truth holds the live values; the accessor DeepSpeed has at stage 3 returns fp32.
            assert got[name].dtype == _stored(truth, key), f"{what} {key} {name}"
            assert_bitwise_equal(got[name].to(value.dtype), value, f"{what} {key} {name}")


@pytest.mark.parametrize("stage", sorted(SOURCES))
def test_every_key_of_every_group(stage):
    truth = real_truth(SOURCES[stage])
    root = real_root(SOURCES[stage])
    assert set(truth["optimizer_states"]["momentum_buffer"]) == set(truth["muon_params"])
    assert not set(truth["muon_params"]) & set(truth["optimizer_states"]["exp_avg"])
    _check_states(root, truth, "source")
    # The default dtype policy gives fp32 of the same values.
    momentum = zerofast.optimizer_state(root, "momentum_buffer")
    for name, value in truth["optimizer_states"]["momentum_buffer"].items():
        assert_bitwise_equal(momentum[name], value.float(), name)
    state = zerofast.reconstruct(root, dtype=None)
    for name, value in {**truth["trainable"], **truth["frozen"], **truth["buffers"]}.items():
        assert_bitwise_equal(state[name], value, name)


@pytest.mark.parametrize("stage", sorted(SOURCES))
def test_inspect_lists_the_keys_per_group(stage, capsys):
    groups = describe(real_root(SOURCES[stage]))["optimizer_groups"]
    assert [g["keys"] for g in groups] == GROUP_KEYS
    assert [g["name"] for g in groups] == ["muon-params", "adam-params"]
    truth = real_truth(SOURCES[stage])
    assert [g["params"] for g in groups] == [len(truth["muon_params"]),
                                             len(truth["trainable"]) - len(truth["muon_params"])]
    assert main(["inspect", str(real_root(SOURCES[stage]))]) == 0
    out = capsys.readouterr().out
    assert "group 0 (muon-params): 10 params: momentum_buffer" in out
    assert "group 1 (adam-params): 15 params: exp_avg, exp_avg_sq" in out


@pytest.mark.parametrize("stage", sorted(SOURCES))
def test_export_carries_every_key_in_its_own_dtype(tmp_path, stage):
    truth = real_truth(SOURCES[stage])
    zerofast.export(real_root(SOURCES[stage]), tmp_path, optimizer_states=True)
    got = load_file(tmp_path / "optimizer.safetensors")
    want = {f"{name}.{key}": value for key, values in truth["optimizer_states"].items()
            for name, value in values.items()}
    assert set(got) == set(want)
    for name, value in want.items():
        key = name.rsplit(".", 1)[1]
        assert got[name].dtype == _stored(truth, key), name
        assert_bitwise_equal(got[name].to(value.dtype), value, name)
    doc = json.loads((tmp_path / "optimizer_state.json").read_text())
    assert doc["keys"] == ["momentum_buffer", "exp_avg", "exp_avg_sq"]
    adam = set(truth["optimizer_states"]["exp_avg"])
    assert {n for n, s in doc["state"].items() if s.get("step") == truth["optimizer_step"]} == adam


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    base = tmp_path_factory.mktemp("muon")
    out = {}
    for stage, layout in SOURCES.items():
        root = real_root(layout)
        w3 = reshard(root, base / f"s{stage}_w3", 3).parent
        w1 = reshard(w3, base / f"s{stage}_w1", 1).parent  # and back down, from the rewritten one
        out[stage] = {"w3": w3, "w1": w1}
    return out


@pytest.mark.parametrize("stage", sorted(SOURCES))
def test_reshard_keeps_every_key(outputs, stage):
    truth = real_truth(SOURCES[stage])
    for world in ("w3", "w1"):
        _check_states(outputs[stage][world], truth, world)
        state = zerofast.reconstruct(outputs[stage][world], dtype=None)
        for name, value in {**truth["trainable"], **truth["frozen"], **truth["buffers"]}.items():
            assert_bitwise_equal(state[name], value, f"{world} {name}")


def test_deepspeed_resumes_the_reshards(outputs, tmp_path):
    """DeepSpeed's load_checkpoint at world 3 gives back the run's masters, every optimizer key
    of both groups, steps, frozen params and buffers; then trains a step."""
    cases = [_case(layout, outputs[stage]["w3"], 3) for stage, layout in SOURCES.items()]
    results = _resume(tmp_path, 3, cases)
    assert set(results) == {c["name"] for c in cases}
    assert {name: errors for name, errors in results.items() if errors} == {}


@pytest.mark.parametrize("stage", sorted(SOURCES))
def test_to_universal_refuses_what_deepspeed_cannot_load(tmp_path, stage):
    """DeepSpeed 0.19.8's universal loader gives every parameter the same states (stage 3: Adam's
    two, with group 0's hyperparameters for all; stages 1-2: sliced like the fp32 partition, so
    a 1010-element momentum where Muon needs 1280). Loaded by DeepSpeed, a universal folder of a
    Muon save fails (stage 3: KeyError 'step') or restores a momentum of the wrong length."""
    with pytest.raises(zerofast.UnplacedOptimizerStateError, match="to-universal cannot place") as e:
        to_universal(real_root(SOURCES[stage]), tmp_path / "u" / "global_step3")
    assert "momentum_buffer" in str(e.value) or "exp_avg" in str(e.value)
    assert e.value.path.endswith("optim_states.pt")
    assert not (tmp_path / "u" / "global_step3").exists() or not [
        p for p in (tmp_path / "u" / "global_step3").iterdir() if not p.name.startswith(".zerofast")]


@pytest.mark.parametrize("stage", sorted(SOURCES))
def test_to_dcp_carries_every_key_of_every_group(tmp_path, stage):
    """to-dcp writes get_state_dict's optimizer layout with each parameter's own group's keys
    (Muon's momentum_buffer, Adam's moments) in the dtype the save keeps them in; torch's own
    converter reads them back equal to DeepSpeed's truth, and the groups keep their names."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    layout = SOURCES[stage]
    truth = real_truth(layout)
    folder = zerofast.to_dcp(real_root(layout), tmp_path / "dcp").out_dir
    dcp_to_torch_save(folder, tmp_path / "back.pt")
    optim = torch.load(tmp_path / "back.pt", weights_only=False)["optim"]
    state = optim["state"]
    # As the save keeps them: Muon's momentum in bf16 at every stage (DeepSpeed's stage-3 accessor
    # hands it back as fp32, an exact widening), Adam's moments in fp32.
    stored = {"momentum_buffer": torch.bfloat16, "exp_avg": torch.float32, "exp_avg_sq": torch.float32}
    for key, values in truth["optimizer_states"].items():
        for name, value in values.items():
            assert state[name][key].dtype == stored[key], f"{name}.{key}"
            assert_bitwise_equal(state[name][key].to(value.dtype), value, f"{name}.{key}")
    for name, entry in state.items():
        kept = {k for k, values in truth["optimizer_states"].items() if name in values}
        assert set(entry) - {"step"} == kept, name  # no key of the other group (Muon keeps no step)
    assert [g["name"] for g in optim["param_groups"]] == ["muon-params", "adam-params"]
    assert [g["use_muon"] for g in optim["param_groups"]] == [True, False]
    weights = zerofast.to_dcp(real_root(layout), tmp_path / "weights", optimizer=False).out_dir
    dcp_to_torch_save(weights, tmp_path / "weights.pt")
    assert set(torch.load(tmp_path / "weights.pt", weights_only=False)) == {"model"}
