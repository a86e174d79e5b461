"""Universal checkpoints, made by DeepSpeed's own ds_to_universal from real ZeRO-2 and ZeRO-3
saves, judged against the ground truth of the save they were converted from."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

import zerofast
from zerofast.cli import describe, main
from zerofast.hf.run import OPTIMIZER_JSON

from tests.conftest import needs_deepspeed
from tests.dsgen.universal import DEFAULT, ensure_universal
from tests.helpers import assert_bitwise_equal, expected_value, real_root, real_truth, stored_values

pytestmark = needs_deepspeed
KEYS = ["exp_avg", "exp_avg_sq"]
S2, S3, _ = DEFAULT


@pytest.fixture(scope="module", params=DEFAULT)
def universal(request):
    """(layout, universal root, tag folder, truth of the source save)."""
    root = ensure_universal(request.param)
    tag_dir = root / (root / "latest_universal").read_text().strip()
    return request.param, root, tag_dir, real_truth(request.param)


def _check_weights(sd, truth, dtype, ordered: bool = True) -> None:
    values = stored_values(truth)
    assert (list(sd) if ordered else sorted(sd)) == (truth["state_dict_keys"] if ordered
                                                     else sorted(truth["state_dict_keys"]))
    for name in truth["state_dict_keys"]:
        assert_bitwise_equal(sd[name], expected_value(values[truth["tied"].get(name, name)], dtype), name)


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
@pytest.mark.parametrize("dtype", [torch.float32, None], ids=str)
@pytest.mark.parametrize("where", ["root", "tag"])
def test_reconstruct_matches_the_source_truth(universal, where, dtype, lazy):
    _, root, tag_dir, truth = universal
    sd = zerofast.reconstruct(root if where == "root" else tag_dir, dtype=dtype, lazy=lazy)
    _check_weights(sd, truth, dtype)
    if not lazy:
        for alias, source in truth["tied"].items():
            assert sd[alias] is sd[source]


def test_buffers_keep_their_dtype_and_shape(universal):
    """ds_to_universal stores buffers as float32 copies; the dict holds the original ones."""
    layout, root, tag_dir, truth = universal
    sd = zerofast.reconstruct(root, dtype=torch.float32)
    dtypes = {name: sd[name].dtype for name in truth["buffers"]}
    assert {torch.int64, torch.bool} <= set(dtypes.values())
    for name, value in truth["buffers"].items():
        assert_bitwise_equal(sd[name], expected_value(value, torch.float32), name)
    if layout == S2:  # the float32 copies the converter wrote are there, and are not what we read
        copy = torch.load(tag_dir / "zero" / "token_mask" / "fp32.pt", weights_only=True)["param"]
        assert copy.dtype == torch.float32 and sd["token_mask"].dtype == torch.bool


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
@pytest.mark.parametrize("dtype", [torch.float32, None], ids=str)
@pytest.mark.parametrize("key", KEYS)
def test_optimizer_state_matches_the_source_truth(universal, key, dtype, lazy):
    _, root, _, truth = universal
    got = zerofast.optimizer_state(root, key, dtype=dtype, lazy=lazy)
    want = truth["optimizer_states"][key]
    assert list(got) == [n for n in truth["state_dict_keys"] if n in want]
    for name, value in want.items():
        assert_bitwise_equal(got[name], expected_value(value, dtype), name)


def test_export_matches_the_source_and_its_export(universal, tmp_path):
    layout, root, tag_dir, truth = universal
    result = zerofast.export(tag_dir, tmp_path / "u", optimizer_states=True, max_shard_size=4000)
    assert len(result.files) > 1
    _check_weights(zerofast.load_exported(tmp_path / "u"), truth, torch.float32, ordered=False)  # shard order
    states = {k: v for name in result.optimizer_files if name.endswith(".safetensors")
              for k, v in load_file(tmp_path / "u" / name).items()}
    assert set(states) == {f"{n}.{k}" for n in truth["trainable"] for k in KEYS}
    for name in truth["trainable"]:
        for key in KEYS:
            assert_bitwise_equal(states[f"{name}.{key}"], truth["optimizer_states"][key][name], f"{name}.{key}")
    zerofast.export(real_root(layout), tmp_path / "src", optimizer_states=True, max_shard_size=4000)
    doc, source_doc = (json.loads((tmp_path / d / OPTIMIZER_JSON).read_text()) for d in ("u", "src"))
    assert doc.pop("tag") == tag_dir.name and source_doc.pop("tag") == truth["tag"]
    assert doc == source_doc  # step per parameter, param groups with their names


def test_inspect_says_universal_and_the_source_stage(universal, capsys):
    layout, root, _, truth = universal
    report = describe(root)
    assert report["universal"] is True and report["stage"] == truth["stage"] == int(layout[1])
    assert report["world_size"] == truth["world_size"]
    assert report["tensors"]["trainable"]["count"] == len(truth["trainable"])
    assert report["tensors"]["frozen"]["dtypes"] == ["bfloat16"]  # the model dtype, not the converter's fp32
    assert main(["inspect", str(root)]) == 0
    assert f"ZeRO-{truth['stage']}  (universal checkpoint" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# Incomplete universal folders name what is missing

def _copy(universal, tmp_path):
    layout, root, tag_dir, _ = universal
    dst = tmp_path / "u"
    shutil.copytree(root, dst)
    return layout, dst, dst / tag_dir.name


def test_missing_parameter_file_is_named(universal, tmp_path):
    _, root, tag_dir = _copy(universal, tmp_path)
    (tag_dir / "zero" / "blocks.1.fc1.weight" / "fp32.pt").unlink()
    with pytest.raises(zerofast.IncompleteCheckpointError) as e:
        zerofast.reconstruct(root)
    assert e.value.path == str(tag_dir / "zero")
    assert str(e.value).endswith("found 24; missing: zero/blocks.1.fc1.weight/fp32.pt")
    (tag_dir / "zero" / "blocks.1.fc1.weight" / "exp_avg.pt").unlink()
    zerofast.optimizer_state(root, "exp_avg_sq")  # still complete
    with pytest.raises(zerofast.IncompleteCheckpointError, match=r"missing: zero/blocks\.1\.fc1\.weight/exp_avg\.pt$"):
        zerofast.optimizer_state(root, "exp_avg")
    with pytest.raises(zerofast.MissingOptimizerStateError, match=r"per-element states here: \['exp_avg', 'exp_avg_sq'\]"):
        zerofast.optimizer_state(root, "momentum_buffer")


def test_missing_stage3_rank_of_a_universal_folder_is_named(tmp_path):
    _, root, tag_dir = _copy((S3, *_universal_paths(S3)), tmp_path)
    (tag_dir / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()
    with pytest.raises(zerofast.IncompleteCheckpointError, match=r"missing: zero_pp_rank_1_mp_rank_00_model_states\.pt$"):
        zerofast.reconstruct(root)


def test_missing_common_optimizer_state_is_named(tmp_path):
    _, root, tag_dir = _copy((S2, *_universal_paths(S2)), tmp_path)
    (tag_dir / "zero" / "optimizer_state.pt").unlink()
    with pytest.raises(zerofast.IncompleteCheckpointError, match=r"expected optimizer_state\.pt in .*'zero' folder"):
        zerofast.reconstruct(tag_dir)


def test_a_parameter_name_cannot_lead_out_of_the_zero_folder(tmp_path):
    from tests.planting import rewrite

    _, root, tag_dir = _copy((S2, *_universal_paths(S2)), tmp_path)
    model = tag_dir / "mp_rank_00_model_states.pt"
    rewrite(model, lambda o: o["param_shapes"][0].__setitem__("../../escape", torch.Size([2])))
    with pytest.raises(zerofast.CorruptCheckpointError, match="usable as folder names, found '../../escape'"):
        zerofast.reconstruct(root)


def _universal_paths(layout):
    root = ensure_universal(layout)
    return root, root / (root / "latest_universal").read_text().strip(), real_truth(layout)


def test_root_with_both_latest_files_reads_latest_unless_told(tmp_path):
    """Converted next to its source, the root holds both files: ``latest`` stays the training
    run's own newest save; the universal one is read by its tag, or when it is the only one."""
    from tests.planting import copy_checkpoint

    root, _ = copy_checkpoint(real_root(S2), tmp_path / "ckpt")
    universal_root, universal_tag, truth = _universal_paths(S2)
    shutil.copytree(universal_tag, root / universal_tag.name)
    shutil.copy(universal_root / "latest_universal", root / "latest_universal")
    assert describe(root)["universal"] is False
    assert describe(root, tag=universal_tag.name)["universal"] is True
    (root / "latest").unlink()
    assert describe(root)["universal"] is True
    _check_weights(zerofast.reconstruct(root), truth, torch.float32)


def test_parameter_file_of_the_other_layout_is_refused(tmp_path):
    """A ZeRO-1/2 source's files are {'param': tensor}; a bare tensor there is not read as one."""
    _, root, tag_dir = _copy((S2, *_universal_paths(S2)), tmp_path)
    victim = tag_dir / "zero" / "odd.gate" / "fp32.pt"
    value = torch.load(victim, weights_only=True)["param"]
    torch.save(value, victim)
    with pytest.raises(zerofast.InconsistentCheckpointError) as e:
        zerofast.reconstruct(root)
    assert e.value.path == str(victim)
    assert str(e.value).endswith("expected {'param': tensor of shape (1,)} (ZeRO-1/2 source), as 'param_shapes' "
                                 "records, found a bare torch.float32 tensor of shape (1,)")


def test_parameter_files_go_through_the_restricted_loader(tmp_path):
    from tests.planting import Call, save

    _, root, tag_dir = _copy((S3, *_universal_paths(S3)), tmp_path)
    victim = tag_dir / "zero" / "odd.gate" / "exp_avg.pt"
    marker = tmp_path / "ran"
    save(Call("posix.system", f"touch '{marker}'"), victim)
    with pytest.raises(zerofast.UnsafeCheckpointError) as e:
        zerofast.optimizer_state(root, "exp_avg")
    assert e.value.path == str(victim) and "posix.system" in str(e.value)
    assert not marker.exists()


def test_load_into_and_compat_take_a_universal_folder(universal):
    from tests.dsgen.models import build_model
    from zerofast.compat import get_fp32_state_dict_from_zero_checkpoint

    _, root, _, truth = universal
    model = build_model(truth["spec"].get("model"))
    result = zerofast.load_into(model, root, dtype=torch.float32)
    assert not result.missing_keys and not result.unexpected_keys
    _check_weights(model.state_dict(), truth, torch.float32)
    _check_weights(get_fp32_state_dict_from_zero_checkpoint(str(root)), truth, torch.float32)
