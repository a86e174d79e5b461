"""The export's columnar file layout (hf/shards.py, hf/formats/safetensors_files.py) against
what it stands in for.

- ``header`` writes, byte for byte, ``json.dumps`` of the header dict the safetensors format
  defines (compact separators, the metadata first, tensors by falling itemsize, in order among
  equals), whatever the names hold: quotes, backslashes, control characters, non-ASCII.
- ``PlanTensors.of`` / ``select`` / ``nbytes`` give, tensor by tensor, what the TensorPlans say.
- ``_batches`` hands each byte of the data region to exactly one call, whole tensors in order
  and at most the limit a call unless one tensor alone; a larger tensor goes in slices.
- On a real save, the batched writer fed a :class:`Placed` writes the same bytes as fed pairs.
"""
from __future__ import annotations

import json
import math
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import needs_deepspeed
from tests.dsgen.catalog import ensure_checkpoint
from zerofast.base.dtypes import SAFETENSORS_CODES
from zerofast.base.errors import ExportError
from zerofast.hf.formats import safetensors_files as sf
from zerofast.prepare import prepare
from zerofast.plan.columns import Placed, PlanTensors
from zerofast.plan.model import TensorPlan

DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.float16)
name = st.text(min_size=1, max_size=12).filter(lambda n: n != "__metadata__")
shape = st.lists(st.integers(0, 5), max_size=3).map(tuple)


def _plans(entries) -> list[TensorPlan]:
    return [TensorPlan(n, s, "trainable", d, d, ((0, 0, 0, math.prod(s)),)) for n, s, d in entries]


plans = st.lists(st.tuples(name, shape, st.sampled_from(DTYPES)), max_size=12,
                 unique_by=lambda e: e[0]).map(_plans)


def _reference_header(tps, metadata) -> tuple[bytes, list[tuple[str, int]]]:
    """The header as its definition reads: a dict, json.dumps'd compactly, padded to 8."""
    head, placed, pos = {"__metadata__": metadata}, [], 0
    for tp in sorted(tps, key=lambda t: -t.out_dtype.itemsize):
        head[tp.name] = {"dtype": SAFETENSORS_CODES[tp.out_dtype], "shape": list(tp.shape),
                         "data_offsets": [pos, pos + tp.nbytes]}
        placed.append((tp.name, pos))
        pos += tp.nbytes
    raw = json.dumps(head, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, placed


@settings(max_examples=300, deadline=None)
@given(plans, st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=2))
def test_header_is_json_dumps_of_the_header_dict(tps, metadata):
    head, placed = sf.header(PlanTensors.of(tps), metadata)
    want, where = _reference_header(tps, metadata)
    assert head == want
    assert [(tp.name, off) for tp, off in placed] == where
    assert json.loads(head[8:])["__metadata__"] == metadata


BAD = (torch.complex64, torch.complex128)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "__metadata__", "c"]), st.sampled_from(DTYPES + BAD)),
                min_size=1, max_size=6, unique_by=lambda e: e[0]))
def test_header_refuses_the_first_tensor_in_file_order_it_cannot_hold(entries):
    """As the dict's definition does: by falling itemsize, the first whose name or dtype fails."""
    tps = _plans([(n, (2,), d) for n, d in entries])
    first = next((tp for tp in sorted(tps, key=lambda t: -t.out_dtype.itemsize)
                  if tp.name == "__metadata__" or tp.out_dtype in BAD), None)
    if first is None:
        sf.header(PlanTensors.of(tps), {})
        return
    want = "'__metadata__' cannot be stored" if first.name == "__metadata__" else f"{first.name!r} has dtype"
    with pytest.raises(ExportError, match=want):
        sf.header(PlanTensors.of(tps), {})


def test_header_refuses_what_safetensors_cannot_hold():
    with pytest.raises(ExportError, match="'__metadata__' cannot be stored"):
        sf.header(PlanTensors.of(_plans([("__metadata__", (1,), torch.float32)])), {})
    with pytest.raises(ExportError, match="'c' has dtype torch.complex64, which safetensors cannot store"):
        sf.header(PlanTensors.of(_plans([("r", (1,), torch.float32), ("c", (2,), torch.complex64)])), {})


@settings(max_examples=200, deadline=None)
@given(plans, st.data())
def test_select_and_columns_match_the_plans(tps, data):
    cols = PlanTensors.of(tps)
    assert list(cols.values()) == tps
    assert cols.nbytes().tolist() == [tp.nbytes for tp in tps]
    assert cols.numels().tolist() == [tp.numel for tp in tps]
    numbers = data.draw(st.lists(st.integers(0, max(len(tps) - 1, 0)), max_size=8)) if tps else []
    renamed = [f"r{k}" for k in range(len(numbers))]
    for names in (None, renamed):
        picked = cols.select(np.array(numbers, dtype=np.int64), names)
        assert len(picked) == len(numbers)
        for k, i in enumerate(numbers):
            tp = picked.plan_of(k)
            assert (tp.name, tp.shape, tp.out_dtype, tuple(tp.segments)) == (
                tps[i].name if names is None else names[k], tps[i].shape, tps[i].out_dtype, tuple(tps[i].segments))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.sampled_from([torch.uint8, torch.bfloat16, torch.float32])),
                max_size=30), st.lists(st.integers(8, 64), min_size=1, max_size=5))
def test_batches_cover_every_byte_once(tensors, limits):
    """Whatever the order of dtypes, and the limit changing between calls as the pace does."""
    tps = _plans([(f"t{i}", (n,), d) for i, (n, d) in enumerate(tensors)])
    sizes = [tp.nbytes for tp in tps]
    placed = Placed(PlanTensors.of(tps), np.cumsum([0] + sizes[:-1]).astype(np.int64))
    pace = sf._Pace()
    pace.limit = limits[0]
    written = []  # (file offset, bytes) of every piece in call order
    for k, (batch, nbytes) in enumerate(sf._batches(placed, 100, pace)):
        limit = pace.limit
        pieces = [(off, tp.nbytes) for tp, off in batch]
        assert nbytes == sum(b for _, b in pieces)
        # a call passes the limit only by the tensor that reaches it, or holds one tensor
        assert len(pieces) == 1 or sum(b for _, b in pieces[:-1]) < limit
        assert isinstance(batch, Placed) or (len(pieces) == 1 and pieces[0][1] <= max(limit, 4))
        written += pieces
        pace.limit = limits[(k + 1) % len(limits)]
    at = 100
    for off, nbytes in written:
        assert off == at
        at += nbytes
    assert at == 100 + sum(sizes)


@needs_deepspeed
@pytest.mark.parametrize("layout", ["s2_bf16_w2_frozen_tied", "s3_bf16_w2_frozen_tied", "moe_s2_bf16_w2_ep2"])
def test_batched_write_of_placed_equals_pairs(tmp_path, layout):
    prepared = prepare(ensure_checkpoint(layout))
    cols = PlanTensors.of(list(prepared.plan.tensors.values()))
    offsets = np.cumsum(np.concatenate([[0], cols.nbytes()[:-1]])).astype(np.int64)
    out = {}
    for how, placed in (("pairs", list(zip(cols.values(), offsets.tolist()))), ("placed", Placed(cols, offsets))):
        path = tmp_path / how
        with open(path, "wb") as f:
            prepared.streaming_executor().batch.write(f.fileno(), placed)
        out[how] = path.read_bytes()
    assert out["pairs"] == out["placed"] and len(out["placed"]) == int(cols.nbytes().sum())


def test_a_zerofast_error_keeps_its_cause_through_the_many_file_reader(tmp_path, monkeypatch):
    """load_files passes zerofast's own errors on as they are, those that are builtin errors too."""
    from zerofast.base.errors import MappingLimitError
    from zerofast.load import reader

    files = [tmp_path / f"f{i}.pt" for i in range(3)]
    for i, f in enumerate(files):
        torch.save({"t": torch.zeros(i + 1)}, f)
    cause = OSError(12, "Cannot allocate memory")

    def read_with(core, path, index):
        try:
            raise cause
        except OSError as e:
            raise MappingLimitError("simulated", path) from e

    monkeypatch.setattr(reader, "_read_with", read_with)
    with pytest.raises(MappingLimitError) as e:
        reader.load_files(files)
    assert e.value.__cause__ is cause
