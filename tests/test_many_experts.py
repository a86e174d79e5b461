"""Saves of many expert files (issue 22): the expert files are indexed in one native batch, small
ones read whole; the pool policy of ``read_all`` (rank files); and a real DeepSpeed 0.19.8 MoE
save of 1024 expert files (benchmarks/generate.py's ``ds_moe_1k``)
reads back bit for bit against DeepSpeed's own ground truth.

The 1024-file save takes a minute or more to train and save on two cores, so that test runs only
with ``ZEROFAST_TEST_MANY_EXPERTS`` set: ``1`` makes it (once) in the test checkpoint cache, a
folder path makes it (once) there or reuses it (``/work/bench-data`` holds the benchmark's copy).
"""
from __future__ import annotations

import gc
import io
import os
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
from safetensors.torch import load_file as load_safetensors

import zerofast
import zerofast.layouts.moe as moe_layout
import zerofast.layouts.zero as zero_layout
import zerofast.load.archive as archive
import zerofast.load.parallel as parallel
import zerofast.load.reader as reader_module
import zerofast.load.unpickle as unpickle
from zerofast.base.errors import ZeroFastError
from zerofast.layouts import discover
from zerofast.load.reader import load_file, load_files, native_core
from zerofast.execute import Executor
from zerofast.prepare import prepare
from zerofast.plan.model import SourceTable, TensorPlan

from tests.conftest import HAVE_DEEPSPEED, needs_nvme
from tests.planting import copy_checkpoint
from tests.helpers import assert_bitwise_equal, expected_value, real_root, stored_values

MANY_EXPERTS = os.environ.get("ZEROFAST_TEST_MANY_EXPERTS", "")
SMALL_MOE = "moe_s2_bf16_w2_ep2"

pytestmark = pytest.mark.skipif(not HAVE_DEEPSPEED, reason="DeepSpeed 0.19.8 makes the real checkpoints")


def _expert_paths() -> list[Path]:
    return list(discover(real_root(SMALL_MOE)).expert_files)


def test_expert_files_are_indexed_in_one_native_batch_and_small_ones_read_whole(monkeypatch):
    """Every expert file's zip directory is read in one call of the native core (on its threads,
    without the GIL), and a file of a few KiB is read into memory, not mapped."""
    if native_core() is None:
        pytest.skip("no native core: each file is indexed by archive.py in turn")
    batches, indexes = [], []
    index_archives = reader_module.index_archives

    def spy(paths):
        batches.append([Path(p).name for p in paths])
        got = index_archives(paths)
        indexes.extend(got)
        return got

    monkeypatch.setattr(reader_module, "index_archives", spy)
    zerofast.reconstruct(real_root(SMALL_MOE))
    experts = _expert_paths()
    assert batches == [[p.name for p in experts]]
    assert all(p.stat().st_size <= archive.READ_WHOLE_BYTES for p in experts)
    assert all(i is not None and bytes(i.whole.numpy()) == p.read_bytes() for i, p in zip(indexes, experts))


def test_sources_read_whole_are_never_streamed(monkeypatch, tmp_path):
    """A tensor cut from a file read whole is plain memory: the plan must not mark it as a file
    mapping, whose pages the executor drops once read (on plain memory that would zero it). One
    cut from a mapping still is one. (A torch.save file of whole pages of floats: the executor
    drops only whole pages.)"""
    small, large = tmp_path / "small.pt", tmp_path / "large.pt"
    torch.save({"w": torch.arange(1 << 16, dtype=torch.float32)}, small)
    torch.save({"w": torch.arange(1 << 17, dtype=torch.float32)}, large)
    monkeypatch.setattr(archive, "READ_WHOLE_BYTES", small.stat().st_size)
    table = SourceTable()
    for path, tree in zip((small, large), load_files([small, large])):
        table.add(str(path), "w", tree["w"])
    whole = native_core() is not None  # without the core every file is mapped
    assert table.mapped == [not whole, True]
    executor = Executor(table.tensors, streamable=table.mapped)
    for i, t in enumerate(table.tensors):
        tp = TensorPlan(str(i), tuple(t.shape), "trainable", t.dtype, torch.float64, ((i, 0, 0, t.numel()),))
        want = torch.arange(t.numel(), dtype=torch.float64)
        assert_bitwise_equal(executor.run(tp), want, str(i))
        assert_bitwise_equal(executor.run(tp), want, f"{i}, read again")


def test_memory_that_is_not_a_live_mapping_is_not_streamable(tmp_path):
    """A copy is not a mapping; nor is memory that a mapping, since freed, once covered. (Here the
    memory stays put while the mapping object the listing holds dies: the listing is stale, and
    the answer must still be no.)"""
    path = tmp_path / "w.pt"
    torch.save({"w": torch.arange(1 << 16, dtype=torch.float32)}, path)
    mapped = load_file(path)["w"]
    assert unpickle.in_file_mapping(str(path), mapped)
    assert not unpickle.in_file_mapping(str(path), mapped.clone())
    # Memory a listed mapping once covered, now plain memory: a numpy buffer seen twice by torch,
    # the first time listed as if it were a mapping, the second time not.
    buffer = np.zeros(1 << 16, dtype=np.float32)
    listed = torch.frombuffer(buffer, dtype=torch.float32)
    (tmp_path / "fake.pt").write_bytes(b"listed")
    unpickle._remember_mapping(tmp_path / "fake.pt", listed.untyped_storage())
    assert unpickle.in_file_mapping(str(tmp_path / "other.pt"), listed)  # listed: counted
    del listed  # the listed storage dies, its ranges stay in the listing
    gc.collect()
    again = torch.frombuffer(buffer, dtype=torch.float32)
    assert again.data_ptr() == buffer.ctypes.data
    assert not unpickle.in_file_mapping(str(tmp_path / "other.pt"), again)


def test_small_files_read_whole_match_their_mapped_reading(monkeypatch):
    """The trees of files read whole equal those of the same files mapped, bit for bit."""
    paths = _expert_paths()
    batch = load_files(paths)
    monkeypatch.setattr(archive, "READ_WHOLE_BYTES", 0)  # every file mapped
    mapped = load_files(paths)
    one_by_one = [load_file(p) for p in paths]
    for a, b, c in zip(batch, mapped, one_by_one):
        assert list(a) == list(b) == list(c)
        for name in a:
            assert_bitwise_equal(a[name], b[name], name)
            assert_bitwise_equal(a[name], c[name], name)


def _copies(tmp_path, damage: dict) -> list[Path]:
    """Six expert files copied, ``damage[i]`` applied to the bytes of copy ``i``."""
    paths = []
    for i, p in enumerate(_expert_paths()[:6]):
        q = tmp_path / p.name
        q.write_bytes(damage.get(i, lambda b: b)(p.read_bytes()))
        paths.append(q)
    return paths


def _same_error(batch_call, single_call, path: Path) -> None:
    with pytest.raises(ZeroFastError) as batch:
        batch_call()
    with pytest.raises(ZeroFastError) as single:
        single_call()
    assert type(batch.value) is type(single.value)
    assert batch.value.path == single.value.path == str(path)
    assert str(batch.value) == str(single.value)


def _halved(data: bytes) -> bytes:
    return data[:len(data) // 2]


def _pickle_damaged(data: bytes) -> bytes:
    """An opcode of data.pkl changed in place: the zip directory stays valid (the batch accepts
    it), the pickle does not (the reader refuses it)."""
    at = data.index(b"\x80\x02") + 2  # just past PROTO 2
    return data[:at] + b"\xff" + data[at + 1:]


@pytest.mark.parametrize("damage", [{2: _halved, 4: _halved}, {2: _pickle_damaged, 4: _halved}],
                         ids=["directory", "pickle"])
def test_a_damaged_expert_file_in_a_batch_raises_its_own_error(tmp_path, damage):
    """The batch reads every file at once, but the first bad one in order raises, naming it, as
    reading them one by one would; later ones are not blamed."""
    paths = _copies(tmp_path, damage)
    _same_error(lambda: load_files(paths), lambda: load_file(paths[2]), paths[2])


def test_a_check_of_an_earlier_file_comes_before_a_later_damaged_file(tmp_path):
    """What the layout checks of each file runs in order with the reading: a valid file that is
    not an expert file (a list) raises before a damaged file after it."""
    not_a_dict = io.BytesIO()
    torch.save([1, 2], not_a_dict)
    paths = _copies(tmp_path, {1: lambda _: not_a_dict.getvalue(), 3: _halved})
    _same_error(lambda: load_files(paths, moe_layout._expert_file),
                lambda: moe_layout._expert_file(paths[1], load_file(paths[1])), paths[1])


def test_a_file_changed_since_its_stat_is_read_again_in_turn(tmp_path, monkeypatch):
    """A file whose identity differs from its stat's (changed between the two) is left out of
    the batch and read by itself: the same trees."""
    paths = _copies(tmp_path, {})
    stat_or_none = archive._stat_or_none

    def stale(path):
        st = stat_or_none(path)
        if Path(path) != paths[3]:
            return st
        return os.stat_result((st.st_mode, st.st_ino, st.st_dev, st.st_nlink, st.st_uid, st.st_gid, st.st_size,
                               st.st_atime, st.st_mtime - 1, st.st_ctime))

    monkeypatch.setattr(archive, "_stat_or_none", stale)
    indexes = archive.index_archives(paths)
    assert indexes[3] is None
    assert all(i is not None for k, i in enumerate(indexes) if k != 3) == (native_core() is not None)
    for got, path in zip(load_files(paths), paths):
        assert list(got) == list(load_file(path))
        for name in got:
            assert_bitwise_equal(got[name], load_file(path)[name], name)


@pytest.mark.parametrize("layout", [pytest.param("s3_bf16_w2_nvme", marks=needs_nvme), "moe_s0_bf16_w2_ep2",
                                    "moe_s2_fp32_w4_ep2"])
def test_sources_cut_from_mappings_stay_streamable(layout):
    """Every source cut from a file mapping is marked so, also where it is filed under another
    file than the one it was cut from (NVMe swap files under their optimizer file, a ZeRO-off
    MoE's module tensors under the expp_rank file)."""
    prepared = prepare(real_root(layout))
    for source, mapped, file in zip(prepared.sources, prepared.mapped, prepared.files):
        if source.numel():
            assert mapped, f"{Path(file).name}: a source of {source.numel()} elements is not marked streamable"


def _readers(monkeypatch, paths: list[Path]) -> dict[str, str]:
    """Each of ``paths`` read through ``read_all``, by the name of the thread that read it."""
    readers: dict[str, str] = {}

    def read(path):
        readers[Path(path).name] = threading.current_thread().name
        return load_file(path)

    parallel.read_all(read, paths)
    return readers


def test_small_files_are_read_in_turn(monkeypatch):
    """Files of a few KiB that read quickly: the pool's hand-offs would cost more than they hide."""
    me = threading.current_thread().name
    assert set(_readers(monkeypatch, _expert_paths()).values()) == {me}


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one CPU: the files are read one by one, as they should")
@pytest.mark.parametrize("knob", ["POOL_FILE_BYTES", "POOL_FILE_SECONDS"])
def test_files_are_read_on_the_thread_pool_where_they_are_large_or_slow(monkeypatch, knob):
    # Every file counts as large (all go to the pool), or as slow to read (all but the first two,
    # read in turn to find that out).
    monkeypatch.setattr(parallel, knob, 0)
    monkeypatch.setattr(parallel, "PROBE_FILES", 2)
    order = _expert_paths()
    readers = _readers(monkeypatch, order)
    probed = 0 if knob == "POOL_FILE_BYTES" else 2
    me = threading.current_thread().name
    assert [readers[p.name] for p in order[:probed]] == [me] * probed
    assert all(readers[p.name].startswith("zerofast-read") for p in order[probed:])


def _many_experts_root() -> Path:
    from benchmarks.generate import ensure_real
    from tests.dsgen.catalog import cache_dir

    folder = cache_dir() if MANY_EXPERTS == "1" else Path(MANY_EXPERTS)
    folder.mkdir(parents=True, exist_ok=True)
    return ensure_real(folder, "ds_moe_1k")


@pytest.mark.skipif(not MANY_EXPERTS, reason="trains a 1024-expert-file MoE save with DeepSpeed (a minute or more): "
                                             "set ZEROFAST_TEST_MANY_EXPERTS=1 (or a folder) to run it")
def test_a_thousand_expert_files_read_back_bit_for_bit(tmp_path):
    root = _many_experts_root()
    truth = torch.load(root / "ground_truth.pt", weights_only=True)
    assert len(discover(root).expert_files) >= 1000
    want = stored_values(truth)
    for dtype in (None, torch.float32):
        sd = zerofast.reconstruct(root, dtype=dtype)
        assert list(sd) == truth["state_dict_keys"]
        for name in sd:
            assert_bitwise_equal(sd[name], expected_value(want[truth["tied"].get(name, name)], dtype), name)
    lazy = zerofast.reconstruct(root, lazy=True)
    for name, value in lazy.items():
        assert_bitwise_equal(value, expected_value(want[truth["tied"].get(name, name)], torch.float32), name)
    zerofast.export(root, tmp_path / "hf")
    exported = {}
    for shard in sorted((tmp_path / "hf").glob("*.safetensors")):
        exported.update(load_safetensors(shard))
    for name, value in exported.items():
        assert_bitwise_equal(value, expected_value(want[truth["tied"].get(name, name)], torch.float32), name)
    assert set(exported) | set(truth["tied"]) >= set(truth["state_dict_keys"])


def _by_pattern(name: str):
    m = moe_layout.EXPERT_NAME.match(name)
    return (m.group(1), int(m.group(2)), m.group(3)) if m else None


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([moe_layout.EXPERTS, moe_layout.EXPERTS[:-1], "layers.0", "7", "12", ".", "w",
                                 "\n", "\u0663", "é", "deepspeed_experts."]), max_size=8).map("".join))
def test_split_expert_finds_what_the_pattern_finds(name):
    """The string search that splits every tensor name of a thousand-file save agrees with the
    pattern it stands in for, on names built from its pieces (newlines, non-ASCII digits too)."""
    assert moe_layout.split_expert(name) == _by_pattern(name)


@pytest.mark.parametrize("name", [f"m.layers.1{moe_layout.EXPERTS}3.w1.weight",
                                  f"a{moe_layout.EXPERTS}1.b{moe_layout.EXPERTS}2.c",
                                  f"a{moe_layout.EXPERTS}1.b{moe_layout.EXPERTS}x.c",
                                  f"a{moe_layout.EXPERTS}12.w\n", f"a{moe_layout.EXPERTS}.w"])
def test_split_expert_on_names_that_pick_an_occurrence(name):
    assert moe_layout.split_expert(name) == _by_pattern(name)


S2 = "s2_bf16_w2_frozen_tied"


def _damaged_copy(tmp_path, names: list[str]) -> Path:
    root, _ = copy_checkpoint(real_root(S2), tmp_path / "ckpt")
    for name in names:
        for path in root.rglob(name):
            path.write_bytes(path.read_bytes()[:200])
    return root


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one CPU: nothing is read meanwhile")
def test_optimizer_files_read_meanwhile_give_the_same_result_and_the_same_first_error(monkeypatch, tmp_path):
    """Stages 0-2 read the optimizer files on threads while the model file is read (every file
    counts as large here). The result is the plain loop's; with both kinds damaged the model
    file's error comes first, as in the loop; no reader thread is left behind."""
    monkeypatch.setattr(parallel, "POOL_FILE_BYTES", 0)
    readers = set()
    real = zero_layout.read_optim_states

    def spy(path):
        readers.add(threading.current_thread().name)
        return real(path)

    monkeypatch.setattr(zero_layout, "read_optim_states", spy)
    got = zerofast.reconstruct(real_root(S2))
    meanwhile = set(readers)
    monkeypatch.setattr(parallel, "POOL_FILE_BYTES", 1 << 60)
    want = zerofast.reconstruct(real_root(S2))
    assert list(got) == list(want)
    for name in want:
        assert_bitwise_equal(got[name], want[name], name)
    assert meanwhile and (native_core() is None or all(r.startswith("zerofast-read-meanwhile") for r in meanwhile))
    monkeypatch.setattr(parallel, "POOL_FILE_BYTES", 0)
    before = threading.active_count()
    both = _damaged_copy(tmp_path / "both", ["mp_rank_00_model_states.pt", "*optim_states.pt"])
    with pytest.raises(ZeroFastError) as e:
        zerofast.reconstruct(both)
    assert e.value.path.endswith("mp_rank_00_model_states.pt")
    optim = _damaged_copy(tmp_path / "optim", ["bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"])
    with pytest.raises(ZeroFastError) as e:
        zerofast.reconstruct(optim)
    assert e.value.path.endswith("bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")
    assert threading.active_count() == before
