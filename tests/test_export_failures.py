"""Exports that fail or die: a file-size limit, a full disk, an I/O error while moving files into
place, SIGKILL at random moments.

A failed export raises an ExportError naming the file and the OS error, removes its temporary
folder and leaves the output folder as it found it. A killed export leaves nothing under a final
name while it writes; killed while it moves the finished files into place (a few renames), it may
leave some of them, each complete, but never an index or a file that makes the folder look like a
complete export. A rerun into the same folder always succeeds.

The checkpoint is synthesized (no DeepSpeed needed): 25 MB of fp32 output, six shards of about
4 MB at ``--max-shard-size 5MB``, big enough that a kill by the clock lands inside the writing.
"""
from __future__ import annotations

import errno
import json
import os
import random
import re
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
from zerofast.base.errors import ExportError
from zerofast.testing.synthesize import BufferSpec, LayoutSpec, ParamSpec, synthesize
from zerofast.hf import export, load_exported
from zerofast.output.transaction import MARKER

MARKER_TOP, MARKER_NAME = MARKER.split("/")[0], Path(MARKER).name  # what listdir / a rename shows

from tests.helpers import assert_bitwise_equal, small_tmpfs

REPO = Path(__file__).resolve().parent.parent
SAFE = "safetensors"
SHARDED, SINGLE = "5MB", "5GB"
CONFIGS = [(SAFE, SHARDED), ("torch", SHARDED), (SAFE, SINGLE), ("torch", SINGLE)]
TMP_DIR = re.compile(r"^\.zerofast-tmp-\d+$")
CHILD_ENV = dict(os.environ, PYTHONPATH=str(REPO), PYTHONDONTWRITEBYTECODE="1")

BIG = LayoutSpec(
    stage=2, world_size=2, model_dtype=torch.bfloat16,
    groups=[[ParamSpec(f"layers.{i}.weight", (512, 1024)) for i in range(12)], [ParamSpec("norm.weight", (1024,))]],
    frozen=[ParamSpec("embed.weight", (1000, 64))], buffers=[BufferSpec("pos", (64,), torch.int64)],
    tied={"head.weight": "embed.weight"}, with_optimizer_states=False)

# Twenty 12-byte tensors, one per shard at a 16-byte limit: every shard is smaller than the index.
MANY_SMALL = LayoutSpec(stage=1, world_size=1, model_dtype=torch.float32,
                        groups=[[ParamSpec(f"blocks.{i}.weight", (3,)) for i in range(20)]],
                        with_optimizer_states=False)


class Reference:
    """The checkpoint, its reconstruction, and a clean export of every config: the content of each
    file by name (tensors, or the parsed JSON of an index) and the files in the order written."""

    def __init__(self, root: Path, refs: Path):
        self.root = root
        self.want = dict(zerofast.reconstruct(root))
        self.content: dict[str, object] = {}
        self.written: dict[tuple[str, str], list[tuple[str, int]]] = {}
        self.seconds = 0.0
        self.total = 0
        for fmt, shard in CONFIGS:
            out = refs / f"{fmt}-{shard}"
            started = time.monotonic()
            result = export(root, out, format=fmt, max_shard_size=shard)
            self.seconds = max(self.seconds, time.monotonic() - started)
            self.total = result.total_size
            names = [*result.files, *([result.index] if result.index else [])]
            self.written[fmt, shard] = [(n, (out / n).stat().st_size) for n in names]
            for n in names:
                assert n not in self.content, "two configs write the same name; the checks below need unique ones"
                self.content[n] = _read(out / n)

    def names(self, fmt: str, shard: str) -> list[str]:
        return [n for n, _ in self.written[fmt, shard]]


@pytest.fixture(scope="module")
def ref(tmp_path_factory) -> Reference:
    base = tmp_path_factory.mktemp("failures")
    synthesize(base / "ckpt", BIG)
    return Reference(base / "ckpt", base / "refs")


def _read(path: Path):
    if path.name.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    if path.name.endswith(".bin"):
        return torch.load(path, map_location="cpu", weights_only=True)
    return json.loads(path.read_text())


def _assert_same(got, want, where: str) -> None:
    if isinstance(want, dict) and all(isinstance(v, torch.Tensor) for v in want.values()):
        assert sorted(got) == sorted(want), where
        for k in want:
            assert_bitwise_equal(got[k], want[k], f"{where}: {k}")
    else:
        assert got == want, where


def _snapshot(folder: Path) -> dict[str, bytes]:
    """Every file in the folder and its bytes; temporary folders left by a kill are not files."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and not TMP_DIR.match(p.relative_to(folder).parts[0])}


def _assert_rerun_succeeds(ref: Reference, out: Path, fmt: str, shard: str) -> None:
    result = export(ref.root, out, format=fmt, max_shard_size=shard)
    assert sorted(os.listdir(out)) == sorted([MARKER_TOP, *result.files, *([result.index] if result.index else [])])
    _assert_same(load_exported(out), ref.want, str(out))


# ---------------------------------------------------------------------------------------------
# A file-size limit: every write past RLIMIT_FSIZE fails with EFBIG, deterministically, as writes
# fail on a full disk.

_UNDER_LIMITS = textwrap.dedent("""
    import json, resource, signal, sys
    from zerofast.hf import export

    # Past the limit the kernel sends SIGXFSZ, whose default action kills the process; ignored, the
    # write fails with EFBIG instead.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    results = []
    for case in json.loads(sys.argv[1]):
        resource.setrlimit(resource.RLIMIT_FSIZE, (case["limit"], hard))
        try:
            export(case["ckpt"], case["out"], format=case["format"], max_shard_size=case["shard"])
            results.append({"raised": None})
        except BaseException as e:
            results.append({"raised": type(e).__name__, "path": getattr(e, "path", None), "message": str(e)})
        resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
    print(json.dumps(results))
""")

# Sets the limit and ignores SIGXFSZ, then runs the command: both survive exec.
_LAUNCH = ("import os, resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
           "hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]; "
           "resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), hard)); "
           "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])")


def _first_over(written: list[tuple[str, int]], limit: int) -> str:
    return next(name for name, size in written if size > limit)


def test_file_size_limit_fails_cleanly_and_a_rerun_succeeds(ref, tmp_path):
    small_root = tmp_path / "small"
    synthesize(small_root, MANY_SMALL)
    small = export(small_root, tmp_path / "small-ref", max_shard_size=16)
    shard_sizes = [(tmp_path / "small-ref" / n).stat().st_size for n in small.files]
    index_size = (tmp_path / "small-ref" / small.index).stat().st_size
    assert len(small.files) == 20 and max(shard_sizes) < index_size - 1

    kept = tmp_path / "kept"
    export(ref.root, kept, format=SAFE, max_shard_size=SHARDED)
    before = _snapshot(kept)

    largest = {cfg: max(size for _, size in written) for cfg, written in ref.written.items()}
    cases = [  # (checkpoint, out, format, shard, limit, the file that must fail)
        (ref.root, tmp_path / "st", SAFE, SHARDED, largest[SAFE, SHARDED] - 1, None),
        (ref.root, tmp_path / "pt", "torch", SHARDED, largest["torch", SHARDED] - 1, None),
        (ref.root, tmp_path / "st1", SAFE, SINGLE, largest[SAFE, SINGLE] // 2, None),
        (ref.root, kept, "torch", SINGLE, 1 << 20, None),
        (small_root, tmp_path / "index", SAFE, 16, index_size - 1, small.index),
    ]
    doc = [{"ckpt": str(c), "out": str(o), "format": f, "shard": s, "limit": limit} for c, o, f, s, limit, _ in cases]
    proc = subprocess.run([sys.executable, "-c", _UNDER_LIMITS, json.dumps(doc)], cwd=REPO, env=CHILD_ENV,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout.strip().splitlines()[-1])

    for (root, out, fmt, shard, limit, failing), got in zip(cases, results):
        failing = failing or _first_over(ref.written[fmt, shard], limit)
        assert got["raised"] == "ExportError", got
        assert got["path"] == str(out / failing), got
        assert got["message"].startswith(f"{out / failing}: could not write this file: File too large (EFBIG)")
        if out == kept:
            assert _snapshot(kept) == before  # the previous export, untouched
        else:
            assert not out.exists()  # no final name, no temporary folder, no folder this call made
        if root == small_root:
            assert export(root, out, max_shard_size=16).index == small.index
        else:
            _assert_rerun_succeeds(ref, out, fmt, shard)


def test_cli_reports_a_write_error_in_one_line(ref, tmp_path):
    out = tmp_path / "out"
    limit = max(size for _, size in ref.written[SAFE, SHARDED]) - 1
    failing = out / _first_over(ref.written[SAFE, SHARDED], limit)
    proc = subprocess.run([sys.executable, "-c", _LAUNCH, str(limit), "-m", "zerofast", "export", str(ref.root),
                           str(out), "--max-shard-size", SHARDED], cwd=REPO, env=CHILD_ENV, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [f"zerofast: error: {failing}: could not write this file: File too large "
                                        "(EFBIG); the command stopped and put no file in place"]
    assert not out.exists()
    assert main(["export", str(ref.root), str(out), "--max-shard-size", SHARDED, "--quiet"]) == 0
    _assert_same(load_exported(out), ref.want, str(out))


# ---------------------------------------------------------------------------------------------
# A full disk: a tmpfs of 32 MiB mounted for the test, filled until the export cannot fit.

@pytest.fixture
def small_disk(tmp_path):
    with small_tmpfs(tmp_path / "disk", "32m", "the file-size limit tests cover failing writes") as mnt:
        yield mnt


def _free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


@pytest.mark.parametrize("fmt", [SAFE, "torch"])
def test_full_disk_fails_cleanly_and_a_rerun_succeeds_once_there_is_room(ref, small_disk, fmt):
    out = small_disk / "out"
    out.mkdir()
    filler = small_disk / "filler"
    room = 6 << 20  # one shard fits, the second does not
    with open(filler, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, _free(small_disk) - room)
    free = _free(small_disk)

    with pytest.raises(ExportError) as e:
        export(ref.root, out, format=fmt, max_shard_size=SHARDED)
    shards = ref.names(fmt, SHARDED)
    assert e.value.path == str(out / shards[1]), str(e.value)
    assert "No space left on device (ENOSPC)" in str(e.value)
    assert isinstance(e.value.__cause__, OSError) and e.value.__cause__.errno == errno.ENOSPC
    assert os.listdir(out) == []
    assert _free(small_disk) == free  # what was written went with the temporary folder

    filler.unlink()
    _assert_rerun_succeeds(ref, out, fmt, SHARDED)


# ---------------------------------------------------------------------------------------------
# Failures while moving the files into place.

def test_error_while_moving_files_is_reported_and_a_rerun_succeeds(ref, tmp_path, monkeypatch):
    out = tmp_path / "out"
    real = os.replace
    moved = []

    def replace(src, dst):
        if Path(dst).name != MARKER_NAME:
            moved.append(Path(dst).name)
            if len(moved) == 3:
                raise OSError(errno.EIO, "Input/output error", str(src))
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(ExportError) as e:
        export(ref.root, out, max_shard_size=SHARDED)
    assert e.value.path == str(out)
    assert "while moving the new files into place: Input/output error (EIO)" in str(e.value)
    left = [n for n in os.listdir(out) if n != MARKER_TOP]
    assert sorted(left) == sorted(moved[:2])
    with pytest.raises(ExportError, match="found none"):
        load_exported(out)

    monkeypatch.undo()
    _assert_rerun_succeeds(ref, out, SAFE, SHARDED)


@pytest.mark.parametrize("failing", ["write", "replace"])
def test_marker_that_cannot_shrink_does_not_fail_a_complete_export(ref, tmp_path, monkeypatch, failing):
    out = tmp_path / "out"
    export(ref.root, out, format="torch", max_shard_size=SHARDED)
    real_write, real_replace = Path.write_text, os.replace
    markers = []

    def write_text(path, text):
        if path.name == MARKER_NAME:
            markers.append(json.loads(text)["files"])
            if failing == "write" and len(markers) == 2:
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_write(path, text)

    def replace(src, dst):
        if failing == "replace" and Path(dst).name == MARKER_NAME and len(markers) == 2:
            raise OSError(errno.EIO, "Input/output error", str(src))
        return real_replace(src, dst)

    monkeypatch.setattr(Path, "write_text", write_text)
    monkeypatch.setattr(os, "replace", replace)
    result = export(ref.root, out, max_shard_size=SINGLE)
    assert result.files == ("model.safetensors",)
    assert len(markers) == 2
    # The claim made before the moves stays: the new name and the names it replaced.
    on_disk = json.loads((out / MARKER).read_text())["files"]
    assert on_disk == markers[0] == sorted({"model.safetensors", *ref.names("torch", SHARDED)})
    assert sorted(os.listdir(out)) == [MARKER_TOP, "model.safetensors"]

    monkeypatch.undo()
    _assert_rerun_succeeds(ref, out, "torch", SHARDED)


# ---------------------------------------------------------------------------------------------
# SIGKILL at random moments: after so many bytes, before the k-th unlink or rename of the commit,
# or after a random share of the time the export takes. Each run starts from the complete export
# the last one's rerun left, in another config, so that the commit also removes what it replaces.

_KILLED = textwrap.dedent("""
    import os, signal, sys, threading, time
    from zerofast.output import windows
    from zerofast.hf.formats import safetensors_files as write_shards
    from zerofast.hf import export

    ckpt, out, fmt, shard, mode, value = sys.argv[1:7]
    value = float(value)
    windows.WINDOW_BYTES = write_shards._BATCH_BYTES = 1 << 20  # many progress reports: kills by bytes land inside files

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    def progress(done, total):
        if mode == "bytes" and done >= value:
            die()

    if mode == "step":
        steps = [0]

        def counted(real):
            def step(*args, **kwargs):
                steps[0] += 1
                if steps[0] >= value:
                    die()
                return real(*args, **kwargs)
            return step

        os.replace, os.unlink = counted(os.replace), counted(os.unlink)
    timer = None
    if mode == "time":
        # The same export into a scratch folder says how long one takes on this machine, now.
        started = time.monotonic()
        export(ckpt, out + "-timing", format=fmt, max_shard_size=shard)
        timer = threading.Timer(value * (time.monotonic() - started), die)
        timer.start()
    export(ckpt, out, format=fmt, max_shard_size=shard, progress=progress)
    if timer is not None:
        timer.cancel()
""")

KILL_RUNS = 6


def _check_after_kill(ref: Reference, out: Path) -> None:
    for name in os.listdir(out):
        if name == MARKER_TOP or TMP_DIR.match(name):
            continue
        assert name in ref.content, f"{name} is no file of any export"
        _assert_same(_read(out / name), ref.content[name], f"{name} under its final name after a kill")
    for name in os.listdir(out):
        if name.endswith(".index.json"):
            listed = set(json.loads((out / name).read_text())["weight_map"].values())
            assert listed <= set(os.listdir(out)), f"{name} lists shards that are not there"
    try:
        loaded = load_exported(out)
    except ExportError as e:
        assert "found none" in str(e), str(e)
    else:
        _assert_same(loaded, ref.want, "what a loader finds after a kill")


def _commit_steps(ref: Reference, out: Path, fmt: str, shard: str) -> int:
    """The unlinks and renames of the commit before the last file lands: the marker's claim, the
    previous files the new ones do not replace, and the moves."""
    final = ref.names(fmt, shard)
    data = {n for n in final if not n.endswith(".index.json")}
    stale = [n for n in os.listdir(out) if n != MARKER_TOP and n not in data]
    return 1 + len(stale) + len(final)


def test_sigkill_at_random_moments_never_leaves_a_partial_export(ref, tmp_path):
    rng = random.Random(4)
    out = tmp_path / "out"
    out.mkdir()
    killed = []
    config = None
    for run in range(KILL_RUNS):
        config = fmt, shard = rng.choice([c for c in CONFIGS if c != config])
        mode = ("bytes", "step", "time")[run % 3]
        if mode == "bytes":
            value = rng.randrange(1, ref.total)
        elif mode == "step":  # after the claim, before the last file lands
            value = rng.randint(2, _commit_steps(ref, out, fmt, shard))
        else:
            value = rng.uniform(0, 1.1)
        before = _snapshot(out)
        proc = subprocess.run([sys.executable, "-c", _KILLED, str(ref.root), str(out), fmt, shard, mode, str(value)],
                              cwd=REPO, env=CHILD_ENV, capture_output=True, text=True, timeout=120)
        where = f"run {run}: {fmt} {shard}, killed by {mode} at {value}"
        # Kills by bytes and steps are set inside the export, so they always happen; a kill by the
        # clock may come after the end.
        assert proc.returncode == -signal.SIGKILL or (mode == "time" and proc.returncode == 0), \
            f"{where}: exit code {proc.returncode}\n{proc.stderr}"
        killed.append(proc.returncode == -signal.SIGKILL)
        _check_after_kill(ref, out)
        if mode == "bytes":
            assert _snapshot(out) == before, f"{where}: killed while writing, yet the folder changed"
        _assert_rerun_succeeds(ref, out, fmt, shard)
    assert sum(killed) >= 4
