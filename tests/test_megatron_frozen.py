"""Frozen parameters of a Megatron-DeepSpeed tensor-parallel save (issue 47).

A frozen parameter is in no optimizer: each tp rank's model states (a pipeline's: its layer
files) hold its shard of it, in the model dtype, and nothing else says how the shards go together but the rules that join the
trainable ones (``universal_checkpoint_info``'s patterns). Before, zerofast returned tp rank 0's
shard as the whole tensor. tests/dsgen/train_megatron.py's ``frozen`` variant freezes one
parameter of each kind (vocabulary, column, row, SwiGLU, replicated) and records each put
together over the tp group by the model's own partitioning; DeepSpeed's ds_to_universal fails on
this save (its vocabulary pattern matches no trainable parameter), so the job's truth is the
reference.
"""
from __future__ import annotations

import functools
import shutil

import pytest
import torch

import zerofast
from tests.conftest import needs_deepspeed
from tests.dsgen.catalog import ensure_checkpoint
from tests.dsgen.families import MEGATRON_VARIANTS, ensure_megatron_variant
from tests.dsgen.megatron_pipe_layouts import MEGATRON_PIPE_LAYOUTS
from tests.dsgen.train_megatron import FROZEN
from tests.helpers import assert_bitwise_equal, expected_value, exported

pytestmark = needs_deepspeed

LAYOUTS = sorted(n for n, spec in MEGATRON_VARIANTS.items() if spec.get("frozen"))
PIPE = sorted(n for n, spec in MEGATRON_PIPE_LAYOUTS.items() if spec.get("frozen"))  # TP 2 x PP 2
DTYPES = [None, torch.float32, torch.bfloat16]


def _root(layout: str):
    return ensure_checkpoint(layout) if layout in MEGATRON_PIPE_LAYOUTS else ensure_megatron_variant(layout)


@functools.lru_cache(maxsize=None)
def _truth(layout: str) -> dict:
    return torch.load(_root(layout) / "ground_truth.pt", weights_only=True)


def _tag_dir(layout: str):
    root = _root(layout)
    return root / (root / "latest").read_text().strip()


def _want(truth: dict, name: str) -> torch.Tensor:
    return truth["frozen"][name] if name in truth["frozen"] else truth["trainable"][name]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_save_holds_shards_of_the_frozen_parameters(layout):
    truth = _truth(layout)
    assert set(truth["frozen"]) == set(FROZEN) and not set(FROZEN) & set(truth["trainable"])
    for t in range(2):
        states = torch.load(_tag_dir(layout) / f"mp_rank_{t:02d}_model_states.pt", weights_only=True)
        assert not {n for g in states["param_shapes"] for n in g} & set(FROZEN)  # no optimizer holds them
        for name in FROZEN:
            held = states["module"][name]
            assert held.dtype == torch.bfloat16 and list(held.shape) == truth["shard_shapes"][name], name
            if "layernorm" not in name:  # every split kind: the shard is not the whole
                assert held.shape != truth["frozen"][name].shape, name


@pytest.mark.parametrize("layout", PIPE)
def test_the_pipeline_save_holds_shards_in_its_layer_files(layout):
    truth = _truth(layout)
    assert set(truth["frozen"]) and not set(truth["frozen"]) & set(truth["trainable"])
    for t in range(2):  # the first layer is on stage 0: layer_02-model_0t
        held = torch.load(_tag_dir(layout) / f"layer_02-model_{t:02d}-model_states.pt", weights_only=True)
        for name in truth["frozen"]:
            value = held[name.split(".", 1)[1]]
            assert value.dtype == torch.bfloat16 and list(value.shape) == truth["shard_shapes"][name], name


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS + PIPE)
def test_frozen_shards_are_put_together(layout, dtype):
    truth = _truth(layout)
    for lazy in (False, True):
        sd = zerofast.reconstruct(_root(layout), dtype=dtype, lazy=lazy)
        assert list(sd) == truth["state_dict_keys"]
        for name in truth["state_dict_keys"]:
            assert_bitwise_equal(sd[name], expected_value(_want(truth, name), dtype), name)
    trained = zerofast.reconstruct(_root(layout), dtype=dtype, exclude_frozen=True)
    assert list(trained) == [n for n in truth["state_dict_keys"] if n not in truth["frozen"]]


@pytest.mark.parametrize("layout", LAYOUTS + PIPE)
def test_export_writes_the_whole_frozen_parameters(layout, tmp_path):
    truth = _truth(layout)
    result = zerofast.export(_root(layout), tmp_path / "hf", dtype=None)
    got = exported(tmp_path / "hf", result.files)
    assert sorted(got) == sorted(truth["state_dict_keys"])
    for name in truth["state_dict_keys"]:
        assert_bitwise_equal(got[name], expected_value(_want(truth, name), None), name)


def _with_rank1_layernorm_changed(layout: str, tmp_path):
    """A copy of the save whose tp rank 1 holds a different frozen (replicated) layer norm."""
    tag = _tag_dir(layout)
    copy = tmp_path / "ckpt"
    shutil.copytree(tag.parent, copy, ignore=shutil.ignore_patterns("universal", "ground_truth.pt"))
    victim = copy / tag.name / "mp_rank_01_model_states.pt"
    states = torch.load(victim, weights_only=True)
    name = next(n for n in FROZEN if "layernorm" in n)
    states["module"][name] = states["module"][name] + 1
    torch.save(states, victim)
    return copy, name


@pytest.mark.parametrize("layout", LAYOUTS[:1])
def test_differing_frozen_replicated_copies_are_refused_or_averaged(layout, tmp_path):
    root, name = _with_rank1_layernorm_changed(layout, tmp_path)
    with pytest.raises(zerofast.InconsistentCheckpointError, match=f"{name!r} is named tensor-parallel replicated"):
        zerofast.reconstruct(root, dtype=None)
    with pytest.warns(UserWarning, match="averaged"):
        sd = zerofast.reconstruct(root, dtype=None, tp_replicated="mean")
    shard = _truth(layout)["frozen"][name]
    copies = [shard, shard + 1]
    mean = 0
    for c in copies:  # ds_to_universal's mean, in the stored dtype, from an int 0
        mean = mean + c
    assert_bitwise_equal(sd[name], mean / 2, name)
