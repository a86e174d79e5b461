"""Universal folders of tensor- and pipeline-parallel saves (issue 47): DeepSpeed 0.19.8's own
ds_to_universal run on the suite's real saves, read by zerofast, judged bit for bit against the
ground truth the training job gathered (eager, lazy, export, optimizer states).

Where the folders come from:
* the Megatron-style saves (tests/dsgen/train_megatron.py: TP 2 at ZeRO 1, 2 and 3, averaged
  parameters, SwiGLU sub-parameters, Megatron's own ``save_checkpoint``; train_megatron_pipe.py:
  TP 2 x PP 2): their generator ran the converter, strict, into ``<save>/universal``;
* the Megatron ``frozen`` variants and the AutoTP saves: tests/dsgen/universal_tp.py (the frozen
  ones with ``--no_strict``, strict fails on them);
* the plain ``PipelineModule`` saves: tests/dsgen/universal_pipe.py.
Where the converter failed on a save, its test skips with the converter's recorded error.

The trainable parameters come whole from ``zero/<name>/fp32.pt``; the frozen ones from each tp
rank's copied model states, joined by the save's rules (the converter's own ``fp32.pt`` of a split
frozen parameter is tp rank 0's shard). A pipeline's frozen parameters and buffers are only in its
layer files, which the converter does not copy: without them the folder is refused by name (or read
with ``exclude_frozen`` when it has no buffers); with them copied in, it reads whole.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import zerofast
from zerofast.cli import describe
from zerofast.hf.run import OPTIMIZER_JSON

from tests.conftest import needs_deepspeed
from tests.dsgen.families import FAMILY_LAYOUTS, MEGATRON_VARIANTS
from tests.dsgen.megatron_pipe_layouts import MEGATRON_PIPE_LAYOUTS
from tests.dsgen.train_megatron import FROZEN
from tests.dsgen.universal_pipe import PIPE_ZERO, ensure_pipe_universal
from tests.dsgen.universal_tp import CONVERSIONS, ERROR, ensure_tp_universal
from tests.helpers import assert_bitwise_equal, expected_value, real_root, real_truth

pytestmark = needs_deepspeed

MEGATRON = sorted(n for n, s in {**FAMILY_LAYOUTS, **MEGATRON_VARIANTS}.items() if s["family"] == "megatron")
AUTOTP = sorted(n for n in CONVERSIONS if n.startswith("autotp"))
TP = MEGATRON + AUTOTP
MEGATRON_PIPE = sorted(n for n, s in MEGATRON_PIPE_LAYOUTS.items())
PIPE = MEGATRON_PIPE + sorted(PIPE_ZERO)
FROZEN_TP = [n for n in TP if "frozen" in n]
KEYS = ("exp_avg", "exp_avg_sq")


@pytest.fixture(autouse=True)
def _save_rules_only(monkeypatch):
    """The rules are the save's own: no --tp-rules or --tp-replicated from the environment."""
    monkeypatch.delenv("ZEROFAST_TP_REPLICATED", raising=False)
    monkeypatch.delenv("ZEROFAST_TP_RULES", raising=False)


def _root(layout: str) -> Path:
    """The folder holding ``latest_universal``; a skip with the converter's error where it failed."""
    if layout in CONVERSIONS:
        root = ensure_tp_universal(layout)
        error = root / ERROR
    elif layout in PIPE_ZERO:
        root = ensure_pipe_universal(layout)
        error = root / ERROR
    else:  # the generator ran it next to the save
        root, error = real_root(layout) / "universal", real_root(layout) / ERROR
    if error.is_file():
        pytest.skip(f"DeepSpeed's ds_to_universal failed on {layout}: {error.read_text().strip()}")
    return root


def _tag_dir(layout: str) -> Path:
    root = _root(layout)
    return root / (root / "latest_universal").read_text().strip()


def _want(truth: dict, name: str) -> torch.Tensor:
    values = {**truth["trainable"], **truth["frozen"], **truth["buffers"]}
    return values[truth.get("tied", {}).get(name, name)]


def _check(sd, truth: dict, dtype, names=None) -> None:
    names = truth["state_dict_keys"] if names is None else names
    assert list(sd) == names
    for name in names:
        assert_bitwise_equal(sd[name], expected_value(_want(truth, name), dtype), name)


def _with_layer_files(layout: str, tmp_path: Path) -> Path:
    """A copy of the pipeline save's universal folder with the source's layer files copied in."""
    root = tmp_path / "u"
    shutil.copytree(_root(layout), root)
    tag = root / (root / "latest_universal").read_text().strip()
    source = real_root(layout) / real_truth(layout)["tag"]
    for layer in sorted(source.glob("layer_*-model_states.pt")):
        shutil.copy(layer, tag / layer.name)
    return root


# ---------------------------------------------------------------------------------------------
# Tensor parallelism without pipeline stages: Megatron-DeepSpeed's rules and AutoTP's affine_map

@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
@pytest.mark.parametrize("dtype", [None, torch.float32], ids=str)
@pytest.mark.parametrize("layout", TP)
def test_reconstruct_matches_the_training_truth(layout, dtype, lazy):
    truth = real_truth(layout)
    _check(zerofast.reconstruct(_root(layout), dtype=dtype, lazy=lazy), truth, dtype)
    trained = zerofast.reconstruct(_tag_dir(layout), dtype=dtype, exclude_frozen=True)
    _check(trained, truth, dtype, [n for n in truth["state_dict_keys"] if n not in truth["frozen"]])


@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize("layout", TP + MEGATRON_PIPE)
def test_optimizer_state_matches_the_training_truth(layout, key):
    """Read from the parameters' own files; a pipeline's needs no layer file."""
    want = real_truth(layout)["optimizer_states"][key]
    got = zerofast.optimizer_state(_root(layout), key, dtype=None)
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert_bitwise_equal(got[name], value, f"{name} {key}")


@pytest.mark.parametrize("layout", TP)
def test_export_matches_the_truth_and_the_saves_own_export(layout, tmp_path):
    truth = real_truth(layout)
    result = zerofast.export(_root(layout), tmp_path / "u", dtype=None, optimizer_states=True)
    exported = zerofast.load_exported(tmp_path / "u")
    assert sorted(exported) == sorted(truth["state_dict_keys"])
    for name in truth["state_dict_keys"]:
        assert_bitwise_equal(exported[name], _want(truth, name), name)
    states = {k: v for f in result.optimizer_files if f.endswith(".safetensors")
              for k, v in load_file(tmp_path / "u" / f).items()}
    assert set(states) == {f"{n}.{k}" for n in truth["optimizer_states"]["exp_avg"] for k in KEYS}
    for key in KEYS:
        for name, value in truth["optimizer_states"][key].items():
            assert_bitwise_equal(states[f"{name}.{key}"], value, f"{name}.{key}")
    zerofast.export(real_root(layout), tmp_path / "src", dtype=None, optimizer_states=True)
    doc, source_doc = (json.loads((tmp_path / d / OPTIMIZER_JSON).read_text()) for d in ("u", "src"))
    assert doc.pop("tag") != source_doc.pop("tag")
    assert doc == source_doc  # step per parameter, param groups with their names


@pytest.mark.parametrize("layout", TP + MEGATRON_PIPE)
def test_inspect_says_universal_and_the_tensor_parallel_degree(layout, tmp_path):
    truth = real_truth(layout)
    report = describe(_root(layout) if layout in TP else _with_layer_files(layout, tmp_path))
    assert report["universal"] is True and report["stage"] == truth["stage"]
    assert report["world_size"] == truth["world_size"] and report["parallelism"]["tp"] == 2
    assert report["tensors"]["frozen"]["count"] == len(truth["frozen"])


@pytest.mark.parametrize("layout", FROZEN_TP)
def test_the_converters_fp32_of_a_split_frozen_parameter_is_one_shard(layout):
    """What zerofast does not read: ds_to_universal writes ``fp32.pt`` for a frozen parameter from the
    first model states holding it, tp rank 0's shard; the whole comes from every tp rank's shard."""
    truth = real_truth(layout)
    split = [n for n in truth["frozen"] if "layernorm" not in n]
    assert split
    sd = zerofast.reconstruct(_root(layout), dtype=None)
    for name in split:
        theirs = torch.load(_tag_dir(layout) / "zero" / name / "fp32.pt", weights_only=True)["param"]
        assert theirs.shape != truth["frozen"][name].shape, name
        assert_bitwise_equal(sd[name], truth["frozen"][name], name)


@pytest.mark.parametrize("layout", sorted(n for n, s in MEGATRON_VARIANTS.items() if s.get("frozen")))
def test_strict_ds_to_universal_fails_on_the_frozen_megatron_saves(layout):
    """Why tests/dsgen/universal_tp.py converts them with --no_strict (the generator's strict run)."""
    assert set(real_truth(layout)["frozen"]) == set(FROZEN)
    error = (real_root(layout) / ERROR).read_text()
    assert error.startswith("AssertionError: Unused patterns=['language_model\\\\.embedding\\\\.word_embeddings")


@pytest.mark.parametrize("layout", ["megatron_s1_bf16_tp2_dp2", "megatron_s3_bf16_tp2_dp2",
                                    "megatron_s2_bf16_tp2_dp2_frozen", "megatron_pipe_s1_bf16_tp2_pp2_frozen"])
def test_zerofasts_own_to_universal_reads_back(layout, tmp_path):
    """zerofast.to_universal writes these saves as ds_to_universal does (the model states copied, no
    layer file): read back, they give the training truth (a pipeline's trainable parameters alone)."""
    truth = real_truth(layout)
    out = zerofast.to_universal(real_root(layout), tmp_path / "u" / "step_universal")
    pipe = layout in MEGATRON_PIPE_LAYOUTS
    names = [n for n in truth["state_dict_keys"] if not (pipe and n in truth["frozen"])]
    sd = zerofast.reconstruct(out, dtype=None, exclude_frozen=pipe)
    assert (sorted(sd) if pipe else list(sd)) == (sorted(names) if pipe else names)
    for name in names:
        assert_bitwise_equal(sd[name], _want(truth, name), name)


# ---------------------------------------------------------------------------------------------
# Incomplete or contradictory tensor-parallel folders

def _copy(layout: str, tmp_path: Path) -> Path:
    root = tmp_path / "u"
    shutil.copytree(_root(layout), root)
    return root / (root / "latest_universal").read_text().strip()


def test_a_missing_tp_rank_is_named(tmp_path):
    tag = _copy("megatron_s1_bf16_tp2_dp2", tmp_path)
    (tag / "mp_rank_01_model_states.pt").unlink()
    with pytest.raises(zerofast.IncompleteCheckpointError, match=r"mp_world_size 1 .*found 2: the other model-parallel "
                                                                 r"ranks' model-states files"):
        zerofast.reconstruct(tag)


def test_a_missing_zero3_rank_of_one_tp_rank_is_named(tmp_path):
    tag = _copy("megatron_s3_bf16_tp2_dp2", tmp_path)
    (tag / "zero_pp_rank_1_mp_rank_01_model_states.pt").unlink()
    with pytest.raises(zerofast.IncompleteCheckpointError, match=r"every \(data-parallel, tensor-parallel\) rank pair"):
        zerofast.reconstruct(tag)


def test_a_rule_other_than_the_converters_is_refused(tmp_path):
    """The frozen shards are joined by the model states' rules; a parameter the converter joined by
    another (here: its cat_dim edited) says the two disagree."""
    tag = _copy("megatron_s1_bf16_tp2_dp2", tmp_path)
    path = tag / "zero" / "language_model.encoder.layers.0.self_attention.dense.weight" / "fp32.pt"
    state = torch.load(path, weights_only=True)
    assert state["cat_dim"] == 1
    state["cat_dim"] = 0
    torch.save(state, path)
    with pytest.raises(zerofast.InconsistentCheckpointError, match=r"expected the fields \{'cat_dim': 1\}.*found "
                                                                   r"\{'cat_dim': 0\}") as e:
        zerofast.reconstruct(tag)
    assert "self_attention.dense.weight" in str(e.value)


def test_an_autotp_zero3_folder_is_refused(tmp_path):
    """ds_to_universal fails on AutoTP ZeRO-3 saves (recorded by tests/dsgen/universal_tp.py); a folder
    laid out as one would be (the save's model states and a common state) is refused by name."""
    layout = "autotp_s3_bf16_w4_tp2"
    error = (ensure_tp_universal(layout) / ERROR).read_text()
    assert error.startswith("RuntimeError: start (0) + length")
    tag = tmp_path / "u" / "step_universal"
    (tag / "zero").mkdir(parents=True)
    for f in sorted((real_root(layout) / real_truth(layout)["tag"]).glob("zero_pp_rank_*_model_states.pt")):
        shutil.copy(f, tag / f.name)
    torch.save({"zero_stage": 3, "param_groups": []}, tag / "zero" / "optimizer_state.pt")
    with pytest.raises(zerofast.UnsupportedCheckpointError, match="AutoTP save at ZeRO-3 is not supported"):
        zerofast.reconstruct(tag)


def test_a_mixture_of_experts_folder_with_model_parallelism_is_refused(tmp_path):
    tag = _copy("megatron_s1_bf16_tp2_dp2", tmp_path)
    (tag / "layer_0_expert_0_mp_rank_01_model_states.pt").write_bytes(b"")
    with pytest.raises(zerofast.UnsupportedCheckpointError, match="mixture-of-experts.*(model|tensor) parallelism"):
        zerofast.reconstruct(tag)


# ---------------------------------------------------------------------------------------------
# Pipelines: the frozen parameters and buffers are in the layer files the converter leaves out

@pytest.mark.parametrize("layout", PIPE)
def test_a_pipeline_folder_without_its_layer_files_is_refused_by_name(layout):
    truth = real_truth(layout)
    what = f"buffers \\({', '.join(sorted(truth['buffers']))}\\)" if truth["buffers"] else "frozen parameters"
    with pytest.raises(zerofast.IncompleteCheckpointError, match=f"{what}.*copies no layer_\\*-model_states.pt"):
        zerofast.reconstruct(_root(layout))


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
@pytest.mark.parametrize("layout", PIPE)
def test_exclude_frozen_reads_the_trainable_parameters_alone(layout, lazy):
    truth = real_truth(layout)
    if truth["buffers"]:
        with pytest.raises(zerofast.IncompleteCheckpointError, match="buffers"):
            zerofast.reconstruct(_root(layout), exclude_frozen=True)
        return
    sd = zerofast.reconstruct(_root(layout), dtype=None, lazy=lazy, exclude_frozen=True)
    assert sorted(sd) == sorted(truth["trainable"])  # param_shapes order: no layer file tells the module's
    for name, value in truth["trainable"].items():
        assert_bitwise_equal(sd[name], value, name)


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
@pytest.mark.parametrize("layout", PIPE)
def test_with_the_layer_files_copied_in_the_pipeline_reads_whole(layout, lazy, tmp_path):
    truth = real_truth(layout)
    root = _with_layer_files(layout, tmp_path)
    for dtype in (None, torch.float32):
        _check(zerofast.reconstruct(root, dtype=dtype, lazy=lazy), truth, dtype)


def test_a_layer_file_left_behind_is_named(tmp_path):
    root = _with_layer_files("megatron_pipe_s1_bf16_tp2_pp2", tmp_path)
    tag = root / (root / "latest_universal").read_text().strip()
    for f in tag.glob("layer_04-model_*-model_states.pt"):
        f.unlink()
    with pytest.raises(zerofast.IncompleteCheckpointError, match=r"found none for layers 4 "):
        zerofast.reconstruct(root)


@pytest.mark.parametrize("layout", PIPE)
def test_export_of_a_pipeline_folder_with_its_layer_files(layout, tmp_path):
    truth = real_truth(layout)
    zerofast.export(_with_layer_files(layout, tmp_path), tmp_path / "hf", dtype=None)
    exported = zerofast.load_exported(tmp_path / "hf")
    assert sorted(exported) == sorted(truth["state_dict_keys"])
    for name in truth["state_dict_keys"]:
        assert_bitwise_equal(exported[name], _want(truth, name), name)
