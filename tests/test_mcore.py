"""Megatron-Core ``dist_checkpointing`` folders (torch_dist backend, issue 48 section 2).

Real saves by megatron-core 0.16.1 at TP 2 on gloo (tests/dsgen/mcore.py: hand-made sharded
tensors split on dim 0, 1 and 2, replicated bf16, stacked layers, optimizer state, byte entries),
judged bit for bit against the full tensors the job cut the shards from; a 0.13-style flattened
tensor (``mcore_data``) made by torch's own ``dcp.save`` and a rewritten ``.metadata``; and
``.metadata`` files whose plans carry more than plain data, refused with nothing run.
"""
from __future__ import annotations

import json
import pickle
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import zerofast
from zerofast.base.errors import UnsafeCheckpointError, UnsupportedCheckpointError
from zerofast.cli import main

from tests.dsgen.mcore import HAVE_MCORE, ITERATION, MCORE_VERSION, full_tensors
from tests.helpers import assert_bitwise_equal

ORIG_SHAPE = "nd_reformulated_orig_global_shape"
MCORE_JSON = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
              "common_backend_version": 1}
needs_mcore = pytest.mark.skipif(not HAVE_MCORE, reason=f"megatron-core ({MCORE_VERSION} tested) is not installed: "
                                                        "pip install megatron-core==" + MCORE_VERSION)


@pytest.fixture(scope="module")
def root() -> Path:
    from tests.dsgen.mcore import ensure_mcore

    return ensure_mcore()


def _truth(root: Path) -> dict[str, torch.Tensor]:
    return torch.load(root.parent / "truth.pt", weights_only=True)


@needs_mcore
def test_weights_come_back_bit_for_bit_from_the_latest_iteration(root):
    truth = _truth(root)
    want = full_tensors()
    got = zerofast.reconstruct(root, dtype=None)  # latest_checkpointed_iteration.txt names iter_0000010
    assert sorted(got) == sorted(want)  # no optimizer.*, no rng_state byte entries, nothing of common.pt
    lazy = zerofast.reconstruct(root, dtype=None, lazy=True)
    for name, value in want.items():
        assert_bitwise_equal(truth[name], value, name)
        assert_bitwise_equal(got[name], value, name)
        assert_bitwise_equal(lazy[name], value, name)
    older = zerofast.reconstruct(root, tag="iter_0000005", dtype=None)
    assert_bitwise_equal(older["embedding.word_embeddings.weight"], want["embedding.word_embeddings.weight"] * 2)


@needs_mcore
def test_export_holds_the_weights_only(root, tmp_path):
    out = tmp_path / "hf"
    assert main(["export", str(root), str(out), "--dtype", "keep", "--max-shard-size", "500B", "--quiet"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    got = {}
    for name in sorted(set(index["weight_map"].values())):
        got.update(load_file(out / name))
    want = full_tensors()
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert_bitwise_equal(got[name], value, name)


@needs_mcore
def test_optimizer_state_is_mapped_to_parameter_names(root):
    """fully_sharded_model_space (optimizer.state.<key>.<param>) comes back under the parameters'
    names; the flat dp_reshardable buffers beside it are left out with a warning."""
    truth = _truth(root)
    with pytest.warns(UserWarning, match="dp_reshardable"):
        states = zerofast.optimizer_state(root, "exp_avg", dtype=None)
    want = {k[len("optimizer.state.exp_avg."):]: v for k, v in truth.items() if k.startswith("optimizer.state.exp_avg.")}
    assert list(states) == list(want) and want
    for name, value in want.items():
        assert_bitwise_equal(states[name], value, name)
    with pytest.raises(UnsupportedCheckpointError, match="expected optimizer state 'exp_avg_sq'"), \
            pytest.warns(UserWarning):
        zerofast.optimizer_state(root, "exp_avg_sq")


@needs_mcore
def test_unstack_layers_names_each_layer(root, tmp_path, monkeypatch):
    """--unstack-layers / ZEROFAST_UNSTACK_LAYERS=1: a stacked key (L, ...) comes out as L tensors
    named decoder.layers.<i>...., each the stacked tensor's slice, in the eager dict, the export and
    the optimizer state."""
    truth = _truth(root)
    stacked = {k: v for k, v in truth.items() if ".layers." in k and not k.startswith("optimizer.")}
    assert stacked
    monkeypatch.setenv("ZEROFAST_UNSTACK_LAYERS", "1")
    sd = zerofast.reconstruct(root, dtype=None)
    for key, value in stacked.items():
        head, tail = key.split("layers.", 1)
        for i in range(value.shape[0]):
            assert_bitwise_equal(sd[f"{head}layers.{i}.{tail}"], value[i], f"{key}[{i}]")
    assert not set(stacked) & set(sd)
    with pytest.warns(UserWarning):
        moments = zerofast.optimizer_state(root, "exp_avg", dtype=None)
    value = truth["optimizer.state.exp_avg.decoder.layers.self_attention.linear_proj.weight"]
    for i in range(value.shape[0]):
        assert_bitwise_equal(moments[f"decoder.layers.{i}.self_attention.linear_proj.weight"], value[i], str(i))
    monkeypatch.delenv("ZEROFAST_UNSTACK_LAYERS")
    assert main(["export", str(root), str(tmp_path / "hf"), "--unstack-layers"]) == 0
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert set(exported) == set(sd)
    for name, value in sd.items():
        assert_bitwise_equal(exported[name], value.float() if value.is_floating_point() else value, name)


@needs_mcore
def test_the_unstack_keyword_wins_over_the_variable(root, tmp_path, monkeypatch):
    """unstack_layers=True with the variable unset, and False with it set: the call's keyword is
    what counts, in the eager and lazy dicts and the export, and only for that call."""
    stacked = [k for k in _truth(root) if ".layers." in k and not k.startswith("optimizer.")]
    monkeypatch.delenv("ZEROFAST_UNSTACK_LAYERS", raising=False)
    per_layer = zerofast.reconstruct(root, dtype=None, unstack_layers=True)
    lazy = zerofast.reconstruct(root, dtype=None, lazy=True, unstack_layers=True)
    assert list(lazy) == list(per_layer) and not set(stacked) & set(per_layer)
    for name, value in per_layer.items():
        assert_bitwise_equal(lazy[name], value, name)
    result = zerofast.export(root, tmp_path / "hf", unstack_layers=True)
    assert set(load_file(tmp_path / "hf" / result.files[0])) == set(per_layer)
    assert set(stacked) <= set(zerofast.reconstruct(root, dtype=None))  # the call after: as stored
    monkeypatch.setenv("ZEROFAST_UNSTACK_LAYERS", "1")
    assert set(stacked) <= set(zerofast.reconstruct(root, dtype=None, unstack_layers=False))
    with pytest.raises(zerofast.SettingsError, match="unstack_layers= expects True or False"):
        zerofast.reconstruct(root, unstack_layers="yes")


@needs_mcore
def test_inspect_names_the_backend_and_the_layers(root, capsys):
    assert main(["inspect", str(root)]) == 0
    text = capsys.readouterr().out
    assert f"iter_{ITERATION:07d}" in text
    assert "Megatron-Core dist_checkpointing (torch_dist)" in text and "stacked" in text
    assert main(["inspect", str(root), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["backend"].endswith("(torch_dist)") and report["layers"].startswith("stacked")
    assert "dp_reshardable" in report["optimizer_state"]


# ---------------------------------------------------------------------------------------------
# Folders made with torch's dcp.save and a rewritten .metadata (no megatron-core needed)

def _save(folder: Path, state: dict) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # single-process save: torch warns that no process group is set up
        dcp.save(state, checkpoint_id=str(folder))
    (folder / "metadata.json").write_text(json.dumps(MCORE_JSON))


def _rewrite_metadata(folder: Path, change) -> None:
    path = folder / ".metadata"
    meta = pickle.loads(path.read_bytes())  # our own file, written just above
    change(meta)
    path.write_bytes(pickle.dumps(meta))


def test_a_flattened_tensor_comes_back_in_its_real_shape(tmp_path):
    """Megatron-Core 0.13 stored a (4, 6) tensor cut in 2 x 3 boxes of (2, 2) as (2, 3, 4)."""
    real = torch.arange(24, dtype=torch.float32).reshape(4, 6) * 1.5
    stored = real.reshape(2, 2, 3, 2).permute(0, 2, 1, 3).reshape(2, 3, 4).contiguous()
    _save(tmp_path, {"w": stored, "plain": real.clone()})
    _rewrite_metadata(tmp_path, lambda m: setattr(m, "mcore_data", {"w": {ORIG_SHAPE: (4, 6)}}))
    got = zerofast.reconstruct(tmp_path, dtype=None)
    assert_bitwise_equal(got["w"], real, "w")
    assert_bitwise_equal(zerofast.reconstruct(tmp_path, dtype=None, lazy=True)["w"], real, "w")
    _rewrite_metadata(tmp_path, lambda m: setattr(m, "mcore_data", {"w": {ORIG_SHAPE: (4, 5)}}))
    with pytest.raises(zerofast.ZeroFastError, match="no flattening of the real shape"):
        zerofast.reconstruct(tmp_path)


def test_plans_of_plain_data_are_read(tmp_path):
    from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType
    from torch.distributed.checkpoint.metadata import MetadataIndex

    w = torch.randn(3, 4)
    _save(tmp_path, {"w": w})
    plan = SavePlan([WriteItem(MetadataIndex("w", torch.Size([0, 0])), WriteItemType.TENSOR)], planner_data={})
    _rewrite_metadata(tmp_path, lambda m: setattr(m, "all_local_plans", [plan]))
    assert_bitwise_equal(zerofast.reconstruct(tmp_path, dtype=None)["w"], w, "w")


class _Runs:
    """Pickles as a call of print: what a hostile plan would carry."""

    def __reduce__(self):
        return (print, ("planted code ran",))


class _OddEnum:
    def __reduce__(self):
        from torch.distributed.checkpoint.planner import WriteItemType

        return (WriteItemType, (99,))


@pytest.mark.parametrize("payload,match", [
    (_Runs(), "refused pickle global 'builtins.print'"),
    (_OddEnum(), "WriteItemType.*expects 1, 2 or 3"),
    ({"depth": [[[[[1]]]]]}, "not plain data"),
], ids=["code", "enum", "deep"])
def test_plans_carrying_anything_but_plain_data_are_refused(tmp_path, capsys, payload, match):
    from torch.distributed.checkpoint.planner import SavePlan

    w = torch.randn(3, 4)
    _save(tmp_path, {"w": w})
    _rewrite_metadata(tmp_path, lambda m: setattr(m, "all_local_plans", [SavePlan([], planner_data=payload)]))
    with pytest.raises(UnsafeCheckpointError, match=match):
        zerofast.reconstruct(tmp_path)
    assert "planted code ran" not in capsys.readouterr().out


def test_megatron_stand_ins_hold_fields_only(tmp_path):
    """An MCoreSavePlan is a record of fields: a field named like a method is refused."""
    from zerofast.load.dcp_stand_ins import DCP_ALLOWED
    from zerofast.load.stand_ins import RefusedState

    plan = DCP_ALLOWED["megatron.core.dist_checkpointing.strategies.torch.MCoreSavePlan"]()
    plan.__setstate__({"items": [], "mcore_data": {"w": {"nd_reformulated_orig_global_shape": (4, 6)}}})
    assert plan.get("mcore_data")["w"]["nd_reformulated_orig_global_shape"] == (4, 6)
    with pytest.raises(RefusedState):
        DCP_ALLOWED["megatron.core.dist_checkpointing.strategies.torch.MCoreSavePlan"]().__setstate__({"get": 1})


def test_a_foreign_backend_is_refused_by_name(tmp_path):
    _save(tmp_path, {"w": torch.randn(2)})
    (tmp_path / "metadata.json").write_text(json.dumps({**MCORE_JSON, "sharded_backend": "zarr"}))
    with pytest.raises(UnsupportedCheckpointError, match="'zarr' backend"):
        zerofast.reconstruct(tmp_path)
