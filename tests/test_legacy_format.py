"""torch.save's legacy (non-zip) format (zerofast/load/legacy.py), as DeepSpeed writes it with
``"checkpoint": {"checkpoint_serialization": false}``.

The real saves (``s2_bf16_w2_legacy``, ``s3_bf16_w2_legacy`` in tests/dsgen/catalog.py) run
through every test of the plain layouts (reconstruct, lazy, export, verify, reshard, ...); here,
the format's own guarantees: the same values as ``torch.load``, shared storages kept shared, and
a typed error, with nothing run, for every damaged or hostile file.
"""
from __future__ import annotations

import collections
import os
import pickle
import struct

import pytest
import torch

from tests.dsgen.catalog import ensure_checkpoint
from zerofast.base.errors import CorruptCheckpointError, UnsafeCheckpointError, UnsupportedCheckpointError
from zerofast.load import load_file
from zerofast.load import legacy


@pytest.fixture(params=["native", "python"])
def reader(request, monkeypatch):
    monkeypatch.setenv("ZEROFAST_NATIVE", "1" if request.param == "native" else "0")
    return request.param


def saved(tmp_path, obj, name="legacy.pt"):
    path = tmp_path / name
    torch.save(obj, path, _use_new_zipfile_serialization=False)
    return path


def sample():
    a = torch.randn(3, 4)
    return {"module": collections.OrderedDict(a=a, row=a[1], ids=torch.arange(5), half=torch.randn(7).bfloat16(),
                                              empty=torch.empty(0)), "step": 3, "name": "x"}


def test_values_and_shared_storages_equal_torch_load(reader, tmp_path):
    path = saved(tmp_path, sample())
    assert legacy.is_legacy(path)
    got, want = load_file(path), torch.load(path, weights_only=True)
    for key, value in want["module"].items():
        assert got["module"][key].dtype == value.dtype and torch.equal(got["module"][key], value), key
    assert got["module"]["row"].untyped_storage().data_ptr() == got["module"]["a"].untyped_storage().data_ptr()
    assert (got["step"], got["name"]) == (3, "x")


def test_the_real_saves_are_legacy_files():
    root = ensure_checkpoint("s2_bf16_w2_legacy")
    files = sorted(root.glob("*/*.pt"))
    assert files and all(legacy.is_legacy(p) for p in files)


def _damage(path, at, data):
    raw = bytearray(path.read_bytes())
    raw[at:at + len(data)] = data
    path.write_bytes(bytes(raw))


def test_a_truncated_file_is_corrupt(reader, tmp_path):
    path = saved(tmp_path, sample())
    for keep in (len(legacy.HEAD) + 3, os.path.getsize(path) // 2, os.path.getsize(path) - 1):
        cut = tmp_path / f"cut{keep}.pt"
        cut.write_bytes(path.read_bytes()[:keep])
        with pytest.raises(CorruptCheckpointError):
            load_file(cut)


def test_a_storage_count_past_the_end_is_corrupt(reader, tmp_path):
    path = saved(tmp_path, {"t": torch.ones(4)})
    size = os.path.getsize(path)
    _damage(path, size - 16 - 8, struct.pack("<q", 1 << 40))  # the count before the 16 bytes of data
    with pytest.raises(CorruptCheckpointError, match="more than the file holds"):
        load_file(path)


def test_bytes_after_the_last_storage_are_corrupt(reader, tmp_path):
    path = saved(tmp_path, {"t": torch.ones(4)})
    with open(path, "ab") as f:
        f.write(b"\0" * 8)
    with pytest.raises(CorruptCheckpointError, match="to end after"):
        load_file(path)


def test_a_big_endian_file_is_refused(reader, tmp_path):
    path = saved(tmp_path, {"t": torch.ones(1)})
    raw = path.read_bytes()
    flipped = raw.replace(b"little_endian\x94\x88", b"little_endian\x94\x89", 1)
    if flipped == raw:  # protocol 2 has no FRAME/MEMOIZE: the bool follows the key's BINPUT
        i = raw.index(b"little_endian") + len(b"little_endian")
        j = raw.index(b"\x88", i)
        flipped = raw[:j] + b"\x89" + raw[j + 1:]
    path.write_bytes(flipped)
    with pytest.raises(UnsupportedCheckpointError, match="little-endian"):
        load_file(path)


class _System:
    def __reduce__(self):
        return os.system, ("touch /tmp/zerofast-legacy-marker",)


def test_a_planted_global_is_refused_and_nothing_runs(reader, tmp_path):
    marker = "/tmp/zerofast-legacy-marker"
    if os.path.exists(marker):
        os.remove(marker)
    path = saved(tmp_path, {"t": torch.ones(2), "payload": _System()})
    with pytest.raises(UnsafeCheckpointError, match="system"):
        load_file(path)
    assert not os.path.exists(marker)


def test_a_key_list_that_is_not_strings_is_corrupt(reader, tmp_path):
    path = saved(tmp_path, {"t": torch.ones(2)})
    raw = path.read_bytes()
    key = next(iter(legacy.read_layout(path, os.path.getsize(path))[1]))
    keys = pickle.dumps([key], protocol=2)
    assert raw.count(keys) == 1
    path.write_bytes(raw.replace(keys, pickle.dumps([7], protocol=2)))
    with pytest.raises(CorruptCheckpointError, match="distinct storage keys"):
        load_file(path)


def test_a_storage_view_from_torch_before_0_4_is_unsupported(tmp_path):
    pid = ("storage", ("global", "torch FloatStorage"), "1", "cpu", 4, ("0", 0, 4))
    with pytest.raises(UnsupportedCheckpointError, match="storage views"):
        legacy._note_storage(tmp_path / "x.pt", pid, {"torch FloatStorage": 4}, {})
    assert pickle.HIGHEST_PROTOCOL >= 2
