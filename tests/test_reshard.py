"""zerofast.reshard and zerofast.to_universal, judged by real DeepSpeed 0.19.8 resuming the result.

Sources: real ZeRO 1/2/3 saves at world size 4 (bf16, frozen params, tied weights, 2 param
groups, int/bool/float buffers, a WarmupLR scheduler), each with DeepSpeed's own ground truth
taken in the training run. Every output is loaded by a torchrun job at the new world size with a
plain ``engine.load_checkpoint`` (``load_universal`` for universal checkpoints), which checks
masters, Adam moments, frozen params, buffers, steps and the scheduler bit for bit and trains one
more step (tests/dsgen/resume.py). One job per world size keeps the runs few.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

import zerofast
from zerofast.cli import main
from zerofast.writers.reshard import reshard
from zerofast.writers.universal import LATEST, to_universal, universal_module_state

from tests.conftest import needs_deepspeed
from tests.dsgen.catalog import REPO_ROOT, not_ours
from tests.helpers import assert_bitwise_equal, real_root, real_truth

SOURCES = {1: "s1_bf16_w4_resume", 2: "s2_bf16_w4_resume", 3: "s3_bf16_w4_resume"}
# More variants from the catalog, resharded to one other size each and resumed in the same jobs:
# the BF16_Optimizer wrapper, CPU offload, stage-3 sub-groups (re-split at the new size), fp32,
# three param groups, empty parameters, and stage 0 (its copy with the world size rewritten).
VARIANTS = {2: ["s3_bf16_w4_offload", "s3_fp32_w3_3groups_subgroups", "s1_fp32_w3"],
            3: ["s1_bf16_w2_fp32accum", "s2_bf16_w2_offload", "s2_fp32_w4_odd_3groups", "s0_bf16_w2"]}
RESUME = REPO_ROOT / "tests" / "dsgen" / "resume.py"
KEYS = ("exp_avg", "exp_avg_sq")

pytestmark = needs_deepspeed


def _model_states_name(stage: int) -> str:
    return "zero_pp_rank_0_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt"


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """stage -> {"w2", "w3", "w4" (from the w3 output), "universal"} folders."""
    base = tmp_path_factory.mktemp("reshard")
    out = {}
    for stage, layout in SOURCES.items():
        root = real_root(layout)
        w2 = base / f"s{stage}_w2"
        w3 = base / f"s{stage}_w3"
        w4 = base / f"s{stage}_w4"
        reshard(root, w2, 2)
        reshard(root, w3, 3)
        reshard(w3, w4, 4)
        universal = to_universal(root, base / f"s{stage}_universal" / "global_step3")
        torch.save(universal_module_state(universal), base / f"s{stage}_universal" / "module_state.pt")
        out[stage] = {"w2": w2, "w3": w3, "w4": w4, "universal": universal.parent}
    for world, layouts in VARIANTS.items():
        for layout in layouts:
            out[layout] = reshard(real_root(layout), base / f"{layout}_w{world}", world).parent
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _resume(tmp_path, world: int, cases: list[dict]) -> dict:
    job = tmp_path / f"job_w{world}.json"
    result = tmp_path / f"result_w{world}.json"
    job.write_text(json.dumps({"result": str(result), "cases": cases}))
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    for _attempt in range(3):  # again only where not_ours: the port taken, the rendezvous failed
        result.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_addr",
               "127.0.0.1", "--master_port", str(_free_port()), str(RESUME), str(job)]
        proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode == 0 or not not_ours(proc.stdout + proc.stderr):
            break
    assert proc.returncode == 0 and result.is_file(), (proc.stdout + proc.stderr)[-6000:]
    return json.loads(result.read_text())


def _case(layout: str, ckpt, world: int, universal: bool = False) -> dict:
    root = real_root(layout)
    truth = real_truth(layout)
    stage = truth["stage"]
    case = {"name": f"{layout}_{'universal' if universal else 'reshard'}_w{world}",
            "spec": {**truth["spec"], "world_size": world}, "ckpt": str(ckpt), "truth": str(root / "ground_truth.pt"),
            "source_model_states": str(root / truth["tag"] / _model_states_name(stage))}
    if universal:
        case.update(universal=True, restore_module=str(ckpt / "module_state.pt"))
    return case


@pytest.mark.parametrize("world", [2, 3, 4])
def test_deepspeed_resumes_at_the_new_world_size(outputs, tmp_path, world):
    """Reshard 4 -> 2, 4 -> 3 and 3 -> 4 (from the 4 -> 3 output); universal loaded at 2 and 3."""
    cases = [_case(layout, outputs[stage][f"w{world}"], world) for stage, layout in SOURCES.items()]
    if world in (2, 3):
        cases += [_case(layout, outputs[stage]["universal"], world, universal=True) for stage, layout in SOURCES.items()]
    cases += [_case(layout, outputs[layout], world) for layout in VARIANTS.get(world, [])]
    results = _resume(tmp_path, world, cases)
    assert set(results) == {c["name"] for c in cases}
    assert {name: errors for name, errors in results.items() if errors} == {}


@pytest.mark.parametrize("stage", sorted(SOURCES))
@pytest.mark.parametrize("world", [2, 3, 4])
def test_files_are_the_ones_deepspeed_writes(outputs, stage, world):
    tag = outputs[stage][f"w{world}"] / "global_step3"
    prefix = "bf16_"
    want = {f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(world)}
    want |= ({f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world)} if stage == 3
             else {"mp_rank_00_model_states.pt"})
    assert set(os.listdir(tag)) == want
    assert (outputs[stage][f"w{world}"] / "latest").read_text() == "global_step3"
    states = torch.load(tag / _model_states_name(stage), weights_only=False)
    assert states["dp_world_size"] == world
    optim = torch.load(tag / f"{prefix}zero_pp_rank_0_mp_rank_00_optim_states.pt", weights_only=False)
    count = optim["optimizer_state_dict"]["partition_count"]
    assert count == world or count == [world] * len(count)
    assert type(optim["optimizer_state_dict"]["zero_stage"]).__name__ == "ZeroStageEnum"


@pytest.mark.parametrize("stage", sorted(SOURCES))
def test_consolidated_values_are_unchanged(outputs, stage):
    """What zerofast reads back from each output equals DeepSpeed's truth of the original run."""
    truth = real_truth(SOURCES[stage])
    for world in (2, 3, 4):
        out = outputs[stage][f"w{world}"]
        state = zerofast.reconstruct(out, dtype=None)
        for name, value in {**truth["trainable"], **truth["frozen"], **truth["buffers"]}.items():
            assert_bitwise_equal(state[name], value, f"w{world} {name}")
        for key in KEYS:
            moments = zerofast.optimizer_state(out, key)
            for name, value in truth["optimizer_states"][key].items():
                assert_bitwise_equal(moments[name], value, f"w{world} {key} {name}")


@pytest.mark.parametrize("stage", sorted(SOURCES))
def test_universal_layout(outputs, stage):
    truth = real_truth(SOURCES[stage])
    folder = outputs[stage]["universal"] / "global_step3"
    assert (folder.parent / LATEST).read_text() == "global_step3"
    for name, value in truth["trainable"].items():
        for key, want in [("fp32", value)] + [(k, truth["optimizer_states"][k][name]) for k in KEYS]:
            got = torch.load(folder / "zero" / name / f"{key}.pt", weights_only=True)
            got = got.view(value.shape) if stage == 3 else got["param"]  # stage 3: flattened, as DeepSpeed's tool
            assert_bitwise_equal(got, want, f"{key} {name}")
        step = torch.load(folder / "zero" / name / "step.pt", weights_only=True)
        assert float(step) == truth["optimizer_step"]
    module = universal_module_state(folder)
    assert set(module) == set(truth["frozen"]) | set(truth["buffers"])
    for name, value in {**truth["frozen"], **truth["buffers"]}.items():
        assert_bitwise_equal(module[name], value, name)
    # zerofast's own universal reader sees the run's values too, frozen params and buffers included.
    state = zerofast.reconstruct(folder, dtype=None)
    for name, value in {**truth["trainable"], **truth["frozen"], **truth["buffers"]}.items():
        assert_bitwise_equal(state[name], value, f"read back {name}")


def test_stage0_is_a_copy_with_the_world_size_rewritten(tmp_path):
    root = real_root("s0_bf16_w2")
    truth = real_truth("s0_bf16_w2")
    reshard(root, tmp_path / "out", 3)
    states = torch.load(tmp_path / "out" / truth["tag"] / "mp_rank_00_model_states.pt", weights_only=False)
    assert states["dp_world_size"] == 3
    cfg = states["ds_config"]
    if "train_batch_size" in cfg:
        assert cfg["train_batch_size"] == 3 * cfg["train_micro_batch_size_per_gpu"] * cfg.get("gradient_accumulation_steps", 1)
    before = zerofast.reconstruct(root, dtype=None)
    after = zerofast.reconstruct(tmp_path / "out", dtype=None)
    assert list(after) == list(before)
    for name in before:
        assert_bitwise_equal(after[name], before[name], name)


def test_world_size_that_cannot_hold_the_partitions(tmp_path):
    root = real_root(SOURCES[1])
    with pytest.raises(zerofast.ReshardError, match="without a single element of param group"):
        reshard(root, tmp_path / "out", 100_000)
    with pytest.raises(zerofast.ReshardError, match="an int >= 1"):
        reshard(root, tmp_path / "out", 0)
    assert not (tmp_path / "out").exists()


def test_elastic_checkpoints_get_param_groups_of_params_alone(tmp_path):
    """An elastic save keeps no param groups; its universal folder gets one per flat group with
    ``params`` only, so DeepSpeed's loader keeps the engine's hyperparameters (loaded by DeepSpeed
    in tests/test_reshard_elastic.py), and every parameter's values equal the source's."""
    root = real_root("s2_fp32_w3_elastic")
    out = to_universal(root, tmp_path / "out" / "global_step3")
    groups = torch.load(out / "zero" / "optimizer_state.pt", weights_only=False)["param_groups"]
    assert groups == [{"params": [0]}, {"params": [1]}]
    got, want = zerofast.reconstruct(tmp_path / "out", dtype=None), zerofast.reconstruct(root, dtype=None)
    assert list(got) == list(want)
    for name in want:
        assert_bitwise_equal(got[name], want[name], name)


def test_output_folder_is_not_clobbered(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(zerofast.OutputExistsError):
        reshard(real_root(SOURCES[2]), out, 2)
    assert sorted(os.listdir(out)) == ["notes.txt"]


def test_rerun_replaces_its_own_output(tmp_path):
    out = tmp_path / "out"
    reshard(real_root(SOURCES[2]), out, 2)
    reshard(real_root(SOURCES[2]), out, 3)
    assert sorted(p for p in os.listdir(out / "global_step3") if "optim" in p) == [
        f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(3)]


def test_cli(tmp_path, capsys):
    root = real_root(SOURCES[3])
    assert main(["reshard", str(root), str(tmp_path / "r"), "--world-size", "2"]) == 0
    assert main(["to-universal", str(root), str(tmp_path / "u" / "global_step3")]) == 0
    assert (tmp_path / "u" / LATEST).is_file()
    assert main(["reshard", str(root), str(tmp_path / "bad"), "--world-size", "3", "--tag", "nope"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("zerofast: error:")


def test_broken_source_is_named_and_nothing_is_written(tmp_path):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(real_root(SOURCES[2]), src)
    victim = src / "global_step3" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    with pytest.raises(zerofast.CorruptCheckpointError) as e:
        reshard(src, tmp_path / "out", 2)
    assert e.value.path == str(victim)
    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")


def test_failure_while_writing_leaves_no_checkpoint(tmp_path, monkeypatch):
    from zerofast.writers import source as module

    written = []

    def failing(path, obj, skeleton, executor, advance=None):
        if len(written) == 2:
            raise zerofast.ExportError("disk full (simulated)", path)
        written.append(path)
        real(path, obj, skeleton, executor, advance)

    real = module.write_torch_file
    monkeypatch.setattr(module, "write_torch_file", failing)
    with pytest.raises(zerofast.ExportError, match="simulated"):
        reshard(real_root(SOURCES[3]), tmp_path / "out", 2)
    assert not (tmp_path / "out").exists()  # nothing put in place, and no folder this call made (issue 45)


def test_workers_share_the_files(outputs, tmp_path):
    """Two local ranks (--workers 2) write what one process writes."""
    root = real_root(SOURCES[3])
    assert main(["reshard", str(root), str(tmp_path / "r"), "--world-size", "3", "--workers", "2"]) == 0
    assert main(["to-universal", str(root), str(tmp_path / "u" / "global_step3"), "--workers", "2"]) == 0
    alone = outputs[3]["w3"]
    assert sorted(os.listdir(tmp_path / "r" / "global_step3")) == sorted(os.listdir(alone / "global_step3"))
    for name, value in zerofast.reconstruct(alone, dtype=None).items():
        assert_bitwise_equal(zerofast.reconstruct(tmp_path / "r", dtype=None)[name], value, name)
    for key in KEYS:
        want = zerofast.optimizer_state(alone, key)
        got = zerofast.optimizer_state(tmp_path / "r", key)
        for name in want:
            assert_bitwise_equal(got[name], want[name], f"{key} {name}")
    universal = outputs[3]["universal"] / "global_step3"
    files = sorted(p.relative_to(universal) for p in universal.rglob("*.pt"))
    assert sorted(p.relative_to(tmp_path / "u" / "global_step3")
                  for p in (tmp_path / "u" / "global_step3").rglob("*.pt")) == files
    for rel in files:
        if rel.parts[0] == "zero" and rel.name != "optimizer_state.pt":
            a = torch.load(universal / rel, weights_only=True)
            b = torch.load(tmp_path / "u" / "global_step3" / rel, weights_only=True)
            a, b = (a["param"], b["param"]) if isinstance(a, dict) else (a, b)
            assert_bitwise_equal(b, a, str(rel))
