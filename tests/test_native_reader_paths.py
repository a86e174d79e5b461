"""The native reader's shortcuts (csrc/load/unpickle.cpp, zip_directory.cpp) against the reference.

The native reader skips work the Python reference does where the outcome is fixed: a stand-in's
state set without calling ``__setstate__`` when ``_check_fields`` would pass it by type alone,
the empty ``OrderedDict()`` of a tensor's backward hooks made only when something other than the
rebuild takes it, ``torch.Size(t)`` built without the call, storage keys looked up by number.
Each test writes trees that reach both sides of a shortcut (taken, not taken, refused) into a
real rank file and checks, with test_native_reader's comparison, that the two readers agree:
same verdict, same objects, the same sharing.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from tests.planting import FRAGMENT_ADDRESS, Build, Call, Global, load, save
from tests.test_native_reader import CORE, LAYOUTS, Tally, _rank_files, _verdict, compare, needs_core
from tests.test_native_zip import _reference
from zerofast.base.errors import CorruptCheckpointError
from zerofast.load import reader
from zerofast.load.archive import index_archive
from zerofast.load.stand_ins import DeepSpeedRecord

pytestmark = needs_core


def _source() -> Path:
    return next(p for p in _rank_files(LAYOUTS[0]) if "model_states" in p.name)


def _check(tmp_path: Path, monkeypatch, cases: dict[str, object], accepted: set[str]) -> Tally:
    """Each case planted into a copy of a real file under the key ``zf_case``: the readers agree,
    and the reference accepts exactly the cases named in ``accepted``."""
    tally = Tally()
    for label, value in cases.items():
        obj = load(_source())
        obj["zf_case"] = value
        victim = tmp_path / f"{label}.pt"
        save(obj, victim)
        del obj
        reference = _verdict(victim, monkeypatch, native=False)
        assert (reference[0] == "ok") == (label in accepted), f"{label}: {reference[0]}"
        compare(victim, monkeypatch, tally, label=label)
    return tally


def _native_tree(path: Path):
    ok, tree = reader.read_native(path, index_archive(path), CORE)
    assert ok, tree
    return tree


# -- stand-ins' state -------------------------------------------------------------------------------

_STATES = {
    "scalars": {"numel": 4, "start": 0},  # the shortcut: DeepSpeed's own records look like this
    "every_plain_type": {"a": None, "b": True, "c": -3, "d": 2 ** 80, "e": 1.5, "f": "x"},
    "empty": {},
    "nested_plain": {"numel": [1, (2, 3)], "d": {"k": 1}},  # left to __setstate__, which accepts
    "dtype": {"dtype": torch.float16},
    "ordered_dict": OrderedDict(numel=4),  # a dict, not exactly one
    "tuple_state": ({"numel": 4}, {"start": 1}),
    "tuple_with_none": ({"numel": 4}, None),
    "dunder_key": {"numel": 4, "__class__": 1},
    "int_key": {1: 2},
    "too_deep": {"a": [[[[[1]]]]]},
    "nested_record": {"a": Build(FRAGMENT_ADDRESS, {"numel": 1})},
    "callable": {"a": Global("collections.OrderedDict")},
    "a_list": [("numel", 4)],
    "a_str": "numel",
}
# A record inside a record is accepted: it was checked when it was built (Megatron's args, a
# Namespace, hold enum members and may hold Namespaces).
_ACCEPTED_STATES = {"scalars", "every_plain_type", "empty", "nested_plain", "dtype", "ordered_dict", "tuple_state",
                    "tuple_with_none", "nested_record"}


def test_stand_in_states_get_the_reference_objects_and_refusals(tmp_path, monkeypatch):
    cases = {label: [Build(FRAGMENT_ADDRESS, state), Build(FRAGMENT_ADDRESS, state)]  # the second shares it
             for label, state in _STATES.items()}
    tally = _check(tmp_path, monkeypatch, cases, _ACCEPTED_STATES)
    assert tally.native == len(_ACCEPTED_STATES)
    records = _native_tree(tmp_path / "every_plain_type.pt")["zf_case"]
    assert type(records[0]).ds_name == FRAGMENT_ADDRESS and records[0] is not records[1]
    assert vars(records[0]) == vars(records[1]) == _STATES["every_plain_type"]


def test_real_deepspeed_records_are_read_natively(monkeypatch):
    # ZeRO-1/2 optimizer files hold a fragment address per parameter (param_slice_mappings).
    paths = [p for p in _rank_files(LAYOUTS[0]) if "optim_states" in p.name]
    for path in paths:
        compare(path, monkeypatch, Tally(), label=path.name)
    tree = _native_tree(paths[0])
    records = [r for m in tree["optimizer_state_dict"]["param_slice_mappings"] for r in m.values()]
    assert records and all(isinstance(r, DeepSpeedRecord) and set(vars(r)) == {"numel", "start"} for r in records)


# -- a tensor's backward hooks ----------------------------------------------------------------------

class _Hooked:
    """``tensor`` pickled by ``_rebuild_tensor_v2`` with ``hooks`` as its backward hooks, so a
    test can share that OrderedDict with the rest of the tree."""

    def __init__(self, tensor: torch.Tensor, hooks):
        self.storage = torch.storage.TypedStorage(wrap_storage=tensor.clone().untyped_storage(), dtype=tensor.dtype,
                                                  _internal=True)
        self.shape, self.hooks = tuple(tensor.shape), hooks

    def __reduce__(self):
        stride = tuple(torch.empty(self.shape).stride())
        return Global("torch._utils._rebuild_tensor_v2"), (self.storage, 0, self.shape, stride, False, self.hooks)


def test_backward_hooks_shared_with_the_tree_stay_one_object(tmp_path, monkeypatch):
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    empty, filled = OrderedDict(), OrderedDict(x=1)
    cases = {
        "empty_after": {"a": _Hooked(t, empty), "hooks": empty, "b": _Hooked(t, empty)},
        "empty_before": {"hooks": empty, "a": _Hooked(t, empty)},
        "filled": {"a": _Hooked(t, filled), "hooks": filled, "b": _Hooked(t, filled)},
        "parameter": {"p": Call("torch._utils._rebuild_parameter", _Hooked(t, empty), False, empty), "hooks": empty},
        "in_a_tuple": {"a": _Hooked(t, empty), "pair": (empty, empty)},
        "unhashable": {"a": _Hooked(t, empty), "s": Call("builtins.set", (empty,))},
    }
    tally = _check(tmp_path, monkeypatch, cases, set(cases) - {"unhashable"})
    assert tally.native == len(cases) - 1
    tree = _native_tree(tmp_path / "empty_after.pt")["zf_case"]
    assert type(tree["hooks"]) is OrderedDict and not tree["hooks"]
    pair = _native_tree(tmp_path / "in_a_tuple.pt")["zf_case"]["pair"]
    assert pair[0] is pair[1] and type(pair[0]) is OrderedDict


# -- tensors made in batches -------------------------------------------------------------------------

class _Items:
    """An OrderedDict pickled as ``OrderedDict()`` then SETITEMS of ``pairs`` as given, repeated
    keys included (no dict can be saved with those)."""

    def __init__(self, *pairs):
        self.pairs = pairs

    def __reduce__(self):
        return Global("collections.OrderedDict"), (), None, None, iter(self.pairs)


def _batched_cases() -> dict[str, object]:
    """The native reader makes the tensors that share a storage in batches, after the items they
    go into are set: each case puts such tensors where a batch must be made early, or where the
    items set meanwhile must keep their order and their last value."""
    base = torch.arange(40, dtype=torch.float32)
    a, b, c = base[2:10], base[10:22].view(3, 4), base.as_strided((3, 3), (1, 3), 5)
    return {
        "in_lists_tuples_and_twice": {"x": a, "y": a, "l": [b, (a, c)], "t": (c, b)},
        "repeated_keys": _Items(("k", a), ("k", None), ("j", b), ("j", c), ("m", None), ("m", a),
                                ("p", a), ("q", 5), ("p", b)),
        "int_keys": {1: a, "s": b, 2: c},
        "handed_to_a_call": Call("collections.OrderedDict", {"x": a, "y": b, "z": c}),
        "in_a_record_state": Build(FRAGMENT_ADDRESS, {"numel": 4, "start": 0, "t": a}),
        "parameter": {"p": Call("torch._utils._rebuild_parameter", b, False, OrderedDict()), "q": c},
    }


def test_batched_tensors_get_the_reference_tree(tmp_path, monkeypatch):
    cases = _batched_cases()
    tally = _check(tmp_path, monkeypatch, cases, accepted=set(cases))
    assert tally.native == len(cases), "each case should be read natively"
    tree = _native_tree(tmp_path / "in_lists_tuples_and_twice.pt")["zf_case"]
    assert tree["x"] is tree["y"] is tree["l"][1][0] and tree["t"][0] is tree["l"][1][1]
    assert not tree["x"]._is_view() and tree["x"]._base is None
    assert tree["x"].untyped_storage().data_ptr() == tree["l"][0].untyped_storage().data_ptr()
    repeated = _native_tree(tmp_path / "repeated_keys.pt")["zf_case"]
    assert list(repeated) == ["k", "j", "m", "p", "q"] and repeated["k"] is None and repeated["q"] == 5
    assert torch.equal(repeated["j"], torch.arange(40.0).as_strided((3, 3), (1, 3), 5))
    assert repeated["m"] is not None and torch.equal(repeated["p"], torch.arange(10.0, 22.0).view(3, 4))
    called = _native_tree(tmp_path / "handed_to_a_call.pt")["zf_case"]
    assert type(called) is OrderedDict and list(called) == ["x", "y", "z"]
    assert all(isinstance(t, torch.Tensor) for t in called.values())


# -- torch.Size -------------------------------------------------------------------------------------

def test_torch_sizes_are_the_reference_sizes(tmp_path, monkeypatch):
    cases = {
        "plain": [torch.Size([3, 4]), torch.Size([]), torch.Size([2 ** 62, 0, 1])],
        "negative": Call("torch.Size", (-1, 2)),
        "list": Call("torch.Size", [1, 2]),
        "bools": Call("torch.Size", (True, 2)),
        "huge": Call("torch.Size", (2 ** 70,)),
        "float": Call("torch.Size", (1.5,)),
        "two_arguments": Call("torch.Size", (1,), (2,)),
        "no_argument": Call("torch.Size"),
    }
    accepted = {label for label, value in cases.items() if _builds(value)}
    assert {"plain", "negative", "list", "no_argument"} <= accepted and "float" not in accepted
    tally = _check(tmp_path, monkeypatch, cases, accepted)
    assert tally.native >= 4
    sizes = _native_tree(tmp_path / "plain.pt")["zf_case"]
    assert [type(s) for s in sizes] == [torch.Size] * 3 and sizes[2] == (2 ** 62, 0, 1)


def _builds(value) -> bool:  # what torch.Size itself says of the case
    if not isinstance(value, Call):
        return True
    try:
        torch.Size(*value.args)
        return True
    except (TypeError, ValueError, RuntimeError, OverflowError):
        return False


# -- storage keys -----------------------------------------------------------------------------------

def _spellings(key: str, entries: int) -> list[str]:
    return [key, "0" + key, key + " ", "+" + key, "-" + key, key + "0", f"{key}.0", str(int(key) + entries),
            "4294967296", "99999999999", ""]


def _lookup(index, key: str, nbytes: int):
    try:
        return index.storage_offset(key, nbytes)
    except CorruptCheckpointError:
        return None


@pytest.mark.parametrize("rename", [False, True], ids=["as_saved", "data_folder_upper_case"])
def test_storage_keys_are_found_as_the_reference_finds_them(tmp_path, monkeypatch, rename):
    path = _source()
    if rename:  # every entry's name, local and central: "<prefix>/DATA/<key>", matched without case
        path = tmp_path / "renamed.pt"
        path.write_bytes(_source().read_bytes().replace(b"/data/", b"/DATA/"))
    native, reference = index_archive(path), _reference(path, monkeypatch)
    assert native.directory is not None
    sizes = {e.name.rsplit("/", 1)[1]: e.size for e in reference.entries.values() if "/data/" in e.name.lower()}
    for key, nbytes in sizes.items():
        for spelled in _spellings(key, len(reference.entries)):
            for n in (nbytes, nbytes + 1):
                found = native.directory.storage_offset(spelled, n)
                expected = _lookup(reference, spelled, n)
                assert found == (-1 if expected is None else expected), (spelled, n)
    compare(path, monkeypatch, Tally(), label=path.name)
    assert reader.read_native(path, native, CORE)[0]


# -- the memo ---------------------------------------------------------------------------------------

def _long_chain(puts: int) -> bytes:
    # `puts` values put under LONG_BINPUT 1..puts; only the first and the last are read back.
    body = b"".join(b"K\x07r" + i.to_bytes(4, "little") for i in range(1, puts + 1))
    return (b"\x80\x02]q\x00(" + body + b"j\x01\x00\x00\x00j" + puts.to_bytes(4, "little") + b"h\x00e.")


# Pickles that reach each branch of the memo the native reader keeps (only the indices some GET
# reads, in slots the bounds pass assigned): overwritten indices, MEMOIZE's count mixed with
# explicit indices, a GET of the list itself (a cycle), indices past 255, and the refusals.
_MEMO_CASES = {
    # [1, 2, 2, <the list>]: index 1 overwritten before it is read
    "overwritten": b"\x80\x02]q\x00(K\x01q\x01K\x02q\x01h\x01h\x00e.",
    # [7, 7, <the list>, 9, 9]: an explicit index where MEMOIZE's count has reached
    "memoize": b"\x80\x04]\x94(K\x07\x94h\x01h\x00K\tq\x02h\x02e.",
    # put 0..2, read 2 only, then MEMOIZE counts the values put by index: it lands at 3
    "unread_then_memoize": b"\x80\x04(K\x01q\x00K\x02q\x01K\x03q\x02h\x02K\x04\x94h\x03l.",
    # read, overwritten, read again
    "read_overwritten_read": b"\x80\x02]q\x00(K\x01q\x01h\x01K\x02q\x01h\x01h\x00e.",
    # a native tuple and an OrderedDict() not made yet, each taken again twice through the memo
    "shared_tuple": b"\x80\x02]q\x00(K\x01K\x02\x86q\x01h\x01h\x01e.",
    "shared_ordered_dict": b"\x80\x02]q\x00(ccollections\nOrderedDict\n)Rq\x01h\x01h\x01e.",
    # values the memo alone keeps alive after POP, POP_MARK, and one put after DUP
    "after_pop": b"\x80\x02]q\x00(]q\x010h\x01e.",
    "after_pop_mark": b"\x80\x02]q\x00((]q\x01]q\x021h\x01h\x02e.",
    "after_dup": b"\x80\x02]q\x00(]2q\x01h\x01e.",
    "past_255": _long_chain(300),
    "never_put": b"\x80\x02]q\x00h\x05a.",
    "put_ahead": b"\x80\x02]r\x00\x00\x00\x10.",
    "read_before_put": b"\x80\x02]h\x00q\x00a.",
}
_MEMO_ACCEPTED = {"overwritten", "memoize", "unread_then_memoize", "past_255", "read_overwritten_read", "shared_tuple",
                  "shared_ordered_dict", "after_pop", "after_pop_mark", "after_dup"}


def test_the_memo_keeps_what_is_read_back_and_refuses_what_the_reference_refuses(monkeypatch):
    path = _source()
    base = index_archive(path)
    tally = Tally()
    for label, data in _MEMO_CASES.items():
        index = dataclasses.replace(base, pickle_bytes=data)
        reference = _verdict(path, monkeypatch, native=False, index=index)
        assert (reference[0] == "ok") == (label in _MEMO_ACCEPTED), f"{label}: {reference}"
        compare(path, monkeypatch, tally, index=index, label=label)
    assert tally.native == len(_MEMO_ACCEPTED), "the accepted cases should be read natively, not declined"
    def native(label):
        return reader.read_native(path, dataclasses.replace(base, pickle_bytes=_MEMO_CASES[label]), CORE)[1]

    tree = native("overwritten")
    assert tree[:3] == [1, 2, 2] and tree[3] is tree
    tree = native("shared_tuple")
    assert tree == [(1, 2)] * 3 and tree[0] is tree[1] is tree[2]


# -- tensors made through DLPack (csrc/load/dlpack_tensor.h) -----------------------------------------

def _storage_views() -> dict[str, object]:
    base = torch.arange(24, dtype=torch.float32)
    grid = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    return {
        "whole_then_view": [base, base[4:10]],  # the DLPack tensor first, a view of its storage after
        "view_then_whole": [base[4:10], base],
        "offset_only": [base[3:]],
        "transposed_whole": [grid.t()],  # spans its entry without being contiguous
        "two_tensors_one_entry": [grid, grid.t(), grid[1]],
        "empty": [torch.empty(0, dtype=torch.float16)],
        "dtypes": [torch.ones(3, dtype=d) for d in (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32,
                                                     torch.float16, torch.bfloat16, torch.float64,
                                                     torch.complex64)],
    }


def _storage_ids(tree: list) -> list[int]:
    """Each tensor's storage object numbered by first appearance: the sharing pattern."""
    seen: dict[int, int] = {}
    return [seen.setdefault(t.untyped_storage()._cdata, len(seen)) for t in tree]


def test_tensors_share_one_storage_per_entry_as_the_reference_does(tmp_path, monkeypatch):
    cases = _storage_views()
    tally = _check(tmp_path, monkeypatch, cases, accepted=set(cases))
    assert tally.native == len(cases), "each case should be read natively"
    for label, value in cases.items():
        native = _native_tree(tmp_path / f"{label}.pt")["zf_case"]
        reference = _verdict(tmp_path / f"{label}.pt", monkeypatch, native=False)[1]["zf_case"]
        assert _storage_ids(native) == _storage_ids(reference[:len(native)]), label
        for got, want in zip(native, value):
            assert torch.equal(got, want), label


def test_tensors_keep_the_file_mapping_alive(tmp_path, monkeypatch):
    value = {"w": torch.arange(1000, dtype=torch.float32), "v": torch.arange(7, dtype=torch.int16)}
    path = tmp_path / "alone.pt"
    torch.save(value, path)
    ok, tree = reader.read_native(path, index_archive(path), CORE)
    assert ok, tree
    import gc
    gc.collect()
    path.unlink()  # the mapping stays while a tensor over it lives, whatever else is dropped
    assert torch.equal(tree["w"], value["w"]) and torch.equal(tree["v"], value["v"])
    w = tree.pop("w")
    del tree
    gc.collect()
    assert torch.equal(w.clone(), value["w"])


def test_twin_copies_share_one_storage_per_entry_as_the_reference_does(tmp_path):
    from zerofast.load.unpickle import load_indexed

    def tree(k: int) -> dict:
        line, grid = torch.arange(24, dtype=torch.float32) + k, torch.arange(12).reshape(3, 4) + k
        return {"line": [line, line[4:10], line[3:]], "grid": [grid.t(), grid, grid[1]],
                "placeholders": [torch.empty(0), torch.empty(0, dtype=torch.bfloat16)]}

    first, second = tmp_path / "rank0.pt", tmp_path / "rank1.pt"
    torch.save(tree(0), first)
    torch.save(tree(100), second)
    _, template = reader.load_like(first, [])
    assert template is not None, "the first file should be read natively, a template"
    twin, which = reader.load_like(second, [template])
    assert which == 0, "the second file should be the first's twin"
    got, want = twin.tree(), load_indexed(second, index_archive(second))
    for key, tensors in want.items():
        assert _storage_ids(got[key]) == _storage_ids(tensors), key
        for a, b in zip(got[key], tensors):
            assert (a.shape, a.stride(), a.storage_offset()) == (b.shape, b.stride(), b.storage_offset()), key
            assert a.untyped_storage().nbytes() == b.untyped_storage().nbytes() and torch.equal(a, b), key
