"""Saves of many expert files (issue 22): each expert file is read on the loader's thread pool, and
a real DeepSpeed 0.19.8 MoE save of 1024 expert files (benchmarks/generate.py's ``ds_moe_1k``)
reads back bit for bit against DeepSpeed's own ground truth.

The 1024-file save takes a minute or more to train and save on two cores, so that test runs only
with ``ZEROFAST_TEST_MANY_EXPERTS`` set: ``1`` makes it (once) in the test checkpoint cache, a
folder path makes it (once) there or reuses it (``/work/bench-data`` holds the benchmark's copy).
"""
from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
from safetensors.torch import load_file as load_safetensors

import zerofast
import zerofast.layouts.moe as moe_layout
import zerofast.load.parallel as parallel
from zerofast.layouts import discover

from tests.conftest import HAVE_DEEPSPEED
from tests.helpers import assert_bitwise_equal, expected_value, real_root, stored_values

MANY_EXPERTS = os.environ.get("ZEROFAST_TEST_MANY_EXPERTS", "")
SMALL_MOE = "moe_s2_bf16_w2_ep2"

pytestmark = pytest.mark.skipif(not HAVE_DEEPSPEED, reason="DeepSpeed 0.19.8 makes the real checkpoints")


def _expert_readers(monkeypatch) -> dict[str, str]:
    """Each expert file of the small MoE save, by the name of the thread that read it."""
    root = real_root(SMALL_MOE)
    readers: dict[str, str] = {}
    read = moe_layout.load_file

    def spy(path):
        readers[Path(path).name] = threading.current_thread().name
        return read(path)

    monkeypatch.setattr(moe_layout, "load_file", spy)
    zerofast.reconstruct(root)
    experts = {p.name for p in discover(root).expert_files}
    assert experts and set(readers) >= experts
    return {name: readers[name] for name in experts}


def test_small_expert_files_are_read_in_turn(monkeypatch):
    """Files of a few KiB that read quickly: the pool's hand-offs would cost more than they hide."""
    me = threading.current_thread().name
    assert set(_expert_readers(monkeypatch).values()) == {me}


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one CPU: the files are read one by one, as they should")
@pytest.mark.parametrize("knob", ["POOL_FILE_BYTES", "POOL_FILE_SECONDS"])
def test_expert_files_are_read_on_the_thread_pool_where_they_are_large_or_slow(monkeypatch, knob):
    # Every file counts as large (all go to the pool), or as slow to read (all but the first two,
    # read in turn to find that out).
    monkeypatch.setattr(parallel, knob, 0)
    monkeypatch.setattr(parallel, "PROBE_FILES", 2)
    readers = _expert_readers(monkeypatch)
    order = [p.name for p in discover(real_root(SMALL_MOE)).expert_files]
    probed = 0 if knob == "POOL_FILE_BYTES" else 2
    me = threading.current_thread().name
    assert [readers[n] for n in order[:probed]] == [me] * probed
    assert all(readers[n].startswith("zerofast-read") for n in order[probed:])


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
