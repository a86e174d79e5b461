"""Comparisons shared by the tests. Everything is bit for bit: zerofast only copies and casts."""
from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

import torch

import zerofast

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def ctrl_c_as_in_a_terminal() -> None:
    """``preexec_fn`` for a child a test interrupts: Ctrl-C's default action, as a terminal gives
    it. A suite started in the background of a non-interactive shell (``make test &``) inherits
    SIGINT ignored, and Python then keeps it ignored in every child."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of ``t`` as integers, so NaNs and signed zeros compare exactly."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    return t.view(_INT_VIEW[t.element_size()])


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, name: str = "") -> None:
    assert actual.dtype == expected.dtype, f"{name}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.equal(bits(actual), bits(expected)), f"{name}: values differ"


def assert_same_state(got: Path, want_root: Path) -> None:
    """``got`` (a written checkpoint) reconstructs to exactly what ``want_root`` does."""
    want = zerofast.reconstruct(want_root, dtype=None)
    have = zerofast.reconstruct(got, dtype=None)
    assert list(have) == list(want)
    for name, value in want.items():
        assert_bitwise_equal(have[name], value, name)


def expected_value(value: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """What the dtype policy promises for a stored tensor."""
    if dtype is None or not value.is_floating_point():
        return value
    return value.to(dtype)


@functools.lru_cache(maxsize=None)
def real_root(name: str) -> Path:
    """The cached real DeepSpeed checkpoint of layout ``name`` (made on first use)."""
    from tests.dsgen.catalog import ensure_checkpoint

    return ensure_checkpoint(name)


@functools.lru_cache(maxsize=None)
def real_truth(name: str) -> dict:
    """DeepSpeed's own ground truth saved next to that checkpoint."""
    return torch.load(real_root(name) / "ground_truth.pt", weights_only=True)


def stored_values(truth: dict) -> dict:
    """Every tensor the checkpoint holds, by name, in its stored dtype."""
    return {**truth["trainable"], **truth["frozen"], **truth["buffers"]}


@contextlib.contextmanager
def small_tmpfs(mnt: Path, size: str, elsewhere: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``mnt`` for a full-disk test, unmounted after; a skip that
    says why (and where else failing writes are covered, ``elsewhere``) where it cannot be mounted."""
    mnt.mkdir()
    try:
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True,
                              text=True, timeout=30)
        reason = proc.stderr.strip() or f"exit code {proc.returncode}"
    except OSError as e:
        proc, reason = None, str(e)
    if proc is None or proc.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (mounting needs root and CAP_SYS_ADMIN: {reason}); {elsewhere}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


def every_writer_refuses(root: Path, tmp_path: Path, key: str, planted: list) -> None:
    """Each checkpoint writer (reshard, to-universal, export --optimizer-states, to-dcp) refuses
    ``root`` with an UnplacedOptimizerStateError naming ``key``, the writer and one of the
    ``planted`` files, and leaves nothing under its output folder."""
    from zerofast.writers.reshard import reshard
    from zerofast.writers.universal import to_universal

    writers = [
        ("reshard", lambda: reshard(root, tmp_path / "reshard", 3), tmp_path / "reshard"),
        ("to-universal", lambda: to_universal(root, tmp_path / "universal" / "t"), tmp_path / "universal"),
        ("export --optimizer-states", lambda: zerofast.export(root, tmp_path / "export", optimizer_states=True),
         tmp_path / "export"),
        ("to-dcp", lambda: zerofast.to_dcp(root, tmp_path / "dcp"), tmp_path / "dcp"),
    ]
    for writer, run, out in writers:
        with pytest.raises(zerofast.UnplacedOptimizerStateError) as e:
            run()
        message = str(e.value)
        assert key in message and writer in message, message
        assert e.value.path in {str(p) for p in planted}, (e.value.path, planted)
        assert nothing_written(out), (writer, sorted(os.listdir(out)))


def exported(out: Path, files) -> dict:
    """Every tensor of an export's safetensors ``files`` (an ``ExportResult.files``) in ``out``, by name."""
    from safetensors.torch import load_file

    got = {}
    for name in files:
        got.update(load_file(out / name))
    return got


def nothing_written(out: Path) -> bool:
    """``out`` is absent or holds nothing but zerofast's own leftovers (its lock, a temp folder)."""
    return not out.exists() or not [p for p in os.listdir(out) if not p.startswith(".zerofast")]


def module_like(sd) -> torch.nn.Module:
    """A module whose parameters are zeros shaped as the state dict's tensors, under its names."""
    root = torch.nn.Module()
    for name, value in sd.items():
        *path, leaf = name.split(".")
        owner = root
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, torch.nn.Module())
            owner = getattr(owner, part)
        if not hasattr(owner, leaf):
            owner.register_parameter(leaf, torch.nn.Parameter(torch.zeros_like(value), requires_grad=False))
    return root
