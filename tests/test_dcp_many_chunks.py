"""DCP tensors of many chunks (issue 48): real saves of 1,024 and 4,096 chunks per tensor written by
torch's own ``dcp.save`` (tests/dsgen/dcp_chunks.py), judged against torch's ``dcp_to_torch_save``;
hostile chunk layouts in a ``.metadata`` (overlaps, holes, boxes past the tensor) named with a
typed error; a million tiny chunks checked in bounded time and memory; and the coverage check
(zerofast/load/dcp_cover.py) against counting every element, by each of its ways."""
from __future__ import annotations

import json
import pickle
import random
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import zerofast
from zerofast.cli import main
from zerofast.load import dcp_cover
from zerofast.load.dcp import read_dcp

from tests.dsgen.dcp_chunks import CHUNKS, ensure_many_chunks, full_tensors
from tests.helpers import assert_bitwise_equal

WHERE = Path("hostile/.metadata")


@pytest.fixture(scope="module", params=CHUNKS, ids=lambda n: f"{n}chunks")
def saved(request, tmp_path_factory) -> tuple[Path, dict, int]:
    """(folder, dcp_to_torch_save's model dict, chunks per tensor), the truth made once per save."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    folder = ensure_many_chunks(request.param)
    out = tmp_path_factory.mktemp("truth") / "torch_save.pt"
    dcp_to_torch_save(folder, out)
    return folder, torch.load(out, weights_only=False)["model"], request.param


def test_the_saves_have_that_many_chunks_and_torch_agrees_with_the_job(saved):
    folder, want, chunks = saved
    records = read_dcp(folder)
    counts = {key: len(t.chunks) for key, t in records.tensors.items()}
    assert counts == {"model.rows.weight": chunks, "model.grid.weight": chunks, "model.ids": chunks,
                      "model.bias": 1}
    assert records.ranks == 2
    job = full_tensors(chunks)
    assert list(want) == list(job)
    for name, value in job.items():
        assert_bitwise_equal(want[name], value, name)


def test_reconstruct_and_lazy_equal_dcp_to_torch_save(saved):
    folder, want, _ = saved
    got = zerofast.reconstruct(folder, dtype=None)
    assert list(got) == list(want)
    for name, value in want.items():
        assert_bitwise_equal(got[name], value, name)
    lazy = zerofast.reconstruct(folder, lazy=True, dtype=None)
    assert sorted(lazy) == sorted(want)
    for name, value in want.items():
        assert_bitwise_equal(lazy[name], value, name)


def test_export_equals_dcp_to_torch_save(saved, tmp_path):
    folder, want, _ = saved
    out = tmp_path / "hf"
    assert main(["export", str(folder), str(out), "--dtype", "keep", "--max-shard-size", "16KB", "--quiet"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    got = {}
    for name in sorted(set(index["weight_map"].values())):
        got.update(load_file(out / name))
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert_bitwise_equal(got[name], value, name)


# -- hostile layouts in a .metadata -------------------------------------------------------------

def _planted(tmp_path: Path, size: tuple, boxes: list[tuple[tuple, tuple]]) -> Path:
    """A folder saved by ``dcp.save`` whose ``.metadata`` then says that ``model.w`` (of ``size``)
    is made of ``boxes`` (offsets, sizes), each pointing at the one stored item."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "planted"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # single-process save: no process group
        dcp.save({"model": {"w": torch.zeros(size), "b": torch.ones(3)}}, checkpoint_id=str(folder))
    with open(folder / ".metadata", "rb") as f:
        meta = pickle.load(f)  # our own file, just written
    [(index, info)] = [(i, v) for i, v in meta.storage_data.items() if i.fqn == "model.w"]
    del meta.storage_data[index]
    meta.state_dict_metadata["model.w"].chunks = [ChunkStorageMetadata(_size(o), _size(s)) for o, s in boxes]
    for n, (o, _) in enumerate(boxes):
        meta.storage_data[MetadataIndex("model.w", _size(o), n)] = info
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(meta, f)
    return folder


def _size(values: tuple) -> tuple:
    """torch.Size as dcp.save writes it; a plain tuple (as a hand-made pickle can) past int64."""
    return torch.Size(values) if max(values, default=0) < 2**63 else tuple(values)


def _rows(n: int, width: int = 4) -> list[tuple[tuple, tuple]]:
    return [((i, 0), (1, width)) for i in range(n)]


def _grid(rows: int) -> list[tuple[tuple, tuple]]:
    return [((i, c), (1, 2)) for i in range(rows) for c in (0, 2)]


HOSTILE = {  # name: (size, boxes, error type, what the message must say)
    "overlap": ((8, 4), [((0, 0), (4, 4)), ((3, 0), (5, 4))], zerofast.InconsistentCheckpointError,
                r"chunks at \(0, 0\) of size \(4, 4\) and at \(3, 0\) of size \(5, 4\) overlap "
                r"\(both hold the element at \(3, 0\)\)"),
    "overlap_and_hole_of_equal_volume": ((8, 4), [((0, 0), (4, 4)), ((3, 0), (4, 4))],
                                         zerofast.InconsistentCheckpointError,
                                         r"\(0, 0\) of size \(4, 4\) and at \(3, 0\) of size \(4, 4\) overlap"),
    "hole": ((8, 4), [((0, 0), (4, 4)), ((5, 0), (3, 4))], zerofast.InconsistentCheckpointError,
             r"the element at \(4, 0\) of the tensor of size \(8, 4\) is in none of its 2 chunks"),
    "column_hole": ((8, 4), [((0, 0), (8, 1)), ((0, 2), (8, 2))], zerofast.InconsistentCheckpointError,
                    r"the element at \(0, 1\) .* is in none"),
    "past_the_tensor": ((8, 4), [((0, 0), (4, 4)), ((4, 0), (5, 4))], zerofast.InconsistentCheckpointError,
                        r"chunk at \(4, 0\) of size \(5, 4\) is not inside the tensor's size \(8, 4\)"),
    "past_int64": ((8, 4), [((0, 0), (8, 4)), ((2**70, 0), (1, 4))], zerofast.InconsistentCheckpointError,
                   r"chunk at \(%d, 0\) of size \(1, 4\) is not inside" % 2**70),
    "many_rows_one_twice": ((4096, 4), _rows(4096) + [((4000, 0), (1, 4))], zerofast.InconsistentCheckpointError,
                            r"chunks at \(4000, 0\) of size \(1, 4\) and at \(4000, 0\) of size \(1, 4\) overlap"),
    "many_rows_one_missing": ((4096, 4), _rows(4096)[:2999] + _rows(4096)[3000:],
                              zerofast.InconsistentCheckpointError,
                              r"the element at \(2999, 0\) .* is in none of its 4095 chunks"),
    "grid_cell_missing": ((2048, 4), [b for b in _grid(2048) if b[0] != (1500, 2)],
                          zerofast.InconsistentCheckpointError, r"the element at \(1500, 2\) .* is in none"),
    "irregular_overlap": ((2048, 4), _grid(2047) + [((2047, 0), (1, 3)), ((2047, 2), (1, 2))],
                          zerofast.InconsistentCheckpointError,
                          r"chunks at \(2047, 0\) of size \(1, 3\) and at \(2047, 2\) of size \(1, 2\) overlap "
                          r"\(both hold the element at \(2047, 2\)\)"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_chunk_layouts_give_typed_errors_naming_what_is_wrong(tmp_path, case):
    size, boxes, error, message = HOSTILE[case]
    folder = _planted(tmp_path, size, boxes)
    with pytest.raises(error, match=r"\.metadata: entry 'model\.w': ") as e:
        zerofast.reconstruct(folder)
    assert re.search(message, str(e.value)), str(e.value)
    assert str(folder / ".metadata") in str(e.value)
    if len(boxes) < 100:
        assert main(["inspect", str(folder)]) == 1  # the CLI reports it too, without a traceback


def test_a_planted_exact_cover_of_many_irregular_chunks_passes_the_check(tmp_path):
    """Even rows split at column 1, odd rows at column 3: not a grid, and exactly once. The
    metadata is accepted; reading then finds that the planted chunks' item is not their data."""
    boxes = [b for i in range(1024) for b in ((((i, 0), (1, 1 + 2 * (i % 2))),
                                                ((i, 1 + 2 * (i % 2)), (1, 3 - 2 * (i % 2)))))]
    folder = _planted(tmp_path, (1024, 4), boxes)
    assert len(read_dcp(folder).tensors["model.w"].chunks) == 2048
    with pytest.raises(zerofast.InconsistentCheckpointError, match=r"'model\.w' at \(0, 0\): expected a contiguous "
                                                                   r"torch\.float32 tensor of size \(1, 1\)"):
        zerofast.reconstruct(folder)


# -- a million tiny chunks ------------------------------------------------------------------------

MILLION = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from zerofast.base.errors import ZeroFastError
    from zerofast.load.dcp_cover import check_cover

    def rss(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) * 1024

    n = 1 << 20
    rows = [(i, 0) for i in range(n)]
    one = [(1, 4)] * n
    cases = {
        "rows": ((n, 4), rows, one),
        "one_twice": ((n, 4), rows + [(n - 7, 0)], one + [(1, 4)]),
        "one_missing": ((n, 4), rows[:n // 2] + rows[n // 2 + 1:], one[1:]),
        "all_at_one_place": ((n, 4), [(0, 0)] * n, one),
        "irregular_overlap": ((n // 2, 4), [(i // 2, 2 * (i % 2)) for i in range(n)],
                              [(1, 3 if i % 2 == 0 else 2) for i in range(n)]),
    }
    out = {}
    for name, (size, offsets, sizes) in cases.items():
        before = rss("VmRSS")
        started = time.perf_counter()
        try:
            check_cover("w", size, offsets, sizes, Path("million/.metadata"))
            result = "ok"
        except ZeroFastError as e:
            result = type(e).__name__ + ": " + str(e)
        out[name] = {"result": result, "seconds": time.perf_counter() - started,
                     "peak_growth": rss("VmHWM") - before}
    print(json.dumps(out))
""")


def test_a_million_tiny_chunks_in_bounded_time_and_memory():
    proc = subprocess.run([sys.executable, "-c", MILLION], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    expect = {
        "rows": "ok",
        "one_twice": r"chunks at \(1048569, 0\) of size \(1, 4\) and at \(1048569, 0\) of size \(1, 4\) overlap",
        "one_missing": r"the element at \(524288, 0\) .* is in none of its 1048575 chunks",
        "all_at_one_place": r"chunks at \(0, 0\) of size \(1, 4\) and at \(0, 0\) of size \(1, 4\) overlap",
        "irregular_overlap": r"chunks at \(0, 0\) of size \(1, 3\) and at \(0, 2\) of size \(1, 2\) overlap",
    }
    for name, want in expect.items():
        got = out[name]
        if want == "ok":
            assert got["result"] == "ok", (name, got)
        else:
            assert got["result"].startswith("InconsistentCheckpointError: million/.metadata: entry 'w': "), (name, got)
            assert re.search(want, got["result"]), (name, got)
        assert got["seconds"] < 30, (name, got)  # measured 1-5 s each on 2 busy cores
        # The process's peak so far less its size before the case (an upper bound on what the
        # case added): measured 130-280 MB, a few int64 arrays of the boxes.
        assert got["peak_growth"] < 512 << 20, (name, got)


# -- the check itself: each way against counting every element ------------------------------------

def _guillotine(rng: random.Random, lo: list[int], hi: list[int], depth: int) -> list[tuple[tuple, tuple]]:
    """An exact cover of the box [lo, hi): cut along a random dimension, recursively."""
    splittable = [k for k in range(len(lo)) if hi[k] - lo[k] >= 2]
    if not splittable or depth == 0 or rng.random() < 0.2:
        return [(tuple(lo), tuple(h - low for low, h in zip(lo, hi)))]
    k = rng.choice(splittable)
    cut = rng.randrange(lo[k] + 1, hi[k])
    upper, lower = list(hi), list(lo)
    upper[k], lower[k] = cut, cut
    return _guillotine(rng, lo, upper, depth - 1) + _guillotine(rng, lower, hi, depth - 1)


def _counted(size: tuple, boxes: list) -> str:
    count = torch.zeros(size, dtype=torch.int64)
    for o, s in boxes:
        if any(a + b > n for a, b, n in zip(o, s, size)):
            return "past"
        count[tuple(slice(a, a + b) for a, b in zip(o, s))] += 1
    return "overlap" if (count > 1).any() else "hole" if (count == 0).any() else "ok"


def _held(point: tuple, boxes: list) -> int:
    return sum(all(a <= p < a + b for a, b, p in zip(o, s, point)) for o, s in boxes)


@pytest.mark.parametrize("way", ["default", "arrays", "corners", "sweep"])
def test_random_layouts_agree_with_counting_every_element(monkeypatch, way):
    """Exact covers cut at random, then damaged (a box dropped, repeated, moved, grown, or an
    empty one added): every way of the check gives the counted answer, and the element it names
    is really covered twice or not at all."""
    if way != "default":
        monkeypatch.setattr(dcp_cover, "FEW", 0)  # numpy even for a few boxes
    if way == "corners":
        monkeypatch.setattr(dcp_cover._Cover, "grid", dcp_cover._Cover.corners)
    if way == "sweep":
        monkeypatch.setattr(dcp_cover, "CORNER_BUDGET", 0)
    rng = random.Random(f"cover-{way}")
    for case in range(300):
        d = rng.randint(0, 4)
        size = tuple(rng.randint(1, 6) for _ in range(d))
        boxes = _guillotine(rng, [0] * d, list(size), rng.randint(0, 6))
        damage = rng.random()
        if damage < 0.2 and len(boxes) > 1:
            boxes.pop(rng.randrange(len(boxes)))
        elif damage < 0.4:
            boxes.append(boxes[rng.randrange(len(boxes))])
        elif damage < 0.6 and d:
            i = rng.randrange(len(boxes))
            boxes[i] = tuple(tuple(max(0, v + rng.randint(-1, 1)) for v in part) for part in boxes[i])
        elif damage < 0.65 and d:
            boxes.append((tuple(rng.randint(0, n) for n in size), (0,) * d))
        rng.shuffle(boxes)
        want = _counted(size, boxes)
        try:
            dcp_cover.check_cover("w", size, [o for o, _ in boxes], [s for _, s in boxes], WHERE)
            got, text = "ok", ""
        except zerofast.InconsistentCheckpointError as e:
            text = str(e)
            got = "past" if "not inside" in text else "overlap" if "overlap" in text else "hole"
        where = f"case {case}: {size} {boxes}: {text}"
        if want in ("overlap", "hole") and got in ("overlap", "hole"):  # a layout can have both
            named = re.search(r"element at (\([0-9, ]*\))", text)
            if named:
                point = tuple(int(v) for v in re.findall(r"\d+", named.group(1)))
                assert (_held(point, boxes) == 0) if got == "hole" else (_held(point, boxes) >= 2), where
            continue
        assert got == want, where


def test_the_sweep_refuses_past_its_budget_and_the_corners_stay_within_theirs(monkeypatch):
    """Boxes that split many dimensions without forming a grid go to the sweep when their corners
    are too many; past its budget of comparisons the entry is refused, not checked for ever."""
    # Rows [i, i+1) x [0, 8) on top, columns [8, 16) x [j, j+1) below: not a grid in dim 1.
    size = (16, 8)
    boxes = [((i, 0), (1, 8)) for i in range(8)] + [((8, j), (8, 1)) for j in range(8)]
    offsets, sizes = [o for o, _ in boxes], [s for _, s in boxes]
    dcp_cover.check_cover("w", size, offsets, sizes, WHERE)  # corners
    monkeypatch.setattr(dcp_cover, "CORNER_BUDGET", 0)
    dcp_cover.check_cover("w", size, offsets, sizes, WHERE)  # the sweep, within its budget
    monkeypatch.setattr(dcp_cover, "SWEEP_BUDGET", 10)
    with pytest.raises(zerofast.UnsupportedCheckpointError, match="without forming a grid.*more than 10 comparisons"):
        dcp_cover.check_cover("w", size, offsets, sizes, WHERE)


@pytest.mark.parametrize("size,offsets,sizes,outcome", [
    ((), [()], [()], "ok"),                                   # a 0-d tensor: one chunk
    ((), [(), ()], [(), ()], "overlap"),
    ((), [], [], "hole"),
    ((0, 5), [(0, 0), (0, 2)], [(0, 2), (0, 3)], "ok"),       # no elements: empty boxes only
    ((3, 4), [(0, 0), (1, 2)], [(3, 4), (0, 9)], "past"),     # an empty box still lies inside
    ((3, 4), [(0, 0), (0, 0)], [(3, 4), (0, 0)], "ok"),       # an empty box covers nothing
    ((2**62, 1), [(0, 0)], [(2**62, 1)], "unsupported"),
])
def test_edge_cases(size, offsets, sizes, outcome):
    try:
        dcp_cover.check_cover("w", size, offsets, sizes, WHERE)
        got = "ok"
    except zerofast.UnsupportedCheckpointError:
        got = "unsupported"
    except zerofast.InconsistentCheckpointError as e:
        got = "past" if "not inside" in str(e) else "overlap" if "overlap" in str(e) else "hole"
    assert got == outcome
