"""A DCP ``.metadata`` is bounded by the native core's pass (csrc/load/pickle_scan.cpp) where
there is one, and by the Python pass (zerofast/load/pickle_bounds.py) otherwise.

A million-chunk save's ``.metadata`` is a hundred MB of pickle, where the Python pass takes about
a minute on 2 cores; the native port takes a fraction of a second. The two must agree: the
native pass never passes a pickle the Python pass refuses (hostile pickles, in the protocol-4
frames ``.metadata`` is written in), and the records read either way are the same.
"""
from __future__ import annotations

import pickle
import struct

import pytest
import torch
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                   TensorProperties, TensorStorageMetadata)

from tests.dsgen.dcp import ensure_dcp
from tests.test_hostile_bounds import P2, _deep_key, _deep_set_member, _shared_tuple_key
from tests.test_native_reader import needs_core
from zerofast.load import dcp
from zerofast.load.pickle_bounds import BoundsExceeded, check_pickle
from zerofast.load.reader import bounded_natively

pytestmark = needs_core


def _framed(p2: bytes) -> bytes:
    """A protocol-2 pickle of test_hostile_bounds rewritten as protocol 4, in one frame."""
    body = p2[2:]
    return b"\x80\x04\x95" + struct.pack("<Q", len(body)) + body


HOSTILE = {
    "deep_key": _framed(_deep_key(100_000)),
    "deep_set_member": _framed(_deep_set_member(100_000)),
    "shared_tuple_key": _framed(_shared_tuple_key(40, 64)),
    "memo_far_ahead": _framed(P2 + b"N" + pickle.LONG_BINPUT + struct.pack("<I", 1 << 30) + b"."),
    "deep_list": _framed(P2 + b"]" * 5000 + b"a" * 4999 + b"."),
}


@pytest.mark.parametrize("name", HOSTILE)
def test_the_native_pass_refuses_what_the_python_pass_refuses(name):
    data = HOSTILE[name]
    with pytest.raises((BoundsExceeded, pickle.UnpicklingError)):
        check_pickle(data)
    assert not bounded_natively(data)


def _metadata(n: int) -> Metadata:
    """One tensor of ``n`` one-element chunks, as torch's DCP describes it."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    chunks = [ChunkStorageMetadata(offsets=torch.Size([i]), sizes=torch.Size([1])) for i in range(n)]
    meta = Metadata(state_dict_metadata={"w": TensorStorageMetadata(TensorProperties(dtype=torch.float32),
                                                                   torch.Size([n]), chunks)})
    meta.storage_data = {MetadataIndex("w", torch.Size([i])): _StorageInfo("__0_0.distcp", 4 * i, 4) for i in range(n)}
    return meta


def _folder(tmp_path, meta: Metadata, n: int, protocol: int):
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / ".metadata").write_bytes(pickle.dumps(meta, protocol=protocol))
    (tmp_path / "__0_0.distcp").write_bytes(torch.arange(n, dtype=torch.float32).numpy().tobytes())
    return tmp_path


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_real_and_many_chunk_metadata_pass_natively_and_read_the_same(tmp_path, monkeypatch, protocol):
    real = (ensure_dcp(2) / ".metadata").read_bytes()
    assert bounded_natively(real)
    check_pickle(real)
    n = 20_000
    folder = _folder(tmp_path / str(protocol), _metadata(n), n, protocol)
    data = (folder / ".metadata").read_bytes()
    assert bounded_natively(data)
    native = dcp.read_dcp(folder)
    monkeypatch.setenv("ZEROFAST_NATIVE", "0")  # no core: the Python pass bounds it
    assert not bounded_natively(data)
    python = dcp.read_dcp(folder)
    assert native.tensors.keys() == {"w"} and native.tensors["w"].shape == (n,)
    assert len(native.tensors["w"].chunks) == n and native.tensors == python.tensors


def test_mutations_of_a_real_metadata_get_no_looser_verdict_natively():
    """Every byte of a real .metadata overwritten in turn with a few values: wherever the native
    pass passes the result, the Python pass passes it too."""
    real = bytearray((ensure_dcp(2) / ".metadata").read_bytes())
    step = max(1, len(real) // 1500)
    for i in range(0, len(real), step):
        for value in (0x00, 0x28, 0x71, 0x73, 0x85, 0x95, 0xFF):
            data = bytes(real[:i] + bytes([value]) + real[i + 1:])
            if bounded_natively(data):
                check_pickle(data)  # raises where the two disagree
