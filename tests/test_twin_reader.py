"""ZeRO-3's per-rank model-states files read as twins of an earlier one (csrc/load/twin.cpp, reader.load_like).

A twin is rank 0's tree copied with each storage cut from the rank's own file. It must be what
reading that file in full builds: the same objects in the same shape, the same sharing (one
tensor named twice, views of one storage), every tensor's bytes those of its own file. Judged on
real DeepSpeed ZeRO-3 saves (frozen fragments and buffers differ per rank) and on synthesized
files holding every kind of object the copy knows; a file that is not a twin is read in full.
"""
from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

import zerofast
from tests.conftest import needs_deepspeed
from tests.helpers import real_root
from tests.planting import LOSS_SCALER, Build, Global, copy_checkpoint, save, zero3_model_name
from zerofast.base.errors import CorruptCheckpointError, UnsafeCheckpointError
from zerofast.load import reader
from zerofast.load.reader import Template, TwinDeclined, load_archive, load_like, native_core, read_errors
from zerofast.load.parallel import read_ahead
from zerofast.load.rank_states import TwinModelStates, read_rank_model_states
from zerofast.load.records import read_model_states
from zerofast.load.stand_ins import DeepSpeedRecord

needs_core = pytest.mark.skipif(native_core() is None, reason="no native core to test: it could not be built "
                                                              "here (`zerofast doctor` says why) or ZEROFAST_NATIVE=0")
pytestmark = needs_core


def assert_same_tree(got, want) -> None:
    """Equal objects, tensors bit for bit, the same sharing (objects and storages)."""
    pairs: dict[int, int] = {}
    storages: dict[int, int] = {}
    _same(got, want, pairs, storages, "tree")


def assert_in_file(tree, path: Path) -> None:
    """Every storage of ``tree`` lies in a mapping of ``path`` (the process's own map says)."""
    ranges = _mapped(path)
    for t in _tensors(tree):
        s = t.untyped_storage()
        assert any(lo <= s.data_ptr() and s.data_ptr() + s.nbytes() <= hi for lo, hi in ranges), \
            f"a tensor of {path.name} is not cut from it"


def _mapped(path: Path) -> list[tuple[int, int]]:
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == str(path.resolve()):
            lo, hi = fields[0].split("-")
            out.append((int(lo, 16), int(hi, 16)))
    assert out, f"{path} is not mapped"
    return out


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from _tensors(k)
            yield from _tensors(v)
        if isinstance(tree, OrderedDict):
            yield from _tensors(vars(tree))
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _tensors(v)
    elif isinstance(tree, DeepSpeedRecord):
        yield from _tensors(vars(tree))


def _same(a, b, pairs: dict, storages: dict, where: str) -> None:
    assert type(a) is type(b), f"{where}: {type(a)} against {type(b)}"
    if isinstance(a, (torch.Tensor, list, tuple, dict, set, DeepSpeedRecord)) and not isinstance(a, torch.Size):
        # Each object of one tree stands for exactly one of the other (memo sharing kept).
        assert pairs.setdefault(id(a), id(b)) == id(b), f"{where}: sharing differs"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.stride(), a.storage_offset()) == (b.dtype, b.shape, b.stride(), b.storage_offset()), where
        sa, sb = a.untyped_storage(), b.untyped_storage()
        assert storages.setdefault(sa.data_ptr(), sb.data_ptr()) == sb.data_ptr(), f"{where}: storage sharing differs"
        assert sa.nbytes() == sb.nbytes() and bytes(sa) == bytes(sb), f"{where}: bytes differ"
        assert not a.requires_grad
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            _same(a[k], b[k], pairs, storages, f"{where}[{k!r}]")
        if isinstance(a, OrderedDict):
            _same(vars(a), vars(b), pairs, storages, f"{where}.__dict__")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, pairs, storages, f"{where}[{i}]")
    elif isinstance(a, DeepSpeedRecord):
        _same(vars(a), vars(b), pairs, storages, f"{where}.__dict__")
    else:
        assert a == b, f"{where}: {a!r} against {b!r}"


def _model_files(layout: str) -> list[Path]:
    root = real_root(layout)
    tag = root / (root / "latest").read_text().strip()
    return sorted(tag.glob("zero_pp_rank_*_mp_rank_00_model_states.pt"))


@needs_deepspeed
@pytest.mark.parametrize("layout", ["s3_bf16_w2_frozen_tied", "s3_fp32_w3_3groups_subgroups", "s3_bf16_w4_offload"])
def test_real_rank_files_read_as_twins_are_their_full_reads(layout, monkeypatch):
    paths = _model_files(layout)
    verdicts = []
    real_like = reader.load_like

    def spy(path, templates, index):
        result, how = real_like(path, templates, index)
        verdicts.append(how if isinstance(how, int) else type(how).__name__)
        return result, how

    monkeypatch.setattr("zerofast.load.rank_states.load_like", spy)
    twins = read_rank_model_states(paths)
    # DeepSpeed records shared_params (the tied weights) on rank 0 alone: rank 1 is a second
    # template, which the later ranks repeat.
    assert verdicts == ["Template", "Template", *[1] * (len(paths) - 2)]
    for got, path in zip(twins, paths):
        # A twin's placeholders are copied only when asked for (planning never does).
        assert isinstance(got, TwinModelStates) == ("module" not in vars(got)) == (path not in paths[:2])
        if isinstance(got, TwinModelStates):  # the shapes too are the template's, and copied only for raw
            assert {"module", "param_shapes"}.isdisjoint(vars(got)["_pending"][2])
        assert_in_file(got.raw, path)
        want = read_model_states(path)
        assert got.path == path
        assert_same_tree(got.raw, want.raw)
        assert_same_tree(got.module, want.module)
        assert_same_tree(got.frozen_param_fragments, want.frozen_param_fragments)
        assert (got.param_shapes, got.frozen_param_shapes, got.buffer_names, got.shared_params, got.dp_world_size) == \
            (want.param_shapes, want.frozen_param_shapes, want.buffer_names, want.shared_params, want.dp_world_size)


def _tree(seed: int) -> dict:
    """Every kind of object the copy knows, values drawn from ``seed``, structure the same for all."""
    g = torch.Generator().manual_seed(seed)
    state = torch.nn.Linear(3, 4).state_dict()  # an OrderedDict with _metadata
    for k in state:
        state[k] = torch.randn(state[k].shape, generator=g)
    tied = torch.randn(4, 3, generator=g)
    base = torch.randn(10, generator=g).to(torch.bfloat16)
    scaler = Build(LOSS_SCALER, {"cur_scale": 2.0, "scale": torch.ones(1) * seed})
    return {"module": state, "tied": [tied, tied], "views": (base[:4], base[4:]), "transposed": tied.t(),
            "plain": {"ints": [1, 2 ** 70, -3], "floats": (2.5, float("inf")), "s": "x", "none": None,
                      "flags": [True, False], "size": torch.Size([2, 3]), "dtype": torch.float16},
            "pair": (tied, "x"),
            "empty": torch.empty(0), "ints": torch.arange(5) + seed, "scalers": [scaler, scaler],
            "nested": [[[torch.full((2,), float(seed))]]]}


def test_a_synthesized_twin_under_a_longer_folder_name_is_its_full_read(tmp_path):
    first, other = tmp_path / "r0.pt", tmp_path / "rank_0000012_model_states.pt"
    save(_tree(0), first)
    save(_tree(1), other)
    _, template = load_like(first, [])
    assert isinstance(template, Template)
    twin, how = load_like(other, [template])
    assert how == 0
    twin = twin.tree()
    assert_in_file(twin, other)
    want = load_archive(other)
    assert_same_tree(twin, want)
    assert twin["tied"][0] is twin["tied"][1]
    assert float(twin["nested"][0][0][0][0]) == 1.0  # this file's value, not the template's


def test_a_file_with_another_pickle_is_read_in_full(tmp_path):
    first, other = tmp_path / "a.pt", tmp_path / "b.pt"
    save(_tree(0), first)
    changed = _tree(1)
    changed["tied"].append(torch.zeros(2))
    save(changed, other)
    _, template = load_like(first, [])
    got, how = load_like(other, [template])
    assert isinstance(how, Template)
    assert_same_tree(got, load_archive(other))


@needs_deepspeed
def test_a_damaged_rank_file_is_refused_naming_it(tmp_path):
    root, tag = copy_checkpoint(real_root("s3_bf16_w2_frozen_tied"), tmp_path / "ckpt")
    damaged = tag / zero3_model_name(1)
    data = damaged.read_bytes()
    damaged.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptCheckpointError) as e:
        zerofast.reconstruct(root)
    assert e.value.path == damaged or str(damaged.name) in str(e.value)


def _twin_of(first_tree, other_tree, tmp_path, first="a.pt", other="b.pt"):
    """(tree, how, full read) of ``other`` read with ``first``'s template."""
    a, b = tmp_path / first, tmp_path / other
    save(first_tree, a)
    save(other_tree, b)
    _, template = load_like(a, [])
    assert isinstance(template, Template)
    tree, how = load_like(b, [template])
    if isinstance(how, int):
        try:
            tree = tree.tree()
        except TwinDeclined:  # as read_rank_model_states does: the file is read in full
            tree, how = load_archive(b), "declined"
    return tree, how, load_archive(b)


def _gpu_like(monkeypatch, device: str) -> None:
    # A GPU save's storage ids name their device: a fresh "cuda:<rank>" string per storage, as
    # torch's tagger builds it (so each is memoized on its own).
    monkeypatch.setattr(torch.serialization, "location_tag", lambda storage: device[:4] + device[4:])


def test_pickles_that_differ_in_storage_locations_alone_are_twins(tmp_path, monkeypatch):
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    _gpu_like(monkeypatch, "cuda:0")
    save(_tree(0), a)
    _gpu_like(monkeypatch, "cuda:12")
    save(_tree(1), b)
    monkeypatch.undo()
    assert a.read_bytes().count(b"cuda:0") and b.read_bytes().count(b"cuda:12")
    _, template = load_like(a, [])
    twin, how = load_like(b, [template])
    assert how == 0
    twin = twin.tree()
    assert_in_file(twin, b)
    assert_same_tree(twin, load_archive(b))


def test_a_location_string_the_tree_also_holds_is_no_twin(tmp_path, monkeypatch):
    where = {}

    def tree(seed, device):
        where["device"] = device  # the same object as the storages' location, memoized once
        return {"w": torch.full((2,), float(seed)), "device": device}

    monkeypatch.setattr(torch.serialization, "location_tag", lambda storage: where["device"])
    got, how, full = _twin_of(tree(0, "cuda:0"), tree(1, "cuda:1"), tmp_path)
    assert isinstance(how, Template) and got["device"] == "cuda:1"
    assert_same_tree(got, full)


def test_a_smaller_twin_keeps_its_own_bound_on_tensor_bytes(tmp_path):
    # 7 views of one 1 MiB storage: more than 4x the small file allows, less than the large one.
    def tree():
        big = torch.zeros(1 << 18)
        return {"tiny": [torch.zeros(1, dtype=torch.uint8) for _ in range(1500)], "views": [big.view(-1)] * 1 + [
            big.view(-1) for _ in range(6)]}

    a, b = tmp_path / ("a" * 230 + ".pt"), tmp_path / "b.pt"
    save(tree(), a)
    save(tree(), b)
    assert 4 * b.stat().st_size + (1 << 20) < 7 * (1 << 20) < 4 * a.stat().st_size + (1 << 20)
    _, template = load_like(a, [])
    with pytest.raises(UnsafeCheckpointError):
        with read_errors(b):
            twin, how = load_like(b, [template])
            assert not isinstance(how, int)


class _PlantedOrderedDict:
    """Pickled as OrderedDict(), its items set, then BUILD with ``state``."""

    def __init__(self, items, state):
        self.items, self.state = items, state

    def __reduce__(self):
        return Global("collections.OrderedDict"), (), self.state, None, iter(self.items)


@pytest.mark.parametrize("attribute", ["items", "keys"])
def test_an_ordered_dict_with_attributes_that_hide_its_methods_is_read_in_full(attribute, tmp_path):
    def tree(seed):
        items = [("w", torch.full((2,), float(seed))), ("n", 3)]
        return {"od": _PlantedOrderedDict(items, {attribute: Global("builtins.set")})}

    got, how, full = _twin_of(tree(0), tree(1), tmp_path)
    assert how == "declined"
    assert [(k, dict.__getitem__(got["od"], k)[0].item() if k == "w" else dict.__getitem__(got["od"], k))
            for k in OrderedDict.__iter__(got["od"])] == [("w", 1.0), ("n", 3)]


def test_sets_are_read_in_full(tmp_path):
    # Items added again need not iterate in the file's order.
    got, how, full = _twin_of({"s": {29, 13, 40, 3}, "w": torch.zeros(2)}, {"s": {29, 13, 40, 3}, "w": torch.ones(2)},
                              tmp_path)
    assert how == "declined" and list(got["s"]) == list(full["s"])


def test_rank_files_without_twins_are_all_read(tmp_path):
    paths = []
    for r in range(4):
        paths.append(tmp_path / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt")
        save({"module": OrderedDict(w=torch.full((r + 1,), float(r))), "param_shapes": [OrderedDict(w=torch.Size([4]))],
              "buffer_names": [], "rank": r}, paths[-1])
    states = read_rank_model_states(paths)
    assert [float(s.module["w"][0]) for s in states] == [0.0, 1.0, 2.0, 3.0]
    assert [s.raw["rank"] for s in states] == [0, 1, 2, 3]


def test_rank_files_whose_twin_copy_declines_are_read_in_full(tmp_path):
    paths = []
    for r in range(3):
        paths.append(tmp_path / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt")
        save({"module": OrderedDict(w=torch.full((2,), float(r))), "param_shapes": [OrderedDict(w=torch.Size([4]))],
              "buffer_names": [], "tags": {3, 1, 2}}, paths[-1])
    states = read_rank_model_states(paths)
    assert not any(isinstance(s, TwinModelStates) for s in states)  # a set does not copy
    assert [float(s.module["w"][0]) for s in states] == [0.0, 1.0, 2.0]
    assert all(s.raw["tags"] == {1, 2, 3} for s in states)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one CPU: read_ahead reads in turn, as it should")
def test_read_ahead_gives_each_read_in_order_with_a_bounded_number_under_way(tmp_path):
    paths = [tmp_path / f"{i}.pt" for i in range(12)]
    lock, running, peak, started = threading.Lock(), [0], [0], []

    def read(path):
        with lock:
            started.append(path)
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.01)
        with lock:
            running[0] -= 1
        if path.name == "7.pt":
            raise CorruptCheckpointError("expected a zip archive", path)
        return path.name

    calls = read_ahead(read, paths, ahead=3)
    got = [next(calls)() for _ in range(7)]
    assert got == [p.name for p in paths[:7]]
    with pytest.raises(CorruptCheckpointError, match="7.pt"):  # at its own turn, not before
        next(calls)()
    calls.close()  # leaving early: what is under way finishes, nothing more starts
    n = len(started)
    time.sleep(0.05)
    assert peak[0] <= 3 and len(started) == n <= 8 + 3 and running[0] == 0


def test_read_ahead_reads_in_turn_on_one_path(tmp_path):
    me = threading.current_thread().name
    seen = []
    calls = read_ahead(lambda p: seen.append(threading.current_thread().name) or p, [tmp_path], ahead=4)
    assert [c() for c in calls] == [tmp_path] and seen == [me]


def test_without_the_native_core_the_directories_are_read_in_turn(tmp_path, monkeypatch):
    """The Python reference reads a zip directory under the GIL: threads would only contend."""
    import zerofast.load.rank_states as rank_states

    paths = []
    for r in range(3):
        paths.append(tmp_path / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt")
        save({"module": OrderedDict(w=torch.full((2,), float(r))), "buffer_names": []}, paths[-1])
    threads = []
    index = rank_states._index
    monkeypatch.setattr(rank_states, "_index", lambda p: threads.append(threading.current_thread().name) or index(p))
    monkeypatch.setattr(rank_states, "native_core", lambda: None)
    states = read_rank_model_states(paths)
    assert [float(s.module["w"][0]) for s in states] == [0.0, 1.0, 2.0]
    assert threads == [threading.current_thread().name] * 3


def test_parts_copied_in_turn_are_one_tree(tmp_path):
    """A twin's parts copied by separate calls (each making its tensors in one batch) share what
    they share in the file: the same tensor object, one storage per entry."""
    def tree(k: int) -> dict:
        base = torch.arange(40, dtype=torch.float32) + k
        shared = base[2:10].view(2, 4)
        return {"a": [shared, base[10:20], {"t": base.as_strided((3, 3), (1, 3), 5)}],
                "b": {"again": shared, "whole": base}}

    first, other = tmp_path / "r0.pt", tmp_path / "r1.pt"
    save(tree(0), first)
    save(tree(100), other)
    _, template = load_like(first, [])
    twin, how = load_like(other, [template])
    assert how == 0
    a = twin.copy(template.result["a"])
    b = twin.copy(template.result["b"])
    assert b["again"] is a[0]
    assert len({t.untyped_storage().data_ptr() for t in (a[0], a[1], a[2]["t"], b["whole"])}) == 1
    want = load_archive(other)
    assert_same_tree({"a": a, "b": b}, want)
    assert float(b["whole"][0]) == 100.0 and not a[0]._is_view()


def test_a_twin_is_its_file_whatever_was_done_to_the_template(tmp_path):
    """The twin's tensors come from what the template's read noted of each (its recipes), not
    from the template's tensors as they are now: changing those changes no copy."""
    def tree(k: int) -> dict:
        base = torch.arange(24, dtype=torch.float32) + k
        return {"views": [base[2:8].view(2, 3), base[8:]], "whole": torch.arange(6, dtype=torch.int64) + k}

    first, other = tmp_path / "r0.pt", tmp_path / "r1.pt"
    save(tree(0), first)
    save(tree(100), other)
    _, template = load_like(first, [])
    views = template.result["views"]
    views[0].requires_grad_(True)
    views[1].as_strided_((2, 2), (1, 2), 3)
    template.result["whole"].unsqueeze_(0)
    twin, how = load_like(other, [template])
    assert how == 0
    copied = twin.tree()
    assert_same_tree(copied, load_archive(other))
    assert not copied["views"][0].requires_grad and copied["whole"].shape == (6,)
