"""Broken checkpoints: each gets its own ZeroFastError subclass, and the message names the file
and says what was expected and what was found. (More cases live in test_discover.py.)

Every case damages a copy of a real DeepSpeed checkpoint.
"""
from __future__ import annotations

import os
import pickle
import random
import re
import shutil
import zipfile

import pytest
import torch

import zerofast
from tests.conftest import needs_deepspeed
from tests.dsgen.catalog import ensure_checkpoint
from tests.planting import MODEL, Call, ZERO_STAGE_ENUM, copy_checkpoint, member, replace_member, rewrite, run_isolated
from tests.planting import optim_name as _optim, zero3_model_name as _model3

pytestmark = needs_deepspeed

S0 = "s0_bf16_w2"
S2 = "s2_bf16_w2_frozen_tied"
S2W4 = "s2_fp32_w4_odd_3groups"
S3 = "s3_bf16_w2_frozen_tied"


@pytest.fixture
def ckpt(tmp_path):
    """ckpt(layout) -> (root, tag folder) of a fresh copy."""
    return lambda layout: copy_checkpoint(ensure_checkpoint(layout), tmp_path / layout)


def _raises(error: type, where, expected: str, root, **kwargs) -> zerofast.ZeroFastError:
    """reconstruct(root) raises exactly ``error`` about ``where`` with ``expected`` (a regex) in it."""
    with pytest.raises(zerofast.ZeroFastError) as e:
        zerofast.reconstruct(root, **kwargs)
    assert type(e.value) is error, f"{type(e.value).__name__}: {e.value}"
    assert e.value.path == str(where)
    message = str(e.value)
    assert message.startswith(f"{where}: ")
    assert re.search(expected, message[len(str(where)) + 2:]), message
    return e.value


def _osd(obj):
    return obj["optimizer_state_dict"]


# ---------------------------------------------------------------------------------------------
# Truncated or corrupt .pt files

def _zip_without(path, suffix):
    tmp = path.with_suffix(".tmp")
    with zipfile.ZipFile(path) as zin, zipfile.ZipFile(tmp, "w") as zout:
        for info in zin.infolist():
            if not info.filename.endswith(suffix):
                zout.writestr(info.filename, zin.read(info))
    os.replace(tmp, path)


NOT_A_TORCH_ZIP = r"^expected a torch.save zip archive; the file is truncated or not one"


def _zero_bytes(victim):
    victim.write_bytes(b"")
    return NOT_A_TORCH_ZIP


def _random_bytes(victim):
    victim.write_bytes(random.Random(0).randbytes(4096))
    return NOT_A_TORCH_ZIP


def _cut_before_the_end(victim):
    data = victim.read_bytes()
    victim.write_bytes(data[:-30])  # the zip's end record is gone
    return NOT_A_TORCH_ZIP


def _no_data_pkl(victim):
    _zip_without(victim, "/data.pkl")
    return r"^expected zip entry 'mp_rank_00_model_states/data.pkl', found only \['mp_rank_00_model_states/"


def _flat_zip(victim):
    with zipfile.ZipFile(victim, "w") as zf:
        zf.writestr("data.pkl", pickle.dumps({}, protocol=2))
    return r"^expected a torch.save archive \(entries inside one folder\), found \['data.pkl'\]"


def _garbage_pickle(victim):
    replace_member(victim, "/data.pkl", random.Random(1).randbytes(512))
    return r"^expected a (valid pickle in data.pkl, got: |torch.save pickle \(protocol 2\), found opcode )"


def _truncated_pickle(victim):
    data = zipfile.ZipFile(victim).read(member(victim, "/data.pkl"))
    replace_member(victim, "/data.pkl", data[:len(data) // 2])
    return r"^expected a valid pickle in data.pkl, got: pickle data was truncated"


def _pickle_of_a_list(victim):
    replace_member(victim, "/data.pkl", pickle.dumps([1, 2], protocol=2))
    return r"^expected the model-states file to be a dict, found list$"


def _storage_entry_missing(victim):
    _zip_without(victim, "/data/3")
    return r"^expected zip entry 'mp_rank_00_model_states/data/3', found only"


def _a_folder(victim):
    victim.unlink()
    victim.mkdir()
    return r"^expected a regular file, found a directory$"


@pytest.mark.parametrize("damage", [_zero_bytes, _random_bytes, _cut_before_the_end, _no_data_pkl, _flat_zip,
                                    _garbage_pickle, _truncated_pickle, _pickle_of_a_list, _storage_entry_missing,
                                    _a_folder], ids=lambda f: f.__name__.strip("_"))
def test_corrupt_model_states_file(ckpt, damage):
    root, tag_dir = ckpt(S2)
    victim = tag_dir / MODEL
    _raises(zerofast.CorruptCheckpointError, victim, damage(victim), root)


def test_optimizer_file_without_optimizer_state(ckpt):
    root, tag_dir = ckpt(S2)
    victim = tag_dir / _optim(1)
    rewrite(victim, lambda o: o.pop("optimizer_state_dict"))
    _raises(zerofast.CorruptCheckpointError, victim, r"^expected 'optimizer_state_dict' to be a dict, found NoneType$",
            root)


def test_rank_file_that_is_a_fifo_does_not_block(ckpt):
    root, tag_dir = ckpt(S2)
    victim = tag_dir / _optim(1)
    victim.unlink()
    os.mkfifo(victim)
    proc = run_isolated(f"import zerofast\ntry:\n    zerofast.reconstruct({str(root)!r})\n"
                        "except zerofast.CorruptCheckpointError as e:\n    print(e)\n", timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == f"{victim}: expected a regular file, found a special file (FIFO, device or socket)"


# ---------------------------------------------------------------------------------------------
# Missing, stray and disagreeing rank files

def test_missing_last_optimizer_rank(ckpt):
    root, tag_dir = ckpt(S2)
    (tag_dir / _optim(1)).unlink()
    _raises(zerofast.IncompleteCheckpointError, tag_dir,
            r"^expected the files of 2 ranks \(partition_count 2\); missing: bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt$",
            root)


def test_missing_stage3_optimizer_rank(ckpt):
    root, tag_dir = ckpt(S3)
    (tag_dir / _optim(1)).unlink()
    _raises(zerofast.IncompleteCheckpointError, tag_dir,
            r"^expected the files of 2 ranks \(partition_count 2\); missing: bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt$",
            root)


def test_missing_model_states_next_to_optimizer_files(ckpt):
    root, tag_dir = ckpt(S2)
    (tag_dir / MODEL).unlink()
    _raises(zerofast.IncompleteCheckpointError, tag_dir,
            r"^expected mp_rank_00_model_states.pt or zero_pp_rank_\*_mp_rank_00_model_states.pt next to 2 "
            r"optimizer files, found neither$", root)


def test_stray_stage3_ranks_from_a_larger_world(ckpt):
    root, tag_dir = ckpt(S3)
    for r in (2, 3):  # an older save with world size 4 left ranks 2 and 3 behind
        shutil.copy(tag_dir / _model3(0), tag_dir / _model3(r))
        shutil.copy(tag_dir / _optim(0), tag_dir / _optim(r))
    _raises(zerofast.IncompleteCheckpointError, tag_dir,
            r"^partition_count is 2 but 4 rank files are present; stray files from another save: "
            r"\['bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt', 'bf16_zero_pp_rank_3_mp_rank_00_optim_states.pt'\]$",
            root)


def test_stray_rank_file_of_another_dtype(ckpt):
    root, tag_dir = ckpt(S2)
    shutil.copy(tag_dir / _optim(0), tag_dir / _optim(0, bf16=False))  # left by an older fp32 save
    _raises(zerofast.IncompleteCheckpointError, tag_dir,
            r"^expected one file for rank 0, found \['bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt', "
            r"'zero_pp_rank_0_mp_rank_00_optim_states.pt'\]: the folder mixes saves of two dtypes$", root)


def test_partition_count_larger_than_the_files(ckpt):
    root, tag_dir = ckpt(S2)
    for r in (0, 1):
        rewrite(tag_dir / _optim(r), lambda o: _osd(o).__setitem__("partition_count", [3, 3]))
    _raises(zerofast.IncompleteCheckpointError, tag_dir,
            r"^expected the files of 3 ranks \(partition_count 3\); missing: bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt$",
            root)


def test_stage3_partition_count_smaller_than_the_files(ckpt):
    root, tag_dir = ckpt(S3)
    for r in (0, 1):
        rewrite(tag_dir / _optim(r), lambda o: _osd(o).__setitem__("partition_count", 1))
    _raises(zerofast.IncompleteCheckpointError, tag_dir,
            r"^partition_count is 1 but 2 rank files are present; stray files from another save: "
            r"\['bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt'\]$", root)


def test_partition_count_disagreeing_between_rank_files(ckpt):
    root, tag_dir = ckpt(S2)
    rewrite(tag_dir / _optim(1), lambda o: _osd(o).__setitem__("partition_count", [4, 4]))
    _raises(zerofast.InconsistentCheckpointError, tag_dir / _optim(1),
            r"^expected partition_count 2 \(as in bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt\), found 4$", root)


def test_zero_stage_disagreeing_between_rank_files(ckpt):
    root, tag_dir = ckpt(S2)
    rewrite(tag_dir / _optim(1), lambda o: _osd(o).__setitem__("zero_stage", Call(ZERO_STAGE_ENUM, 1)))
    _raises(zerofast.InconsistentCheckpointError, tag_dir / _optim(1),
            r"^expected zero_stage 2 \(as in bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt\), found 1$", root)


# ---------------------------------------------------------------------------------------------
# Folders that are not checkpoints, and the `latest` file

def test_folder_of_other_files_is_not_a_checkpoint(tmp_path):
    (tmp_path / "README.md").write_text("a model card\n")
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 64)
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "train.log").write_text("step 1\n")
    _raises(zerofast.CheckpointNotFoundError, tmp_path,
            r"^expected a DeepSpeed checkpoint \('latest' plus a tag folder, or a tag folder holding "
            r"\*_model_states.pt files\), found none$", tmp_path)


def test_a_file_is_not_a_checkpoint_folder(ckpt):
    root, tag_dir = ckpt(S2)
    _raises(zerofast.CheckpointNotFoundError, tag_dir / MODEL,
            r"^expected a DeepSpeed checkpoint folder, found a file; pass the folder that holds it, .*global_step\d+$",
            tag_dir / MODEL)


@pytest.mark.parametrize("content, expected", [
    (b"global_step99\n", r"^'latest' names tag 'global_step99', which has no folder here; the tags here: "
                         r"\['global_step\d+'\]$"),
    (b"  \n", r"^expected a tag name in 'latest', found an empty file$"),
    (b"\xff\xfe\x00global", r"^expected a tag name in 'latest', found binary data b'\\xff\\xfe\\x00global'$"),
    (b"../elsewhere\n", r"^expected a tag name in 'latest' \(a folder under .*\), found '../elsewhere'$"),
    (b"/etc\n", r"^expected a tag name in 'latest' \(a folder under .*\), found '/etc'$"),
], ids=["missing-tag", "empty", "binary", "parent", "absolute"])
def test_bad_latest_file(ckpt, content, expected):
    root, _ = ckpt(S2)
    (root / "latest").write_bytes(content)
    where = root if content.startswith(b"global_step99") else root / "latest"
    _raises(zerofast.CheckpointNotFoundError, where, expected, root)


def test_no_latest_with_several_tags_names_them_all(ckpt):
    root, tag_dir = ckpt(S2)
    (root / "latest").unlink()
    for tag in ("global_step1", "global_step10"):
        shutil.copytree(tag_dir, root / tag)
    (root / "not_a_tag").mkdir()  # folders without model states are not tags
    _raises(zerofast.AmbiguousTagError, root,
            r"^no 'latest' file and 3 tags \['global_step1', 'global_step10', 'global_step3'\]; pass tag= \(or --tag\) "
            r"to pick one$", root)


# ---------------------------------------------------------------------------------------------
# Tensors whose sizes disagree with param_shapes

def test_stage2_param_shape_larger_than_the_partitions(ckpt):
    root, tag_dir = ckpt(S2)
    rewrite(tag_dir / MODEL, lambda o: o["param_shapes"][1].__setitem__("final_norm.bias", torch.Size([16, 16])))
    _raises(zerofast.InconsistentCheckpointError, tag_dir / _optim(0),
            r"^'param_shapes' places 'final_norm.bias' at elements \[\d+, \d+\) of group 1, but the 2 ranks' "
            r"partitions hold only 236$", root)


def test_stage2_partition_shorter_on_a_middle_rank(ckpt):
    root, tag_dir = ckpt(S2W4)
    victim = tag_dir / _optim(1, bf16=False)
    rewrite(victim, lambda o: _osd(o)["single_partition_of_fp32_groups"].__setitem__(
        0, _osd(o)["single_partition_of_fp32_groups"][0][:-2].clone()))
    _raises(zerofast.InconsistentCheckpointError, victim,
            r"^expected group 0's partition to hold 970 elements \(as in zero_pp_rank_0_mp_rank_00_optim_states.pt\), "
            r"found 968; only the partitions at the end of a group may be shorter$", root)


def test_stage3_flat_groups_shorter_than_param_shapes(ckpt):
    root, tag_dir = ckpt(S3)
    victim = tag_dir / _optim(1)
    rewrite(victim, lambda o: _osd(o)["fp32_flat_groups"].__setitem__(1, _osd(o)["fp32_flat_groups"][1][:100].clone()))
    _raises(zerofast.InconsistentCheckpointError, victim,
            r"^'param_shapes' needs \d+ elements per rank to reach '[\w.]+', but this rank's flat groups hold 2040$",
            root)


def test_stage2_frozen_fragment_and_module_disagree_with_frozen_shapes(ckpt):
    root, tag_dir = ckpt(S2)

    def edit(o):
        o["frozen_param_fragments"]["lora.base.weight"] = o["frozen_param_fragments"]["lora.base.weight"][:8].clone()
        o["module"]["lora.base.weight"] = o["module"]["lora.base.weight"][:8].clone()
    rewrite(tag_dir / MODEL, edit)
    _raises(zerofast.InconsistentCheckpointError, tag_dir / MODEL,
            r"^frozen parameter 'lora.base.weight' of shape \(16, 16\) has no full tensor in 'frozen_param_fragments' "
            r"or 'module'$", root)


def test_stage3_frozen_fragment_shorter_than_its_share(ckpt):
    root, tag_dir = ckpt(S3)
    victim = tag_dir / _model3(1)
    rewrite(victim, lambda o: o["frozen_param_fragments"].__setitem__(
        "lora.base.weight", o["frozen_param_fragments"]["lora.base.weight"][:100].clone()))
    _raises(zerofast.InconsistentCheckpointError, victim,
            r"^expected a fragment of at least 128 elements for frozen parameter 'lora.base.weight', found 100$", root)


def test_alignment_paddings_disagree_with_param_shapes(ckpt):
    root, tag_dir = ckpt(S2)
    for r in (0, 1):
        rewrite(tag_dir / _optim(r), lambda o: _osd(o)["param_alignment_paddings"][0].pop())
    _raises(zerofast.InconsistentCheckpointError, tag_dir / _optim(0),
            r"^expected 11 'param_alignment_paddings' for group 0, found 10$", root)


def test_flat_group_count_disagrees_with_param_shapes(ckpt):
    root, tag_dir = ckpt(S2)
    for r in (0, 1):
        rewrite(tag_dir / _optim(r), lambda o: _osd(o)["single_partition_of_fp32_groups"].pop())
    _raises(zerofast.InconsistentCheckpointError, tag_dir / _optim(0),
            r"^expected 2 flat fp32 groups \(one per 'param_shapes' group\), found 1$", root)


@pytest.mark.parametrize("shape", [(-4, 4), 5, ("16",), (16.0,), None, (0, 2 ** 64), (2 ** 40, 2 ** 40),
                                   (1,) * 65], ids=repr)
def test_param_shape_that_is_not_a_shape(ckpt, shape):
    root, tag_dir = ckpt(S2)
    rewrite(tag_dir / MODEL, lambda o: o["param_shapes"][0].__setitem__("embed.weight", shape))
    _raises(zerofast.InconsistentCheckpointError, tag_dir / MODEL,
            r"^expected a shape \(at most 64 non-negative ints, product below 2\*\*63\) for 'embed.weight', found "
            rf"{re.escape(zerofast.base.errors.short_repr(shape))}$", root)


# ---------------------------------------------------------------------------------------------
# Unknown stage

@pytest.mark.parametrize("layout", [S2, S3])
def test_unknown_zero_stage(ckpt, layout):
    root, tag_dir = ckpt(layout)
    for r in (0, 1):
        rewrite(tag_dir / _optim(r), lambda o: _osd(o).__setitem__("zero_stage", Call(ZERO_STAGE_ENUM, 7)))
    _raises(zerofast.UnsupportedCheckpointError, tag_dir / _optim(0),
            r"^expected ZeRO stage 0, 1, 2 or 3, found zero_stage 7: a stage zerofast does not know$", root)


def test_stage3_recorded_next_to_a_single_model_file(ckpt):
    root, tag_dir = ckpt(S2)
    for r in (0, 1):
        rewrite(tag_dir / _optim(r), lambda o: _osd(o).__setitem__("zero_stage", Call(ZERO_STAGE_ENUM, 3)))
    _raises(zerofast.InconsistentCheckpointError, tag_dir / _optim(0),
            r"^expected zero_stage 1 or 2 next to a single mp_rank_00_model_states.pt, found 3$", root)


# ---------------------------------------------------------------------------------------------
# MoE, pipeline and tensor-parallel files without the rest of their save: a specific error, never a
# wrong result

@pytest.mark.parametrize("name, error, where, expected", [
    ("layer_0_expert_0_mp_rank_00_model_states.pt", zerofast.CorruptCheckpointError, MODEL,
     r"^expected 'num_experts' to be a list, found NoneType$"),
    ("expp_rank_0_mp_rank_00_optim_states.pt", zerofast.IncompleteCheckpointError, None,
     r"^expected either expp_rank_\* \(MoE without ZeRO\) or zero_pp_rank_\* optimizer files, found both"),
    ("layer_01-model_states.pt", zerofast.CorruptCheckpointError, "layer_01-model_states.pt",
     r"^expected a layer file to map names \(str\) to tensors, found str -> dict for 'optimizer_state_dict'$"),
    ("zero_pp_rank_0_mp_rank_01_optim_states.pt", zerofast.IncompleteCheckpointError, None,
     r"^expected a model-states file for each of the 2 tensor-parallel ranks \(mp_rank_00..01\), found "
     r"mp_rank_00_model_states.pt$"),
])
def test_parallel_layout_files_without_their_save_are_refused(ckpt, name, error, where, expected):
    root, tag_dir = ckpt(S2)
    shutil.copy(tag_dir / _optim(0), tag_dir / name)
    _raises(error, tag_dir / where if where else tag_dir, expected, root)


@pytest.mark.parametrize("key, value, error, expected", [
    ("mp_world_size", 2, zerofast.IncompleteCheckpointError,
     r"^expected mp_world_size 1 in a folder with only mp_rank_00 files, found 2: the other tensor-parallel ranks' "
     r"files of this save are missing$"),
    ("checkpoint_parallel_dimensions", {"pp_degree": 2, "tp_degree": 1}, zerofast.IncompleteCheckpointError,
     r"^expected pp_degree 1 in a folder with only mp_rank_00 files, found 2: the layer_\*-model_states.pt files "
     r"of this pipeline-parallel save are missing$"),
    ("checkpoint_parallel_dimensions", {"pp_degree": 1, "tp_degree": 4}, zerofast.IncompleteCheckpointError,
     r"^expected tp_degree 1 in a folder with only mp_rank_00 files, found 4: the other tensor-parallel ranks' "
     r"files of this save are missing$"),
])
def test_parallel_degrees_recorded_in_the_model_file_are_checked(ckpt, key, value, error, expected):
    """The other model-parallel ranks' files may simply be absent; the recorded degree still says so."""
    root, tag_dir = ckpt(S2)
    rewrite(tag_dir / MODEL, lambda o: o.__setitem__(key, value))
    _raises(error, tag_dir / MODEL, expected, root)


def test_expert_groups_without_expert_files_are_refused(ckpt):
    root, tag_dir = ckpt(S2)
    for r in (0, 1):
        rewrite(tag_dir / _optim(r), lambda o: _osd(o).__setitem__("partition_count", [2, 1]))
    _raises(zerofast.InconsistentCheckpointError, tag_dir / _optim(0),
            r"^expected one partition_count for every group, found \[2, 1\]: a mixture-of-experts save, but the "
            r"folder holds no layer_\*_expert_\* files$", root)


# ---------------------------------------------------------------------------------------------
# Metadata of the wrong type: the loader checks what it reads, so nothing downstream fails with
# a bare TypeError, KeyError or AttributeError.

def _set(key, value):
    return lambda o: o.__setitem__(key, value)


def _set_osd(key, value):
    return lambda o: _osd(o).__setitem__(key, value)


def _set_group(index, value):
    return lambda o: _osd(o)["single_partition_of_fp32_groups"].__setitem__(index, value)


MALFORMED = {
    "buffer_names=int": (S2, MODEL, _set("buffer_names", 5), zerofast.CorruptCheckpointError,
                         r"^expected 'buffer_names' to be a list, found int$"),
    "buffer_names=[int]": (S2, MODEL, _set("buffer_names", ["scale", 3]), zerofast.CorruptCheckpointError,
                           r"^expected 'buffer_names' to hold names \(str\), found int$"),
    "shared_params=list": (S2, MODEL, _set("shared_params", ["lm_head.weight"]), zerofast.CorruptCheckpointError,
                           r"^expected 'shared_params' to be a dict, found list$"),
    "shared_params={str: int}": (S2, MODEL, _set("shared_params", {"lm_head.weight": 3}),
                                 zerofast.CorruptCheckpointError,
                                 r"^expected 'shared_params' to map names \(str\) to names, found str -> int for "
                                 r"'lm_head.weight'$"),
    "frozen_param_fragments={str: int}": (S2, MODEL, lambda o: o["frozen_param_fragments"].__setitem__(
        "lora.base.bias", 3), zerofast.CorruptCheckpointError,
        r"^expected 'frozen_param_fragments' to map names \(str\) to tensors, found str -> int for 'lora.base.bias'$"),
    "param_shapes=int": (S2, MODEL, _set("param_shapes", 5), zerofast.CorruptCheckpointError,
                         r"^expected 'param_shapes' to be a list, found int$"),
    "param_shapes[0]=list": (S2, MODEL, lambda o: o["param_shapes"].__setitem__(0, [1, 2]),
                             zerofast.CorruptCheckpointError,
                             r"^expected a 'param_shapes' group to be a dict, found list$"),
    "module={int: tensor}": (S2, MODEL, lambda o: o["module"].__setitem__(7, torch.zeros(1)),
                             zerofast.CorruptCheckpointError,
                             r"^expected 'module' to map names \(str\) to tensors, found int -> Tensor for 7$"),
    "module[buffer]=float": (S2, MODEL, lambda o: o["module"].__setitem__("scale", 1.5),
                             zerofast.UnsupportedCheckpointError,
                             r"^expected every 'module' entry to be a tensor, found a float for 'scale' \(non-tensor "
                             r"extra state is not supported yet\)$"),
    "dp_world_size=str": (S0, MODEL, _set("dp_world_size", "two"), zerofast.CorruptCheckpointError,
                          r"^expected 'dp_world_size' to be an int >= 1, found 'two'$"),
    "partition_count=str": (S2, _optim(0), _set_osd("partition_count", "2"), zerofast.CorruptCheckpointError,
                            r"^expected 'partition_count' to be an int >= 1, found '2'$"),
    "partition_count=[0, 0]": (S2, _optim(0), _set_osd("partition_count", [0, 0]), zerofast.CorruptCheckpointError,
                               r"^expected each 'partition_count' to be an int >= 1, found 0$"),
    "zero_stage=str": (S2, _optim(0), _set_osd("zero_stage", "2"), zerofast.CorruptCheckpointError,
                       r"^expected 'zero_stage' to be an int >= 0, found '2'$"),
    "flat groups=int": (S2, _optim(1), _set_osd("single_partition_of_fp32_groups", 3),
                        zerofast.CorruptCheckpointError,
                        r"^expected 'single_partition_of_fp32_groups' to be a list, found int$"),
    "flat group=int64": (S2, _optim(1), _set_group(0, torch.zeros(1938, dtype=torch.int64)),
                         zerofast.CorruptCheckpointError,
                         r"^expected single_partition_of_fp32_groups\[0\] to be a 1-D floating-point tensor, found a "
                         r"1-D torch.int64 tensor$"),
    "flat group=float64": (S2, _optim(1), _set_group(1, torch.zeros(118, dtype=torch.float64)),
                           zerofast.InconsistentCheckpointError,
                           r"^expected every flat group in torch.float32 \(as bf16_zero_pp_rank_0_mp_rank_00_optim_"
                           r"states.pt's first\), found torch.float64 in group 1$"),
    "param_alignment_paddings=[[str]]": (S2, _optim(0), lambda o: _osd(o)["param_alignment_paddings"][0].__setitem__(
        1, "x"), zerofast.CorruptCheckpointError,
        r"^expected each 'param_alignment_paddings' entry to be an int >= 0, found 'x'$"),
    "param_alignment_paddings=int": (S2, _optim(0), _set_osd("param_alignment_paddings", 0),
                                     zerofast.CorruptCheckpointError,
                                     r"^expected 'param_alignment_paddings' to be a list, found int$"),
    "stage0 fp32_groups=None": (S0, MODEL, lambda o: o["optimizer"].__setitem__("fp32_groups", None),
                                zerofast.CorruptCheckpointError,
                                r"^expected optimizer.fp32_groups to be a list, found NoneType$"),
    "stage0 fp32_groups[0][1]=str": (S0, MODEL, lambda o: o["optimizer"]["fp32_groups"][0].__setitem__(1, "x"),
                                     zerofast.CorruptCheckpointError,
                                     r"^expected optimizer.fp32_groups\[0\] to be a list of floating-point tensors, "
                                     r"found list with other items$"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_metadata_is_reported_not_crashed_on(ckpt, case):
    layout, file, edit, error, expected = MALFORMED[case]
    root, tag_dir = ckpt(layout)
    rewrite(tag_dir / file, edit)
    _raises(error, tag_dir / file, expected, root)


# ---------------------------------------------------------------------------------------------
# Malformed pickles, hand-assembled (torch.save's protocol-2 opcodes) into a real archive

def _text(s: str) -> bytes:
    return pickle.BINUNICODE + len(s.encode()).to_bytes(4, "little") + s.encode()


def _storage_ref(key: str, numel: int, storage_type: bytes = b"ctorch\nFloatStorage\n") -> bytes:
    return (pickle.MARK + _text("storage") + storage_type + _text(key) + _text("cpu")
            + pickle.BININT + numel.to_bytes(4, "little") + pickle.TUPLE + pickle.BINPERSID)


P2 = pickle.PROTO + b"\x02"


@pytest.mark.parametrize("data, expected", [
    (P2 + pickle.TUPLE + pickle.STOP, r"^expected a valid pickle in data.pkl, got: could not find MARK$"),
    (P2 + pickle.BINGET + b"\x05" + pickle.STOP, r"^expected a valid pickle in data.pkl, got: Memo value not found"),
    (P2 + pickle.APPEND + pickle.STOP, r"^expected a valid pickle in data.pkl, got: unpickling stack underflow$"),
    (P2 + pickle.MARK + pickle.NONE + pickle.SETITEMS + pickle.STOP,
     r"^expected a valid pickle in data.pkl, got: unpickling stack underflow$"),
    (P2 + pickle.BININT1 + b"\x05" + pickle.BINPERSID + pickle.STOP,
     r"^expected a torch storage reference in the pickle, found 5$"),
    (P2 + _storage_ref("0", 1, storage_type=_text("torch.FloatStorage")) + pickle.STOP,
     r"^expected a torch storage reference in the pickle, found \('storage', 'torch.FloatStorage', '0', 'cpu', 1\)$"),
    (P2 + pickle.EMPTY_LIST + _storage_ref("0", 16) + pickle.APPEND + _storage_ref("0", 2) + pickle.APPEND
     + pickle.STOP, r"^the pickle declares storage '0' twice, with 64 and 8 bytes$"),
    (P2 + pickle.EMPTY_DICT + pickle.MEMOIZE + pickle.STOP, r"^expected a 'module' entry, found keys \[\]$"),
], ids=["tuple-without-mark", "unknown-memo", "append-to-nothing", "setitems-without-target", "persistent-id-int",
        "storage-type-as-text", "storage-declared-twice", "protocol-4-opcode"])
def test_malformed_pickle_stream(ckpt, data, expected):
    root, tag_dir = ckpt(S2)
    victim = tag_dir / MODEL
    replace_member(victim, "/data.pkl", data)
    _raises(zerofast.CorruptCheckpointError, victim, expected, root)
