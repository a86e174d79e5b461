"""ZeRO-Infinity saves (issue 25, item 3): optimizer and params offloaded to NVMe at ZeRO-3.

The source is a real DeepSpeed 0.19.8 save (tests/dsgen/train_nvme.py, catalog
``s3_bf16_w2_nvme``: world 2, bf16, frozen params, a tied weight) whose two large sub-groups keep
their fp32 partitions and Adam moments in the swap files ``save_checkpoint`` copies into
``offloaded_tensors/``. Judged bit for bit against the ground truth the live engine gave
(``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``, which swap the sub-group in),
and, for reshard and to-universal, by DeepSpeed loading the result at world size 3.

Needs DeepSpeed's async_io op to make the save (tests/conftest.py: ``needs_nvme``).
"""
from __future__ import annotations

import os
import shutil

import pytest
import torch

import zerofast
from zerofast.base import keys as K
from zerofast.cli import main
from zerofast.layouts import discover, load_checkpoint
from zerofast.load import load_file
from zerofast.writers.reshard import reshard
from zerofast.writers.universal import to_universal, universal_module_state

from tests import planting
from tests.conftest import needs_deepspeed, needs_nvme
from tests.dsgen.catalog import NVME_LAYOUTS
from tests.dsgen.models import build_model
from tests.helpers import assert_bitwise_equal, every_writer_refuses, nothing_written, real_root, real_truth, stored_values
from tests.test_reshard import _model_states_name, _resume

NAME = "s3_bf16_w2_nvme"
KEYS = ("exp_avg", "exp_avg_sq")
PLANTED = "shadow_sum"

pytestmark = [needs_deepspeed, needs_nvme]


def _tag():
    return real_root(NAME) / real_truth(NAME)["tag"]


def _swap_dir(tag, rank: int):
    return tag / "offloaded_tensors" / f"rank{rank:02d}"


def test_the_state_really_is_in_swap_files():
    """Sub-groups 0 and 1 (over 1 MiB per rank) are empty in the optimizer files, masters and
    moments alike; their elements are only in offloaded_tensors/. The rest stays in the files."""
    tag = _tag()
    for r in range(2):
        osd = load_file(tag / planting.optim_name(r))[K.OPTIMIZER_STATE_DICT]
        flats = osd[K.ZERO3_FLAT]
        assert [i for i, t in enumerate(flats) if t.numel() == 0] == [0, 1]
        assert all(t.numel() > 0 for t in flats[2:])
        state = osd[K.ZERO3_INNER][K.STATE]
        assert all(state[i][k].numel() == 0 for i in (0, 1) for k in KEYS)
        names = sorted(p.name for p in _swap_dir(tag, r).iterdir())
        assert len(names) == 6 and all(n.endswith(".tensor.swp") for n in names), names
    assert discover(real_root(NAME)).layout.name == "nvme"


def test_reconstruct_and_every_optimizer_key_bit_for_bit():
    root, truth = real_root(NAME), real_truth(NAME)
    for lazy in (False, True):
        state = zerofast.reconstruct(root, dtype=None, lazy=lazy)
        for name, value in stored_values(truth).items():
            assert_bitwise_equal(state[name], value, f"{name} (lazy={lazy})")
    build_model(truth["spec"]["model"]).load_state_dict(zerofast.reconstruct(root), strict=True)
    ckpt = load_checkpoint(discover(root))
    assert sorted(ckpt.layout.optimizer_keys(ckpt)) == sorted(KEYS)
    for key in KEYS:
        got = zerofast.optimizer_state(root, key)
        assert list(got) == list(truth["optimizer_states"][key])
        for name, value in truth["optimizer_states"][key].items():
            assert_bitwise_equal(got[name], value, f"{key} {name}")


def test_export_with_optimizer_states(tmp_path):
    from safetensors.torch import load_file as load_safetensors

    truth = real_truth(NAME)
    zerofast.export(real_root(NAME), tmp_path / "out", dtype=None, optimizer_states=True)
    weights = load_safetensors(tmp_path / "out" / "model.safetensors")
    for name, value in stored_values(truth).items():
        assert_bitwise_equal(weights[name], value, name)
    optimizer = load_safetensors(tmp_path / "out" / "optimizer.safetensors")
    for key in KEYS:
        for name, value in truth["optimizer_states"][key].items():
            assert_bitwise_equal(optimizer[f"{name}.{key}"], value, f"{key} {name}")


def test_inspect_names_the_swapped_sub_groups(capsys):
    assert main(["inspect", str(real_root(NAME))]) == 0
    out = capsys.readouterr().out
    assert "sub-groups [0, 1] in offloaded_tensors/ (12 swap files)" in out, out
    assert "group 0: 9 params: exp_avg, exp_avg_sq" in out, out


def test_verify_reads_the_swap_files(tmp_path):
    assert zerofast.verify(real_root(NAME)).ok
    root, tag = planting.copy_checkpoint(real_root(NAME), tmp_path / "src")
    path = _swap_dir(tag, 1) / "exp_avg_sq-0_3.tensor.swp"
    with open(path, "r+b") as f:  # a NaN at the first element of rank 1's swapped moment
        f.write(torch.tensor([float("nan")]).numpy().tobytes())
    report = zerofast.verify(root, strict=True)
    assert not report.ok and any("exp_avg_sq" in f.name or "exp_avg_sq" in f.message for f in report.failures), \
        report.findings


@pytest.mark.parametrize("damage", ["truncated", "missing", "missing_master"])
def test_a_damaged_swap_file_is_refused_by_name(tmp_path, capsys, damage):
    root, tag = planting.copy_checkpoint(real_root(NAME), tmp_path / "src")
    path = _swap_dir(tag, 0) / ("5_5.tensor.swp" if damage == "missing_master" else "exp_avg-5_5.tensor.swp")
    if damage == "truncated":
        os.truncate(path, path.stat().st_size - 1024)
        error = zerofast.InconsistentCheckpointError
    else:
        path.unlink()
        error = zerofast.IncompleteCheckpointError
    with pytest.raises(error, match="exp_avg-5_5.tensor.swp|swap file") as e:
        zerofast.optimizer_state(root, "exp_avg")
    assert "rank00" in str(e.value), e.value
    assert main(["inspect", str(root)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("zerofast: error:"), err


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    base = tmp_path_factory.mktemp("nvme")
    out = reshard(real_root(NAME), base / "w3", 3).parent
    universal = to_universal(real_root(NAME), base / "universal" / "global_step3")
    torch.save(universal_module_state(universal), base / "universal" / "module_state.pt")
    return {"w3": out, "universal": universal.parent}


def test_reshard_writes_a_plain_save_with_every_value(written):
    out, truth = written["w3"], real_truth(NAME)
    tag = out / truth["tag"]
    assert not (tag / "offloaded_tensors").exists()
    assert sorted(p.name for p in tag.glob("*optim_states.pt")) == [planting.optim_name(r) for r in range(3)]
    assert discover(out).layout.name == "zero"
    state = zerofast.reconstruct(out, dtype=None)
    for name, value in stored_values(truth).items():
        assert_bitwise_equal(state[name], value, name)
    for key in KEYS:
        got = zerofast.optimizer_state(out, key)
        for name, value in truth["optimizer_states"][key].items():
            assert_bitwise_equal(got[name], value, f"{key} {name}")
    assert zerofast.verify(out, against=real_root(NAME)).ok


def _plain_spec(world: int) -> dict:
    """The run's spec without the NVMe offload: DeepSpeed loads a plain save only into an engine
    that does not swap its optimizer to NVMe (an NVMe engine copies offloaded_tensors/ back)."""
    spec = {**NVME_LAYOUTS[NAME], "world_size": world}
    zero = {k: v for k, v in spec["ds_config"]["zero_optimization"].items() if not k.startswith("offload_")}
    spec["ds_config"] = {**spec["ds_config"], "zero_optimization": zero}
    return spec


def test_deepspeed_resumes_at_world_size_3(written, tmp_path):
    """Masters, both moments, steps, frozen params and buffers equal after DeepSpeed's own
    load_checkpoint at 3 ranks (and load_universal for the universal copy), then a step trains."""
    root, truth = real_root(NAME), real_truth(NAME)
    common = {"spec": _plain_spec(3), "truth": str(root / "ground_truth.pt"),
              "source_model_states": str(root / truth["tag"] / _model_states_name(3))}
    cases = [{**common, "name": "nvme_reshard_w3", "ckpt": str(written["w3"])},
             {**common, "name": "nvme_universal_w3", "ckpt": str(written["universal"]), "universal": True,
              "restore_module": str(written["universal"] / "module_state.pt")}]
    results = _resume(tmp_path, 3, cases)
    assert results == {"nvme_reshard_w3": [], "nvme_universal_w3": []}, results


def test_keep_nvme_is_refused(tmp_path, capsys):
    out = tmp_path / "out"
    with pytest.raises(zerofast.UnsupportedCheckpointError, match="ds_id"):
        reshard(real_root(NAME), out, 3, keep_nvme=True)
    assert main(["reshard", str(real_root(NAME)), str(out), "--world-size", "3", "--keep-nvme"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--keep-nvme" in err, err
    assert not out.exists()


# ---------------------------------------------------------------------------------------------
# A per-element value no rule places (issue 25, item 1) makes every writer refuse here too.

def _plant_in_file(tag, ranks, group: int, value) -> list:
    planted = []
    for r in ranks:
        path = tag / planting.optim_name(r)

        def edit(obj):
            obj[K.OPTIMIZER_STATE_DICT][K.ZERO3_INNER][K.STATE][group][PLANTED] = value(obj)

        planting.rewrite(path, edit)
        planted.append(path)
    return planted


def _plant_group0(tag, ranks) -> None:
    """``PLANTED`` for param group 0 of ``ranks``, kept as DeepSpeed keeps Adam's moments: for the
    swapped sub-groups 0 and 1 an empty entry in the file and a swap file (a copy of the
    master's), for sub-group 2 the master's values in the file."""
    for stem, group in (("0_3", 0), ("5_5", 1)):
        _plant_in_file(tag, ranks, group, lambda obj: torch.empty(0))
        for r in ranks:
            shutil.copy(_swap_dir(tag, r) / f"{stem}.tensor.swp", _swap_dir(tag, r) / f"{PLANTED}-{stem}.tensor.swp")
    _plant_in_file(tag, ranks, 2, lambda obj: obj[K.OPTIMIZER_STATE_DICT][K.ZERO3_FLAT][2].clone())


@pytest.mark.parametrize("plant", ["in_file_one_rank", "in_file_no_layout", "orphan_swap_file"])
def test_every_writer_refuses_a_value_it_cannot_place(tmp_path, plant):
    root, tag = planting.copy_checkpoint(real_root(NAME), tmp_path / "src")
    if plant == "in_file_one_rank":  # sub-group 2 (in the file) of rank 1 only
        planted = _plant_in_file(tag, [1], 2, lambda obj: torch.arange(2396, dtype=torch.float32))
    elif plant == "in_file_no_layout":  # every rank, 3 elements: no layout fits
        planted = _plant_in_file(tag, [0, 1], 2, lambda obj: torch.arange(3, dtype=torch.float32))
    else:  # a swap file that no optimizer state names: dropping it would lose a value
        shutil.copy(_swap_dir(tag, 1) / "0_3.tensor.swp", _swap_dir(tag, 1) / f"{PLANTED}-0_3.tensor.swp")
        planted = [_swap_dir(tag, 1) / f"{PLANTED}-0_3.tensor.swp"]
    every_writer_refuses(root, tmp_path, PLANTED, planted)
    exp_avg = zerofast.optimizer_state(root, "exp_avg")
    for name, value in real_truth(NAME)["optimizer_states"]["exp_avg"].items():
        assert_bitwise_equal(exp_avg[name], value, name)


def test_a_swapped_key_of_every_rank_is_carried(tmp_path):
    """A state every rank keeps for param group 0, swapped where DeepSpeed swaps Adam's, is read
    from its swap files and carried by reshard into the plain files."""
    root, tag = planting.copy_checkpoint(real_root(NAME), tmp_path / "src")
    _plant_group0(tag, [0, 1])
    before = zerofast.optimizer_state(root, PLANTED)
    truth = real_truth(NAME)
    assert list(before) == truth["param_groups"][0]
    for name, value in before.items():  # the planted values are copies of the masters
        assert_bitwise_equal(value, truth["trainable"][name], name)
    out = reshard(root, tmp_path / "out", 3).parent
    after = zerofast.optimizer_state(out, PLANTED)
    assert list(after) == list(before)
    for name, value in before.items():
        assert_bitwise_equal(after[name], value, name)


def test_reshard_refuses_a_key_of_one_sub_group(tmp_path):
    """The new ranks' sub-groups mix the old ones' parameters: a key that one sub-group of a
    param group keeps and another does not has no place in them, and is refused, not dropped."""
    root, tag = planting.copy_checkpoint(real_root(NAME), tmp_path / "src")
    _plant_in_file(tag, [0, 1], 1, lambda obj: torch.empty(0))
    for r in range(2):
        shutil.copy(_swap_dir(tag, r) / "5_5.tensor.swp", _swap_dir(tag, r) / f"{PLANTED}-5_5.tensor.swp")
    assert list(zerofast.optimizer_state(root, PLANTED)) == ["blocks.0.fc2.weight"]
    with pytest.raises(zerofast.UnplacedOptimizerStateError, match="sub-group 1"):
        reshard(root, tmp_path / "out", 3)
    assert nothing_written(tmp_path / "out")


def _rename_ids(tag, renames: dict[str, str]) -> None:
    """Give the swap files of sub-groups other ``ds_id``s, on both ranks, master and states alike."""
    for r in range(2):
        for path in list(_swap_dir(tag, r).iterdir()):
            key, _, stem = path.name[:-len(".tensor.swp")].rpartition("-")
            if stem in renames:
                path.rename(path.with_name(f"{key + '-' if key else ''}{renames[stem]}.tensor.swp"))


@pytest.mark.parametrize("ids", ["shifted", "unnamed", "unnamed_and_resized"])
def test_swap_files_are_paired_with_their_sub_groups(tmp_path, ids):
    """``ds_id``s shifted alike (a process that built another model first) still name the files;
    ids the parameters' order does not name fall back to the sizes, and without those the save
    is refused."""
    root, tag = planting.copy_checkpoint(real_root(NAME), tmp_path / "src")
    if ids == "shifted":
        _rename_ids(tag, {"0_3": "100_103", "5_5": "105_105"})
    else:  # 5_5 -> 2_2, 0_3 -> 5_5: names that would pair sub-group 1 with sub-group 0's file
        _rename_ids(tag, {"5_5": "2_2"})
        _rename_ids(tag, {"0_3": "5_5"})
    if ids == "unnamed_and_resized":
        os.truncate(_swap_dir(tag, 0) / "5_5.tensor.swp", 1024)
        with pytest.raises(zerofast.InconsistentCheckpointError, match="cannot tell which swap file"):
            zerofast.reconstruct(root)
        return
    truth = real_truth(NAME)
    state = zerofast.reconstruct(root, dtype=None)
    for name, value in truth["trainable"].items():
        assert_bitwise_equal(state[name], value, name)
    got = zerofast.optimizer_state(root, "exp_avg_sq")
    for name, value in truth["optimizer_states"]["exp_avg_sq"].items():
        assert_bitwise_equal(got[name], value, name)


def test_a_frozen_param_deepspeed_saved_as_a_placeholder_is_refused_by_name(capsys):
    """DeepSpeed 0.19.8 saves a frozen parameter that offload_param keeps on NVMe as a 1-element
    placeholder (and copies no param swap file): that weight is not in the save. Reading it is
    refused naming it; the optimizer state, all in the save, still reads bit for bit."""
    name = "s3_bf16_w2_nvme_frozen_swapped"
    root, truth = real_root(name), real_truth(name)
    fragment = load_file(root / truth["tag"] / planting.zero3_model_name(0))[K.FROZEN_PARAM_FRAGMENTS]
    assert fragment["lora.base.weight"].numel() == 1
    with pytest.raises(zerofast.IncompleteCheckpointError, match="'lora.base.weight'.*placeholder"):
        zerofast.reconstruct(root)
    assert main(["inspect", str(root)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "lora.base.weight" in err, err
    for key in KEYS:
        got = zerofast.optimizer_state(root, key)
        assert list(got) == list(truth["optimizer_states"][key])
        for param, value in truth["optimizer_states"][key].items():
            assert_bitwise_equal(got[param], value, f"{key} {param}")
