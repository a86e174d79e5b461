"""The ``zerofast`` command: export, inspect, progress bar, and its one-line errors."""
from __future__ import annotations

import importlib.util
import io
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
from zerofast.hf import load_exported
from zerofast.output.transaction import MARKER

MARKER_TOP, MARKER_NAME = MARKER.split("/")[0], Path(MARKER).name  # what listdir / a rename shows

from tests.dsgen.catalog import LAYOUTS
from tests.planting import ZERO_STAGE_ENUM, Call, copy_checkpoint, rewrite
from tests.helpers import real_root as _root, real_truth as _truth

REPO = Path(__file__).resolve().parent.parent

_NO_DEEPSPEED = importlib.util.find_spec("deepspeed") is None
SMALL = "s2_bf16_w2_frozen_tied"


def needs_deepspeed(test):
    skip = pytest.mark.skipif(_NO_DEEPSPEED, reason="real checkpoints are made by DeepSpeed 0.19.8, "
                                                    "which is not installed (pip install deepspeed==0.19.8)")
    return pytest.mark.deepspeed(skip(test))


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def _assert_one_error_line(err: str, *fragments: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("zerofast: error: "), err
    for fragment in fragments:
        assert fragment in lines[0]


# ---------------------------------------------------------------------------------------------
# export

@needs_deepspeed
def test_export_writes_files_and_a_summary(tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["export", str(_root(SMALL)), str(out), "--dtype", "bf16", "--format", "torch",
               "--max-shard-size", "2KB"])
    stdout = capsys.readouterr().out
    assert rc == 0
    assert stdout.startswith("wrote ") and str(out) in stdout
    assert (out / "pytorch_model.bin.index.json").is_file()
    got = load_exported(out)
    want = zerofast.reconstruct(_root(SMALL), torch.bfloat16)
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in want)


@needs_deepspeed
@pytest.mark.parametrize("flag,dtype", [("keep", None), ("fp16", torch.float16)])
def test_export_dtype_flag_follows_the_policy(tmp_path, flag, dtype):
    assert main(["export", str(_root(SMALL)), str(tmp_path), "--dtype", flag, "--quiet"]) == 0
    got = load_exported(tmp_path)
    want = zerofast.reconstruct(_root(SMALL), dtype)
    assert {k: v.dtype for k, v in got.items()} == {k: v.dtype for k, v in want.items()}
    assert all(torch.equal(got[k], want[k]) for k in want)


@needs_deepspeed
def test_export_flags_reach_the_export(tmp_path):
    rc = main(["export", str(_root(SMALL)), str(tmp_path), "--exclude-frozen", "--duplicate-tied", "--quiet",
               "--tag", _truth(SMALL)["tag"]])
    assert rc == 0
    got = load_exported(tmp_path)
    assert not set(got) & set(_truth(SMALL)["frozen"])
    for alias, source in _truth(SMALL)["tied"].items():
        assert got[alias].data_ptr() != got[source].data_ptr()


@needs_deepspeed
def test_progress_bar_only_on_a_terminal_and_not_with_quiet(tmp_path, monkeypatch, capsys):
    tty = _Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    assert main(["export", str(_root(SMALL)), str(tmp_path / "a")]) == 0
    assert "export" in tty.getvalue() and "B/s" in tty.getvalue()
    assert capsys.readouterr().out.startswith("wrote ")

    quiet = _Tty()
    monkeypatch.setattr(sys, "stderr", quiet)
    assert main(["export", str(_root(SMALL)), str(tmp_path / "b"), "--quiet"]) == 0
    assert quiet.getvalue() == "" and capsys.readouterr().out == ""

    piped = io.StringIO()
    monkeypatch.setattr(sys, "stderr", piped)
    assert main(["export", str(_root(SMALL)), str(tmp_path / "c")]) == 0
    assert piped.getvalue() == ""


def test_missing_checkpoint_is_one_line_and_exit_1(tmp_path, capsys):
    rc = main(["export", str(tmp_path / "nope"), str(tmp_path / "out")])
    _assert_one_error_line(capsys.readouterr().err, str(tmp_path / "nope"))
    assert rc == 1
    assert not (tmp_path / "out").exists()


def test_debug_adds_the_traceback(tmp_path, capsys):
    rc = main(["inspect", str(tmp_path / "nope"), "--debug"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "Traceback" in err and "CheckpointNotFoundError" in err
    assert err.strip().splitlines()[-1].startswith("zerofast: error: ")


@needs_deepspeed
def test_foreign_output_folder_is_one_line_naming_overwrite(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    rc = main(["export", str(_root(SMALL)), str(tmp_path)])
    _assert_one_error_line(capsys.readouterr().err, "notes.txt", "--overwrite")
    assert rc == 1
    assert main(["export", str(_root(SMALL)), str(tmp_path), "--overwrite", "--quiet"]) == 0
    assert sorted(os.listdir(tmp_path)) == [MARKER_TOP, "model.safetensors", "notes.txt"]


@pytest.mark.parametrize("argv", [["export", "a", "b", "--max-shard-size", "5 parsecs"],
                                  ["export", "a", "b", "--dtype", "fp8"], ["export", "a"]])
def test_usage_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert "usage:" in capsys.readouterr().err


def test_no_command_prints_help_and_exits_2(capsys):
    assert main([]) == 2
    assert "export" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# inspect

def _stored_bytes(truth: dict, dtype: torch.dtype | None) -> int:
    total = 0
    for group in ("trainable", "frozen", "buffers"):
        for value in truth[group].values():
            size = dtype.itemsize if dtype is not None and value.is_floating_point() else value.element_size()
            total += value.numel() * size
    return total


@needs_deepspeed
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_inspect_json_reports_the_checkpoint(layout, capsys):
    assert main(["inspect", str(_root(layout)), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    truth = _truth(layout)
    assert (report["stage"], report["world_size"], report["tag"]) == (truth["stage"], truth["world_size"], truth["tag"])
    assert report["deepspeed_version"] == truth["ds_version"]
    assert report["training_dtype"] == truth["spec"]["dtype"]
    assert report["model_dtype"] == truth["model_dtype"]
    assert report["tied"] == truth["tied"]
    counts = {k: v["count"] for k, v in report["tensors"].items()}
    assert counts["trainable"] + counts["frozen"] == len(truth["trainable"]) + len(truth["frozen"])
    assert counts["buffer"] == len(truth["buffers"])
    assert sum(v["bytes"] for v in report["tensors"].values()) == _stored_bytes(truth, None)
    assert report["output_bytes"] == {"fp32": _stored_bytes(truth, torch.float32),
                                      "bf16": _stored_bytes(truth, torch.bfloat16),
                                      "fp16": _stored_bytes(truth, torch.float16),
                                      "keep": _stored_bytes(truth, None)}


@needs_deepspeed
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_inspect_table_is_readable(layout, capsys):
    assert main(["inspect", str(_root(layout))]) == 0
    text = capsys.readouterr().out
    truth = _truth(layout)
    assert f"ZeRO-{truth['stage']}" in text and truth["tag"] in text
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.strip()}
    assert rows["world"][-1] == str(truth["world_size"])
    assert int(rows["buffer"][1]) == len(truth["buffers"])
    assert int(rows["fp32"][-2].replace(",", "")) == _stored_bytes(truth, torch.float32)
    for alias, source in truth["tied"].items():
        assert f"{alias} -> {source}" in text


@needs_deepspeed
def test_python_dash_m_runs_the_same_command():
    proc = subprocess.run([sys.executable, "-m", "zerofast", "inspect", str(_root(SMALL)), "--json"],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["stage"] == _truth(SMALL)["stage"]


# ---------------------------------------------------------------------------------------------
# Hostile and broken checkpoints through the command: one line naming the file, exit 1, nothing
# run and nothing written.

OPTIM = "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"


def _planted(tmp_path: Path, marker: Path) -> tuple[Path, Path]:
    """A copy of SMALL with ``os.system("touch marker")`` planted in an Adam moment, a part of the
    file zerofast never uses."""
    root, tag_dir = copy_checkpoint(_root(SMALL), tmp_path / "ckpt")
    victim = tag_dir / OPTIM
    payload = Call(f"{os.system.__module__}.system", f"touch '{marker}'")
    rewrite(victim, lambda o: o["optimizer_state_dict"]["base_optimizer_state"]["state"][0].__setitem__("exp_avg",
                                                                                                         payload))
    return root, victim


def _commands(root: Path, out: Path) -> dict[str, list[str]]:
    return {"inspect": ["inspect", str(root)], "export": ["export", str(root), str(out)],
            "zero-to-fp32": ["zero-to-fp32", str(root), str(out)]}


@needs_deepspeed
@pytest.mark.parametrize("command", ["inspect", "export", "zero-to-fp32"])
def test_planted_payload_is_one_line_and_nothing_runs(tmp_path, capsys, command):
    marker = tmp_path / "marker"
    root, victim = _planted(tmp_path, marker)
    out = tmp_path / "out"
    rc = main(_commands(root, out)[command])
    captured = capsys.readouterr()
    assert rc == 1 and captured.out == ""
    _assert_one_error_line(captured.err, f"{victim}: refused pickle ", f"'{os.system.__module__}.system'",
                           "nothing was executed")
    assert not marker.exists()
    assert not out.exists()


@needs_deepspeed
def test_planted_payload_in_a_fresh_process(tmp_path):
    """The real command, as a user runs it: exit code 1, one line and no traceback, and with
    --debug the traceback too. Nothing runs either way."""
    marker = tmp_path / "marker"
    root, victim = _planted(tmp_path, marker)
    argv = [sys.executable, "-m", "zerofast", "export", str(root), str(tmp_path / "out")]
    plain = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=120)
    debug = subprocess.run([*argv, "--debug"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert plain.returncode == debug.returncode == 1
    _assert_one_error_line(plain.stderr, str(victim), "refused pickle")
    assert "Traceback" in debug.stderr and "UnsafeCheckpointError" in debug.stderr
    assert debug.stderr.splitlines()[-1] == plain.stderr.strip()
    assert not marker.exists()


def _truncate(root: Path, tag_dir: Path) -> tuple[Path, str]:
    victim = tag_dir / OPTIM
    victim.write_bytes(victim.read_bytes()[:-30])
    return victim, "expected a torch.save zip archive; the file is truncated or not one"


def _remove_rank(root: Path, tag_dir: Path) -> tuple[Path, str]:
    (tag_dir / OPTIM).unlink()
    return tag_dir, "missing: bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"


def _unknown_stage(root: Path, tag_dir: Path) -> tuple[Path, str]:
    for rank in (0, 1):
        rewrite(tag_dir / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
                lambda o: o["optimizer_state_dict"].__setitem__("zero_stage", Call(ZERO_STAGE_ENUM, 7)))
    return tag_dir / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "found zero_stage 7"


def _several_tags(root: Path, tag_dir: Path) -> tuple[Path, str]:
    (root / "latest").unlink()
    shutil.copytree(tag_dir, root / "global_step99")
    return root, "no 'latest' file and 2 tags"


@needs_deepspeed
@pytest.mark.parametrize("command", ["inspect", "export"])
@pytest.mark.parametrize("damage", [_truncate, _remove_rank, _unknown_stage, _several_tags],
                         ids=lambda f: f.__name__.strip("_"))
def test_broken_checkpoint_is_one_line_naming_the_file(tmp_path, capsys, damage, command):
    root, tag_dir = copy_checkpoint(_root(SMALL), tmp_path / "ckpt")
    where, expected = damage(root, tag_dir)
    out = tmp_path / "out"
    rc = main(_commands(root, out)[command])
    assert rc == 1
    _assert_one_error_line(capsys.readouterr().err, f"zerofast: error: {where}: ", expected)
    assert not out.exists()
