"""PyTorch Distributed Checkpoint folders as input: real ones saved by an FSDP2 gloo job at world 2
and 4 (tests/dsgen/dcp.py), judged against torch's own ``dcp_to_torch_save`` and the job's
gathered state; a planted ``.metadata`` runs under torch and is refused by zerofast."""
from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import zerofast
from zerofast.cli import main

from tests.dsgen.dcp import WORLDS, ensure_dcp
from tests.helpers import assert_bitwise_equal, expected_value


def _torch_model_state(folder: Path, tmp: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / "torch_save.pt"
    dcp_to_torch_save(folder, out)
    return torch.load(out, weights_only=False)["model"]


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"w{w}")
def folder(request) -> Path:
    return ensure_dcp(request.param)


def test_reconstruct_equals_dcp_to_torch_save_and_the_job(folder, tmp_path):
    want = _torch_model_state(folder, tmp_path)
    truth = torch.load(folder.parent / "truth.pt", weights_only=False)["model"]
    got = zerofast.reconstruct(folder, dtype=None)
    assert list(got) == list(want) and sorted(got) == sorted(truth)
    for name, value in want.items():
        assert_bitwise_equal(got[name], value, name)
        assert_bitwise_equal(got[name], truth[name], name)
    assert got["low.weight"].dtype == torch.bfloat16  # the bf16 unit stays bf16 under dtype=None
    fp32 = zerofast.reconstruct(folder)
    for name, value in want.items():
        assert_bitwise_equal(fp32[name], expected_value(value, torch.float32), name)


def test_lazy_builds_one_tensor_on_lookup(folder, tmp_path):
    want = _torch_model_state(folder, tmp_path)
    lazy = zerofast.reconstruct(folder, lazy=True, dtype=None)
    assert lazy.meta("embed.weight").shape == (37, 10) and lazy.meta("mask").dtype == torch.bool
    for name, value in want.items():
        assert_bitwise_equal(lazy[name], value, name)


@pytest.mark.parametrize("dtype,flag", [(None, "keep"), (torch.float32, "fp32"), (torch.bfloat16, "bf16")], ids=str)
def test_export_equals_dcp_to_torch_save(folder, tmp_path, dtype, flag):
    want = _torch_model_state(folder, tmp_path)
    out = tmp_path / "hf"
    assert main(["export", str(folder), str(out), "--dtype", flag, "--max-shard-size", "1KB", "--quiet"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    got = {}
    for name in sorted(set(index["weight_map"].values())):
        got.update(load_file(out / name))
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert_bitwise_equal(got[name], expected_value(value, dtype), name)  # ties: each name its own tensor


def test_inspect_names_the_format(folder, capsys):
    from zerofast.cli.dcp import DCP_FORMAT
    from zerofast.layouts.dcp import FORMAT

    assert DCP_FORMAT == FORMAT  # spelled twice so that the parser imports no torch
    assert main(["inspect", str(folder)]) == 0
    text = capsys.readouterr().out
    world = int(folder.parent.name.split("_w")[1].split("-")[0])
    assert f"format        PyTorch DCP, {world} ranks, FSDP2 shards (dim 0)" in text
    assert main(["inspect", str(folder), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tensors"]["trainable"]["count"] == 7 and report["tensors"]["buffer"]["count"] == 2


class _Planted:
    """Pickles as a call of os.system: what a stranger's .metadata can hold."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def test_planted_metadata_runs_under_torch_and_is_refused_by_zerofast(tmp_path):
    planted = tmp_path / "planted"
    shutil.copytree(ensure_dcp(2), planted)
    with open(planted / ".metadata", "rb") as f:
        meta = pickle.load(f)  # our own file, written by the fixture job
    marker = tmp_path / "payload-ran"
    meta.planner_data["zz"] = _Planted(f"touch {marker}")
    with open(planted / ".metadata", "wb") as f:
        pickle.dump(meta, f)
    with pytest.raises(zerofast.UnsafeCheckpointError, match="'posix.system'.*nothing was executed"):
        zerofast.reconstruct(planted)
    assert main(["inspect", str(planted)]) == 1
    assert not marker.exists()
    # torch's own converter unpickles .metadata with plain pickle: the payload runs there.
    code = ("from torch.distributed.checkpoint.format_utils import dcp_to_torch_save; "
            f"dcp_to_torch_save({str(planted)!r}, {str(tmp_path / 'out.pt')!r})")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    assert marker.exists()


def _copy(tmp_path: Path) -> Path:
    target = tmp_path / "copy"
    shutil.copytree(ensure_dcp(2), target)
    return target


def test_missing_truncated_and_outside_data_files(tmp_path):
    broken = _copy(tmp_path)
    (broken / "__1_0.distcp").unlink()
    with pytest.raises(zerofast.CheckpointNotFoundError, match="__1_0.distcp"):
        zerofast.reconstruct(broken)
    shutil.rmtree(broken)
    broken = _copy(tmp_path)
    with open(broken / "__0_0.distcp", "r+b") as f:
        f.truncate(3000)  # inside the first model items
    with pytest.raises(zerofast.CorruptCheckpointError, match="__0_0.distcp"):
        zerofast.reconstruct(broken)
    shutil.rmtree(broken)
    broken = _copy(tmp_path)
    data = (broken / ".metadata").read_bytes().replace(b"__0_0.distcp", b"../x0.distcp")
    (broken / ".metadata").write_bytes(data)
    with pytest.raises(zerofast.UnsafeCheckpointError, match="__<rank>_<n>.distcp"):
        zerofast.reconstruct(broken)


def test_options_a_dcp_folder_cannot_honour(tmp_path):
    with pytest.raises(zerofast.UnsupportedCheckpointError, match="requires_grad"):
        zerofast.reconstruct(ensure_dcp(2), exclude_frozen=True)
    with pytest.raises(zerofast.UnsupportedCheckpointError, match="optimizer"):
        zerofast.optimizer_state(ensure_dcp(2), "exp_avg")


@pytest.mark.parametrize("size,offsets,sizes", [
    ((4, 6, 5), (1, 2, 0), (2, 3, 5)),   # a box inside: one run per (row, column) index before dim 2
    ((7, 10), (0, 4), (7, 3)),           # a column split (tensor parallel): one run per row
    ((37, 10), (30, 0), (7, 10)),        # FSDP2's dim-0 shard: one run
    ((5,), (2,), (3,)),
    ((), (), ()),                         # a 0-d tensor (step, a scalar buffer)
])
def test_box_runs_place_every_element_of_a_chunk(size, offsets, sizes):
    from zerofast.plan.dcp import box_runs

    full = torch.arange(max(1, int(torch.Size(size).numel()))).view(size)
    chunk = full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].contiguous().reshape(-1)
    runs = box_runs(0, size, offsets, sizes)
    assert sum(n for *_, n in runs) == chunk.numel()
    for src, src_off, dst, n in runs:
        assert src == 0 and torch.equal(chunk[src_off:src_off + n], full.reshape(-1)[dst:dst + n])


def test_stand_ins_keep_plain_data_only():
    from zerofast.load.dcp_stand_ins import DCP_ALLOWED
    from zerofast.load.stand_ins import RefusedState

    record = DCP_ALLOWED["torch.distributed.checkpoint.metadata.MetadataIndex"]
    index = record.__new__(record)
    index.__setstate__({"fqn": "model.w", "offset": torch.Size([0, 0]), "index": 0})
    assert index.get("fqn") == "model.w"
    for bad in ({"get": 1}, {"__class__": dict}, {"fqn": object()}, ["not", "a", "dict"]):
        with pytest.raises(RefusedState):
            record.__new__(record).__setstate__(bad)
    with pytest.raises(AttributeError):
        record.get = lambda *a: None  # the class is read-only


def test_load_into_a_fresh_model(folder):
    from tests.dsgen.dcp import DcpModel

    truth = torch.load(folder.parent / "truth.pt", weights_only=False)["model"]
    model = DcpModel()
    result = zerofast.load_into(model, folder)
    assert not result.missing_keys and not result.unexpected_keys
    for name, value in model.state_dict().items():
        assert_bitwise_equal(value, truth[name], name)


def test_a_root_of_step_folders_picks_one_like_a_tag(tmp_path):
    shutil.copytree(ensure_dcp(2), tmp_path / "step-10")
    assert "embed.weight" in zerofast.reconstruct(tmp_path, lazy=True)
    shutil.copytree(ensure_dcp(4), tmp_path / "step-20")
    with pytest.raises(zerofast.AmbiguousTagError, match="step-10"):
        zerofast.reconstruct(tmp_path)
    assert main(["inspect", str(tmp_path), "--tag", "step-20", "--json"]) == 0


def test_verify_and_diff_take_dcp_folders(tmp_path):
    two, four = ensure_dcp(2), ensure_dcp(4)
    assert zerofast.verify(two).ok
    assert main(["export", str(two), str(tmp_path / "hf"), "--dtype", "keep", "--quiet"]) == 0
    assert zerofast.verify(tmp_path / "hf", against=two).ok
    same = zerofast.diff(two, shutil.copytree(two, tmp_path / "copy"))
    assert same.identical and len(same.equal) == 9
    other = zerofast.diff(two, four)  # two different runs (each job seeds its own batches)
    assert not other.only_a and not other.only_b and other.changed


def test_links_are_followed_where_discovery_allows_them(tmp_path):
    """A DCP folder whose files are links: inside the folder they are followed; out of it they
    are refused unless follow_symlinks (the Hub cache links every file into blobs/)."""
    want = zerofast.reconstruct(ensure_dcp(2))
    inside, outside = _copy(tmp_path / "in"), _copy(tmp_path / "out")
    (inside / "blobs").mkdir()
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    for name in (".metadata", "__0_0.distcp"):
        (inside / name).rename(inside / "blobs" / name)
        (inside / name).symlink_to(inside / "blobs" / name)
        (outside / name).rename(blobs / name)
        (outside / name).symlink_to(blobs / name)
    for folder, options in ((inside, {}), (outside, {"follow_symlinks": True})):
        got = zerofast.reconstruct(folder, **options)
        assert list(got) == list(want)
        for name in want:
            assert_bitwise_equal(got[name], want[name], name)
    with pytest.raises(zerofast.UnsafeCheckpointError, match="is a symbolic link"):
        zerofast.reconstruct(outside)
