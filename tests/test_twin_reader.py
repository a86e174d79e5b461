"""ZeRO-3's per-rank model-states files read as twins of rank 0's (csrc/load/twin.cpp, reader.load_twin).

A twin is rank 0's tree copied with each storage cut from the rank's own file. It must be what
reading that file in full builds: the same objects in the same shape, the same sharing (one
tensor named twice, views of one storage), every tensor's bytes those of its own file. Judged on
real DeepSpeed ZeRO-3 saves (frozen fragments and buffers differ per rank) and on synthesized
files holding every kind of object the copy knows; a file that is not a twin is read in full.
"""
from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import pytest
import torch

import zerofast
from tests.conftest import needs_deepspeed
from tests.helpers import real_root
from tests.planting import LOSS_SCALER, Build, copy_checkpoint, save, zero3_model_name
from zerofast.errors import CorruptCheckpointError
from zerofast.load import reader
from zerofast.load.reader import Template, load_archive, load_like, native_core
from zerofast.load.records import read_model_states, read_rank_model_states
from zerofast.load.stand_ins import DeepSpeedRecord

needs_core = pytest.mark.skipif(native_core() is None, reason="no native core to test: it could not be built "
                                                              "here (`zerofast doctor` says why) or ZEROFAST_NATIVE=0")
pytestmark = needs_core


def assert_same_tree(got, want, path: Path) -> None:
    """Equal objects, tensors bit for bit and inside ``path``'s own mapping, the same sharing."""
    pairs: dict[int, int] = {}
    storages: dict[int, int] = {}
    _same(got, want, pairs, storages, "tree")


def _same(a, b, pairs: dict, storages: dict, where: str) -> None:
    assert type(a) is type(b), f"{where}: {type(a)} against {type(b)}"
    if isinstance(a, (torch.Tensor, list, dict, set, DeepSpeedRecord)):
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

    def spy(path, templates):
        result, how = real_like(path, templates)
        verdicts.append(how if isinstance(how, int) else type(how).__name__)
        return result, how

    monkeypatch.setattr("zerofast.load.records.load_like", spy)
    twins = read_rank_model_states(paths)
    # DeepSpeed records shared_params (the tied weights) on rank 0 alone: rank 1 is a second
    # template, which the later ranks repeat.
    assert verdicts == ["Template", "Template", *[1] * (len(paths) - 2)]
    for got, path in zip(twins, paths):
        want = read_model_states(path)
        assert got.path == path
        assert_same_tree(got.raw, want.raw, path)
        assert_same_tree(got.module, want.module, path)
        assert_same_tree(got.frozen_param_fragments, want.frozen_param_fragments, path)
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
                      "flags": [True, False], "set": {1, 2}, "size": torch.Size([2, 3]), "dtype": torch.float16},
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
    want = load_archive(other)
    assert_same_tree(twin, want, other)
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
    assert_same_tree(got, load_archive(other), other)


@needs_deepspeed
def test_a_damaged_rank_file_is_refused_naming_it(tmp_path):
    root, tag = copy_checkpoint(real_root("s3_bf16_w2_frozen_tied"), tmp_path / "ckpt")
    damaged = tag / zero3_model_name(1)
    data = damaged.read_bytes()
    damaged.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptCheckpointError) as e:
        zerofast.reconstruct(root)
    assert e.value.path == damaged or str(damaged.name) in str(e.value)
