"""The heap the rank files' trees leave is handed back before the outputs are made (reader.release_freed_heap).

The trim itself is glibc's; what is ours is when it runs: once per public call, after the records
are dropped and before any output exists, and only for plans large enough to leave much. The
peak it saves is measured in benchmarks/ (docs/performance.md), not here.
"""
from __future__ import annotations

import gc
import importlib

import pytest
import torch

import zerofast
from zerofast.execute import Executor
from zerofast.prepare import prepare
from tests.conftest import needs_deepspeed
from tests.helpers import module_like, real_root
from zerofast.load import reader


def _trims(monkeypatch) -> list[int]:
    calls: list[int] = []
    monkeypatch.setattr(reader, "_malloc_trim", lambda: calls.append)
    return calls


def test_only_plans_of_many_tensors_trim(monkeypatch):
    calls = _trims(monkeypatch)
    reader.release_freed_heap(reader.TRIM_TENSORS - 1)
    assert calls == []
    reader.release_freed_heap(reader.TRIM_TENSORS)
    assert calls == [0]  # malloc_trim(0): keep no slack at the top of the heap


def test_without_malloc_trim_nothing_happens(monkeypatch):
    monkeypatch.setattr(reader, "_malloc_trim", lambda: None)
    reader.release_freed_heap(10 ** 9)  # a C library without malloc_trim (musl): a no-op, no error


def test_glibc_trim_is_found_here():
    trim = reader._malloc_trim()
    if trim is None:
        pytest.skip("this C library has no malloc_trim (not glibc): release_freed_heap is a no-op here")
    assert trim(0) in (0, 1)  # 1: memory was handed back, 0: there was none to hand back


@needs_deepspeed
@pytest.mark.parametrize("entry", ["reconstruct", "lazy", "load_into", "optimizer_state"])
def test_each_entry_point_trims_once_before_making_outputs(entry, monkeypatch):
    root = real_root("s3_bf16_w2_frozen_tied")
    # reconstruct and optimizer_state make their results through results.state_dict_of
    where = "zerofast.api.load_into" if entry == "load_into" else "zerofast.results"
    target = module_like(zerofast.reconstruct(root)) if entry == "load_into" else None
    events: list = []
    monkeypatch.setattr(importlib.import_module(where), "release_freed_heap", lambda n: events.append(n))
    for method in ("run_plan", "run_into", "run", "view"):
        monkeypatch.setattr(Executor, method, _noting(getattr(Executor, method), events))
    if entry == "reconstruct":
        assert zerofast.reconstruct(root)
    elif entry == "lazy":
        assert [v for v in zerofast.reconstruct(root, lazy=True).values()]
    elif entry == "load_into":
        zerofast.load_into(target, root, strict=False)
    else:
        assert zerofast.optimizer_state(root, "exp_avg")
    assert "outputs" in events and events.count("outputs") < len(events)
    first = events[0]
    assert isinstance(first, int) and events.count(first) == 1  # once, before any output
    want = prepare(root, None if entry == "load_into" else torch.float32,
                   optimizer_keys=["exp_avg"] if entry == "optimizer_state" else None).plan
    assert first == len(want.tensors)


def _noting(real, events):
    def run(self, *args, **kwargs):
        events.append("outputs")
        return real(self, *args, **kwargs)
    return run


@needs_deepspeed
@pytest.mark.parametrize("was_enabled", [True, False])
def test_the_collector_is_paused_for_the_whole_call_and_given_back_as_found(was_enabled, monkeypatch):
    """The entry points run with the cyclic collector off (the records and the plan are freed
    before it is back, so its owed collection walks only the result), and leave it as they
    found it, also when the call fails."""
    root = real_root("s3_bf16_w2_frozen_tied")
    seen = []
    real_run_plan = Executor.run_plan
    monkeypatch.setattr(Executor, "run_plan", lambda self, cols: seen.append(gc.isenabled()) or real_run_plan(self, cols))
    real_prepare = importlib.import_module("zerofast.api.reconstruct").prepare
    monkeypatch.setattr(importlib.import_module("zerofast.api.reconstruct"), "prepare",
                        lambda *a, **k: seen.append(gc.isenabled()) or real_prepare(*a, **k))
    (gc.enable if was_enabled else gc.disable)()
    try:
        assert zerofast.reconstruct(root)
        assert gc.isenabled() == was_enabled
        with pytest.raises(zerofast.ZeroFastError):
            zerofast.reconstruct(root / "no such tag")
        assert gc.isenabled() == was_enabled
    finally:
        gc.enable()
    assert seen and not any(seen)
