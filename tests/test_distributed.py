"""An export shared among ranks: under torchrun on loopback and with ``--workers``, it writes the
bytes a single process writes; a rank that fails makes every rank fail, and nothing lands under a
final name. Each launch costs a few seconds (every rank imports torch), so there are few of them.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from zerofast.cli import _as_one_rank, main
from zerofast.output.team import Team, share
from zerofast.base.errors import ExportError
from zerofast.testing.synthesize import BufferSpec, LayoutSpec, ParamSpec, synthesize
from zerofast.hf import export
from zerofast.output.transaction import MARKER

from tests.conftest import needs_deepspeed
from tests.dsgen.catalog import ensure_checkpoint
from tests.dist_fault import FAULT_ENV

REPO = Path(__file__).resolve().parent.parent
TINY = "3KB"  # several shards per export, so both ranks get files to write
REAL = "s3_bf16_w2_frozen_tied"


@pytest.fixture(scope="module")
def synthesized(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("synth")
    synthesize(root, LayoutSpec(
        stage=2, world_size=3, model_dtype=torch.bfloat16,
        groups=[[ParamSpec("embed.weight", (64, 16)), ParamSpec("l0.weight", (48, 16)), ParamSpec("l0.bias", (48,))],
                [ParamSpec(f"l{i}.weight", (40, 16)) for i in range(1, 6)]],
        frozen=[ParamSpec("base.weight", (32, 16))],
        buffers=[BufferSpec("steps", (2,), torch.int64), BufferSpec("mask", (5,), torch.bool)],
        tied={"head.weight": "embed.weight"}))
    return root


def _env(path: Path | None = None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", FAULT_ENV)}
    paths = [str(p) for p in (path, REPO) if p] + [env.get("PYTHONPATH", "")]
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(paths), **extra)
    return env


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(*args: str, module: str = "zerofast") -> subprocess.CompletedProcess:
    for _ in range(3):  # another process may take the free port before the launcher binds it
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(_free_port()), "-m", module, *args]
        proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=180)
        if "address already in use" not in proc.stderr.lower():
            break
    return proc


def _zerofast(*args: str, path: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zerofast", *args], cwd=REPO, env=_env(path, **env),
                          capture_output=True, text=True, timeout=180)


def _assert_same_files(got: Path, want: Path) -> None:
    names = sorted(str(p.relative_to(want)) for p in want.rglob("*") if p.is_file())
    assert sorted(str(p.relative_to(got)) for p in got.rglob("*") if p.is_file()) == names
    # The marker records each file's inode and mtime (what proves it zerofast's): only its list matches.
    assert json.loads((got / MARKER).read_text())["files"] == json.loads((want / MARKER).read_text())["files"]
    assert [n for n in names if n != MARKER and (got / n).read_bytes() != (want / n).read_bytes()] == []


def _assert_nothing_final(out: Path) -> None:
    # Not even the temporary folder: every rank that is still alive cleans up before it exits.
    assert not out.exists() or os.listdir(out) == []


# ---------------------------------------------------------------------------------------------
# The same bytes as one process

@needs_deepspeed
def test_torchrun_export_of_a_real_checkpoint_is_the_single_process_export(tmp_path):
    ckpt = ensure_checkpoint(REAL)
    single = export(ckpt, tmp_path / "single", max_shard_size=TINY, optimizer_states=True)
    proc = _torchrun("export", str(ckpt), str(tmp_path / "ranks"), "--max-shard-size", TINY, "--optimizer-states")
    assert proc.returncode == 0, proc.stderr
    assert len(single.files) > 2 and single.index
    assert proc.stdout.count("wrote ") == 1 and "by 2 ranks" in proc.stdout  # rank 0 alone reports
    _assert_same_files(tmp_path / "ranks", tmp_path / "single")


def test_torchrun_export_of_a_synthesized_checkpoint_is_the_single_process_export(tmp_path, synthesized):
    single = export(synthesized, tmp_path / "single", max_shard_size=TINY, format="torch", dtype=torch.bfloat16)
    proc = _torchrun("export", str(synthesized), str(tmp_path / "ranks"), "--max-shard-size", TINY,
                     "--format", "torch", "--dtype", "bf16")
    assert proc.returncode == 0, proc.stderr
    assert len(single.files) > 2
    _assert_same_files(tmp_path / "ranks", tmp_path / "single")


def test_workers_export_is_the_single_process_export(tmp_path, synthesized):
    single = export(synthesized, tmp_path / "single", max_shard_size=TINY, optimizer_states=True, dtype=None)
    proc = _zerofast("export", str(synthesized), str(tmp_path / "workers"), "--max-shard-size", TINY,
                     "--optimizer-states", "--dtype", "keep", "--workers", "2")
    assert proc.returncode == 0, proc.stderr
    assert len(single.files) > 2
    assert "by 2 ranks" in proc.stdout
    _assert_same_files(tmp_path / "workers", tmp_path / "single")


# ---------------------------------------------------------------------------------------------
# One rank fails

def test_a_rank_that_dies_fails_every_rank_and_nothing_is_committed(tmp_path, synthesized):
    out = tmp_path / "out"
    proc = _torchrun("exit", "export", str(synthesized), str(out), "--max-shard-size", TINY,
                     module="tests.dist_fault")
    assert proc.returncode != 0
    # Rank 0 hears of it from gloo (the connection closes) or from torchrun (SIGTERM), and says so;
    # on a busy machine torchrun's SIGTERM can come before rank 0 has joined the team, and rank 0
    # then ends as any interrupted command does (rank 1 dies printing nothing).
    rank0 = [ln for ln in proc.stderr.splitlines()
             if ln.startswith("zerofast: error: [rank 0 of 2]") or ln == "zerofast: interrupted (SIGTERM)"]
    assert len(rank0) == 1 and ("lost contact" in rank0[0] or "SIGTERM" in rank0[0]), proc.stderr
    _assert_nothing_final(out)


def test_a_rank_that_raises_fails_every_worker_with_its_error(tmp_path, synthesized):
    out = tmp_path / "out"
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text("import tests.dist_fault\n")
    proc = _zerofast("export", str(synthesized), str(out), "--max-shard-size", TINY, "--workers", "2",
                     path=tmp_path / "site", **{FAULT_ENV: "raise"})
    assert proc.returncode == 1
    assert ("zerofast: error: [rank 0 of 2] " f"{out}: rank 1 of 2 failed while writing the files: "
            "RuntimeError: injected failure in rank 1") in proc.stderr
    assert proc.stderr.rstrip().splitlines()[-1].startswith("zerofast: error: the export on 2 workers failed: ")
    _assert_nothing_final(out)


def test_workers_under_torchrun_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert main(["export", str(tmp_path), str(tmp_path / "out"), "--workers", "2"]) == 1
    assert capsys.readouterr().err.startswith("zerofast: error: [rank 1 of 2] --workers starts ranks of its own")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_workers_on_a_missing_gpu_fail_before_starting_any_rank(tmp_path, capsys):
    assert main(["export", str(tmp_path), str(tmp_path / "out"), "--device", "cuda", "--workers", "2"]) == 1
    assert capsys.readouterr().err.startswith("zerofast: error: device='cuda': ")
    assert not (tmp_path / "out").exists()


def test_each_worker_runs_the_command_with_one_worker():
    assert _as_one_rank(["export", "a", "b", "--workers", "4"]) == ["export", "a", "b", "--workers", "4",
                                                                    "--workers", "1"]
    assert _as_one_rank(["export", "--workers=2", "--", "-a", "b"]) == ["export", "--workers=2", "--workers", "1",
                                                                       "--", "-a", "b"]


# ---------------------------------------------------------------------------------------------
# The pieces, without launching: the assignment and the agreement

@given(st.lists(st.integers(0, 10**9), max_size=40), st.integers(1, 6))
def test_share_gives_each_file_to_one_rank_balanced_by_bytes(sizes, ranks):
    owners = share(sizes, ranks)
    assert len(owners) == len(sizes) and all(0 <= r < ranks for r in owners)
    loads = [sum(s for s, r in zip(sizes, owners) if r == rank) for rank in range(ranks)]
    assert max(loads) - min(loads) <= max(sizes, default=0)
    assert share(list(sizes), ranks) == owners  # what every rank computes on its own


def _team(rank: int, *answers: list, sent: list | None = None) -> Team:
    """A Team whose other ranks send ``answers[i]`` (their objects, in rank order) to gather i."""
    replies = iter(answers)

    def gather(obj):
        if sent is not None:
            sent.append(obj)
        others = next(replies)
        return [*others[:rank], obj, *others[rank:]]

    return Team(rank, len(answers[0]) + 1, gather)


def test_a_step_fails_on_every_rank_when_one_rank_failed(tmp_path):
    team = _team(0, ["RuntimeError: disk full"])
    with pytest.raises(ExportError, match="rank 1 of 2 failed while writing the files: RuntimeError: disk full"):
        with team.step("writing the files", tmp_path):
            pass
    assert team.failing


def test_a_failing_rank_tells_the_others_and_raises_its_own_error(tmp_path):
    sent = []
    team = _team(1, [None], sent=sent)
    with pytest.raises(OSError, match="no space"):
        with team.step("writing the files", tmp_path):
            raise OSError("no space")
    assert sent == ["OSError: no space"]


def test_a_lost_rank_is_reported_as_lost_contact(tmp_path):
    def gather(obj):
        raise RuntimeError("[pair.cc:537] Read error: Connection reset by peer. This is typically caused by ...")

    team = Team(0, 2, gather)
    with pytest.raises(ExportError, match=r"lost contact with the other ranks while writing the files .*"
                                          r": Read error: Connection reset by peer$"):
        with team.step("writing the files", tmp_path):
            pass


def test_ranks_that_planned_different_exports_are_refused(tmp_path):
    team = _team(0, ["another plan"])
    with pytest.raises(ExportError, match="rank 1 of 2 planned another export than rank 0"):
        team.share([], "global_step1", tmp_path)


def test_a_rank_that_cannot_see_the_output_folder_fails(tmp_path):
    team = _team(1, [None], [str(tmp_path / ".zerofast-tmp-1")], [None])
    with pytest.raises(ExportError, match="every rank must write to the same folder"):
        with team.output_dir(tmp_path, overwrite=False):
            pass
