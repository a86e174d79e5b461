"""``zerofast.to_dcp`` / ``zerofast to-dcp``: real DeepSpeed 0.19.8 checkpoints written as PyTorch
Distributed Checkpoint folders, resumed by an FSDP2 gloo job at world 2 and 3 (tests/dcp_load_job.py)
and judged against DeepSpeed's own ground truth."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zerofast
from zerofast.cli import main

from tests.conftest import needs_deepspeed
from tests.dsgen.catalog import not_ours
from tests.helpers import assert_bitwise_equal, expected_value, real_root, real_truth

pytestmark = needs_deepspeed

REPO_ROOT = Path(__file__).resolve().parent.parent
JOB = Path(__file__).resolve().parent / "dcp_load_job.py"
# ZeRO-1/2/3, all with frozen params and a tied embedding; stages 2 and 3 with two param groups.
LAYOUTS = ["s1_bf16_w2_frozen", "s2_bf16_w2_frozen_tied", "s3_bf16_w2_frozen_tied"]


def _torch_save_of(folder: Path, tmp: Path) -> dict:
    """What torch's own converter reads out of a DCP folder."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / f"{folder.name}.pt"
    dcp_to_torch_save(folder, out)
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("to_dcp")
    return {name: zerofast.to_dcp(real_root(name), base / name).out_dir for name in LAYOUTS}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp2_job_resumes_bit_for_bit(written, tmp_path, world):
    cases = [{"name": name, "dcp": str(folder), "truth": str(real_root(name) / "ground_truth.pt")}
             for name, folder in written.items()]
    job = tmp_path / "cases.json"
    job.write_text(json.dumps(cases))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for _attempt in range(3):  # again only where not_ours: the port taken, the rendezvous failed
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_addr",
               "127.0.0.1", "--master_port", str(_free_port()), str(JOB), str(job)]
        proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
        output = proc.stdout + proc.stderr
        if proc.returncode == 0 or not not_ours(output):
            break
    assert proc.returncode == 0, output[-6000:]
    assert [ln for ln in proc.stdout.splitlines() if ln.startswith("checked ")] == [f"checked {n}" for n in LAYOUTS]


def test_contents_are_the_state_dict_and_optimizer_state(written, tmp_path):
    name = "s3_bf16_w2_frozen_tied"
    truth = real_truth(name)
    got = _torch_save_of(written[name], tmp_path)
    model = got["model"]
    assert list(model) == truth["state_dict_keys"]
    want = {**truth["trainable"], **truth["frozen"], **truth["buffers"]}
    for key in model:
        assert_bitwise_equal(model[key], expected_value(want[truth["tied"].get(key, key)], torch.float32), key)
    state = got["optim"]["state"]
    assert list(state) == [n for n in truth["state_dict_keys"] if n in truth["trainable"]]
    for key, values in truth["optimizer_states"].items():
        for param, value in values.items():
            assert_bitwise_equal(state[param][key], value, f"{param}.{key}")
    groups = got["optim"]["param_groups"]
    assert [sorted(g["params"]) for g in groups] == [sorted(g) for g in truth["param_groups"]]
    assert groups[0]["betas"] == (0.9, 0.99) and groups[1]["weight_decay"] == 0.0


def test_dtype_policy_and_weights_only(tmp_path):
    name = "s2_bf16_w2_frozen_tied"
    truth = real_truth(name)
    result = zerofast.to_dcp(real_root(name), tmp_path / "bf16", dtype=torch.bfloat16, optimizer=False)
    got = _torch_save_of(result.out_dir, tmp_path)
    assert set(got) == {"model"}
    assert_bitwise_equal(got["model"]["embed.weight"], truth["trainable"]["embed.weight"].to(torch.bfloat16))
    kept = _torch_save_of(zerofast.to_dcp(real_root(name), tmp_path / "keep", dtype=None).out_dir, tmp_path)
    frozen = next(iter(truth["frozen"]))
    assert_bitwise_equal(kept["model"][frozen], truth["frozen"][frozen])  # bf16, as stored


def test_cli_and_the_output_folder_transaction(tmp_path, capsys):
    root = real_root("s2_bf16_w2_frozen_tied")
    out = tmp_path / "out"
    assert main(["to-dcp", str(root), str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    names = sorted(p.name for p in out.iterdir())
    data = [f"__0_{n}.distcp" for n in range(len(names) - 2)]  # the small items, then one per tensor
    assert names[:2] == [".cache", ".metadata"] and sorted(names[2:]) == sorted(data) and len(data) > 2
    assert main(["to-dcp", str(root), str(out), "--no-optimizer"]) == 0  # our own folder: rewritten
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    assert main(["to-dcp", str(root), str(foreign)]) == 1
    assert "zerofast did not write" in capsys.readouterr().err
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]


def test_stage0_has_no_partitioned_optimizer_state(tmp_path):
    with pytest.raises(zerofast.UnsupportedCheckpointError, match="stage 0"):
        zerofast.to_dcp(real_root("s0_bf16_w2"), tmp_path / "out")
    assert not (tmp_path / "out" / ".metadata").exists()
    result = zerofast.to_dcp(real_root("s0_bf16_w2"), tmp_path / "out", optimizer=False)
    assert (result.out_dir / ".metadata").is_file()


def test_every_catalog_layout(real_ckpt, tmp_path):
    """The weights equal reconstruct's and the moments DeepSpeed's own, at every stage and layout
    of the catalog; saves without what get_state_dict's layout needs are refused, nothing written."""
    name, root, truth = real_ckpt
    elastic = truth["spec"].get("ds_config", {}).get("zero_optimization", {}).get("elastic_checkpoint")
    if truth["stage"] == 0 or elastic:
        with pytest.raises(zerofast.UnsupportedCheckpointError, match="stage 0|no param groups"):
            zerofast.to_dcp(root, tmp_path / "out")
        assert not (tmp_path / "out" / ".metadata").exists()
        return
    got = _torch_save_of(zerofast.to_dcp(root, tmp_path / "out").out_dir, tmp_path)
    want = zerofast.reconstruct(root)
    assert list(got["model"]) == list(want)
    for key, value in want.items():
        assert_bitwise_equal(got["model"][key], value, key)
    for key, values in truth["optimizer_states"].items():
        for param, value in values.items():
            assert_bitwise_equal(got["optim"]["state"][param][key], value, f"{param}.{key}")


def test_a_write_error_is_one_export_error_and_nothing_is_put_in_place(tmp_path, monkeypatch):
    import errno

    from zerofast.writers import dcp_storage

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dcp_storage, "index_archive", full_disk)
    out = tmp_path / "out"
    with pytest.raises(zerofast.ExportError, match="No space left on device"):
        zerofast.to_dcp(real_root("s2_bf16_w2_frozen_tied"), out)
    assert not out.exists()  # no file under a final name, no temporary folder, no folder this call made
