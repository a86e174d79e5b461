"""A save spread over the nodes' local disks (DeepSpeed's ``use_node_local_storage``): two torchrun
agents on this machine (``--nnodes 2``, rendezvous on loopback, gloo), each given a folder holding
only its node's files, write what one process writes from a folder holding them all, byte for
byte. Every storage but scalars is moved as a hole (``ZEROFAST_NODES_HOLE_BYTES=256``) in small messages, so
the per-file transfers, their chunking and the punching run on these small saves.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zerofast.hf import export
from zerofast.load import node_bytes
from zerofast.output.transaction import MARKER
from zerofast.writers.reshard import reshard
from zerofast.writers.universal import to_universal

from tests.conftest import needs_deepspeed
from tests.dsgen.catalog import ensure_checkpoint, not_ours

REPO = Path(__file__).resolve().parent.parent
RANK_FILE = re.compile(r"zero_pp_rank_(\d+)_")
EXPERT_FILE = re.compile(r"^layer_(\d+)_expert_(\d+)_")
SHARD = "3KB"  # several output files, so that each is fed on its own


def _node_of(name: str, experts: dict[int, int]) -> set[int]:
    """Which of the two nodes a world-2 save's file lands on, as DeepSpeed writes them with
    use_node_local_storage and one rank per node: each rank's own files on its node; the shared
    model states on both (each node's local rank 0 writes them); an expert's file with the rank
    of its expert-parallel group that holds it."""
    m = RANK_FILE.search(name)
    if m:
        return {int(m.group(1))}
    m = EXPERT_FILE.match(name)
    if m:
        return {int(m.group(2)) * 2 // experts[int(m.group(1))]}
    return {0, 1}


def _split(root: Path, into: Path, drop: str | None = None) -> list[Path]:
    """Two node folders made from ``root``'s save (``drop``: a file no node gets)."""
    tag = (root / "latest").read_text().strip()
    names = sorted(os.listdir(root / tag))
    experts: dict[int, int] = {}
    for n in names:
        m = EXPERT_FILE.match(n)
        if m:
            experts[int(m.group(1))] = experts.get(int(m.group(1)), 0) + 1
    folders = []
    for node in (0, 1):
        folder = into / f"node{node}" / "ckpt"
        (folder / tag).mkdir(parents=True)
        shutil.copy(root / "latest", folder / "latest")
        for extra in root.iterdir():  # rank 0 alone copies zero_to_fp32.py and friends beside the tags
            if node == 0 and extra.is_file() and extra.name != "latest":
                shutil.copy(extra, folder / extra.name)
        for n in names:
            if n != drop and node in _node_of(n, experts):
                shutil.copy(root / tag / n, folder / tag / n)
        folders.append(folder)
    return folders


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(command: str, folders: list[Path], outs: list[Path], *extra: str) -> list[subprocess.CompletedProcess]:
    """``zerofast command FOLDER OUT *extra`` as two one-rank torchrun agents, node n given folder n;
    their temporary files go to ``tmp`` beside the node folders."""
    tmp = folders[0].parent.parent / "tmp"
    tmp.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "GROUP_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]),
               ZEROFAST_NODES_HOLE_BYTES="256", ZEROFAST_NODES_CHUNK_BYTES="1000", TMPDIR=str(tmp))
    for _ in range(3):
        port = str(_free_port())
        procs = [subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
             "--node_rank", str(n), "--master_addr", "127.0.0.1", "--master_port", port,
             "-m", "zerofast", command, str(folders[n]), str(outs[n]), *extra],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for n in (0, 1)]
        done = []
        for p in procs:
            out, _ = p.communicate(timeout=240)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, ""))
        failed = [p for p in done if p.returncode]
        # Again only where no rank ran (the port taken, the rendezvous failed): these ranks run
        # zerofast, and a retry must never hide a failure of its own, however rare.
        if not failed or not all(not_ours(p.stdout) for p in failed):
            break
        for out in outs:
            shutil.rmtree(out, ignore_errors=True)
    return done


def _tree(folder: Path) -> dict[str, bytes]:
    """Every file's bytes under ``folder`` (zerofast's marker by its list of names: it records inodes)."""
    files = {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
    for name in [n for n in files if n.endswith(MARKER)]:
        files[name] = json.dumps(json.loads(files[name])["files"]).encode()
    return files


def _assert_ok(procs: list[subprocess.CompletedProcess]) -> None:
    for n, p in enumerate(procs):
        assert p.returncode == 0, f"node {n}:\n{p.stdout[-3000:]}"


CASES = ["s1_bf16_w2_frozen", "s2_bf16_w2_frozen_tied", "s3_bf16_w2_frozen_tied", "moe_s2_bf16_w2_ep2"]


@needs_deepspeed
@pytest.mark.parametrize("name", CASES)
def test_an_export_from_two_nodes_disks_is_the_single_process_export(tmp_path, name):
    root = ensure_checkpoint(name)
    folders = _split(root, tmp_path)
    for folder in folders:  # each node really lacks the other's rank files
        assert any(RANK_FILE.search(n) for n in os.listdir(next(p for p in folder.iterdir() if p.is_dir())))
    assert set(os.listdir(folders[0] / (root / "latest").read_text().strip())) != \
        set(os.listdir(folders[1] / (root / "latest").read_text().strip()))
    export(root, tmp_path / "single", max_shard_size=SHARD, optimizer_states=True)
    outs = [tmp_path / "node0" / "out", tmp_path / "node1" / "out"]
    procs = _two_nodes("export", folders, outs, "--max-shard-size", SHARD, "--optimizer-states")
    _assert_ok(procs)
    assert _tree(outs[0]) == _tree(tmp_path / "single")
    assert len([n for n in os.listdir(outs[0]) if n.startswith("model-")]) > 2
    assert not outs[1].exists()  # node 0 writes; node 1 only sent its bytes
    assert not list((tmp_path / "tmp").glob("zerofast-nodes-*"))  # the views and their stubs are gone


@needs_deepspeed
@pytest.mark.parametrize("name", ["s3_bf16_w2_frozen_tied", "moe_s2_bf16_w2_ep2"])
def test_with_output_on_every_node_the_nodes_folders_together_are_the_single_process_export(tmp_path, name):
    root = ensure_checkpoint(name)
    folders = _split(root, tmp_path)
    export(root, tmp_path / "single", max_shard_size=SHARD, optimizer_states=True)
    outs = [tmp_path / "node0" / "out", tmp_path / "node1" / "out"]
    procs = _two_nodes("export", folders, outs, "--max-shard-size", SHARD, "--optimizer-states",
                       "--output-on-every-node")
    _assert_ok(procs)
    trees = [{n: b for n, b in _tree(out).items() if not n.endswith(MARKER)} for out in outs]
    assert not set(trees[0]) & set(trees[1])  # each file written once, on one node
    assert any(n.startswith("model-") for n in trees[1]) and not any(n.endswith(".json") for n in trees[1])
    want = {n: b for n, b in _tree(tmp_path / "single").items() if not n.endswith(MARKER)}
    assert {**trees[0], **trees[1]} == want
    for out, tree in zip(outs, trees):  # each node's folder is a committed output of its own files
        assert sorted(json.loads((out / MARKER).read_text())["files"]) == sorted(tree)
    assert not list((tmp_path / "tmp").glob("zerofast-nodes-*"))


@needs_deepspeed
@pytest.mark.parametrize("command", ["reshard", "to-universal"])
def test_reshard_and_to_universal_from_two_nodes_disks_are_the_single_process_ones(tmp_path, command):
    root = ensure_checkpoint("s3_bf16_w2_frozen_tied")
    folders = _split(root, tmp_path)
    tag = (root / "latest").read_text().strip()
    if command == "reshard":
        reshard(root, tmp_path / "single", 3)
        extra = ("--world-size", "3")
        outs = [tmp_path / "node0" / "out", tmp_path / "node1" / "out"]
    else:
        to_universal(root, tmp_path / "single" / f"{tag}_universal")
        extra = ()
        outs = [tmp_path / "node0" / "out" / f"{tag}_universal", tmp_path / "node1" / "out" / f"{tag}_universal"]
    procs = _two_nodes(command, folders, outs, *extra)
    _assert_ok(procs)
    want = tmp_path / "single" if command == "reshard" else tmp_path / "single" / f"{tag}_universal"
    assert _tree(outs[0]) == _tree(want)


@needs_deepspeed
def test_a_rank_that_no_node_holds_fails_on_both_nodes_naming_it_and_leaves_no_output(tmp_path):
    root = ensure_checkpoint("s1_bf16_w2_frozen")
    tag = (root / "latest").read_text().strip()
    lost = next(n for n in os.listdir(root / tag) if RANK_FILE.search(n) and "_1_" in n)
    folders = _split(root, tmp_path, drop=lost)
    outs = [tmp_path / "node0" / "out", tmp_path / "node1" / "out"]
    procs = _two_nodes("export", folders, outs)
    for p in procs:
        assert p.returncode != 0
        errors = [line for line in p.stdout.splitlines() if line.startswith("zerofast: error:")]
        assert len(errors) == 1, p.stdout[-3000:]
        assert "rank 1" in errors[0] or lost in errors[0], errors[0]
        assert "node 0 holds rank 0" in errors[0] and "node 1 holds no rank files" in errors[0], errors[0]
        assert "zerofast-nodes-" not in errors[0]  # the user's folder, not the view's
    assert not outs[0].exists() and not outs[1].exists()


# -- the pieces, without a process group ----------------------------------------------------

def test_ranges_are_merged_intersected_with_the_holes_and_cut_into_chunks(monkeypatch):
    assert node_bytes.merged([(10, 5), (0, 4), (12, 10), (4, 2), (30, 0)]) == [(0, 6), (10, 12)]
    assert node_bytes.intersect([(0, 6), (10, 12)], [(2, 10), (20, 100)]) == [(2, 4), (10, 2), (20, 2)]
    assert node_bytes.complement([(2, 3), (8, 2)], 12) == [(0, 2), (5, 3), (10, 2)]
    monkeypatch.setenv("ZEROFAST_NODES_CHUNK_BYTES", "4")
    chunks = node_bytes.chunks([("a", 0, 6), ("b", 100, 3)])
    assert chunks == [[("a", 0, 4)], [("a", 4, 2), ("b", 100, 2)], [("b", 102, 1)]]
    assert all(sum(n for *_, n in c) <= 4 for c in chunks)


def test_a_skeleton_rebuilds_a_sparse_stub_with_the_same_bytes_outside_its_holes(tmp_path, monkeypatch):
    monkeypatch.setenv("ZEROFAST_NODES_HOLE_BYTES", "1024")
    src = tmp_path / "src"
    src.mkdir()
    torch.save({"big": torch.arange(4096, dtype=torch.float32), "small": torch.tensor([7.0])}, src / "f.pt")
    data = node_bytes.skeletons(src, ["f.pt"])
    [(name, size, holes, kept, body)] = list(node_bytes.parse_skeletons(data))
    assert name == "f.pt" and size == (src / "f.pt").stat().st_size
    assert [length for _, length in holes] == [4096 * 4]  # the big storage only
    node_bytes.write_stub(tmp_path / "stub.pt", size, kept, body)
    real, stub = (src / "f.pt").read_bytes(), (tmp_path / "stub.pt").read_bytes()
    (offset, length), = holes
    assert stub[:offset] == real[:offset] and stub[offset + length:] == real[offset + length:]
    assert stub[offset:offset + length] == bytes(length)


class _FakeView:
    """What a Round asks of a node view, recorded: no process group, one rank's side."""

    def __init__(self, me: int):
        self.me, self.trades, self.punched = me, [], []

    def needed(self, reads, writer):
        return {f"{writer}:{name}": [(0, 1)] for name in reads}

    def trade(self, needs):
        self.trades.append([w for w, _ in needs])
        return next((n for w, n in needs if w == self.me), {})

    def punch(self, got):
        self.punched.append(sorted(got))


class _FakeWrite:
    def __init__(self, name: str, fail: bool = False):
        self.name, self.fail, self.nbytes, self.written = name, fail, 1, False

    def reads(self):
        return [self.name]

    def write(self, tmp, advance):
        if self.fail:
            raise OSError(f"disk full writing {self.name}")
        self.written = True


def test_every_rank_trades_in_every_round_and_a_failed_write_is_raised_in_the_last():
    from zerofast.output import node_writes

    bad, later = _FakeWrite("a", fail=True), _FakeWrite("c")
    by_rank = [[bad, later], [_FakeWrite("b"), _FakeWrite("d"), _FakeWrite("e")]]
    view = _FakeView(me=0)
    rounds = node_writes.rounds(view, by_rank)
    assert len(rounds) == 3 and [r.nbytes for r in rounds] == [1, 1, 0]  # the longest share's count
    rounds[0].write(None, lambda n: None)  # the failure waits: the other rank still needs this one
    rounds[1].write(None, lambda n: None)
    with pytest.raises(OSError, match="disk full writing a"):
        rounds[2].write(None, lambda n: None)
    assert view.trades == [[0, 1], [0, 1], [1]]  # rank 0 took part in rank 1's third round too
    assert not later.written  # nothing more is written once a write failed
    assert view.punched == [["0:a"], ["0:c"], []]  # what it received is given back each round
