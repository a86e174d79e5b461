"""Megatron-Core saves of a real ``GPTModel`` (issue 48 section 2, "Done when").

tests/dsgen/mcore_gpt.py saves megatron-core 0.16.1's own tiny ``GPTModel`` (local layer spec)
on gloo at TP 1 x DP 2, and at TP 2 with SwiGLU, RoPE and tied embeddings, with stacked layers
and with ``singleton_local_shards``, beside a plain Adam's state as Megatron-Core shards it
(``optimizer.state.<name>.<key>``). Its truth is the full tensor of every key, gathered from
the ShardedTensors by their own global offsets; the first test ties that truth to the model's
own ``state_dict`` on each rank. zerofast's ``reconstruct`` (eager and lazy) and ``export``
must give exactly the truth's weights, bit for bit, and nothing of the optimizer;
``optimizer_state`` the optimizer's, under the weights' names.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import zerofast

from tests.dsgen.mcore_gpt import HAVE_MCORE, ITERATION, MCORE_VERSION, VARIANTS
from tests.helpers import assert_bitwise_equal

pytestmark = pytest.mark.skipif(not HAVE_MCORE, reason=f"megatron-core ({MCORE_VERSION} tested) is not installed: "
                                                       "pip install megatron-core==" + MCORE_VERSION)
STACKED = [v for v, spec in VARIANTS.items() if not spec["singleton"]]

# How Megatron-Core's tensor parallelism cuts a weight of the model's state_dict, by the end of
# its name: the dimension split between the TP ranks; any other is whole on every rank.
COLUMN = ("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight", "linear_qkv.bias",
          "linear_fc1.weight", "linear_fc1.bias")
ROW = ("linear_proj.weight", "linear_fc2.weight")


@functools.lru_cache(maxsize=None)
def made(variant: str) -> Path:
    from tests.dsgen.mcore_gpt import ensure_mcore_gpt

    return ensure_mcore_gpt(variant)


@functools.lru_cache(maxsize=None)
def _load(variant: str, name: str) -> dict[str, torch.Tensor]:
    return torch.load(made(variant) / name, weights_only=True)


def truth(variant: str) -> dict[str, torch.Tensor]:
    return _load(variant, "truth.pt")


def layout(variant: str) -> dict:
    return json.loads((made(variant) / "layout.json").read_text())


def _full(variant: str, name: str) -> torch.Tensor:
    """The whole of the model's ``name`` from the TP ranks' own state_dicts."""
    spec = VARIANTS[variant]
    ranks = [_load(variant, f"model_state_rank{r}.pt")[name] for r in range(spec["world"])]
    tp = spec["tp"]
    if tp == 1 or not name.endswith(COLUMN + ROW):  # whole on every rank (DP replicas, TP-replicated)
        for other in ranks[1:]:
            assert_bitwise_equal(other, ranks[0], f"{name}: replicas")
        return ranks[0]
    local = ranks[:tp]  # world 2 at TP 2: the ranks are the TP ranks
    if spec["glu"] and ".linear_fc1." in name:
        # Each rank holds [w_r; v_r]; the save lays the whole out as [w_0, w_1, ..., v_0, v_1, ...]
        halves = [t.chunk(2, 0) for t in local]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], 0)
    return torch.cat(local, 0 if name.endswith(COLUMN) else 1)


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_truth_is_the_models_own_state_dict(variant):
    """Every weight of the model's state_dict is in the truth, where the layout says (its layer
    of a stacked key, or its own key; SwiGLU's halves under weight_w / weight_v with
    singleton_local_shards), and the truth holds nothing else."""
    want = truth(variant)
    seen = set()
    for name, pieces in layout(variant)["layout"].items():
        full = _full(variant, name)
        keys = list(dict.fromkeys(p[0] for p in pieces))
        parts = [full] if len(keys) == 1 else full.chunk(len(keys), 0)
        layer = pieces[0][1]
        for key, part in zip(keys, parts):
            got = want[key] if layer is None else want[key][layer]
            assert_bitwise_equal(got, part, f"{name} -> {key}[{layer}]")
            seen.add(key)
    assert seen == set(want)
    spec = VARIANTS[variant]
    stacked = [k for k in want if k.startswith("decoder.layers.")]
    if spec["singleton"]:
        assert all(k.split(".")[2].isdigit() for k in stacked)
        assert ("decoder.layers.0.mlp.linear_fc1.weight_w" in want) == spec["glu"]
    else:
        assert all(want[k].shape[0] == 2 for k in stacked)
    assert ("output_layer.weight" in want) != spec["tied"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_weights_come_back_bit_for_bit(variant):
    want = truth(variant)
    root = made(variant) / "root"  # latest_checkpointed_iteration.txt names iter_0000001
    got = zerofast.reconstruct(root, dtype=None)
    assert list(got) == list(want)  # the model's order; no optimizer.*, nothing of common.pt
    lazy = zerofast.reconstruct(root, dtype=None, lazy=True)
    assert sorted(lazy) == sorted(want)
    tagged = zerofast.reconstruct(root, dtype=None, tag=f"iter_{ITERATION:07d}", lazy=True)
    for name, value in want.items():
        assert_bitwise_equal(got[name], value, name)
        assert_bitwise_equal(lazy[name], value, name)
        assert_bitwise_equal(tagged[name], value, name)


@pytest.mark.parametrize("variant", VARIANTS)
def test_export_holds_the_weights_only(variant, tmp_path):
    out = tmp_path / "hf"
    zerofast.export(made(variant) / "root", out, dtype=None, max_shard_size="8KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1
    got = {}
    for name in files:
        got.update(load_file(out / name))
    want = truth(variant)
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert_bitwise_equal(got[name], value, name)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("state", ["exp_avg", "exp_avg_sq"])
def test_optimizer_state_comes_back_under_the_weights_names(variant, state):
    """Megatron-Core's sharded Adam state (optimizer.state.<name>.<key>, sharded like the weight;
    fully_sharded_model_space to zerofast), apart from the weights."""
    prefix = f"optimizer.state.{state}."
    want = {k[len(prefix):]: v for k, v in _load(variant, "optimizer_truth.pt").items() if k.startswith(prefix)}
    assert sorted(want) == sorted(truth(variant))
    for lazy in (False, True):
        got = zerofast.optimizer_state(made(variant) / "root", state, dtype=None, lazy=lazy)
        assert sorted(got) == sorted(want)
        for name, value in want.items():
            assert_bitwise_equal(got[name], value, name)


@pytest.mark.parametrize("variant", STACKED)
def test_unstack_layers_gives_each_layer_its_slice(variant, tmp_path, monkeypatch):
    want = truth(variant)
    monkeypatch.setenv("ZEROFAST_UNSTACK_LAYERS", "1")
    got = zerofast.reconstruct(made(variant) / "root", dtype=None)
    expected = {}
    for key, value in want.items():
        if key.startswith("decoder.layers."):
            for i in range(value.shape[0]):
                expected[f"decoder.layers.{i}.{key[len('decoder.layers.'):]}"] = value[i]
        else:
            expected[key] = value
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        assert_bitwise_equal(got[name], value, name)
    zerofast.export(made(variant) / "root", tmp_path / "hf", dtype=None)
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(exported) == sorted(expected)
    for name, value in expected.items():
        assert_bitwise_equal(exported[name], value, name)


def test_singleton_local_shards_is_the_stacked_save_per_layer():
    """The same model and step, saved both ways: zerofast's per-layer reading of the stacked save
    is the singleton_local_shards save, SwiGLU's linear_fc1 there cut into its w and v halves."""
    stacked = zerofast.reconstruct(made("tp2_stacked") / "root", dtype=None)
    single = zerofast.reconstruct(made("tp2_singleton") / "root", dtype=None)
    matched = set()
    for key, value in stacked.items():
        if not key.startswith("decoder.layers."):
            assert_bitwise_equal(single[key], value, key)
            matched.add(key)
            continue
        tail = key[len("decoder.layers."):]
        for i in range(value.shape[0]):
            name = f"decoder.layers.{i}.{tail}"
            if name in single:
                assert_bitwise_equal(single[name], value[i], name)
                matched.add(name)
            else:  # linear_fc1.weight / .bias: [w; v]
                w, v = value[i].chunk(2, 0)
                assert_bitwise_equal(single[name + "_w"], w, name + "_w")
                assert_bitwise_equal(single[name + "_v"], v, name + "_v")
                matched.update((name + "_w", name + "_v"))
    assert matched == set(single)
