"""settings.read_once: one reading of the environment for the length of one public call (the
per-file reads of a thousand-file save ask for the settings several times per file), every
variable changed before the next call seen there."""
from __future__ import annotations

import threading

import pytest

from zerofast.base.settings import FOLLOW_SYMLINKS_ENV, read_once, settings


def test_a_reading_holds_inside_the_call_and_the_next_call_reads_again(monkeypatch):
    monkeypatch.setenv(FOLLOW_SYMLINKS_ENV, "0")
    with read_once() as held:
        assert held.follow_symlinks is False
        monkeypatch.setenv(FOLLOW_SYMLINKS_ENV, "1")
        assert settings() is held  # the call's reader threads and helpers see the call's reading
        seen: list = []
        worker = threading.Thread(target=lambda: seen.append(settings()))
        worker.start()
        worker.join()
        assert seen == [held]
    assert settings().follow_symlinks is True  # out of the call: the environment as it is now


def test_a_call_that_starts_inside_another_reads_the_environment_again(monkeypatch):
    monkeypatch.setenv(FOLLOW_SYMLINKS_ENV, "0")
    with read_once():
        monkeypatch.setenv(FOLLOW_SYMLINKS_ENV, "1")
        with read_once() as inner:
            assert inner.follow_symlinks is True and settings() is inner
        assert settings().follow_symlinks is True  # the later reading stands until the outer ends
    monkeypatch.setenv(FOLLOW_SYMLINKS_ENV, "0")
    assert settings().follow_symlinks is False


def test_an_error_inside_the_call_lets_the_reading_go(monkeypatch):
    monkeypatch.setenv(FOLLOW_SYMLINKS_ENV, "1")
    try:
        with read_once():
            raise KeyError("x")
    except KeyError:
        pass
    monkeypatch.setenv(FOLLOW_SYMLINKS_ENV, "0")
    assert settings().follow_symlinks is False


def test_reader_threads_default_to_the_intra_op_count_but_at_least_the_minimum(monkeypatch):
    import torch

    from zerofast.base.settings import DEFAULT_MIN_READERS, READERS_ENV, reader_count

    monkeypatch.delenv(READERS_ENV, raising=False)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert reader_count(settings()) == DEFAULT_MIN_READERS  # cold reads wait in pread: more in flight
        torch.set_num_threads(DEFAULT_MIN_READERS + 4)
        assert reader_count(settings()) == DEFAULT_MIN_READERS + 4
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setenv(READERS_ENV, "3")
    assert reader_count(settings()) == 3
    assert reader_count(settings(), resident=1.0) == 3  # the variable wins, warm or cold
    monkeypatch.setenv(READERS_ENV, "not a number")  # not understood: the default
    assert reader_count(settings()) == max(DEFAULT_MIN_READERS, threads)


def test_a_batch_the_page_cache_holds_gets_a_reader_a_core_and_a_cold_one_more(monkeypatch):
    import torch

    from zerofast.base.settings import DEFAULT_MIN_READERS, READERS_ENV, WARM_SHARE, reader_count

    monkeypatch.delenv(READERS_ENV, raising=False)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert reader_count(settings(), resident=1.0) == 2  # a warm read is a copy: one thread a core
        assert reader_count(settings(), resident=WARM_SHARE) == 2
        assert reader_count(settings(), resident=WARM_SHARE / 2) == DEFAULT_MIN_READERS
        assert reader_count(settings(), resident=None) == DEFAULT_MIN_READERS  # unknown: as cold
    finally:
        torch.set_num_threads(threads)


def test_residency_is_told_from_the_page_cache_without_faulting_pages_in(tmp_path):
    import mmap
    import os

    import torch

    from zerofast.load.residency import resident_share

    assert resident_share([]) is None
    assert resident_share([torch.ones(1 << 20)]) == 1.0  # memory the process wrote is resident
    path = tmp_path / "cold.bin"
    path.write_bytes(os.urandom(8 << 20))
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        mapping = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    try:
        source = torch.frombuffer(mapping, dtype=torch.uint8)
        first = resident_share([source])
        if first == 1.0:
            pytest.skip(f"the filesystem of {tmp_path} keeps every page of its files in memory (tmpfs)")
        assert first < 0.5
        assert resident_share([source]) == first  # asking faulted nothing in
        source.sum()  # now read it all
        assert resident_share([source]) == 1.0
    finally:
        del source
        mapping.close()
