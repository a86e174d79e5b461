"""Megatron-DeepSpeed-style tensor-parallel saves (TP x DP, an ``mpu``, no Megatron installed) that
real DeepSpeed 0.19.8 wrote on the CPU (tests/dsgen/train_megatron.py).

The generator's own invariants: the files are named and shaped as a Megatron-DeepSpeed save, the
ground truth holds the full (vocabulary-trimmed) tensors, and DeepSpeed's own ds_to_universal, where
it ran on the save, gives the same full tensors bit for bit. Then zerofast on the variants
(tests/dsgen/families.py's MEGATRON_VARIANTS): replicated copies that drifted apart (refused, or
averaged when asked), parameters named for averaging, a save without universal_checkpoint_info, a
save written as Megatron-DeepSpeed's save_checkpoint writes it; and zerofast against
ds_to_universal's output, bit for bit, on every save it ran on."""
from __future__ import annotations

import argparse
import functools
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy
import pytest
import torch
from safetensors.torch import load_file

import zerofast

from tests.conftest import needs_deepspeed
from tests.dsgen.families import FAMILY_LAYOUTS, MEGATRON_VARIANTS, ensure_megatron_variant
from tests.helpers import assert_bitwise_equal, expected_value, real_root, real_truth

pytestmark = needs_deepspeed

REPO = Path(__file__).resolve().parent.parent
MEGATRON = sorted(n for n, s in FAMILY_LAYOUTS.items() if s["family"] == "megatron")
# the frozen variants have their own file (tests/test_megatron_frozen.py): here every parameter trains
VARIANTS = sorted(n for n, spec in MEGATRON_VARIANTS.items() if not spec.get("frozen"))
EVERY = MEGATRON + VARIANTS
DRIFT = [n for n in VARIANTS if MEGATRON_VARIANTS[n].get("drift") and not MEGATRON_VARIANTS[n].get("average")]
AVERAGE = [n for n in VARIANTS if MEGATRON_VARIANTS[n].get("average")]
NO_INFO = [n for n in VARIANTS if MEGATRON_VARIANTS[n].get("universal_checkpoint_info") is False]
MEGATRON_SAVE = [n for n in VARIANTS if MEGATRON_VARIANTS[n].get("megatron_save")]
KEYS = ("exp_avg", "exp_avg_sq")
DTYPES = [None, torch.float32, torch.bfloat16]
TP_REPLICATED_ENV = "ZEROFAST_TP_REPLICATED"

VOCAB, PADDED_VOCAB, HIDDEN, FFN, MAX_POS = 21, 24, 8, 12, 8


def _full_shapes() -> dict:
    """Megatron-DeepSpeed GPT names (``--no-pipeline-parallel``) -> full shape, the vocabulary trimmed."""
    shapes = {"language_model.embedding.word_embeddings.weight": (VOCAB, HIDDEN),
              "language_model.embedding.position_embeddings.weight": (MAX_POS, HIDDEN)}
    for i in range(2):
        layer = f"language_model.encoder.layers.{i}."
        shapes.update({
            layer + "input_layernorm.weight": (HIDDEN,), layer + "input_layernorm.bias": (HIDDEN,),
            layer + "self_attention.query_key_value.weight": (3 * HIDDEN, HIDDEN),
            layer + "self_attention.query_key_value.bias": (3 * HIDDEN,),
            layer + "self_attention.dense.weight": (HIDDEN, HIDDEN), layer + "self_attention.dense.bias": (HIDDEN,),
            layer + "post_attention_layernorm.weight": (HIDDEN,), layer + "post_attention_layernorm.bias": (HIDDEN,),
            layer + "mlp.dense_h_to_4h.weight": (2 * FFN, HIDDEN), layer + "mlp.dense_h_to_4h.bias": (2 * FFN,),
            layer + "mlp.dense_4h_to_h.weight": (HIDDEN, FFN), layer + "mlp.dense_4h_to_h.bias": (HIDDEN,),
        })
    shapes["language_model.encoder.final_layernorm.weight"] = (HIDDEN,)
    shapes["language_model.encoder.final_layernorm.bias"] = (HIDDEN,)
    return shapes


FULL_SHAPES = _full_shapes()


def _spec(layout: str) -> dict:
    return FAMILY_LAYOUTS[layout] if layout in FAMILY_LAYOUTS else MEGATRON_VARIANTS[layout]


def _root(layout: str) -> Path:
    """The cached save (made on first use): the catalog's, or a variant's."""
    return real_root(layout) if layout in FAMILY_LAYOUTS else ensure_megatron_variant(layout)


@functools.lru_cache(maxsize=None)
def _truth(layout: str) -> dict:
    if layout in FAMILY_LAYOUTS:
        return real_truth(layout)
    return torch.load(_root(layout) / "ground_truth.pt", weights_only=True)


def _degrees(layout: str) -> tuple[int, int]:
    spec = _spec(layout)
    return spec["tp"], spec["world_size"] // spec["tp"]


def _tag_dir(layout: str):
    root = _root(layout)
    return root / (root / "latest").read_text().strip()


def _model_files(layout: str) -> list[str]:
    spec = _spec(layout)
    tp, dp = _degrees(layout)
    if spec["stage"] == 3:
        return [f"zero_pp_rank_{d}_mp_rank_{t:02d}_model_states.pt" for t in range(tp) for d in range(dp)]
    return [f"mp_rank_{t:02d}_model_states.pt" for t in range(tp)]


def _optim_files(layout: str) -> list[str]:
    spec = _spec(layout)
    tp, dp = _degrees(layout)
    prefix = "bf16_" if spec["dtype"] == "bf16" else ""
    return [f"{prefix}zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt" for t in range(tp) for d in range(dp)]


def _flatten(module: dict, prefix: str = "") -> dict:
    """Megatron's nested ``state_dict_for_save_checkpoint`` as flat names (keys joined with ".")."""
    out = {}
    for key, value in module.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


@pytest.mark.parametrize("layout", EVERY)
def test_files_named_by_tp_and_dp_rank(layout):
    names = set(os.listdir(_tag_dir(layout)))
    assert names == set(_model_files(layout)) | set(_optim_files(layout))


@pytest.mark.parametrize("layout", EVERY)
def test_model_states_carry_universal_checkpoint_info(layout):
    spec = _spec(layout)
    tp, dp = _degrees(layout)
    truth = _truth(layout)
    megatron_save = bool(spec.get("megatron_save"))
    for name in _model_files(layout):
        # Megatron's client state pickles argparse.Namespace and numpy's RNG state
        sd = torch.load(_tag_dir(layout) / name, map_location="cpu", weights_only=not megatron_save)
        if spec.get("universal_checkpoint_info") is False:
            assert "universal_checkpoint_info" not in sd and truth["universal_checkpoint_info"] is None
        else:
            assert sd["universal_checkpoint_info"] == truth["universal_checkpoint_info"], name
        assert sd["iteration"] == spec.get("steps", 2)
        assert sd["mp_world_size"] == tp and sd["dp_world_size"] == dp
        assert sd["checkpoint_parallel_dimensions"] == {"pp_degree": 1, "tp_degree": tp}
        # Every trainable parameter, under its Megatron name, with this tp rank's shard shape.
        shapes = {n: list(s) for group in sd["param_shapes"] for n, s in group.items()}
        assert shapes == truth["shard_shapes"]
        module = _flatten(sd["module"]) if megatron_save else sd["module"]
        assert list(module) == list(FULL_SHAPES)


@pytest.mark.parametrize("layout", EVERY)
def test_ground_truth_holds_full_tensors(layout):
    tp, dp = _degrees(layout)
    truth = _truth(layout)  # weights_only=True
    assert truth["layout"] == {"family": "megatron", "dp": dp, "tp": tp, "pp": 1}
    assert truth["state_dict_keys"] == list(FULL_SHAPES)
    assert truth["frozen"] == {} and truth["buffers"] == {} and truth["tied"] == {}
    assert (truth["original_vocab_size"], truth["padded_vocab_size"]) == (VOCAB, PADDED_VOCAB)
    assert set(truth["trainable"]) == set(FULL_SHAPES)
    for name, shape in FULL_SHAPES.items():
        values = [truth["trainable"][name]] + [truth["optimizer_states"][k][name] for k in KEYS]
        for v in values:
            assert v.dtype == torch.float32 and tuple(v.shape) == shape, (name, v.dtype, v.shape)
        # The shards put together are the full (padded) tensor.
        part = truth["tp_partition"][name]
        shard = truth["shard_shapes"][name]
        padded = (PADDED_VOCAB,) + shape[1:] if part["kind"] == "vocab" else shape
        if part["dim"] is None:
            assert tuple(shard) == padded, name
        else:
            want = list(padded)
            want[part["dim"]] //= tp
            assert shard == want, name
    # Training moved every parameter and gave it optimizer state.
    assert truth["optimizer_step"] == float(_spec(layout).get("steps", 2))
    assert all(truth["optimizer_states"]["exp_avg_sq"][n].abs().sum() > 0 for n in FULL_SHAPES)


def _ds_to_universal_error(layout: str) -> str | None:
    root = _root(layout)
    error = root / "ds_to_universal.error"
    if error.is_file():
        assert not (root / "universal").exists()
        return error.read_text().strip()
    return None


def _universal_tag_dir(layout: str):
    error = _ds_to_universal_error(layout)
    if error is not None:
        pytest.skip(f"DeepSpeed's ds_to_universal failed on {layout}: {error}")
    folder = _root(layout) / "universal"
    return folder / (folder / "latest_universal").read_text().strip()


def _load_state(path):
    from deepspeed.checkpoint.universal_checkpoint import SubparamShape  # beside parameter_with_sub_params

    with torch.serialization.safe_globals([SubparamShape]):
        obj = torch.load(path, map_location="cpu", weights_only=True)
    return obj["param"] if isinstance(obj, dict) else obj


@pytest.mark.parametrize("layout", EVERY)
def test_ds_to_universal_params_match_truth(layout):
    tag_dir = _universal_tag_dir(layout)
    truth = _truth(layout)
    for name, want in truth["trainable"].items():
        got = _load_state(tag_dir / "zero" / name / "fp32.pt")
        assert got.dtype == want.dtype and got.shape == want.shape, (name, got.dtype, got.shape)
        assert torch.equal(got, want), name


@pytest.mark.parametrize("layout", EVERY)
def test_ds_to_universal_optimizer_states_match_truth(layout):
    tag_dir = _universal_tag_dir(layout)
    truth = _truth(layout)
    for key in KEYS:
        for name, want in truth["optimizer_states"][key].items():
            got = _load_state(tag_dir / "zero" / name / f"{key}.pt")
            assert got.shape == want.shape and torch.equal(got, want), (key, name)


# -- the variants' own invariants ------------------------------------------------------------------

@pytest.mark.parametrize("layout", DRIFT + AVERAGE)
def test_drift_made_the_replicated_copies_differ(layout):
    """Exactly the layer norms and row-parallel biases drifted (masters and both moments), each
    copy differing from tp rank 0's; the truth holds their mean, (0 + s0 + s1) / 2 in fp32."""
    truth = _truth(layout)
    tp, _ = _degrees(layout)
    drifted = {n for n in FULL_SHAPES if "layernorm" in n or n.endswith(("dense.bias", "dense_4h_to_h.bias"))}
    assert set(truth["tp_copies"]) == drifted
    for key in KEYS:
        assert set(truth["tp_copies_optimizer"][key]) == drifted
    for name in drifted:
        for copies, want in [(truth["tp_copies"][name], truth["trainable"][name])] + [
                (truth["tp_copies_optimizer"][k][name], truth["optimizer_states"][k][name]) for k in KEYS]:
            assert len(copies) == tp and all(c.dtype == torch.float32 for c in copies)
            assert all(not torch.equal(c, copies[0]) for c in copies[1:]), name
            assert_bitwise_equal(want, _mean(copies), name)
    info = truth["universal_checkpoint_info"]
    listed = "parameter_to_average_patterns" if layout in AVERAGE else "tp_replicated_parameter_patterns"
    other = "tp_replicated_parameter_patterns" if layout in AVERAGE else "parameter_to_average_patterns"
    for name in drifted:
        assert any(re.match(p, name) for p in info[listed]), name
        assert not any(re.match(p, name) for p in info[other]), name


@pytest.mark.parametrize("layout", DRIFT + NO_INFO)
def test_ds_to_universal_refuses(layout):
    """DeepSpeed's converter itself refuses these saves (its assertion on the replicated copies;
    the required universal_checkpoint_info)."""
    error = _ds_to_universal_error(layout)
    assert error is not None and error.startswith("AssertionError"), error
    if layout in NO_INFO:
        assert "universal_checkpoint_info" in error, error


@pytest.mark.parametrize("layout", MEGATRON_SAVE)
def test_megatron_save_holds_megatrons_client_state(layout):
    """What Megatron-DeepSpeed's save_checkpoint (--no-pipeline-parallel) puts in every model-states
    file: its nested module, args, checkpoint_version, iteration, rng_state, and the pickle
    globals that weights_only refuses."""
    truth = _truth(layout)
    tp, dp = _degrees(layout)
    for t, name in enumerate(_model_files(layout)):
        path = _tag_dir(layout) / name
        found = set(torch.serialization.get_unsafe_globals_in_checkpoint(path))
        assert "argparse.Namespace" in found and any(g.startswith("numpy") for g in found), found
        sd = torch.load(path, map_location="cpu", weights_only=False)
        assert list(sd["module"]) == ["language_model"]
        assert list(sd["module"]["language_model"]) == ["embedding", "encoder"]
        assert list(sd["module"]["language_model"]["embedding"]) == ["word_embeddings", "position_embeddings"]
        flat = _flatten(sd["module"])
        assert list(flat) == list(FULL_SHAPES)
        if _spec(layout)["stage"] == 3:  # ZeRO-3 placeholders, nested as the rest
            assert all(v.numel() == 0 for v in flat.values())
        else:
            assert {n: list(v.shape) for n, v in flat.items()} == truth["shard_shapes"]
        args = sd["args"]
        assert isinstance(args, argparse.Namespace)
        assert (args.tensor_model_parallel_size, args.data_parallel_size, args.num_layers) == (tp, dp, 2)
        assert isinstance(args.data_path, list) and isinstance(args.deepspeed_config_dict, dict)
        assert sd["checkpoint_version"] == 3.0 and sd["iteration"] == _spec(layout).get("steps", 2)
        assert sd["universal_checkpoint_info"] == truth["universal_checkpoint_info"]
        (rng,) = sd["rng_state"]
        assert sorted(rng) == sorted(["random_rng_state", "np_rng_state", "torch_rng_state", "cuda_rng_state",
                                      "rng_tracker_states"])
        assert isinstance(rng["np_rng_state"][1], numpy.ndarray) and rng["cuda_rng_state"] is None


# -- zerofast on the variants ----------------------------------------------------------------------

def _mean(copies: list[torch.Tensor]) -> torch.Tensor:
    """ds_to_universal's average, ``sum(slices) / len(slices)``: (0 + s0 + s1) / 2 in fp32."""
    assert all(c.dtype == torch.float32 for c in copies)
    total = 0
    for c in copies:
        total = total + c
    return total / len(copies)


def _drifted(layout: str) -> list[str]:
    truth = _truth(layout)
    return [n for n in truth["state_dict_keys"] if n in truth["tp_copies"]]


def _without_tp_env() -> dict:
    return {k: v for k, v in os.environ.items() if k != TP_REPLICATED_ENV}


@pytest.mark.parametrize("layout", DRIFT)
def test_drifted_copies_are_refused(layout, monkeypatch):
    monkeypatch.delenv(TP_REPLICATED_ENV, raising=False)
    drifted = _drifted(layout)
    with pytest.raises(zerofast.InconsistentCheckpointError) as e:
        zerofast.reconstruct(_root(layout))
    message = str(e.value)
    assert "tp ranks 0 and 1" in message and "largest difference" in message, message
    assert any(repr(n) in message for n in drifted), message
    assert not any(repr(n) in message for n in FULL_SHAPES if n not in drifted), message


@pytest.mark.parametrize("layout", DRIFT)
def test_cli_refuses_drifted_copies_in_one_line(layout, tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "zerofast", "export", str(_root(layout)), str(out)],
                          capture_output=True, text=True, cwd=REPO, env=_without_tp_env(), timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("zerofast: error: "), lines
    assert any(repr(n) in lines[0] for n in _drifted(layout)) and "tp ranks 0 and 1" in lines[0], lines[0]
    assert not out.exists()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", DRIFT)
def test_tp_replicated_mean_averages_the_copies(layout, dtype, monkeypatch):
    """ZEROFAST_TP_REPLICATED=mean: each drifted parameter is (0 + s0 + s1) / 2 of the tp ranks'
    fp32 masters, with a UserWarning naming it; every other parameter is the truth."""
    monkeypatch.setenv(TP_REPLICATED_ENV, "mean")
    truth = _truth(layout)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sd = zerofast.reconstruct(_root(layout), dtype=dtype)
    said = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert list(sd) == truth["state_dict_keys"]
    for name in truth["state_dict_keys"]:
        if name in truth["tp_copies"]:
            want = _mean(truth["tp_copies"][name])
            assert any(repr(name) in m for m in said), (name, said)
        else:
            want = truth["trainable"][name]
        assert_bitwise_equal(sd[name], expected_value(want, dtype), name)


@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize("layout", DRIFT)
def test_tp_replicated_mean_averages_the_moments(layout, key, monkeypatch):
    monkeypatch.setenv(TP_REPLICATED_ENV, "mean")
    truth = _truth(layout)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        got = zerofast.optimizer_state(_root(layout), key)
    for name, value in truth["optimizer_states"][key].items():
        copies = truth["tp_copies_optimizer"][key].get(name)
        assert_bitwise_equal(got[name], value if copies is None else _mean(copies), name)


@pytest.mark.parametrize("layout", DRIFT)
def test_cli_export_tp_replicated_mean(layout, tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "zerofast", "export", str(_root(layout)), str(out),
                           "--tp-replicated", "mean", "--quiet"],
                          capture_output=True, text=True, cwd=REPO, env=_without_tp_env(), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    truth = _truth(layout)
    for name in _drifted(layout):  # one warning line each, naming it
        assert any(line.startswith("zerofast: warning: ") and repr(name) in line
                   for line in proc.stderr.splitlines()), (name, proc.stderr)
    loaded = {}
    for shard in sorted(out.glob("*.safetensors")):
        loaded.update(load_file(shard))
    assert sorted(loaded) == sorted(truth["state_dict_keys"])
    for name, value in loaded.items():
        copies = truth["tp_copies"].get(name)
        want = truth["trainable"][name] if copies is None else _mean(copies)
        assert_bitwise_equal(value, expected_value(want, torch.float32), name)  # the CLI's default: fp32


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", AVERAGE)
def test_parameter_to_average_patterns_are_averaged(layout, dtype, monkeypatch):
    """Named in parameter_to_average_patterns: averaged without any option, (0 + s0 + s1) / 2."""
    monkeypatch.delenv(TP_REPLICATED_ENV, raising=False)
    truth = _truth(layout)
    sd = zerofast.reconstruct(_root(layout), dtype=dtype)
    assert list(sd) == truth["state_dict_keys"]
    for name in truth["state_dict_keys"]:
        copies = truth["tp_copies"].get(name)
        want = truth["trainable"][name] if copies is None else _mean(copies)
        assert_bitwise_equal(sd[name], expected_value(want, dtype), name)


@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize("layout", AVERAGE)
def test_parameter_to_average_patterns_average_the_moments(layout, key, monkeypatch):
    monkeypatch.delenv(TP_REPLICATED_ENV, raising=False)
    truth = _truth(layout)
    got = zerofast.optimizer_state(_root(layout), key)
    assert list(got) == truth["state_dict_keys"]
    for name, value in truth["optimizer_states"][key].items():
        copies = truth["tp_copies_optimizer"][key].get(name)
        assert_bitwise_equal(got[name], value if copies is None else _mean(copies), name)


@pytest.mark.parametrize("layout", AVERAGE)
def test_averaged_parameters_equal_ds_to_universal(layout, monkeypatch):
    """The averaged parameters and moments: zerofast, the formula and ds_to_universal agree."""
    monkeypatch.delenv(TP_REPLICATED_ENV, raising=False)
    tag_dir = _universal_tag_dir(layout)
    truth = _truth(layout)
    sd = zerofast.reconstruct(_root(layout), dtype=None)
    for name in _drifted(layout):
        want = _mean(truth["tp_copies"][name])
        assert_bitwise_equal(_load_state(tag_dir / "zero" / name / "fp32.pt"), want, name)
        assert_bitwise_equal(sd[name], want, name)
    for key in KEYS:
        got = zerofast.optimizer_state(_root(layout), key)
        for name in _drifted(layout):
            want = _mean(truth["tp_copies_optimizer"][key][name])
            assert_bitwise_equal(_load_state(tag_dir / "zero" / name / f"{key}.pt"), want, f"{name} {key}")
            assert_bitwise_equal(got[name], want, f"{name} {key}")


@pytest.mark.parametrize("layout", AVERAGE + DRIFT)
def test_export_optimizer_states_of_averaged_parameters(layout, tmp_path, monkeypatch):
    """export with optimizer_states where replicated copies are averaged (named for it, or drifted
    with the keyword tp_replicated="mean" alone): the averaged moments, and each parameter's step
    the truth's, bit for bit, and what to-universal and ds_to_universal write. An average is no
    flat group's: its step is rank 0's group's (issue 47: a KeyError; the keyword was not in force
    when the JSON was written)."""
    monkeypatch.delenv(TP_REPLICATED_ENV, raising=False)
    truth = _truth(layout)
    mean = {} if layout in AVERAGE else {"tp_replicated": "mean"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        zerofast.export(_root(layout), tmp_path / "e", dtype=None, optimizer_states=True, **mean)
        ours = zerofast.to_universal(_root(layout), tmp_path / "u" / "global_step2_universal", **mean)
    states = load_file(tmp_path / "e" / "optimizer.safetensors")
    for key in KEYS:
        for name, value in truth["optimizer_states"][key].items():
            copies = truth["tp_copies_optimizer"][key].get(name)
            assert_bitwise_equal(states[f"{name}.{key}"], value if copies is None else _mean(copies), f"{name}.{key}")
    doc = json.loads((tmp_path / "e" / "optimizer_state.json").read_text())
    trainable = sorted(truth["optimizer_states"]["exp_avg"])
    assert sorted(doc["state"]) == trainable
    assert sorted(n for group in doc["param_groups"] for n in group["params"]) == trainable
    step = truth["optimizer_step"]
    theirs = None if layout in DRIFT else _universal_tag_dir(layout)  # ds_to_universal refuses drift
    for name in trainable:
        assert doc["state"][name] == {"step": step} and type(doc["state"][name]["step"]) is type(step), name
        for folder in (ours, theirs) if _spec(layout)["stage"] != 3 else ():  # ZeRO 3: no step.pt
            if folder is not None:
                written = torch.load(folder / "zero" / name / "step.pt", weights_only=True)
                assert written.item() == step and written.dim() == 0, (folder, name)
    assert _drifted(layout) and set(_drifted(layout)) <= set(trainable)


@pytest.mark.parametrize("layout", NO_INFO)
def test_no_universal_checkpoint_info_is_refused(layout):
    with pytest.raises(zerofast.UnsupportedCheckpointError, match="universal_checkpoint_info") as e:
        zerofast.reconstruct(_root(layout))
    assert "--tp-rules megatron-gpt" in str(e.value)  # the names are Megatron's: the preset is named


@pytest.mark.parametrize("layout", NO_INFO)
def test_no_universal_checkpoint_info_reads_with_the_preset(layout, monkeypatch, tmp_path):
    """The Megatron-DeepSpeed GPT preset, given the two facts the shapes cannot tell, puts the
    save together as its own metadata would have; by the variable, and by the CLI's flag."""
    truth = _truth(layout)
    monkeypatch.setenv("ZEROFAST_TP_RULES", "megatron-gpt:mlp=swiglu,vocab=21")
    sd = zerofast.reconstruct(_root(layout), dtype=None)
    assert list(sd) == truth["state_dict_keys"]
    for name in truth["state_dict_keys"]:
        assert_bitwise_equal(sd[name], expected_value(truth["trainable"][name], None), name)
    monkeypatch.delenv("ZEROFAST_TP_RULES")
    out = tmp_path / "hf"
    done = subprocess.run([sys.executable, "-m", "zerofast", "export", str(_root(layout)), str(out),
                           "--tp-rules", "megatron-gpt:mlp=swiglu,vocab=21"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    exported = load_file(out / "model.safetensors")
    for name in truth["state_dict_keys"]:
        assert_bitwise_equal(exported[name], truth["trainable"][name], name)


@pytest.mark.parametrize("layout", NO_INFO)
def test_the_rules_keyword_wins_over_the_variable(layout, monkeypatch, tmp_path):
    """tp_rules= as a preset, a rules file's path and a dict, each read as the variable would be
    and each winning over a variable that names other rules; lazy and to_universal too."""
    from zerofast.layouts.tp_presets import megatron_gpt

    truth = _truth(layout)
    monkeypatch.setenv("ZEROFAST_TP_RULES", "megatron-gpt:mlp=gelu,vocab=21")  # wrong for this save

    def differs() -> bool:  # the gelu rules join SwiGLU's halves in the wrong order
        sd = zerofast.reconstruct(_root(layout), dtype=None)
        return any(not torch.equal(sd[n], truth["trainable"][n]) for n in truth["state_dict_keys"])

    assert differs()
    rules = megatron_gpt({"mlp": "swiglu", "vocab": "21"})
    (tmp_path / "rules.json").write_text(json.dumps(rules))
    for given in ("megatron-gpt:mlp=swiglu,vocab=21", tmp_path / "rules.json", rules):
        for lazy in (False, True):
            sd = zerofast.reconstruct(_root(layout), dtype=None, lazy=lazy, tp_rules=given)
            assert list(sd) == truth["state_dict_keys"], (given, lazy)
            for name in truth["state_dict_keys"]:
                assert_bitwise_equal(sd[name], expected_value(truth["trainable"][name], None), name)
    assert differs()  # the keyword held for its call only
    monkeypatch.delenv("ZEROFAST_TP_RULES")
    out = zerofast.to_universal(_root(layout), tmp_path / "universal" / "step", tp_rules=rules)
    for name in truth["state_dict_keys"]:
        assert_bitwise_equal(_load_state(out / "zero" / name / "fp32.pt"), truth["trainable"][name], name)
    for bad in ("", 3, ["megatron-gpt"]):
        with pytest.raises(zerofast.SettingsError, match="tp_rules="):
            zerofast.reconstruct(_root(layout), tp_rules=bad)


@pytest.mark.parametrize("layout", DRIFT)
def test_the_replicated_keyword_wins_over_the_variable(layout, monkeypatch, tmp_path):
    truth = _truth(layout)
    monkeypatch.setenv(TP_REPLICATED_ENV, "equal")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        sd = zerofast.reconstruct(_root(layout), dtype=None, tp_replicated="mean")
        result = zerofast.export(_root(layout), tmp_path / "hf", tp_replicated="mean")
    exported = {}
    for shard in result.files:
        exported.update(load_file(tmp_path / "hf" / shard))
    for name in _drifted(layout):
        assert_bitwise_equal(sd[name], _mean(truth["tp_copies"][name]), name)
        assert_bitwise_equal(exported[name], _mean(truth["tp_copies"][name]), name)
    with pytest.raises(zerofast.ZeroFastError):  # the variable's "equal" again, outside the call
        zerofast.reconstruct(_root(layout), dtype=None)
    monkeypatch.setenv(TP_REPLICATED_ENV, "mean")
    with pytest.raises(zerofast.ZeroFastError):  # and the keyword's "equal" over the variable's mean
        zerofast.reconstruct(_root(layout), dtype=None, tp_replicated="equal")
    with pytest.raises(zerofast.SettingsError, match="tp_replicated= expects one of equal, mean"):
        zerofast.reconstruct(_root(layout), tp_replicated="median")


@pytest.mark.parametrize("dtype", [None, torch.float32], ids=str)
@pytest.mark.parametrize("layout", MEGATRON_SAVE)
def test_megatron_save_reconstructs(layout, dtype):
    """A save as Megatron-DeepSpeed writes it: nested module, argparse.Namespace and numpy's RNG
    state in the model states. The flat names, each the truth's fp32 master."""
    truth = _truth(layout)
    sd = zerofast.reconstruct(_root(layout), dtype=dtype)
    assert list(sd) == truth["state_dict_keys"]
    for name in truth["state_dict_keys"]:
        assert_bitwise_equal(sd[name], expected_value(truth["trainable"][name], dtype), name)


# -- zerofast against ds_to_universal (the second reference) ---------------------------------------

@pytest.mark.parametrize("layout", EVERY)
def test_reconstruct_equals_ds_to_universal(layout, monkeypatch):
    """On every save ds_to_universal ran on: zerofast's fp32 equals its fp32.pt 'param', bit for bit."""
    monkeypatch.delenv(TP_REPLICATED_ENV, raising=False)
    tag_dir = _universal_tag_dir(layout)
    sd = zerofast.reconstruct(_root(layout), dtype=None)
    assert list(sd) == list(FULL_SHAPES)
    for name, value in sd.items():
        assert_bitwise_equal(value, _load_state(tag_dir / "zero" / name / "fp32.pt"), name)


@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize("layout", EVERY)
def test_optimizer_state_equals_ds_to_universal(layout, key, monkeypatch):
    monkeypatch.delenv(TP_REPLICATED_ENV, raising=False)
    tag_dir = _universal_tag_dir(layout)
    got = zerofast.optimizer_state(_root(layout), key)
    assert list(got) == list(FULL_SHAPES)
    for name, value in got.items():
        assert_bitwise_equal(value, _load_state(tag_dir / "zero" / name / f"{key}.pt"), name)


# -- hostile or inconsistent metadata ---------------------------------------------------------------

def _copy_with(layout: str, tmp_path, edit) -> Path:
    """A copy of ``layout``'s save whose mp_rank_00 model states went through ``edit``."""
    import shutil

    root = tmp_path / "ckpt"
    shutil.copytree(_root(layout), root, ignore=shutil.ignore_patterns("universal"))
    path = next(root.glob("*/mp_rank_00_model_states.pt"))
    sd = torch.load(path, weights_only=False)
    edit(sd)
    torch.save(sd, path)
    return root


BASE = "megatron_s1_bf16_tp2_dp2"


def test_a_tp_degree_the_files_contradict_is_inconsistent(tmp_path):
    root = _copy_with(BASE, tmp_path, lambda sd: sd["checkpoint_parallel_dimensions"].update(tp_degree=4))
    with pytest.raises(zerofast.InconsistentCheckpointError, match="expected tp_degree 2"):
        zerofast.reconstruct(root)


@pytest.mark.parametrize("patterns, error", [
    (["(a+)+$"], zerofast.UnsupportedCheckpointError),
    (["x" * 5000], zerofast.UnsupportedCheckpointError),
    (["(unclosed"], zerofast.CorruptCheckpointError),
    ([["nested"]], zerofast.CorruptCheckpointError),
])
def test_hostile_patterns_are_refused_in_bounded_time(tmp_path, patterns, error):
    import time

    def edit(sd):
        sd["universal_checkpoint_info"]["tp_replicated_parameter_patterns"] = patterns

    root = _copy_with(BASE, tmp_path, edit)
    start = time.monotonic()
    with pytest.raises(error):
        zerofast.reconstruct(root)
    assert time.monotonic() - start < 10


def test_a_vocabulary_larger_than_the_rows_is_refused(tmp_path):
    root = _copy_with(BASE, tmp_path, lambda sd: sd["universal_checkpoint_info"].update(original_vocab_size=25))
    with pytest.raises(zerofast.UnsupportedCheckpointError, match="original_vocab_size 25"):
        zerofast.reconstruct(root)


# -- to-universal: what ds_to_universal writes, tensor for tensor and field for field ---------------

def _same(a, b, where: str) -> None:
    """Equal objects: tensors bit for bit, dicts with the same keys in the same order."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert_bitwise_equal(a, b, where)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), f"{where}: {list(a)} != {list(b)}"
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif hasattr(a, "__dict__") and not isinstance(a, type):
        assert type(a).__name__ == type(b).__name__, where
        _same(vars(a), vars(b), where)
    else:
        assert a == b or (a != a and b != b), f"{where}: {a!r} != {b!r}"


UNIVERSAL = [n for n in EVERY if MEGATRON_VARIANTS.get(n, {}).get("universal_checkpoint_info") is not False]


@pytest.mark.parametrize("layout", UNIVERSAL)
def test_to_universal_writes_what_ds_to_universal_writes(layout, tmp_path, monkeypatch):
    error = _ds_to_universal_error(layout)
    if error:
        pytest.skip(f"ds_to_universal does not run on {layout}: {error}")
    monkeypatch.delenv("ZEROFAST_TP_REPLICATED", raising=False)
    theirs = _universal_tag_dir(layout)
    ours = zerofast.to_universal(_root(layout), tmp_path / "u" / theirs.name)
    assert (tmp_path / "u" / "latest_universal").read_text() == theirs.name
    files = sorted(p.relative_to(theirs) for p in theirs.rglob("*.pt"))
    assert sorted(p.relative_to(ours) for p in ours.rglob("*.pt")) == files
    for rel in files:
        if rel.parent == Path("."):  # the source's model-states files, copied
            assert (ours / rel).read_bytes() == (theirs / rel).read_bytes(), rel
            continue
        _same(torch.load(ours / rel, weights_only=False), torch.load(theirs / rel, weights_only=False), str(rel))
