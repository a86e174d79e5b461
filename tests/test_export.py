"""zerofast.export against real DeepSpeed checkpoints, read back with the plain libraries.

Every layout is exported in both formats, as tiny shards (several files plus an index) and as one
file, in fp32 and bf16, and once keeping the checkpoint's dtypes. The combinations are spread
over five cases per layout, so that each layout meets each format, shard mode and dtype, and each
format meets each shard mode and dtype, without running the whole product.
"""
from __future__ import annotations

import fcntl
import functools
import importlib.util
import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import zerofast
import zerofast.prepare as prepare_module
from zerofast.output import windows
from zerofast.base.errors import ExportError, OutputExistsError
from zerofast.execute import Executor
from zerofast.execute.read_batch import BatchReader
from zerofast.hf import export, load_exported
from zerofast.hf.formats import TIED_KEY
from zerofast.output.transaction import MARKER

MARKER_TOP, MARKER_NAME = MARKER.split("/")[0], Path(MARKER).name  # what listdir / a rename shows
from zerofast.hf.shards import parse_size, plan_shards

from tests.dsgen.catalog import LAYOUTS
from tests.helpers import assert_bitwise_equal, expected_value
from tests.helpers import real_root as _root, real_truth as _truth

REPO = Path(__file__).resolve().parent.parent

_NO_DEEPSPEED = importlib.util.find_spec("deepspeed") is None


def needs_deepspeed(test):
    skip = pytest.mark.skipif(_NO_DEEPSPEED, reason="real checkpoints are made by DeepSpeed 0.19.8, "
                                                    "which is not installed (pip install deepspeed==0.19.8)")
    return pytest.mark.deepspeed(skip(test))


TINY = 2000  # bytes: splits every test model into several shards, some tensors alone over the limit
SAFE = "safetensors"
CASES = [(SAFE, TINY, torch.float32), (SAFE, "5GB", torch.bfloat16), ("torch", TINY, torch.bfloat16),
         ("torch", "5GB", torch.float32), (SAFE, TINY, None)]
SMALL = "s2_bf16_w2_frozen_tied"  # tied, frozen and mixed dtypes: the layout for the folder tests


@functools.lru_cache(maxsize=None)
def _reconstructed(name: str, dtype: torch.dtype | None) -> dict:
    return dict(zerofast.reconstruct(_root(name), dtype))


def _expected(truth: dict, dtype: torch.dtype | None) -> dict:
    """The ground truth under the dtype policy: floating tensors cast, integer and bool kept."""
    out = {}
    for group in ("trainable", "frozen", "buffers"):
        for name, value in truth[group].items():
            out[name] = expected_value(value, dtype)
    for alias, source in truth["tied"].items():
        out[alias] = out[source]
    return out


def _assert_bit_identical(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert_bitwise_equal(got[name], value, name)


def _read_plain(out: Path, fmt: str) -> dict[str, torch.Tensor]:
    """Every weight file in the folder, read with the plain loader and merged; no alias restored."""
    from safetensors.torch import load_file

    merged: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors" if fmt == SAFE else "*.bin")):
        part = load_file(f) if fmt == SAFE else torch.load(f, map_location="cpu", weights_only=True)
        assert not set(part) & set(merged), f"{f.name} repeats keys of another shard"
        merged.update(part)
    return merged


def _st_header(path: Path) -> tuple[int, dict]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return n, json.loads(f.read(n))


def _weight_names(out: Path) -> list[str]:
    return sorted(n for n in os.listdir(out) if n != MARKER_TOP)


def _case_id(value) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", None: "keep", TINY: "tiny", "5GB": "one"}.get(value, value)


# ---------------------------------------------------------------------------------------------
# Every layout, read back and judged against DeepSpeed's own values.

@needs_deepspeed
@pytest.mark.parametrize("fmt,shard,dtype", CASES, ids=lambda v: _case_id(v))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_export_matches_ground_truth_and_reconstruct(tmp_path, layout, fmt, shard, dtype):
    out = tmp_path / "out"
    result = export(_root(layout), out, dtype=dtype, format=fmt, max_shard_size=shard)
    truth = _truth(layout)

    assert (len(result.files) > 1) == (result.index is not None) == (shard == TINY)
    assert _weight_names(out) == sorted(n for n in (*result.files, result.index) if n)
    loaded = load_exported(out)
    assert sorted(loaded) == sorted(truth["state_dict_keys"])
    _assert_bit_identical(loaded, _expected(truth, dtype))
    _assert_bit_identical(loaded, _reconstructed(layout, dtype))
    for alias, source in truth["tied"].items():
        assert loaded[alias].data_ptr() == loaded[source].data_ptr()

    plain = _read_plain(out, fmt)
    assert sum(t.nbytes for n, t in plain.items() if n not in result.aliases) == result.total_size
    if shard == TINY:
        _check_index(out, fmt, result, plain)


def _check_index(out: Path, fmt: str, result, plain: dict) -> None:
    index = json.loads((out / result.index).read_text())
    assert index["metadata"]["total_size"] == result.total_size
    assert set(index["weight_map"]) == set(plain) and set(index["weight_map"].values()) == set(result.files)
    n = len(result.files)
    stem = "model" if fmt == SAFE else "pytorch_model"
    ext = "safetensors" if fmt == SAFE else "bin"
    assert list(result.files) == [f"{stem}-{i:05d}-of-{n:05d}.{ext}" for i in range(1, n + 1)]
    assert result.index == f"{stem}.{ext}.index.json"


@needs_deepspeed
@pytest.mark.parametrize("dtype", [torch.float32, None], ids=["fp32", "keep"])
def test_safetensors_files_are_laid_out_for_plain_readers(tmp_path, dtype):
    """Header padded to 8 bytes, data packed without gaps, every offset aligned to its itemsize,
    format "pt" in the metadata (transformers refuses a file without it), and no file over the
    limit unless it holds a single tensor larger than the limit."""
    result = export(_root(SMALL), tmp_path, dtype=dtype, max_shard_size=TINY)
    itemsize = {"F32": 4, "BF16": 2, "I64": 8, "BOOL": 1}
    for name in result.files:
        n, header = _st_header(tmp_path / name)
        assert (8 + n) % 8 == 0
        assert header.pop("__metadata__")["format"] == "pt"
        spans = sorted((v["data_offsets"], itemsize[v["dtype"]]) for v in header.values())
        pos = 0
        for (begin, end), size in spans:
            assert begin == pos and begin % size == 0
            pos = end
        assert pos == (tmp_path / name).stat().st_size - 8 - n
        assert pos <= TINY or len(header) == 1


@needs_deepspeed
@pytest.mark.parametrize("shard", [TINY, "5GB"], ids=["tiny", "one"])
def test_tied_aliases_are_recorded_once_in_safetensors(tmp_path, shard):
    result = export(_root(SMALL), tmp_path, max_shard_size=shard)
    tied = _truth(SMALL)["tied"]
    assert result.aliases == tied and tied
    if result.index:
        index = json.loads((tmp_path / result.index).read_text())
        assert json.loads(index["metadata"][TIED_KEY]) == tied
        assert not set(tied) & set(index["weight_map"])
        assert all(TIED_KEY not in _st_header(tmp_path / f)[1]["__metadata__"] for f in result.files)
    else:
        assert json.loads(_st_header(tmp_path / result.files[0])[1]["__metadata__"][TIED_KEY]) == tied
    assert not set(tied) & set(_read_plain(tmp_path, SAFE))


@needs_deepspeed
@pytest.mark.parametrize("shard", [TINY, "5GB"], ids=["tiny", "one"])
def test_torch_format_keeps_true_sharing_in_each_file(tmp_path, shard):
    result = export(_root(SMALL), tmp_path, format="torch", max_shard_size=shard)
    tied = _truth(SMALL)["tied"]
    index = json.loads((tmp_path / result.index).read_text())["weight_map"] if result.index else None
    for alias, source in tied.items():
        home = index[source] if index else result.files[0]
        assert index is None or index[alias] == home
        sd = torch.load(tmp_path / home, map_location="cpu", weights_only=True)
        assert sd[alias].untyped_storage().data_ptr() == sd[source].untyped_storage().data_ptr()


@needs_deepspeed
@pytest.mark.parametrize("fmt", [SAFE, "torch"])
def test_duplicate_tied_writes_real_copies(tmp_path, fmt):
    result = export(_root(SMALL), tmp_path, format=fmt, dtype=torch.bfloat16, duplicate_tied=True)
    assert result.aliases == {}
    plain = _read_plain(tmp_path, fmt)
    for alias, source in _truth(SMALL)["tied"].items():
        assert torch.equal(plain[alias], plain[source])
        assert plain[alias].untyped_storage().data_ptr() != plain[source].untyped_storage().data_ptr()
    _assert_bit_identical(load_exported(tmp_path), _reconstructed(SMALL, torch.bfloat16))


@needs_deepspeed
def test_exclude_frozen_matches_reconstruct(tmp_path):
    export(_root(SMALL), tmp_path, exclude_frozen=True, max_shard_size=TINY)
    want = dict(zerofast.reconstruct(_root(SMALL), exclude_frozen=True))
    assert not set(want) & set(_truth(SMALL)["frozen"])
    _assert_bit_identical(load_exported(tmp_path), want)


@needs_deepspeed
@pytest.mark.parametrize("layout", ["s3_bf16_w4_offload", "s2_fp32_w4_odd_3groups"])
def test_tensors_split_across_mapping_windows_are_bit_identical(tmp_path, monkeypatch, layout):
    """A window far smaller than the tensors (and no multiple of any itemsize) forces every tensor
    through the slicing path that big models take with the real window. The window path is the
    one a GPU export takes: the batched file writer is switched off to reach it on the CPU."""
    monkeypatch.setattr(windows, "WINDOW_BYTES", 100)
    monkeypatch.setattr(prepare_module, "BatchReader", lambda *args: None)
    export(_root(layout), tmp_path, dtype=None)
    _assert_bit_identical(load_exported(tmp_path), _reconstructed(layout, None))


@needs_deepspeed
def test_progress_reports_every_byte(tmp_path):
    calls = []
    result = export(_root(SMALL), tmp_path, max_shard_size=TINY, progress=lambda d, t: calls.append((d, t)))
    assert calls[0] == (0, result.total_size) and calls[-1] == (result.total_size, result.total_size)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)


# ---------------------------------------------------------------------------------------------
# The output folder: refusal, reruns, failures.

@needs_deepspeed
def test_refuses_a_folder_zerofast_did_not_write(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"someone else's weights")
    with pytest.raises(OutputExistsError, match="overwrite"):
        export(_root(SMALL), tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "pytorch_model.bin"]

    export(_root(SMALL), tmp_path, overwrite=True)
    # Only weight files are replaced: a stale pytorch_model.bin would shadow or contradict ours.
    assert sorted(os.listdir(tmp_path)) == [MARKER_TOP, "config.json", "model.safetensors"]


@needs_deepspeed
def test_refuses_a_file_as_output(tmp_path):
    target = tmp_path / "model"
    target.write_text("")
    with pytest.raises(OutputExistsError, match="found a file"):
        export(_root(SMALL), target)


@needs_deepspeed
def test_refuses_while_another_export_holds_the_folder(tmp_path):
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(OutputExistsError, match="another zerofast export"):
            export(_root(SMALL), tmp_path)
    finally:
        os.close(fd)
    assert os.listdir(tmp_path) == []


@needs_deepspeed
def test_rerun_replaces_previous_export_and_cleans_leftovers(tmp_path):
    export(_root(SMALL), tmp_path, format="torch", max_shard_size=TINY)
    stale = tmp_path / ".zerofast-tmp-999999"
    stale.mkdir()
    (stale / ".zerofast-tmp").touch()  # what every export puts in its temporary folder
    (stale / "model-00001-of-00002.safetensors").write_bytes(b"half written")

    result = export(_root(SMALL), tmp_path)
    assert sorted(os.listdir(tmp_path)) == [MARKER_TOP, "model.safetensors"]
    assert json.loads((tmp_path / MARKER).read_text())["files"] == ["model.safetensors"]
    _assert_bit_identical(load_exported(tmp_path), _reconstructed(SMALL, torch.float32))
    assert result.files == ("model.safetensors",)


def _failing_run(after: int):
    real = Executor.run
    calls = []

    def run(self, tp, out=None):
        calls.append(tp.name)
        if len(calls) > after:
            raise RuntimeError("simulated failure in the middle of the export")
        return real(self, tp, out)

    return run


def _failing_write(after: int):
    """The same for the safetensors writer, which hands the executor's batch reader whole groups."""
    real = BatchReader.write
    calls = []

    def write(self, fd, placed):
        calls.extend(tp.name for tp, _ in placed)
        if len(calls) > after:
            raise RuntimeError("simulated failure in the middle of the export")
        return real(self, fd, placed)

    return write


def _fail_after(monkeypatch, after: int) -> None:
    monkeypatch.setattr(Executor, "run", _failing_run(after))
    monkeypatch.setattr(BatchReader, "write", _failing_write(after))


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@needs_deepspeed
@pytest.mark.parametrize("fmt", [SAFE, "torch"])
def test_failure_leaves_no_final_name_and_keeps_the_previous_export(tmp_path, monkeypatch, fmt):
    fresh = tmp_path / "fresh"
    _fail_after(monkeypatch, 12)
    with pytest.raises(RuntimeError, match="simulated"):
        export(_root(SMALL), fresh, format=fmt, max_shard_size=TINY)
    assert not fresh.exists()  # no final name, and no folder this call made (issue 45)

    kept = tmp_path / "kept"
    monkeypatch.undo()
    export(_root(SMALL), kept, format=fmt, max_shard_size=TINY)
    before = _snapshot(kept)
    _fail_after(monkeypatch, 12)
    with pytest.raises(RuntimeError, match="simulated"):
        export(_root(SMALL), kept, format=fmt)
    assert _snapshot(kept) == before


@needs_deepspeed
@pytest.mark.parametrize("fmt", [SAFE, "torch"])
def test_index_is_moved_into_place_last(tmp_path, monkeypatch, fmt):
    moved = []
    real = os.replace

    def replace(src, dst):
        moved.append(Path(dst).name)
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    result = export(_root(SMALL), tmp_path, format=fmt, max_shard_size=TINY)
    weights = [n for n in moved if n != MARKER_NAME]
    assert weights == [*result.files, result.index]
    assert moved[0] == MARKER_NAME  # the new names are claimed before any of them appears


_KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[4])
    from zerofast.execute import Executor
    from zerofast.hf import export

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    if sys.argv[3] == "writing":
        from zerofast.execute.read_batch import BatchReader
        real_write, seen = BatchReader.write, []
        def write(self, fd, placed):
            seen.extend(placed)
            if len(seen) > 10:
                die()
            return real_write(self, fd, placed)
        BatchReader.write = write
    else:  # killed between moving the first shard and the rest
        real_replace = os.replace
        def replace(src, dst):
            real_replace(src, dst)
            if Path(dst).name.startswith("model-00001"):
                die()
        os.replace = replace
    export(sys.argv[1], sys.argv[2], max_shard_size=2000)
""")


@needs_deepspeed
@pytest.mark.parametrize("when", ["writing", "moving"])
def test_killed_export_leaves_no_index_and_a_rerun_succeeds(tmp_path, when):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-c", _KILL_SCRIPT, str(_root(SMALL)), str(out), when, str(REPO)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    left = os.listdir(out)
    assert not [n for n in left if n.endswith(".index.json")]
    if when == "writing":
        assert [n for n in left if n != MARKER_TOP and not n.startswith(".zerofast-tmp-")] == []

    result = export(_root(SMALL), out, max_shard_size=TINY)
    assert _weight_names(out) == sorted([*result.files, result.index])
    _assert_bit_identical(load_exported(out), _reconstructed(SMALL, torch.float32))


def test_load_exported_names_the_folder_when_nothing_is_there(tmp_path):
    with pytest.raises(ExportError, match="found none"):
        load_exported(tmp_path)


# ---------------------------------------------------------------------------------------------
# Shard planning and size strings: pure functions.

@pytest.mark.parametrize("text,expected", [
    ("5GB", 5 * 10**9), ("5GiB", 5 * 2**30), ("500MB", 500 * 10**6), ("1.5mb", 1_500_000), ("64KiB", 65536),
    ("3TB", 3 * 10**12), ("1234", 1234), (1234, 1234), (" 10 KB ", 10_000), ("7B", 7),
])
def test_parse_size_reads_sizes_as_huggingface_hub(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "GB", "5 parsecs", "-1GB", "0", 0, -5, True, 1.5, None])
def test_parse_size_refuses_nonsense(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


@pytest.mark.parametrize("sizes,limit,expected", [
    ([("a", 4), ("b", 4), ("c", 4)], 8, [["a", "b"], ["c"]]),
    ([("a", 5), ("b", 5)], 10, [["a", "b"]]),  # exactly at the limit still fits
    ([("a", 2), ("big", 20), ("b", 2)], 5, [["big"], ["a", "b"]]),  # over the limit: alone, at once
    ([("e", 0), ("a", 3), ("f", 0)], 3, [["e", "a", "f"]]),
    ([], 10, [[]]),
])
def test_plan_shards_follows_huggingface_hub(sizes, limit, expected):
    assert plan_shards(sizes, limit) == expected


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 50), max_size=30), st.integers(1, 40))
def test_plan_shards_is_greedy_and_never_overfills(raw, limit):
    sizes = [(f"t{i}", n) for i, n in enumerate(raw)]
    size = dict(sizes)
    shards = plan_shards(sizes, limit)
    assert sorted(n for s in shards for n in s) == sorted(size)
    regular = [s for s in shards if not (len(s) == 1 and size[s[0]] > limit)]
    assert [n for s in regular for n in s] == [n for n, b in sizes if b <= limit]  # order kept
    for shard in regular:
        assert sum(size[n] for n in shard) <= limit
    for left, right in zip(regular, regular[1:]):  # a shard closes only when the next one would not fit
        assert sum(size[n] for n in left) + size[right[0]] > limit
