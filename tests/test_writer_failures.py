"""reshard, to-universal and export when the disk fills up or a signal comes: one clean error or
one ``interrupted`` line, no temporary folder left, nothing under a final name, and a rerun that
succeeds. On real DeepSpeed 0.19.8 checkpoints, each writer run as a command in a child process
(a SIGBUS there shows up as a return code instead of killing pytest).

The full-disk cases run on a small tmpfs (mounting needs root), filled up to a chosen number of
free pages, so that each writer fails at a different point: its first file, in the middle of a
file, the index, ``latest``. tmpfs counts whole 4 KiB pages per file and nothing for folders, so
those points follow from the sizes of a clean run's files.
"""
from __future__ import annotations

import json
import os
import random
import re
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import zerofast
from zerofast.cli import main
from zerofast.output.transaction import MARKER
from zerofast.testing.synthesize import LayoutSpec, ParamSpec, synthesize

from tests.conftest import needs_deepspeed
from tests.helpers import assert_bitwise_equal, assert_same_state, ctrl_c_as_in_a_terminal, real_root, small_tmpfs

SMALL = "s2_bf16_w2_frozen_tied"
REPO = Path(__file__).resolve().parent.parent
CHILD_ENV = dict(os.environ, PYTHONPATH=str(REPO), PYTHONDONTWRITEBYTECODE="1")
PAGE = 4096
TMP_DIR = re.compile(r"^\.zerofast-tmp-\d+$")


def _pages(size: int) -> int:
    return -(-size // PAGE) * PAGE


def _zerofast(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zerofast", *map(str, args)], cwd=REPO, env=CHILD_ENV,
                          capture_output=True, text=True, timeout=timeout)


def _tmp_folders(folder: Path) -> list[str]:
    return [str(p) for p in folder.rglob(".*tmp*")] if folder.exists() else []


# ---------------------------------------------------------------------------------------------
# A full disk

@pytest.fixture
def small_disk(tmp_path):
    with small_tmpfs(tmp_path / "disk", "16m", "tests/test_export_failures.py covers failing writes with a file-size limit") as mnt:
        yield mnt


def _written(root: Path, order: list[str]) -> list[tuple[str, int]]:
    """(name, size) of a clean run's files, in the order the writer writes them."""
    return [(name, (root / name).stat().st_size) for name in order]


def _reference(tmp_path: Path):
    """Clean runs of each writer on a normal disk, and the order each writes its files in."""
    ck = real_root(SMALL)
    ref = tmp_path / "ref"
    zerofast.reshard(ck, ref / "reshard", 2)
    tag = (ref / "reshard" / "latest").read_text()
    reshard = [f"{tag}/mp_rank_00_model_states.pt"] + [f"{tag}/bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
                                                       for r in range(2)]
    zerofast.to_universal(ck, ref / "u" / "global_step3")
    universal_root = ref / "u" / "global_step3"
    universal = [str(p.relative_to(universal_root)) for p in sorted(universal_root.rglob("*.pt"))]
    export = zerofast.export(ck, ref / "export", max_shard_size="4KB")
    return ck, {"reshard": _written(ref / "reshard", reshard),
                "universal": _written(universal_root, universal),
                "export": _written(ref / "export", list(export.files)), "index": export.index}


# One child runs every case (imports cost seconds each): fill the disk up to ``room`` free bytes,
# run the command, record what it said and left, free the disk, run it again.
_FULL_DISK = textwrap.dedent("""
    import contextlib, io, json, os, sys
    from pathlib import Path
    from zerofast.cli import main

    disk, cases = Path(sys.argv[1]), json.loads(sys.argv[2])
    free = lambda: os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
    results = []
    for case in cases:
        filler = disk / "filler"
        with open(filler, "wb") as f:
            os.posix_fallocate(f.fileno(), 0, free() - case["room"])
        room = free()
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            rc = main(case["command"])
        left = sorted(str(p.relative_to(disk)) for p in disk.rglob("*") if p != filler and p.is_file())
        results.append({"rc": rc, "err": err.getvalue(), "left": left, "room": room, "free": free()})
        filler.unlink()
        results[-1]["rerun"] = main(case["command"] + ["--quiet"])
    print(json.dumps(results))
""")


@needs_deepspeed
def test_a_full_disk_is_one_error_line_at_every_point_and_a_rerun_succeeds(small_disk, tmp_path):
    ck, ref = _reference(tmp_path)
    rs, un, ex = ref["reshard"], ref["universal"], ref["export"]
    data = lambda files: sum(_pages(size) for _, size in files)  # noqa: E731
    biggest = max(range(len(ex)), key=lambda i: ex[i][1])
    reshard, universal = ["reshard", ck, "{out}", "--world-size", "2"], ["to-universal", ck, "{out}/global_step3"]
    export = ["export", ck, "{out}", "--max-shard-size", "4KB"]
    cases = [  # (what, command, room, the file the error names)
        ("reshard: first file", reshard, 0, rs[0][0]),
        ("reshard: mid-file", reshard, _pages(rs[0][1]) + PAGE, rs[1][0]),
        ("reshard: latest", reshard, data(rs), "latest"),
        ("to-universal: first file", universal, 0, "global_step3/zero/optimizer_state.pt"),
        # (the universal files include the copy of the model states, made last)
        ("to-universal: latest", universal, data(un), "latest_universal"),
        ("export: first file", export, 0, ex[0][0]),
        ("export: mid-file", export, data(ex[:biggest]) + PAGE, ex[biggest][0]),
        ("export: index", export, data(ex), ref["index"]),
    ]
    outs = [small_disk / f"out{i}" for i in range(len(cases))]
    doc = [{"command": [str(a).format(out=out) for a in command], "room": room}
           for out, (_, command, room, _) in zip(outs, cases)]
    proc = subprocess.run([sys.executable, "-c", _FULL_DISK, str(small_disk), json.dumps(doc)], cwd=REPO,
                          env=CHILD_ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr  # a SIGBUS would show here as -7
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for out, (what, command, room, failing), got in zip(outs, cases, results):
        assert got["rc"] == 1, f"{what}: {got}"
        lines = got["err"].strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"zerofast: error: {out / failing}: could not write this "
                                                       "file: No space left on device (ENOSPC)"), f"{what}: {got}"
        earlier = [str(o.relative_to(small_disk)) for o in outs[:outs.index(out)]]
        left = [p for p in got["left"] if p.split("/")[0] not in earlier]
        assert left == [], f"{what}: left {left}"  # no temporary folder, nothing under a final name
        assert got["free"] == got["room"], f"{what}: space not given back"
        assert got["rerun"] == 0, f"{what}: the rerun failed"
        if command[0] == "export":
            loaded, want = zerofast.load_exported(out), zerofast.reconstruct(ck)
            for name in want:
                assert_bitwise_equal(loaded[name], want[name], f"{what}: {name}")
        else:
            assert_same_state(out / "global_step3" if command[0] == "to-universal" else out, ck)


# ---------------------------------------------------------------------------------------------
# Signals at random points: the child sends itself SIGINT, SIGTERM or SIGKILL at the k-th write
# of a window, a torch.save, a rename or an unlink, wherever the writer is then.

_SIGNALLED = textwrap.dedent("""
    import os, signal, sys
    from zerofast.cli import main
    from zerofast.output import windows
    from zerofast.writers import torch_stream

    signum, at = int(sys.argv[1]), int(sys.argv[2])
    count = [0]

    def counted(real):
        def call(*args, **kwargs):
            count[0] += 1
            if count[0] == at:
                os.kill(os.getpid(), signum)
            return real(*args, **kwargs)
        return call

    windows._fill = counted(windows._fill)
    torch_stream.torch_save = counted(torch_stream.torch_save)
    os.replace, os.unlink = counted(os.replace), counted(os.unlink)
    code = main(sys.argv[3:])
    print(f"calls {count[0]}")
    sys.exit(code)
""")


def _signalled(signum: int, at: int, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _SIGNALLED, str(signum), str(at), *map(str, args)], cwd=REPO,
                          env=CHILD_ENV, capture_output=True, text=True, timeout=120,
                          preexec_fn=ctrl_c_as_in_a_terminal)


def _count_calls(monkeypatch, argv: list[str]) -> int:
    """The calls the child counts, in a clean run here."""
    from zerofast.output import windows
    from zerofast.writers import torch_stream

    count = [0]

    def counted(real):
        def call(*args, **kwargs):
            count[0] += 1
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(windows, "_fill", counted(windows._fill))
    monkeypatch.setattr(torch_stream, "torch_save", counted(torch_stream.torch_save))
    monkeypatch.setattr(os, "replace", counted(os.replace))
    monkeypatch.setattr(os, "unlink", counted(os.unlink))
    assert main(argv) == 0
    monkeypatch.undo()
    return count[0]


def _final_names(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and not any(TMP_DIR.match(part) for part in p.relative_to(out).parts)
            and MARKER.split("/")[0] not in p.relative_to(out).parts}


WRITERS = {
    "reshard": lambda ck, out: ["reshard", ck, out, "--world-size", "3", "--quiet"],
    "to-universal": lambda ck, out: ["to-universal", ck, out, "--quiet"],
    "export-torch": lambda ck, out: ["export", ck, out, "--format", "torch", "--max-shard-size", "4KB", "--quiet"],
    "export-safetensors": lambda ck, out: ["export", ck, out, "--max-shard-size", "4KB", "--quiet"],
}


@needs_deepspeed
@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_signals_at_random_points_leave_nothing_behind(tmp_path, monkeypatch, writer):
    ck = real_root(SMALL)
    rng = random.Random(writer)
    out = tmp_path / "out" / "global_step3"
    calls = _count_calls(monkeypatch, [str(a) for a in WRITERS[writer](ck, out)])
    reference = _final_names(out)
    subprocess.run(["rm", "-rf", str(tmp_path / "out")], check=True)
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
        at = rng.randint(1, calls)
        proc = _signalled(signum, at, *WRITERS[writer](ck, out))
        where = f"{writer}: {signal.Signals(signum).name} at call {at} of {calls}"
        if signum == signal.SIGKILL:
            assert proc.returncode == -signal.SIGKILL, f"{where}: {proc.stderr}"
        else:
            assert proc.returncode == 128 + signum, f"{where}: exit {proc.returncode}\n{proc.stderr}"
            name = "" if signum == signal.SIGINT else " (SIGTERM)"
            assert proc.stderr.splitlines() == [f"zerofast: interrupted{name}"], f"{where}: {proc.stderr}"
            assert not _tmp_folders(tmp_path / "out"), where
        for name, data in _final_names(out).items():  # under a final name: only complete files
            assert reference.get(name) == data, f"{where}: {name} is no complete file of the output"
        assert main([str(a) for a in WRITERS[writer](ck, out)]) == 0, f"{where}, rerun"
        assert _final_names(out).keys() == reference.keys(), where
        if writer.startswith("export"):
            got, want = zerofast.load_exported(out), zerofast.reconstruct(ck)
            for name in want:
                assert_bitwise_equal(got[name], want[name], f"{where}: {name}")
        else:
            assert_same_state(out, ck)
        subprocess.run(["rm", "-rf", str(tmp_path / "out")], check=True)


# ---------------------------------------------------------------------------------------------
# How soon a signal stops a long write. A checkpoint large enough to take seconds to write is
# synthesized: making one with DeepSpeed on the CPU would take longer than the whole suite.

BIG = LayoutSpec(stage=2, world_size=2, model_dtype=torch.bfloat16,
                 groups=[[ParamSpec(f"layers.{i}.weight", (1024, 1024)) for i in range(24)]])
LATENCY_S = float(os.environ.get("ZEROFAST_TEST_SIGNAL_LATENCY", "0.5"))


# The latency child writes through pread/pwrite and casts every tensor, so that a quiet machine
# (CI's) cannot finish the write before the signal: copy_file_range moves 100 MB in tens of ms.
SLOW_ENV = dict(CHILD_ENV, ZEROFAST_COPY_FILE_RANGE="0")


def _stop_latency(command: list[str], out: Path, signum: int, delay: float) -> float | None:
    """Seconds from the signal to the child's ``interrupted`` line; None if it finished first."""
    proc = subprocess.Popen([sys.executable, "-m", "zerofast", *command], cwd=REPO, env=SLOW_ENV,
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            preexec_fn=ctrl_c_as_in_a_terminal)
    try:
        deadline = time.monotonic() + 120
        while not _tmp_folders(out) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(delay)
        if proc.poll() is not None:
            return None
        sent = time.monotonic()
        proc.send_signal(signum)
        ready, _, _ = select.select([proc.stderr], [], [], 30)
        line = proc.stderr.readline() if ready else ""
        seconds = time.monotonic() - sent
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    if proc.returncode == 0 or (proc.returncode == -signum and not line):
        return None  # it finished first (or was past its last step, its handler gone)
    assert line.startswith("zerofast: interrupted"), line
    assert proc.returncode == 128 + signum
    assert not _tmp_folders(out)
    return seconds


@pytest.mark.parametrize("writer", ["reshard", "export-torch", "export-safetensors"])
def test_a_signal_stops_a_long_write_within_half_a_second(tmp_path, writer):
    root = tmp_path / "big"
    synthesize(root, BIG)
    out = tmp_path / "out"
    command = {"reshard": ["reshard", root, out, "--world-size", "1"],
               "export-torch": ["export", root, out, "--format", "torch", "--max-shard-size", "20MB", "--dtype", "fp16"],
               "export-safetensors": ["export", root, out, "--max-shard-size", "20MB", "--dtype", "fp16"]}[writer]
    seconds = []
    for signum, delay in ((signal.SIGINT, 0.0), (signal.SIGTERM, 0.05)):
        got = _stop_latency([str(a) for a in command], out, signum, delay)
        if got is not None:
            seconds.append(got)
    assert seconds, "the write finished before any signal: make BIG larger"
    assert max(seconds) <= LATENCY_S, f"{writer}: {seconds}"


def test_a_signal_landing_during_the_cleanup_still_removes_the_temporary_folder(tmp_path, monkeypatch):
    """A signal that arrives as a finished command removes its temporary folder: the handler's
    exception is raised inside that removal, which must still complete (CI once found the folder
    left behind this way), and the exception then goes on to the CLI."""
    import shutil

    from zerofast.output import transaction

    real, calls = shutil.rmtree, []

    def interrupted_once(path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 1:
            raise KeyboardInterrupt  # the handler's exception, as the removal starts
        return real(path, *args, **kwargs)

    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        with transaction.output_dir(out, False) as folder:
            (folder.tmp / "data.bin").write_bytes(b"x" * 100)
            monkeypatch.setattr(transaction.shutil, "rmtree", interrupted_once)
    assert len(calls) == 2
    assert not out.exists() or not [p.name for p in out.iterdir() if p.name.startswith(".zerofast-tmp")]
