"""Mixture-of-experts with pipeline parallelism (issue 47): a ``PipelineModule`` with a
``deepspeed.moe.layer.MoE`` in each of its two stages, saved by real DeepSpeed 0.19.8 on the CPU
(tests/dsgen/train_moe_pipe.py), judged bit for bit against the job's own values. No layer files;
each stage's experts are numbered ``layer_0...`` within the stage (``mp_rank`` is the stage)."""
from __future__ import annotations

import functools
import shutil

import pytest
import torch

import zerofast
from tests.conftest import needs_deepspeed
from tests.dsgen.catalog import ensure_checkpoint
from tests.dsgen.families import MOE_PIPE_LAYOUTS
from tests.helpers import assert_bitwise_equal, expected_value, exported

pytestmark = needs_deepspeed

LAYOUTS = sorted(MOE_PIPE_LAYOUTS)


@functools.lru_cache(maxsize=None)
def _truth(layout: str) -> dict:
    return torch.load(ensure_checkpoint(layout) / "ground_truth.pt", weights_only=True)


def _want(truth: dict) -> dict:
    return {**truth["trainable"], **truth["frozen"], **truth["buffers"]}


def _copy(layout: str, tmp_path):
    root = ensure_checkpoint(layout)
    tag = root / (root / "latest").read_text().strip()
    out = tmp_path / "ckpt"
    shutil.copytree(root, out, ignore=shutil.ignore_patterns("ground_truth.pt"))
    return out, out / tag.name


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_save_is_what_deepspeed_writes(layout):
    """No pipeline layer files; each stage's first MoE layer is layer_0 in its expert files."""
    root = ensure_checkpoint(layout)
    names = sorted(p.name for p in (root / (root / "latest").read_text().strip()).iterdir())
    assert not [n for n in names if n.endswith("-model_states.pt")]
    assert "layer_0_expert_3_mp_rank_00_model_states.pt" in names
    assert "layer_0_expert_1_mp_rank_01_model_states.pt" in names
    assert not [n for n in names if n.startswith("layer_1_")]


@pytest.mark.parametrize("dtype", [None, torch.float32], ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_reconstruct_matches_the_training_job(layout, dtype):
    truth = _truth(layout)
    sd = zerofast.reconstruct(ensure_checkpoint(layout), dtype=dtype)
    assert list(sd) == truth["state_dict_keys"]
    want = _want(truth)
    for name in truth["state_dict_keys"]:
        assert_bitwise_equal(sd[name], expected_value(want[name], dtype), name)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_lazy_matches_the_training_job(layout):
    truth = _truth(layout)
    lazy = zerofast.reconstruct(ensure_checkpoint(layout), dtype=None, lazy=True)
    assert list(lazy.keys()) == truth["state_dict_keys"]
    want = _want(truth)
    for name in truth["state_dict_keys"]:
        assert_bitwise_equal(lazy[name], expected_value(want[name], None), name)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_export_writes_every_tensor(layout, tmp_path):
    truth = _truth(layout)
    result = zerofast.export(ensure_checkpoint(layout), tmp_path / "hf", dtype=None)
    got = exported(tmp_path / "hf", result.files)
    assert sorted(got) == sorted(truth["state_dict_keys"])
    want = _want(truth)
    for name in truth["state_dict_keys"]:
        assert_bitwise_equal(got[name], want[name], name)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_inspect_names_both_parallelisms(layout, capsys):
    from zerofast.cli import describe, main

    spec = MOE_PIPE_LAYOUTS[layout]
    p = describe(ensure_checkpoint(layout))["parallelism"]
    assert (p["dp"], p["ep"], p["pp"]) == (spec["world_size"] // spec["pp"], spec["ep"], spec["pp"])
    assert p["experts_per_layer"] == {"1.moe": 4, "3.moe": 2}
    assert p["stages"] == [[0, 1, 2], [3, 4, 5]]
    assert main(["inspect", str(ensure_checkpoint(layout))]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("parallelism"))
    assert "mixture-of-experts with pipeline parallelism" in line and "pp 2" in line and "ep 2" in line


def test_an_expert_file_of_another_layer_is_refused(tmp_path):
    """Stage 1's layer_0 expert files holding stage 0's layer (its tensors' names say so): which layer
    a per-stage L means is told by the names, and a disagreement is refused, not guessed."""
    root, tag = _copy(LAYOUTS[0], tmp_path)
    for e in range(2):
        other = torch.load(tag / f"layer_0_expert_{e}_mp_rank_00_model_states.pt", weights_only=True)
        torch.save(other, tag / f"layer_0_expert_{e}_mp_rank_01_model_states.pt")
    with pytest.raises(zerofast.UnsupportedCheckpointError, match="cannot be told"):
        zerofast.reconstruct(root)


def test_zero_off_stays_refused(tmp_path):
    root, tag = _copy(LAYOUTS[0], tmp_path)
    shutil.copy(next(tag.glob("*zero_pp_rank_0_mp_rank_01_optim_states.pt")),
                tag / "expp_rank_1_mp_rank_01_optim_states.pt")
    with pytest.raises(zerofast.UnsupportedCheckpointError, match="without ZeRO .*expp_rank_1_mp_rank_01"):
        zerofast.reconstruct(root)
