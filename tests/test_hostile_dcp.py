"""Hostile input for DCP folders (``.metadata`` and the chunk files) and for rank files given to
``diff``: seeded byte-level damage, each case read by ``reconstruct``, ``verify`` and ``diff``.
Only a ZeroFastError (or success, or a verify finding) is acceptable, within a time bound; the
seed and the case number of a failure are in its message. ZEROFAST_DCP_FUZZ_CASES sets the
number of damaged files per test (default 40)."""
from __future__ import annotations

import os
import random
import shutil
import time
import warnings
from pathlib import Path

import pytest
import torch

import zerofast

CASES = int(os.environ.get("ZEROFAST_DCP_FUZZ_CASES", "40"))
SECONDS_PER_CASE = 10.0


def _dcp_folder(path: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # single-process save: torch warns that no process group is set up
        dcp.save({"model": {"w": torch.randn(6, 4, generator=g), "b": torch.randn(5, generator=g).bfloat16()}},
                 checkpoint_id=str(path))
    return path


def _damage(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    how = rng.choice(["flip", "truncate", "zero", "insert", "garbage"])
    n = len(data)
    if how == "flip":
        out = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(n)
            out[i] ^= 1 << rng.randrange(8)
        return bytes(out), how
    if how == "truncate":
        cut = rng.randrange(n)
        return data[:cut], f"{how} at {cut}"
    if how == "zero":
        lo = rng.randrange(n)
        hi = min(n, lo + rng.randint(1, 64))
        return data[:lo] + b"\0" * (hi - lo) + data[hi:], f"{how} [{lo}, {hi})"
    if how == "insert":
        at = rng.randrange(n)
        return data[:at] + os.urandom(rng.randint(1, 32)) + data[at:], f"{how} at {at}"
    return os.urandom(rng.randint(0, 200)), how


def _each_reader(folder: Path, pristine: Path) -> None:
    """Every reader of the damaged folder: a typed error or a result, nothing else."""
    for read in (lambda: zerofast.reconstruct(folder), lambda: zerofast.diff(pristine, folder)):
        try:
            read()
        except zerofast.ZeroFastError:
            pass
    zerofast.verify(folder)  # findings, or a typed error: never a raw one (raises through pytest otherwise)


@pytest.mark.parametrize("victim", [".metadata", "__0_0.distcp"])
def test_damaged_dcp_files_give_typed_errors(tmp_path, victim):
    pristine = _dcp_folder(tmp_path / "pristine")
    original = (pristine / victim).read_bytes()
    folder = tmp_path / "damaged"
    for case in range(CASES):
        rng = random.Random(f"{victim}:{case}")
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(pristine, folder)
        data, how = _damage(rng, original)
        (folder / victim).write_bytes(data)
        started = time.monotonic()
        try:
            try:
                _each_reader(folder, pristine)
            except zerofast.ZeroFastError:
                pass
        except Exception as e:
            pytest.fail(f"case {case} ({victim}: {how}): raw {type(e).__name__}: {e}"[:2000])
        assert time.monotonic() - started < SECONDS_PER_CASE, f"case {case} ({victim}: {how}) took too long"


def test_a_metadata_file_that_is_not_a_pickle_is_named(tmp_path):
    folder = _dcp_folder(tmp_path / "d")
    (folder / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(zerofast.ZeroFastError) as e:
        zerofast.reconstruct(folder)
    assert ".metadata" in str(e.value)


def test_damaged_rank_files_given_to_diff_give_typed_errors(tmp_path):
    """diff reads two checkpoints: a damaged rank file on either side is a typed error."""
    from zerofast.testing.synthesize import LayoutSpec, ParamSpec, synthesize

    pristine = tmp_path / "pristine"
    synthesize(pristine, LayoutSpec(2, 2, torch.bfloat16, [[ParamSpec("a.weight", (4, 3)), ParamSpec("b", (5,))]]))
    files = sorted(p.relative_to(pristine) for p in (pristine / "global_step1").iterdir())
    damaged = tmp_path / "damaged"
    for case in range(CASES):
        rng = random.Random(f"diff:{case}")
        shutil.rmtree(damaged, ignore_errors=True)
        shutil.copytree(pristine, damaged)
        victim = rng.choice(files)
        data, how = _damage(rng, (pristine / victim).read_bytes())
        (damaged / victim).write_bytes(data)
        started = time.monotonic()
        for a, b in ((pristine, damaged), (damaged, pristine)):
            try:
                zerofast.diff(a, b)
            except zerofast.ZeroFastError:
                pass
            except Exception as e:
                pytest.fail(f"case {case} ({victim}: {how}): raw {type(e).__name__}: {e}"[:2000])
        assert time.monotonic() - started < 2 * SECONDS_PER_CASE, f"case {case} ({victim}: {how}) took too long"
