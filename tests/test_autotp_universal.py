"""zerofast.to_universal of AutoTP saves (``tensor_parallel.autotp_size``; issue 47), against DeepSpeed
0.19.8's own ds_to_universal run on the same real saves (tests/dsgen/universal_tp.py, cached), file for
file, field for field and bit for bit, and read back against the training job's truth.

What ds_to_universal writes for them (``merge_tp_slices``): each trainable parameter rebuilt from the
tp ranks' slices by the save's ``affine_map``, with no field of a rule (no ``cat_dim``): ``{'param'}``,
or ``{'vocab_tensor': True, 'param'}`` where a vocabulary pattern names it; ``step.pt``; the common
optimizer state of (tp 0, dp 0); the model-states files copied. The one documented exception: a
frozen parameter's ``fp32.pt``, which the converter takes from tp rank 0's model states (its shard,
cast to float32) and zerofast writes whole, joined by the map, in its stored dtype, as it does for
Megatron-DeepSpeed's frozen shards (``{'param', 'cat_dim': 0}``, as for every frozen tensor). Refused
by name: ZeRO-3 (the converter fails there), parameters the save marks unconvertible, a parameter
neither mapped nor named replicated, a vocabulary the converter would cut, scaled pieces.

DeepSpeed's ``load_universal`` resumes zerofast's folders of the ZeRO 1 (dp 1) and ZeRO 2 (dp 2) saves
at tp 2 x dp 1 (tests/dsgen/resume_autotp.py, one torchrun job), every master and moment equal to the
training truth, as it resumes ds_to_universal's own folders of them in the same job (the control)."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zerofast
from zerofast.cli import main
from zerofast.writers.universal import universal_module_state

from tests.conftest import needs_deepspeed
from tests.dsgen.catalog import REPO_ROOT, not_ours
from tests.dsgen.families import FAMILY_LAYOUTS
from tests.dsgen.universal_tp import ERROR, ensure_tp_universal
from tests.helpers import assert_bitwise_equal, real_root, real_truth
from tests.test_megatron_resume import _free_port
from tests.test_megatron_tp import _same

pytestmark = [needs_deepspeed, pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                                  reason="AutoTP checkpoints are made from a transformers model")]

AUTOTP = sorted(n for n, s in FAMILY_LAYOUTS.items() if s["family"] == "autotp" and s["stage"] in (1, 2))
ZERO3 = "autotp_s3_bf16_w4_tp2"
KEYS = ("exp_avg", "exp_avg_sq")
LM_HEAD = "lm_head.weight"


def _theirs(layout: str) -> Path:
    root = ensure_tp_universal(layout)
    assert not (root / ERROR).is_file(), (root / ERROR).read_text()  # it runs on every ZeRO 1-2 AutoTP save
    return root / (root / "latest_universal").read_text().strip()


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """layout -> (DeepSpeed's tag folder, zerofast's), each save converted once."""
    base = tmp_path_factory.mktemp("autotp_universal")
    out = {}

    def get(layout: str) -> tuple[Path, Path]:
        if layout not in out:
            theirs = _theirs(layout)
            ours = zerofast.to_universal(real_root(layout), base / layout / theirs.name)
            assert (base / layout / "latest_universal").read_text() == theirs.name
            out[layout] = theirs, ours
        return out[layout]
    return get


@pytest.mark.parametrize("layout", AUTOTP)
def test_to_universal_writes_what_ds_to_universal_writes(layout, converted):
    """Every file, every field, every tensor; only the frozen parameters' fp32.pt differ (below)."""
    theirs, ours = converted(layout)
    frozen = set(real_truth(layout)["frozen"])
    files = sorted(p.relative_to(theirs) for p in theirs.rglob("*.pt"))
    assert sorted(p.relative_to(theirs) for p in theirs.rglob("*") if p.is_file()) == files  # nothing else
    assert sorted(p.relative_to(ours) for p in ours.rglob("*.pt")) == files
    for rel in files:
        if rel.parent == Path("."):  # the source's mp_rank model-states files, copied
            assert (ours / rel).read_bytes() == (theirs / rel).read_bytes(), rel
        elif rel.parent.name not in frozen:
            _same(torch.load(ours / rel, weights_only=False), torch.load(theirs / rel, weights_only=False), str(rel))


@pytest.mark.parametrize("layout", AUTOTP)
def test_mapped_parameters_carry_no_field_of_a_rule(layout, converted):
    """ds_to_universal's affine branch records no cat_dim; the vocabulary pattern adds vocab_tensor."""
    _, ours = converted(layout)
    truth = real_truth(layout)
    for name in truth["trainable"]:
        for key in ("fp32",) + KEYS:
            got = torch.load(ours / "zero" / name / f"{key}.pt", weights_only=True)
            assert list(got) == (["vocab_tensor", "param"] if name == LM_HEAD else ["param"]), (name, key)
            assert got.get("vocab_tensor", True) is True
            want = truth["trainable"][name] if key == "fp32" else truth["optimizer_states"][key][name]
            assert_bitwise_equal(got["param"], want, f"{name} {key}")
        assert float(torch.load(ours / "zero" / name / "step.pt", weights_only=True)) == truth["optimizer_step"]


def test_frozen_parameters_are_written_whole_where_the_converter_writes_one_shard(converted):
    """The documented exception: DeepSpeed's fp32.pt of a frozen parameter is tp rank 0's shard (a
    replicated one: rank 0's copy), cast to float32; zerofast's is the whole parameter in its stored
    dtype, joined by the affine_map, as for Megatron-DeepSpeed's frozen shards."""
    layout = "autotp_s2_bf16_w4_tp2_frozen"
    theirs, ours = converted(layout)
    truth = real_truth(layout)
    assert truth["frozen"]
    module = universal_module_state(ours)
    assert sorted(module) == sorted(truth["frozen"])
    for name, value in truth["frozen"].items():
        mine = torch.load(ours / "zero" / name / "fp32.pt", weights_only=True)
        assert list(mine) == ["param", "cat_dim"] and mine["cat_dim"] == 0
        assert_bitwise_equal(mine["param"], value, name)
        assert_bitwise_equal(module[name], value, name)
        shard = torch.load(theirs / "zero" / name / "fp32.pt", weights_only=True)
        assert list(shard) == ["param"] and shard["param"].dtype == torch.float32
        if "layernorm" in name:  # replicated: the same values, in float32
            assert_bitwise_equal(shard["param"], value.float(), name)
        else:
            assert shard["param"].shape != value.shape, name
            assert_bitwise_equal(shard["param"], value.float()[tuple(slice(0, n) for n in shard["param"].shape)], name)


@pytest.mark.parametrize("layout", AUTOTP)
def test_read_back_equals_the_source_truth(layout, converted):
    _, ours = converted(layout)
    truth = real_truth(layout)
    sd = zerofast.reconstruct(ours, dtype=None)
    assert list(sd) == truth["state_dict_keys"]
    values = {**truth["trainable"], **truth["frozen"], **truth["buffers"]}
    for name in truth["state_dict_keys"]:
        assert_bitwise_equal(sd[name], values[name], name)
    for key in KEYS:
        got = zerofast.optimizer_state(ours, key, dtype=None)
        assert sorted(got) == sorted(truth["optimizer_states"][key])
        for name, value in truth["optimizer_states"][key].items():
            assert_bitwise_equal(got[name], value, f"{name} {key}")


def test_cli(tmp_path):
    layout = AUTOTP[0]
    assert main(["to-universal", str(real_root(layout)), str(tmp_path / "u" / "step_universal")]) == 0
    assert (tmp_path / "u" / "latest_universal").read_text() == "step_universal"


# ---------------------------------------------------------------------------------------------
# Refused, naming the parameter or the reason, with nothing written

def test_zero3_is_refused(tmp_path):
    """ds_to_universal fails on these saves (recorded by tests/dsgen/universal_tp.py)."""
    assert (ensure_tp_universal(ZERO3) / ERROR).read_text().startswith("RuntimeError: start (0) + length")
    with pytest.raises(zerofast.UnsupportedCheckpointError, match="AutoTP save at ZeRO-3 is not supported"):
        zerofast.to_universal(real_root(ZERO3), tmp_path / "u" / "step")
    assert not (tmp_path / "u" / "step").exists()


def _edited(tmp_path: Path, edit) -> Path:
    """A copy of the ZeRO-1 save with ``edit(universal_checkpoint_info)`` applied on every tp rank."""
    layout = AUTOTP[0]
    root = tmp_path / "src"
    shutil.copytree(real_root(layout), root)
    for path in sorted((root / real_truth(layout)["tag"]).glob("mp_rank_*_model_states.pt")):
        sd = torch.load(path, weights_only=False)
        edit(sd["universal_checkpoint_info"])
        torch.save(sd, path)
    return root


def _refused(root: Path, tmp_path: Path, match: str) -> None:
    with pytest.raises(zerofast.UnsupportedCheckpointError, match=match) as e:
        zerofast.to_universal(root, tmp_path / "u" / "step")
    assert "mp_rank_0" in str(e.value)
    assert not (tmp_path / "u" / "step").exists()


def test_a_vocabulary_the_converter_would_cut_is_refused(tmp_path):
    rows = real_truth(AUTOTP[0])["trainable"][LM_HEAD].shape[0]
    root = _edited(tmp_path, lambda info: info.update(original_vocab_size=rows - 3))
    _refused(root, tmp_path, rf"'lm_head.weight'.*shape \[{rows}, 16\] with original_vocab_size {rows - 3}")


def test_parameters_the_save_marks_unconvertible_are_refused(tmp_path):
    root = _edited(tmp_path, lambda info: info.update(
        autotp_unsupported_parameter_patterns={r"^model\.norm\.weight$": "a reason"}))
    _refused(root, tmp_path, "autotp_unsupported_parameter_patterns")


def test_a_parameter_neither_mapped_nor_replicated_is_refused(tmp_path):
    """Whole on both tp ranks, so zerofast reads it as one tensor; the converter would join the copies."""
    pattern = r"^model\.norm\.weight$"

    def edit(info):
        del info["affine_map"]["params"][pattern]
        info["tp_replicated_parameter_patterns"].remove(pattern)
    root = _edited(tmp_path, edit)
    _refused(root, tmp_path, r"'model.norm.weight': the affine_map has no entry for it")


def test_scaled_pieces_are_refused(tmp_path):
    """A shard holding its block times ``scale`` (DeepSpeed's converter divides it back out, and
    refuses the moments): never read as if unscaled."""
    pattern = r"^model\.layers\.0\.mlp\.down_proj\.weight$"

    def edit(info):
        for entry in info["affine_map"]["params"][pattern]["ranks"].values():
            for piece in entry["pieces"]:
                piece["scale"] = 0.5
    root = _edited(tmp_path, edit)
    _refused(root, tmp_path, r"'model.layers.0.mlp.down_proj.weight' has affine_map pieces with a scale")
    with pytest.raises(zerofast.UnsupportedCheckpointError, match="with a scale"):
        zerofast.reconstruct(root)


# ---------------------------------------------------------------------------------------------
# DeepSpeed's load_universal resumes the folders

RESUME = REPO_ROOT / "tests" / "dsgen" / "resume_autotp.py"
RESUMED = [n for n in AUTOTP if not FAMILY_LAYOUTS[n].get("frozen")]  # frozen ones: see universal_module_state


@pytest.fixture(scope="module")
def resumed(converted, tmp_path_factory) -> dict:
    """case name -> what the job read back; cases ``<layout>_zerofast`` and ``<layout>_ds_to_universal``."""
    base = tmp_path_factory.mktemp("autotp_resume")
    cases = []
    for layout in RESUMED:
        theirs, ours = converted(layout)
        spec = real_truth(layout)["spec"]
        for name, folder in (("zerofast", ours), ("ds_to_universal", theirs)):
            cases.append({"name": f"{layout}_{name}", "spec": spec, "load_dir": str(folder.parent),
                          "tag": folder.name})
    job, result = base / "job.json", base / "result.pt"
    job.write_text(json.dumps({"result": str(result), "cases": cases}))
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    for _attempt in range(3):  # again only where not_ours: the port taken, the rendezvous failed
        result.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(_free_port()), str(RESUME), str(job)]
        proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode == 0 or not not_ours(proc.stdout + proc.stderr):
            break
    assert proc.returncode == 0 and result.is_file(), (proc.stdout + proc.stderr)[-6000:]
    results = torch.load(result, weights_only=True)
    assert set(results) == {c["name"] for c in cases}
    return {**results, "_load_dirs": {c["name"]: c["load_dir"] for c in cases}}


@pytest.mark.parametrize("source", ["zerofast", "ds_to_universal"])
@pytest.mark.parametrize("layout", RESUMED)
def test_deepspeed_resumes_the_folder_at_tp2_dp1(resumed, layout, source):
    got = resumed[f"{layout}_{source}"]
    assert got["errors"] == [], "\n".join(got["errors"])
    assert got["loaded"] is not None and got["loaded"].startswith(resumed["_load_dirs"][f"{layout}_{source}"])
    truth = real_truth(layout)
    assert set(got["trainable"]) == set(truth["trainable"])
    for param, want in truth["trainable"].items():
        assert_bitwise_equal(got["trainable"][param], want, f"fp32 master {param}")
        # the module's bf16 weights are the loaded masters, cast
        assert_bitwise_equal(got["module"][param], want.to(got["module"][param].dtype), f"module weight {param}")
        for key in KEYS:
            assert_bitwise_equal(got["optimizer_states"][key][param], truth["optimizer_states"][key][param],
                                 f"{key} {param}")
    assert got["optimizer_step"] == truth["optimizer_step"]
    assert got["loss_after"] is not None and torch.isfinite(torch.tensor(got["loss_after"]))


@pytest.mark.parametrize("layout", RESUMED)
def test_resumed_step_trains_as_the_control(resumed, layout):
    ours, control = resumed[f"{layout}_zerofast"], resumed[f"{layout}_ds_to_universal"]
    assert ours["errors"] == [] and control["errors"] == []
    assert ours["loss_after"] == control["loss_after"]
