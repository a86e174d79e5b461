"""Mixture-of-experts with Megatron-DeepSpeed tensor parallelism (issue 47): a native
``deepspeed.moe.layer.MoE`` in a GPT trained with an ``mpu`` (tp 2, world 4), saves that real
DeepSpeed 0.19.8 wrote on the CPU (tests/dsgen/train_megatron_moe.py), judged bit for bit against
the training job's own values, gathered by the model's own partitioning.

Both arrangements DeepSpeed writes: tensor-parallel experts (``enable_expert_tensor_parallelism``:
every tp rank writes its shard of every expert, joined here by the save's rules) and whole experts
(Megatron-DeepSpeed's default: expert groups over the global ranks, each expert in one tp rank's
file); with frozen dense and expert tensors, at ZeRO 1 and 2. Whole experts at ep 1 are a save DeepSpeed
leaves without tp rank 1's model states: refused, naming why.
"""
from __future__ import annotations

import functools
import os
import shutil

import pytest
import torch

import zerofast
from tests.conftest import needs_deepspeed
from tests.dsgen.catalog import ensure_checkpoint
from tests.dsgen.families import MEGATRON_MOE_LAYOUTS
from tests.helpers import assert_bitwise_equal, expected_value, exported

pytestmark = needs_deepspeed

NUM_EXPERTS, T = 4, 2
LAYOUTS = sorted(MEGATRON_MOE_LAYOUTS)
SPLIT = [n for n in LAYOUTS if MEGATRON_MOE_LAYOUTS[n]["expert_tp"]]
WHOLE = [n for n in LAYOUTS if not MEGATRON_MOE_LAYOUTS[n]["expert_tp"]]
# whole experts at ep < tp: DeepSpeed writes no model states for tp ranks ep.. (refused, below)
LOST = [n for n in WHOLE if MEGATRON_MOE_LAYOUTS[n]["ep"] < T]
READ = [n for n in LAYOUTS if n not in LOST]
DTYPES = [None, torch.float32, torch.bfloat16]
EXPERT = "language_model.encoder.layers.1.mlp.deepspeed_moe.experts.deepspeed_experts."


@functools.lru_cache(maxsize=None)
def _truth(layout: str) -> dict:
    return torch.load(ensure_checkpoint(layout) / "ground_truth.pt", weights_only=True)


def _tag_dir(layout: str):
    root = ensure_checkpoint(layout)
    return root / (root / "latest").read_text().strip()


def _want(truth: dict, name: str) -> torch.Tensor:
    return truth["frozen"][name] if name in truth["frozen"] else truth["trainable"][name]


def _copy(layout: str, tmp_path):
    tag = _tag_dir(layout)
    root = tmp_path / "ckpt"
    shutil.copytree(tag.parent, root, ignore=shutil.ignore_patterns("ground_truth.pt"))
    return root, root / tag.name


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_save_is_what_deepspeed_writes(layout):
    """The job's record of DeepSpeed's groups, and the files they give: tensor-parallel experts have
    a file per tp rank, whole experts one, that of the tp rank of global rank ``E // num_local``."""
    spec, truth = MEGATRON_MOE_LAYOUTS[layout], _truth(layout)
    ep, world = spec["ep"], spec["world_size"]
    local = NUM_EXPERTS // ep
    groups = truth["expert_parallel"]
    names = {p.name for p in _tag_dir(layout).iterdir()}
    experts = {n for n in names if n.startswith("layer_")}
    if spec["expert_tp"]:  # ep rank = dp rank % ep inside each tp rank's data-parallel group
        assert groups["ep_rank_of_rank"] == [(r // T) % ep for r in range(world)]
        want = {f"layer_0_expert_{e}_mp_rank_{t:02d}_model_states.pt" for e in range(NUM_EXPERTS) for t in range(T)}
    else:  # over the global ranks: ep rank r % ep, expert-data-parallel ranks r % ep, r % ep + ep, ...
        assert groups["ep_rank_of_rank"] == [r % ep for r in range(world)]
        assert groups["edp_group_of_rank"] == [list(range(r % ep, world, ep)) for r in range(world)]
        want = {f"layer_0_expert_{e}_mp_rank_{(e // local) % T:02d}_model_states.pt" for e in range(NUM_EXPERTS)}
    assert experts == want
    # a tp rank's model states come from its dp rank 0, and only where that is expert-data-parallel
    # rank 0 too: with whole experts, global rank t < ep
    written = range(T) if spec["expert_tp"] else range(min(ep, T))
    assert {n for n in names if n.startswith("mp_rank_")} == {f"mp_rank_{t:02d}_model_states.pt" for t in written}
    assert len([n for n in names if n.endswith("_optim_states.pt")]) == world
    held = torch.load(_tag_dir(layout) / sorted(experts)[0], weights_only=True)
    for name, value in held.items():
        full = _want(truth, name)
        assert value.dtype == torch.bfloat16
        assert (value.shape != full.shape) == spec["expert_tp"] or "4h_to_h.bias" in name, name


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", READ)
def test_reconstruct_matches_the_training_job(layout, dtype):
    truth = _truth(layout)
    for lazy in (False, True):
        sd = zerofast.reconstruct(ensure_checkpoint(layout), dtype=dtype, lazy=lazy)
        assert list(sd) == truth["state_dict_keys"]
        for name in truth["state_dict_keys"]:
            assert_bitwise_equal(sd[name], expected_value(_want(truth, name), dtype), name)


@pytest.mark.parametrize("layout", [n for n in READ if MEGATRON_MOE_LAYOUTS[n].get("frozen")])
def test_exclude_frozen(layout):
    truth = _truth(layout)
    assert any(n.startswith(EXPERT) for n in truth["frozen"]) and any(not n.startswith(EXPERT) for n in truth["frozen"])
    trained = zerofast.reconstruct(ensure_checkpoint(layout), exclude_frozen=True)
    assert list(trained) == [n for n in truth["state_dict_keys"] if n not in truth["frozen"]]


@pytest.mark.parametrize("key", ["exp_avg", "exp_avg_sq"])
@pytest.mark.parametrize("layout", READ)
def test_optimizer_state_matches_the_training_job(layout, key):
    want = _truth(layout)["optimizer_states"][key]
    for lazy in (False, True):
        got = zerofast.optimizer_state(ensure_checkpoint(layout), key, lazy=lazy)
        assert list(got) == [n for n in _truth(layout)["state_dict_keys"] if n in want]
        for name, value in want.items():
            assert_bitwise_equal(got[name], value, name)


@pytest.mark.parametrize("layout", READ)
def test_export_writes_the_full_tensors(layout, tmp_path):
    truth = _truth(layout)
    result = zerofast.export(ensure_checkpoint(layout), tmp_path / "hf", dtype=None)
    got = exported(tmp_path / "hf", result.files)
    assert sorted(got) == sorted(truth["state_dict_keys"])
    for name in truth["state_dict_keys"]:
        assert_bitwise_equal(got[name], _want(truth, name), name)


@pytest.mark.parametrize("layout", READ)
def test_inspect_shows_both_parallelisms(layout, capsys):
    from zerofast.cli import describe, main

    spec = MEGATRON_MOE_LAYOUTS[layout]
    p = describe(ensure_checkpoint(layout))["parallelism"]
    assert (p["dp"], p["ep"], p["tp"]) == (spec["world_size"] // T, spec["ep"], T)
    assert p["experts"] == ("tensor-parallel" if spec["expert_tp"] else "whole")
    assert p["experts_per_layer"] == {"language_model.encoder.layers.1.mlp": NUM_EXPERTS}
    rules = p["tp_rules"]
    assert rules[EXPERT + "3.dense_4h_to_h.weight"] == ("joined on dim 1" if spec["expert_tp"] else "whole (expert)")
    assert rules["language_model.encoder.layers.1.mlp.deepspeed_moe.gate.wg.weight"] == "replicated"
    assert main(["inspect", str(ensure_checkpoint(layout))]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("parallelism"))
    assert "mixture-of-experts with tensor parallelism" in line and "ep " in line and "tp 2" in line


@pytest.mark.parametrize("layout", LAYOUTS)
def test_deepspeeds_own_converter_cannot_read_them(layout):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with pytest.raises((ValueError, AttributeError)):
        get_fp32_state_dict_from_zero_checkpoint(str(ensure_checkpoint(layout)))


# -- what is refused, by name ------------------------------------------------------------------------

@pytest.mark.parametrize("layout", LOST)
def test_a_save_without_a_tp_ranks_model_states_is_refused_naming_why(layout):
    """Whole experts at ep 1, tp 2: DeepSpeed's MoE save writes tp rank 1's model states from global
    rank 1, which is not expert-data-parallel rank 0 and so returns before writing them. The masters
    of tp rank 1's shards are in its optimizer files, but their names, shapes and frozen shards were
    not saved: refused, naming the file and the reason."""
    with pytest.raises(zerofast.IncompleteCheckpointError,
                       match=r"mp_rank_00\.\.01\), found mp_rank_00_model_states\.pt; DeepSpeed 0\.19\.8's MoE save"):
        zerofast.reconstruct(ensure_checkpoint(layout))


def test_an_expert_missing_on_one_tp_rank_is_refused(tmp_path):
    root, tag = _copy(SPLIT[0], tmp_path)
    (tag / "layer_0_expert_2_mp_rank_01_model_states.pt").unlink()
    with pytest.raises(zerofast.InconsistentCheckpointError,
                       match=r"on tp ranks \[0, 1\] but expert 2 of MoE layer 0 on tp ranks \[0\]"):
        zerofast.reconstruct(root)


def test_a_whole_expert_in_another_tp_ranks_file_is_refused(tmp_path):
    """Whole experts are placed by DeepSpeed's grouping over the global ranks; a file elsewhere is
    a grouping this layout does not know: refused, not read by guess."""
    layout = next(n for n in WHOLE if n not in LOST)
    root, tag = _copy(layout, tmp_path)
    (tag / "layer_0_expert_3_mp_rank_01_model_states.pt").rename(tag / "layer_0_expert_3_mp_rank_00_model_states.pt")
    with pytest.raises(zerofast.UnsupportedCheckpointError, match="expert 3 of .* its writer is tp rank 1's"):
        zerofast.reconstruct(root)


def test_a_save_without_the_rules_is_refused(tmp_path):
    """Nothing else says how the tp ranks' slices go together: the refusal names --tp-rules."""
    root, tag = _copy(SPLIT[0], tmp_path)
    for t in range(T):
        path = tag / f"mp_rank_{t:02d}_model_states.pt"
        states = torch.load(path, weights_only=False)
        del states["universal_checkpoint_info"]
        torch.save(states, path)
    with pytest.raises(zerofast.UnsupportedCheckpointError, match="--tp-rules"):
        zerofast.reconstruct(root)


def test_zero_off_is_refused_by_name(tmp_path):
    root, tag = _copy(READ[0], tmp_path)
    optim = next(tag.glob("*zero_pp_rank_0_mp_rank_01_optim_states.pt"))
    shutil.copy(optim, tag / "expp_rank_1_mp_rank_01_optim_states.pt")
    with pytest.raises(zerofast.UnsupportedCheckpointError, match="without ZeRO .*expp_rank_1_mp_rank_01"):
        zerofast.reconstruct(root)


def test_a_tensor_parallel_save_marked_as_stages_is_refused(tmp_path):
    """Only checkpoint_parallel_dimensions tells a pipeline's MoE save (read by layouts/moe_pipe.py)
    from tensor parallelism. A tp save whose pp_degree says 2 goes there, and its two "stages"
    holding the same dense names are refused, not read as stages."""
    root, tag = _copy(SPLIT[0], tmp_path)
    for t in range(T):
        path = tag / f"mp_rank_{t:02d}_model_states.pt"
        states = torch.load(path, weights_only=False)
        states["checkpoint_parallel_dimensions"] = {"pp_degree": 2, "tp_degree": 1}
        torch.save(states, path)
    with pytest.raises(zerofast.InconsistentCheckpointError, match="in the module of two stages"):
        zerofast.reconstruct(root)


def test_experts_with_pipeline_stages_stay_refused(tmp_path):
    """A pipeline's layer files next to tensor-parallel expert files: the registry's refusal of
    experts together with pipeline parallelism, not a half read."""
    root, tag = _copy(SPLIT[0], tmp_path)
    shutil.copy(tag / "mp_rank_00_model_states.pt", tag / "layer_01-model_00-model_states.pt")
    with pytest.raises(zerofast.UnsupportedCheckpointError, match="together with pipeline"):
        zerofast.reconstruct(root)
