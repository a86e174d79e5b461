"""Differential tests of the native pickle reader (csrc/load/) against the Python reference.

On every real rank file of the suite's checkpoints, and on mutated copies of their pickles,
the two readers must agree:
- wherever the native reader accepts a pickle, the reference accepts it too and builds the
  same tree: same types, keys in the same order, the same values, the same tensors (dtype,
  shape, strides, offset into the same file bytes, equal bit for bit), sharing storage and
  identity exactly where the reference's do;
- ``load_file`` gives the same verdict either way (the same result, or the same exception
  type and message), since the native reader leaves every refusal to the reference.
The pristine files must be read natively, not declined.

Mutations are byte edits of ``data.pkl`` (bit flips, opcode swaps, argument changes, cuts,
insertions, copies), applied in memory to the file's zip index so each case costs two
unpicklings, and object-tree edits saved back with the planting pickler. ZEROFAST_DIFF_CASES
sets the number of byte cases per layout (default 300; 5000 for the long run),
ZEROFAST_DIFF_SEED the seed (default 0).
"""
from __future__ import annotations

import dataclasses
import math
import os
import pickletools
import random
from pathlib import Path

import pytest
import torch

from tests.conftest import needs_deepspeed
from tests.dsgen.catalog import ensure_checkpoint
from tests.planting import load, save
from zerofast.base.errors import ZeroFastError
from zerofast.load import reader, records
from zerofast.load.archive import index_archive
from zerofast.load.stand_ins import DeepSpeedRecord
from zerofast.load.unpickle import _StorageRef

pytestmark = needs_deepspeed

LAYOUTS = ("s2_bf16_w2_frozen_tied", "s3_bf16_w2_frozen_tied", "s1_bf16_w2_frozen", "s0_bf16_w2")
CASES = int(os.environ.get("ZEROFAST_DIFF_CASES", "300"))
SEED = int(os.environ.get("ZEROFAST_DIFF_SEED", "0"))
CORE = reader.native_core()
needs_core = pytest.mark.skipif(CORE is None, reason="no native core to test: it could not be built here "
                                                     "(`zerofast doctor` says why) or ZEROFAST_NATIVE=0")


def _rank_files(layout: str) -> list[Path]:
    root = ensure_checkpoint(layout)
    tag = root / (root / "latest").read_text().strip()
    return sorted(tag.glob("*.pt"))


# -- comparing two trees ------------------------------------------------------------------------

class _Same:
    """Walks two trees in step; ``pairs`` holds that each object of one stands for one object
    of the other, so shared and cyclic objects (the memo makes both) match up exactly."""

    def __init__(self):
        self.pairs: dict[int, int] = {}  # both trees stay alive meanwhile, so ids stay theirs
        self.back: dict[int, int] = {}  # the other way: sharing in either tree only is caught
        self.storages: dict[int, int] = {}
        self.storages_back: dict[int, int] = {}

    def __call__(self, a, b, where: str = "root") -> None:
        assert type(a) is type(b), f"{where}: {type(a).__name__} vs {type(b).__name__}"
        if not isinstance(a, (int, float, str, bytes, bool, type(None), torch.dtype)):
            seen = id(a) in self.pairs
            assert self.pairs.setdefault(id(a), id(b)) == id(b), f"{where}: shared in the first tree, not the second"
            assert self.back.setdefault(id(b), id(a)) == id(a), f"{where}: shared in the second tree, not the first"
            if seen:
                return
        if isinstance(a, torch.Tensor):
            self.tensor(a, b, where)
        elif isinstance(a, dict):
            assert len(a) == len(b), f"{where}: keys {list(a)[:5]} vs {list(b)[:5]}"
            for (ka, va), (kb, vb) in zip(a.items(), b.items()):  # keys walked too: a mutation may key by a record
                self(ka, kb, f"{where} key")
                self(va, vb, f"{where}[{ka!r:.40}]")
        elif isinstance(a, (list, tuple)):
            assert len(a) == len(b), f"{where}: {len(a)} vs {len(b)} items"
            for i, (x, y) in enumerate(zip(a, b)):
                self(x, y, f"{where}[{i}]")
        elif isinstance(a, (set, frozenset)):
            assert a == b, f"{where}: sets differ"
        elif isinstance(a, DeepSpeedRecord):
            self(vars(a), vars(b), f"{where}.__dict__")
        elif isinstance(a, _StorageRef):  # a storage no rebuild took (a mutation moved it), read twice
            assert (a.dtype, a.numel) == (b.dtype, b.numel), f"{where}: storages differ"
            assert torch.equal(torch.empty(0, dtype=torch.uint8).set_(a.mapping),
                               torch.empty(0, dtype=torch.uint8).set_(b.mapping)), f"{where}: storage bytes differ"
        elif isinstance(a, float) and math.isnan(a):
            assert math.isnan(b), f"{where}: nan vs {b}"
        else:
            assert a == b, f"{where}: {a!r:.80} vs {b!r:.80}"

    def tensor(self, a: torch.Tensor, b: torch.Tensor, where: str) -> None:
        assert (a.dtype, a.shape, a.stride(), a.storage_offset()) == (b.dtype, b.shape, b.stride(), b.storage_offset()), \
            f"{where}: {a.dtype} {tuple(a.shape)} {a.stride()} vs {b.dtype} {tuple(b.shape)} {b.stride()}"
        assert not a.requires_grad and not b.requires_grad, f"{where}: requires_grad"
        sa, sb = a.untyped_storage(), b.untyped_storage()
        assert sa.nbytes() == sb.nbytes(), f"{where}: storages of {sa.nbytes()} and {sb.nbytes()} bytes"
        assert self.storages.setdefault(sa.data_ptr(), sb.data_ptr()) == sb.data_ptr(), \
            f"{where}: storage shared in the first tree, not the second"
        assert self.storages_back.setdefault(sb.data_ptr(), sa.data_ptr()) == sa.data_ptr(), \
            f"{where}: storage shared in the second tree, not the first"
        assert torch.equal(_bytes(a), _bytes(b)), f"{where}: values differ"


def _bytes(t: torch.Tensor) -> torch.Tensor:
    # Through a fresh tensor: a size-1 dimension keeps any stride through contiguous().
    return torch.empty(t.shape, dtype=t.dtype).copy_(t).reshape(-1).view(torch.uint8)


def same_tree(a, b) -> None:
    _Same()(a, b)


# -- the two verdicts ---------------------------------------------------------------------------

def _verdict(path: Path, monkeypatch, native: bool, index=None):
    """``("ok", tree)`` or ``(exception type, message)`` of ``load_file``, on ``index`` if given."""
    with monkeypatch.context() as patch:
        patch.setenv("ZEROFAST_NATIVE", "1" if native else "0")
        if index is not None:
            patch.setattr(reader, "index_archive", lambda p: index)
        try:
            return "ok", records.load_file(path)
        except ZeroFastError as e:
            return type(e), str(e)


class Tally:
    def __init__(self):
        self.native = self.declined = self.refused = 0


def compare(path: Path, monkeypatch, tally: Tally, index=None, label: str = "") -> None:
    reference = _verdict(path, monkeypatch, native=False, index=index)
    ok, native = reader.read_native(path, index or index_archive(path), CORE)
    if ok:
        tally.native += 1
        assert reference[0] == "ok", f"{label}: the native reader accepted what the reference refuses: {reference}"
        same_tree(native, reference[1])
    elif reference[0] == "ok":
        tally.declined += 1
    else:
        tally.refused += 1
    through = _verdict(path, monkeypatch, native=True, index=index)
    if reference[0] == "ok":
        assert through[0] == "ok", f"{label}: {through}"
        same_tree(through[1], reference[1])
    else:
        assert through == reference, f"{label}: {through} vs {reference}"


# -- the tests ----------------------------------------------------------------------------------

@needs_core
@pytest.mark.parametrize("layout", LAYOUTS)
def test_real_files_are_read_natively_and_identically(layout, monkeypatch):
    tally = Tally()
    for path in _rank_files(layout):
        ok, why = reader.read_native(path, index_archive(path), CORE)
        assert ok, f"{path.name}: the native reader declined a real DeepSpeed file: {why}"
        compare(path, monkeypatch, tally, label=path.name)
    assert tally.native == len(_rank_files(layout))


# Opcodes a mutation may write: torch.save's, the rest of protocol 2 to 5, and bytes that are none.
_OPCODES = [op.code.encode("latin-1") for op in pickletools.opcodes] + [b"\x00", b"\xff", b"\x99"]


def _mutate(rng: random.Random, data: bytes, starts: list[int]) -> tuple[bytes, str]:
    n = len(data)
    at = rng.randrange(n)
    kind = rng.randrange(8)
    if kind == 0:
        return data[:at] + bytes([data[at] ^ (1 << rng.randrange(8))]) + data[at + 1:], f"flip bit at {at}"
    if kind == 1:
        at = rng.choice(starts)
        op = rng.choice(_OPCODES)
        return data[:at] + op + data[at + 1:], f"opcode at {at} -> {op!r}"
    if kind == 2:  # an argument byte just after an opcode: memo indices, small ints, lengths
        at = min(rng.choice(starts) + 1 + rng.randrange(4), n - 1)
        value = rng.choice([0, 1, 2, 0x7F, 0x80, 0xFF, rng.randrange(256)])
        return data[:at] + bytes([value]) + data[at + 1:], f"argument byte at {at} -> {value}"
    if kind == 3:
        length = rng.randint(1, 16)
        return data[:at] + data[at + length:], f"cut {length} bytes at {at}"
    if kind == 4:
        junk = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        return data[:at] + junk + data[at:], f"insert {junk!r} at {at}"
    if kind == 5:
        start = rng.choice(starts)
        piece = data[start:start + rng.randint(1, 64)]
        return data[:at] + piece + data[at:], f"copy {len(piece)} bytes from {start} to {at}"
    if kind == 6:
        return data[:at], f"truncate at {at}"
    a, b = sorted(rng.sample(starts, 2))
    return data[:a] + data[b:], f"drop opcodes {a}..{b}"


@needs_core
@pytest.mark.parametrize("layout", LAYOUTS[:2])
def test_mutated_pickles_get_the_reference_verdict(layout, monkeypatch):
    rng = random.Random(f"{SEED}-{layout}")
    files = [(p, index_archive(p)) for p in _rank_files(layout)]
    starts = {p: [pos for _, _, pos in pickletools.genops(i.pickle_bytes)] for p, i in files}
    tally = Tally()
    for case in range(CASES):
        path, index = rng.choice(files)
        data, what = _mutate(rng, index.pickle_bytes, starts[path])
        compare(path, monkeypatch, tally, dataclasses.replace(index, pickle_bytes=data),
                label=f"case {case}: {path.name} {what}")
    print(f"{layout}: {CASES} byte mutations: {tally.native} read natively, {tally.refused} refused by both, "
          f"{tally.declined} declined by the native reader and read by the reference")
    assert tally.native and tally.refused, "the mutations should reach both verdicts"


@needs_core
def test_mutated_object_trees_get_the_reference_verdict(tmp_path, monkeypatch):
    from tests.fuzz_child import KEYS, VALUES, _pick_slot

    rng = random.Random(SEED)
    files = _rank_files(LAYOUTS[0]) + _rank_files(LAYOUTS[1])
    tally = Tally()
    for case in range(max(CASES // 4, 20)):
        source = rng.choice(files)
        obj = load(source)
        container, key = _pick_slot(rng, obj)
        if isinstance(container, dict) and rng.random() < 0.25:
            container[rng.choice(KEYS)()] = container.pop(key)
        else:
            container[key] = rng.choice(VALUES)()
        victim = tmp_path / source.name
        save(obj, victim)
        compare(victim, monkeypatch, tally, label=f"case {case}: {source.name} [{key!r:.40}]")
        del obj
    assert tally.native, "the edited trees should mostly be read natively"


@needs_core
def test_zerofast_native_0_selects_the_reference(monkeypatch):
    monkeypatch.setenv("ZEROFAST_NATIVE", "0")
    assert reader.native_core() is None
