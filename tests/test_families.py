"""Mixture-of-experts and pipeline-parallel checkpoints that real DeepSpeed 0.19.8 wrote on the CPU
(tests/dsgen/families.py), judged bit for bit against the live engine's own values
(safe_get_full_fp32_param, the wrappers' fp32 masters, the optimizer's state) gathered in the run."""
from __future__ import annotations

import functools
import importlib.util
import json
import os

import pytest
import torch
from safetensors.torch import load_file

import zerofast
from zerofast.cli import describe, main

from tests.conftest import HAVE_DEEPSPEED
from tests.dsgen.families import FAMILY_LAYOUTS
from tests.helpers import assert_bitwise_equal, expected_value, real_root, real_truth

HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
_needs_transformers = pytest.mark.skipif(not HAVE_TRANSFORMERS,
                                         reason="AutoTP checkpoints are made from a transformers model")
LAYOUTS = [pytest.param(n, marks=_needs_transformers) if n.startswith("autotp_") else n for n in sorted(FAMILY_LAYOUTS)]
MOE = [n for n in sorted(FAMILY_LAYOUTS) if n.startswith("moe_")]
PIPE = [n for n in sorted(FAMILY_LAYOUTS) if n.startswith("pipe_")]
AUTOTP = [n for n in LAYOUTS if not isinstance(n, str)]
DTYPES = [None, torch.float32, torch.bfloat16]

pytestmark = pytest.mark.skipif(not HAVE_DEEPSPEED, reason="DeepSpeed 0.19.8 makes the real checkpoints")


@functools.lru_cache(maxsize=None)
def _truth(layout: str) -> dict:
    """The run's ground truth under the names the checkpoint can give. A ZeRO-off pipeline save
    records no parameter names (``param_shapes`` is None), so nothing says that layer 0's file holds
    the tied module: its tensors keep their layer name, ``0.weight`` (the sequential model's)."""
    truth = real_truth(layout)
    if truth["spec"]["family"] != "pipe" or truth["stage"] != 0:
        return truth
    rename = {n: "0." + n.removeprefix("tied_modules.embed.") for n in truth["state_dict_keys"]
              if n.startswith("tied_modules.embed.")}
    out = dict(truth)
    for part in ("trainable", "frozen", "buffers"):
        out[part] = {rename.get(n, n): v for n, v in truth[part].items()}
    out["state_dict_keys"] = [rename.get(n, n) for n in truth["state_dict_keys"]]
    return out


def _stored(truth) -> dict:
    return {**truth["trainable"], **truth["frozen"], **truth["buffers"]}


def _check_state_dict(sd, truth, dtype) -> None:
    assert list(sd) == truth["state_dict_keys"]
    want = _stored(truth)
    for name in truth["state_dict_keys"]:
        source = truth["tied"].get(name, name)
        assert_bitwise_equal(sd[name], expected_value(want[source], dtype), name)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_reconstruct_matches_deepspeed(layout, dtype):
    truth = _truth(layout)
    sd = zerofast.reconstruct(real_root(layout), dtype=dtype)
    _check_state_dict(sd, truth, dtype)
    for alias, source in truth["tied"].items():
        assert sd[alias] is sd[source]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_lazy_matches_deepspeed(layout):
    truth = _truth(layout)
    lazy = zerofast.reconstruct(real_root(layout), dtype=None, lazy=True)
    assert isinstance(lazy, zerofast.LazyStateDict)
    want = _stored(truth)
    for name in truth["state_dict_keys"]:
        value = want[truth["tied"].get(name, name)]
        assert lazy.meta(name).shape == value.shape and lazy.meta(name).dtype == value.dtype
    _check_state_dict(lazy, truth, None)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_exclude_frozen(layout):
    truth = _truth(layout)
    if truth["spec"]["family"] == "pipe" and truth["stage"] == 0:
        with pytest.raises(zerofast.UnsupportedCheckpointError, match="does not record which parameters are frozen"):
            zerofast.reconstruct(real_root(layout), exclude_frozen=True)
        return
    sd = zerofast.reconstruct(real_root(layout), exclude_frozen=True)
    assert list(sd) == [n for n in truth["state_dict_keys"] if truth["tied"].get(n, n) not in truth["frozen"]]


@pytest.mark.parametrize("key", ["exp_avg", "exp_avg_sq"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_optimizer_state_matches_the_engine(layout, key):
    """Expert params: the truth is the base optimizer's own state (DeepSpeed's
    safe_get_full_optimizer_state raises for them); the others: safe_get_full_optimizer_state."""
    truth = _truth(layout)
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


@pytest.mark.parametrize("layout", LAYOUTS)
def test_export_loads_with_plain_safetensors(layout, tmp_path):
    truth = _truth(layout)
    opt = truth["stage"] != 0
    zerofast.export(real_root(layout), tmp_path / "out", dtype=torch.bfloat16, max_shard_size="2KB",
                    optimizer_states=opt)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    loaded = {}
    for shard in sorted(set(index["weight_map"].values())):
        loaded.update(load_file(tmp_path / "out" / shard))
    assert len(set(index["weight_map"].values())) > 1
    want = _stored(truth)
    assert sorted(loaded) == sorted(n for n in truth["state_dict_keys"] if n not in truth["tied"])
    for name, value in loaded.items():
        assert_bitwise_equal(value, expected_value(want[name], torch.bfloat16), name)
    assert json.loads(index["metadata"].get("zerofast_tied", "{}")) == truth["tied"]
    if opt:
        states = {}
        for shard in (tmp_path / "out").glob("optimizer*.safetensors"):
            states.update(load_file(shard))
        assert len(states) == 2 * len(truth["optimizer_states"]["exp_avg"])
        for name, value in truth["optimizer_states"]["exp_avg"].items():
            assert_bitwise_equal(states[f"{name}.exp_avg"], value, name)


@pytest.mark.parametrize("layout", MOE)
def test_moe_loads_into_the_single_process_model(layout):
    """Global expert ids: the names of the same model built with ep_size=1."""
    from tests.dsgen.family_models import build_moe

    truth = _truth(layout)
    model = build_moe(1)
    assert list(model.state_dict()) == truth["state_dict_keys"]
    result = zerofast.load_into(model, real_root(layout))
    assert not result.missing_keys and not result.unexpected_keys
    want = _stored(truth)
    for name, value in model.state_dict().items():
        assert_bitwise_equal(value, expected_value(want[truth["tied"].get(name, name)], torch.float32), name)
    assert model.lm_head.weight is model.embed.weight


@pytest.mark.parametrize("layout", AUTOTP)
def test_autotp_loads_into_the_full_model(layout):
    """Shards merged to the full shapes of the model built on one process."""
    from tests.dsgen.family_models import build_llama

    truth = _truth(layout)
    model = build_llama()
    result = zerofast.load_into(model, real_root(layout))
    assert not result.missing_keys and not result.unexpected_keys
    want = _stored(truth)
    for name, value in model.state_dict().items():
        assert_bitwise_equal(value, expected_value(want[name], torch.float32), name)


@pytest.mark.parametrize("layout", PIPE)
def test_pipeline_names_map_to_the_sequential_model(layout):
    from tests.dsgen.family_models import build_sequential

    truth = _truth(layout)
    mapping = zerofast.sequential_names(real_root(layout))
    assert list(mapping) == truth["state_dict_keys"]
    sd = zerofast.reconstruct(real_root(layout))
    model = build_sequential()
    result = model.load_state_dict({mapping[k]: v for k, v in sd.items()}, strict=False)
    # The head (layer 5) reuses the embedding's Parameter; the checkpoint saves it once.
    assert result.missing_keys == ["5.weight"] and not result.unexpected_keys
    assert set(mapping.values()) | {"5.weight"} == set(truth["sequential_keys"])
    for name, value in sd.items():
        assert_bitwise_equal(model.state_dict()[mapping[name]], value, name)


@pytest.mark.parametrize("layout", PIPE)
def test_pipeline_load_into_a_module_with_pipeline_names(layout):
    """load_into works on a model whose names are PipelineModule's (layers by index, tied_modules)."""
    from tests.dsgen.family_models import build_sequential

    truth = _truth(layout)
    seq = build_sequential()
    model = torch.nn.Module()
    for i in range(1, 5):
        model.add_module(str(i), seq[i])
    if truth["stage"] == 0:
        model.add_module("0", seq[0])  # see _truth: no tied_modules names at ZeRO off
    else:
        model.tied_modules = torch.nn.ModuleDict({"embed": seq[0]})
    result = zerofast.load_into(model, real_root(layout))
    assert not result.missing_keys and not result.unexpected_keys
    want = _stored(truth)
    for name, value in model.state_dict().items():
        assert_bitwise_equal(value, expected_value(want[name], torch.float32), name)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_inspect_shows_the_parallel_layout(layout, capsys):
    truth = _truth(layout)
    spec = truth["spec"]
    p = describe(real_root(layout))["parallelism"]
    assert p["dp"] == truth["layout"]["dp"]
    if spec["family"] == "moe":
        assert p["ep"] == spec["ep"] and p["experts_per_layer"] == truth["layout"]["experts"]
    elif spec["family"] in ("autotp", "megatron"):
        assert p["tp"] == spec["tp"]
        assert p["family"] == ("tensor-parallel (Megatron-DeepSpeed)" if spec["family"] == "megatron"
                               else "tensor-parallel (AutoTP)")
        if spec["family"] == "megatron":  # each parameter's rule, as ds_to_universal would take it
            rules = p["tp_rules"]
            assert set(rules) == set(truth["trainable"])
            assert rules["language_model.embedding.word_embeddings.weight"] == "joined on dim 0 (first 21 rows: vocabulary)"
            assert rules["language_model.encoder.final_layernorm.weight"] == "replicated"
            assert rules["language_model.encoder.layers.0.mlp.dense_h_to_4h.weight"] == "two sub-params joined on dim 0"
            assert rules["language_model.encoder.layers.0.self_attention.dense.weight"] == "joined on dim 1"
    else:
        assert p["pp"] == spec["pp"]
        owners = truth["layout"]["layer_stage"]
        for stage, layers in enumerate(p["stages"]):
            assert all(owners[i] == stage or i in p["tied_layers"].values() for i in layers)
        assert p["tied_layers"] == ({} if truth["stage"] == 0 else {"embed": 0})
    assert main(["inspect", str(real_root(layout))]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("parallelism"))
    assert {"moe": "ep ", "pipe": "pp ", "autotp": "tp ", "megatron": "tp "}[spec["family"]] in line


@pytest.mark.parametrize("layout", LAYOUTS)
def test_compat_api(layout, tmp_path):
    from zerofast.compat import convert_zero_checkpoint_to_fp32_state_dict, get_fp32_state_dict_from_zero_checkpoint

    truth = _truth(layout)
    _check_state_dict(get_fp32_state_dict_from_zero_checkpoint(str(real_root(layout))), truth, torch.float32)
    convert_zero_checkpoint_to_fp32_state_dict(str(real_root(layout)), str(tmp_path), safe_serialization=True)
    loaded = load_file(tmp_path / "model.safetensors")
    want = _stored(truth)
    for name, value in loaded.items():
        assert_bitwise_equal(value, expected_value(want[name], torch.float32), name)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_deepspeeds_own_converter_cannot_read_them(layout):
    """The claim of docs/formats.md: DeepSpeed 0.19.8's zero_to_fp32 raises on every one of these saves (MoE:
    "layer_0_expert_0_... is not a model state checkpoint"; pipeline: 'NoneType' object has no
    attribute 'items'; AutoTP: "Expected 1 of '*_optim_states.pt' ... but found 2 files")."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with pytest.raises((ValueError, AttributeError)):
        get_fp32_state_dict_from_zero_checkpoint(str(real_root(layout)))


def test_experts_combined_with_another_family_are_refused(tmp_path):
    """Each family is read on its own: experts next to pipeline stages would be dropped silently."""
    import shutil

    root = tmp_path / "ckpt"
    shutil.copytree(real_root("pipe_s1_bf16_pp2_dp1"), root)
    expert = next((real_root("moe_s2_bf16_w2_ep2") / "global_step2").glob("layer_0_expert_0_*"))
    shutil.copy(expert, root / "global_step2" / expert.name)
    with pytest.raises(zerofast.UnsupportedCheckpointError, match="together with pipeline or tensor parallelism"):
        zerofast.reconstruct(root)


@pytest.mark.parametrize("pattern, name", [
    (r"^model\.layers\.0\.mlp\.down_proj\.weight$", "model.layers.0.mlp.down_proj.weight"),
    (r"^lm_head\.weight$", "lm_head.weight"),
    (r"^model\.layers\.\d+\.w$", None),  # a real regex: refused, never run
    (r"^model\.layers\.\dx$", None),  # \d is a digit class, not "d"
    (r"^(a+)+$", None),
    ("model.norm.weight", None),
])
def test_autotp_patterns_are_read_as_literal_names(pattern, name):
    """The affine_map's patterns come with the checkpoint: zerofast reads the names they spell and
    never runs them as regular expressions."""
    from zerofast.layouts.autotp import _literal

    if name is None:
        with pytest.raises(zerofast.UnsupportedCheckpointError, match="expected AutoTP parameter patterns"):
            _literal("model_states.pt", pattern)
    else:
        assert _literal("model_states.pt", pattern) == name
