"""zerofast.verify and zerofast.diff on real DeepSpeed checkpoints, with planted faults.

Faults are planted into copies of the suite's real checkpoints and exports, each at a place
read off the checkpoint's own plan (so the test names the tensor it expects to be reported).
"""
from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch

import zerofast
from tests.conftest import HAVE_DEEPSPEED
from tests.dsgen.catalog import LAYOUTS, ensure_checkpoint
from tests.dsgen.families import FAMILY_LAYOUTS
from zerofast.cli import main as cli
from zerofast.load.unpickle import file_location
from zerofast.prepare import prepare

pytestmark = pytest.mark.skipif(not HAVE_DEEPSPEED, reason="DeepSpeed 0.19.8 is needed to make real checkpoints")

MIXED_PRECISION_WITH_WEIGHTS = {n for n, s in {**LAYOUTS, **FAMILY_LAYOUTS}.items()
                                if s["stage"] in (0, 1, 2) and s["dtype"] == "bf16"}


def _copy(root: Path, tmp_path: Path) -> Path:
    dest = tmp_path / root.name
    shutil.copytree(root, dest)
    return dest


def _assert_clean(report):
    assert report.ok, "\n".join(report.lines())
    assert report.findings == [], "\n".join(report.lines())


@pytest.mark.parametrize("name", sorted(LAYOUTS) + sorted(FAMILY_LAYOUTS))
def test_verify_is_clean_on_every_real_checkpoint(name):
    report = zerofast.verify(ensure_checkpoint(name))
    _assert_clean(report)
    if name in MIXED_PRECISION_WITH_WEIGHTS and not name.startswith("autotp"):
        assert any(c.startswith("masters:") and "cast to bfloat16" in c for c in report.checks), report.checks
    if LAYOUTS.get(name, FAMILY_LAYOUTS.get(name))["stage"]:
        assert any(c.startswith("steps:") for c in report.checks), report.checks


@pytest.mark.parametrize("run", ["full_z2_bf16_tied", "peft_z2_bf16_tied"])
def test_verify_is_clean_on_hf_trainer_checkpoints(run):
    from tests.dsgen.hf_catalog import ensure_run

    report = zerofast.verify(ensure_run(run))  # the Trainer's output_dir, holding one checkpoint-N
    _assert_clean(report)
    assert any(c.startswith("masters:") and "cast to bfloat16" in c for c in report.checks), report.checks


def test_verify_is_clean_on_deepspeed_universal_checkpoints():
    from tests.dsgen.universal import DEFAULT, ensure_universal

    for name in DEFAULT:
        report = zerofast.verify(ensure_universal(name))
        _assert_clean(report)
        assert report.kind == "universal checkpoint" and any(c.startswith("shapes:") for c in report.checks)


# ---------------------------------------------------------------------------------------------
# Planting faults at the bytes the plan points to

def _segments(ckpt: Path, name: str, key: str | None = None):
    """(file, byte offset, element count, dtype) of every source range of ``name`` (``key``: that
    optimizer state of it), read off zerofast's plan of ``ckpt``."""
    prepared = prepare(ckpt, None, optimizer_keys=[key] if key else None, warn_absent=False)
    tp = prepared.plan.tensors[name]
    out = []
    for src, src_off, _, length in tp.segments:
        t, file = prepared.sources[src], prepared.files[src]
        base, _ = file_location(file, t)
        out.append((file, base + src_off * t.element_size(), length, t.dtype))
    return out


def _overwrite(file: str, offset: int, data: bytes) -> None:
    fd = os.open(file, os.O_WRONLY)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


def _first_trainable(ckpt: Path) -> str:
    plan = prepare(ckpt, None, warn_absent=False).plan
    return next(n for n, tp in plan.tensors.items() if tp.kind == "trainable" and tp.numel > 1)


@pytest.mark.parametrize("layout", ["s1_bf16_w2_frozen", "s2_bf16_w2_frozen_tied"])
def test_one_master_element_changed_is_found_by_the_16bit_cross_check(layout, tmp_path):
    ckpt = _copy(ensure_checkpoint(layout), tmp_path)
    name = _first_trainable(ckpt)
    file, offset, _, dtype = _segments(ckpt, name)[0]
    assert dtype == torch.float32
    with open(file, "rb") as f:
        f.seek(offset)
        (value,) = struct.unpack("<f", f.read(4))
    _overwrite(file, offset, struct.pack("<f", value + 0.5))  # far beyond bf16 rounding
    report = zerofast.verify(ckpt)
    assert not report.ok
    found = report.by_check("master-weight")
    assert [f.name for f in found] == [name], report.lines()
    assert found[0].detail["changed"] == 1 and found[0].detail["max_abs"] >= 0.25


def test_a_rank_file_from_an_earlier_step_of_the_same_run_is_found(tmp_path):
    from tests.dsgen.two_saves import ensure_two_saves

    root = _copy(ensure_two_saves(), tmp_path)
    _assert_clean(zerofast.verify(root))
    stale = "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shutil.copyfile(root / "global_step2" / stale, root / "global_step3" / stale)
    report = zerofast.verify(root)
    assert not report.ok
    steps = report.by_check("steps")
    assert steps and all(f.name.startswith(stale) for f in steps), report.lines()
    assert {f.detail["step"] for f in steps} == {2.0} and {f.detail["expected"] for f in steps} == {3.0}
    assert report.by_check("master-weight"), report.lines()  # rank 1's partition is a step behind


def test_zero3_rank_files_from_an_earlier_step_are_found(tmp_path):
    from tests.dsgen.two_saves import ensure_two_saves

    root = _copy(ensure_two_saves(3), tmp_path)
    _assert_clean(zerofast.verify(root))
    optim, model = "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt"
    shutil.copyfile(root / "global_step2" / optim, root / "global_step3" / optim)
    steps = zerofast.verify(root).by_check("steps")
    assert steps and all(f.name.startswith(optim) and f.detail["step"] == 2.0 for f in steps)
    shutil.copyfile(root / "global_step2" / model, root / "global_step3" / model)
    report = zerofast.verify(root)
    assert any(f.name == model and "global_steps" in f.message for f in report.by_check("files")), report.lines()


def test_one_experts_zeroed_moments_are_found(tmp_path):
    ckpt = _copy(ensure_checkpoint("moe_s2_bf16_w2_ep2"), tmp_path)
    plan = prepare(ckpt, None, optimizer_keys=["exp_avg"], warn_absent=False).plan
    expert = [n for n in plan.tensors if ".deepspeed_experts.1." in n]
    assert expert
    for name in expert:
        for key in ("exp_avg", "exp_avg_sq"):
            for file, offset, length, dtype in _segments(ckpt, name, key):
                _overwrite(file, offset, bytes(length * dtype.itemsize))
    report = zerofast.verify(ckpt)
    assert not report.ok
    assert sorted(f.name for f in report.by_check("moments-zero")) == sorted(
        f"{n}.{k}" for n in expert for k in ("exp_avg", "exp_avg_sq")), report.lines()


def test_nan_in_a_master_is_reported_and_fatal_only_with_strict(tmp_path):
    ckpt = _copy(ensure_checkpoint("s3_bf16_w2_frozen_tied"), tmp_path)  # no 16-bit copy at ZeRO-3
    name = _first_trainable(ckpt)
    file, offset, _, _ = _segments(ckpt, name)[0]
    _overwrite(file, offset, struct.pack("<f", float("nan")))
    report = zerofast.verify(ckpt)
    assert report.ok, report.lines()
    [note] = report.by_check("nonfinite")
    assert (note.name, note.fatal, note.detail) == (name, False, {"nan": 1, "inf": 0})
    strict = zerofast.verify(ckpt, strict=True)
    assert not strict.ok and [f.name for f in strict.failures] == [name]


def test_a_missing_rank_file_is_a_files_finding(tmp_path):
    ckpt = _copy(ensure_checkpoint("s2_bf16_w2_frozen_tied"), tmp_path)
    tag = (ckpt / "latest").read_text().strip()
    (ckpt / tag / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    report = zerofast.verify(ckpt)
    [finding] = report.failures
    assert finding.check == "files" and "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt" in finding.message


# ---------------------------------------------------------------------------------------------
# Outputs against their source

EXPORTS = [
    dict(dtype=torch.float32, max_shard_size="4KB"),
    dict(dtype=torch.bfloat16),
    dict(dtype=None, max_shard_size="4KB", optimizer_states=True),
    dict(dtype=torch.float32, format="torch", max_shard_size="4KB"),
    dict(dtype=torch.float16, exclude_frozen=True),
    dict(dtype=torch.float32, duplicate_tied=True),
]


@pytest.mark.parametrize("layout", ["s2_bf16_w2_frozen_tied", "s3_bf16_w2_frozen_tied", "moe_s1_bf16_w4_ep2",
                                    "pipe_s1_bf16_pp2_dp2", "autotp_s2_bf16_w4_tp2"])
def test_verify_against_is_clean_for_exports(layout, tmp_path):
    ckpt = ensure_checkpoint(layout)
    for i, options in enumerate(EXPORTS if layout.startswith("s") else EXPORTS[:2]):
        out = tmp_path / f"out{i}"
        zerofast.export(ckpt, out, **options)
        report = zerofast.verify(out, against=ckpt)
        _assert_clean(report)
        assert report.tensors > 0 and "equal bit for bit" in " ".join(report.checks)


@pytest.mark.parametrize("layout", ["s1_bf16_w4_resume", "s2_bf16_w4_resume", "s3_bf16_w4_resume"])
def test_verify_against_is_clean_for_reshards_and_universal_outputs(layout, tmp_path):
    ckpt = ensure_checkpoint(layout)
    zerofast.reshard(ckpt, tmp_path / "resharded", 3)
    zerofast.to_universal(ckpt, tmp_path / "universal" / "global_step3")
    for out in (tmp_path / "resharded", tmp_path / "universal"):
        report = zerofast.verify(out, against=ckpt)
        _assert_clean(report)
        checks = " ".join(report.checks)
        assert "optimizer (exp_avg, exp_avg_sq)" in checks and "steps:" in checks and "saved state" in checks
        _assert_clean(zerofast.verify(out))


def test_verify_against_is_clean_for_deepspeeds_universal_conversions():
    from tests.dsgen.universal import DEFAULT, ensure_universal

    for name in DEFAULT:  # ZeRO-2, ZeRO-3, and the BF16_Optimizer
        report = zerofast.verify(ensure_universal(name), against=ensure_checkpoint(name))
        _assert_clean(report)
        assert report.kind == "universal checkpoint" and "optimizer (exp_avg, exp_avg_sq)" in " ".join(report.checks)


def test_an_exported_optimizer_step_that_differs_is_found(tmp_path):
    ckpt = ensure_checkpoint("s2_bf16_w2_frozen_tied")
    zerofast.export(ckpt, tmp_path / "o", optimizer_states=True)
    report = zerofast.verify(tmp_path / "o", against=ckpt)
    _assert_clean(report)
    assert any(c.startswith("steps: optimizer_state.json") for c in report.checks)
    doc = json.loads((tmp_path / "o" / "optimizer_state.json").read_text())
    name = next(iter(doc["state"]))
    doc["state"][name]["step"] = 0
    (tmp_path / "o" / "optimizer_state.json").write_text(json.dumps(doc))
    assert [(f.check, f.name) for f in zerofast.verify(tmp_path / "o", against=ckpt).failures] == [("steps", name)]


def test_a_reshard_with_a_changed_moment_or_global_steps_is_found(tmp_path):
    from tests import planting

    ckpt = ensure_checkpoint("s2_bf16_w4_resume")
    out = zerofast.reshard(ckpt, tmp_path / "r", 2)
    name = _first_trainable(out)
    file, offset, _, _ = _segments(out, name, "exp_avg")[0]
    _overwrite(file, offset, struct.pack("<f", 123.0))
    report = zerofast.verify(tmp_path / "r", against=ckpt)
    assert [f.name for f in report.failures] == [f"{name}.exp_avg"] and report.failures[0].check == "values"
    states = out / "mp_rank_00_model_states.pt"
    obj = planting.load(states)
    obj["global_steps"] += 1
    planting.save(obj, states)
    report = zerofast.verify(tmp_path / "r", against=ckpt)
    assert ("saved-state", "global_steps") in [(f.check, f.name) for f in report.failures], report.lines()


def _sharded_export(tmp_path: Path, **options) -> tuple[Path, Path]:
    ckpt = ensure_checkpoint("s2_bf16_w2_frozen_tied")
    out = tmp_path / "hf"
    zerofast.export(ckpt, out, max_shard_size="4KB", **options)
    return ckpt, out


def _index(out: Path) -> dict:
    return json.loads((out / "model.safetensors.index.json").read_text())


def test_a_truncated_export_shard_is_found(tmp_path):
    ckpt, out = _sharded_export(tmp_path)
    shard = sorted(out.glob("model-0000*.safetensors"))[1]
    lost = [n for n, f in _index(out)["weight_map"].items() if f == shard.name]
    os.truncate(shard, shard.stat().st_size - 100)
    report = zerofast.verify(out, against=ckpt)
    assert [f.name for f in report.by_check("truncated")] == [shard.name]
    assert {f.name for f in report.by_check("missing")} <= set(lost) and report.by_check("missing")
    assert not zerofast.verify(out).ok  # found without the checkpoint too


def test_an_export_shard_replaced_by_the_same_shard_in_bf16_is_found(tmp_path):
    from safetensors.torch import load_file, save_file

    ckpt, out = _sharded_export(tmp_path)
    shard = sorted(out.glob("model-0000*.safetensors"))[0]
    tensors = load_file(shard)
    save_file({n: t.to(torch.bfloat16) if t.is_floating_point() else t for n, t in tensors.items()}, shard,
              metadata={"format": "pt"})
    report = zerofast.verify(out, against=ckpt)
    floating = sorted(n for n, t in tensors.items() if t.is_floating_point())
    assert sorted(f.name for f in report.by_check("dtype")) == floating, report.lines()
    assert all(f.detail == {"expected": "float32", "found": "bfloat16"} for f in report.by_check("dtype"))


def test_a_tensor_dropped_from_the_index_is_found(tmp_path):
    ckpt, out = _sharded_export(tmp_path)
    doc = _index(out)
    dropped = sorted(doc["weight_map"])[3]
    del doc["weight_map"][dropped]
    (out / "model.safetensors.index.json").write_text(json.dumps(doc))
    report = zerofast.verify(out, against=ckpt)
    assert [f.name for f in report.by_check("missing")] == [dropped]
    assert dropped in [f.name for f in report.by_check("index")]
    alone = zerofast.verify(out).by_check("index")  # without the checkpoint: the file holds it, the index not
    assert dropped in [f.name for f in alone] and not zerofast.verify(out).ok


def test_a_config_dtype_that_does_not_match_the_weights_is_found(tmp_path):
    from tests.dsgen.hf_catalog import ensure_run

    run = ensure_run("full_z2_bf16_tied")
    out = tmp_path / "hf"
    zerofast.export(run, out, dtype=torch.float32)
    _assert_clean(zerofast.verify(out, against=run))
    config = json.loads((out / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config))
    report = zerofast.verify(out, against=run)
    [finding] = report.failures
    assert (finding.check, finding.detail) == ("config-dtype", {"config": "bfloat16", "weights": "float32"})


def test_peft_adapter_and_merged_exports_verify_against_the_trainer_checkpoint(tmp_path):
    from tests.dsgen.hf_catalog import ensure_run

    run = ensure_run("peft_z2_bf16_tied")
    zerofast.export(run, tmp_path / "adapter", adapter=True)
    _assert_clean(zerofast.verify(tmp_path / "adapter", against=run))
    zerofast.export(run, tmp_path / "merged", merge_adapters=True, base_model=run / "base")
    _assert_clean(zerofast.verify(tmp_path / "merged", against=run, base_model=run / "base"))


# ---------------------------------------------------------------------------------------------
# diff

def test_diff_of_two_saves_one_step_apart_changes_every_trainable_and_no_frozen_tensor():
    from tests.dsgen.two_saves import ensure_two_saves

    root = ensure_two_saves()
    truth = torch.load(root / "truth.pt", weights_only=True)
    d = zerofast.diff(root / "global_step2", root / "global_step3", optimizer=True)
    assert d.only_a == [] and d.only_b == []
    changed = {c.name for c in d.changed}
    assert set(truth["trainable"]) <= changed, sorted(set(truth["trainable"]) - changed)
    assert set(truth["frozen"]) <= set(d.equal)
    for name in truth["trainable"]:
        c = d.change(name)
        assert not c.retyped and c.changed > 0 and 0 < c.max_abs <= 0.05  # one AdamW step at lr 1e-2
        for key in ("exp_avg", "exp_avg_sq"):
            assert d.change(f"{name}.{key}").changed > 0
    rels = [c.max_rel for c in d.changed]
    assert rels == sorted(rels, reverse=True)


def test_diff_of_a_checkpoint_and_its_exports(tmp_path):
    ckpt = ensure_checkpoint("s2_bf16_w2_frozen_tied")
    zerofast.export(ckpt, tmp_path / "keep", dtype=None)
    zerofast.export(ckpt, tmp_path / "bf16", dtype=torch.bfloat16, exclude_frozen=True)
    same = zerofast.diff(ckpt, tmp_path / "keep")
    assert same.identical and same.equal
    d = zerofast.diff(tmp_path / "keep", tmp_path / "bf16")
    plan = prepare(ckpt, None, warn_absent=False).plan
    frozen = [n for n, tp in plan.tensors.items() if tp.kind == "frozen"]
    assert set(d.only_a) == set(frozen)
    trainable = [n for n, tp in plan.tensors.items() if tp.kind == "trainable"]
    assert set(trainable) <= {c.name for c in d.changed if c.dtype_a == "float32" and c.dtype_b == "bfloat16"}


# ---------------------------------------------------------------------------------------------
# The command line

def test_cli_verify_prints_one_line_per_finding_and_exits_1(tmp_path, capsys):
    ckpt, out = _sharded_export(tmp_path)
    assert cli(["verify", str(out), "--against", str(ckpt)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("OK: ")
    doc = _index(out)
    dropped = sorted(doc["weight_map"])[0]
    del doc["weight_map"][dropped]
    (out / "model.safetensors.index.json").write_text(json.dumps(doc))
    assert cli(["verify", str(out), "--against", str(ckpt)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].startswith("FAILED: ") and f"FAIL missing: {dropped}: " in "\n".join(lines)
    assert cli(["verify", str(out), "--against", str(ckpt), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and {"check": "missing", "name": dropped} in [
        {k: f[k] for k in ("check", "name")} for f in report["findings"]]


def test_cli_diff_json(tmp_path, capsys):
    from tests.dsgen.two_saves import ensure_two_saves

    root = ensure_two_saves()
    assert cli(["diff", str(root / "global_step2"), str(root / "global_step3"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["changed"] and doc["equal"] and doc["identical"] is False
    assert cli(["verify", str(tmp_path / "nope")]) == 1
    assert "FAIL files:" in capsys.readouterr().out
