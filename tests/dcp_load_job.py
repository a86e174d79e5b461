"""A gloo job (run under torchrun) that resumes from DCP folders written by ``zerofast.to_dcp``.

    python -m torch.distributed.run --nproc_per_node W tests/dcp_load_job.py CASES.json

CASES.json is a list of ``{"dcp": folder, "truth": ground_truth.pt, "name": layout}``. For each
case the job builds the fp32 model, shards it with FSDP2 (``fully_shard`` on a CPU mesh), builds
AdamW over DeepSpeed's param groups, loads with ``dcp.load`` plus ``set_state_dict``, and checks
bit for bit against DeepSpeed's ground truth: weights (frozen ones and buffers under the fp32
policy), Adam's moments and ``step``. Then it runs one more optimizer step. Any mismatch raises,
so the job fails; rank 0 prints ``checked <name>`` per case.
"""
import importlib.util
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, get_state_dict, set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

HERE = Path(__file__).resolve().parent


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


models = _load("zf_dcp_models", HERE / "dsgen" / "models.py")
helpers = _load("zf_dcp_helpers", HERE / "helpers.py")
gloo_job = _load("zf_dcp_gloo_job", HERE / "dsgen" / "gloo_job.py")


def build(truth: dict, mesh):
    """The model as DeepSpeed trained it (fp32 here), sharded with FSDP2, and AdamW over the same
    groups (DeepSpeed's config: lr 1e-2, betas (0.9, 0.99))."""
    model = models.build_model(truth["spec"].get("model"))
    for block in [*model.blocks, model.lora, model.odd]:
        if block is not None:
            fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    trainable = {n for g in truth["param_groups"] for n in g}
    named = dict(model.named_parameters())
    groups = models.param_groups(model, len(truth["param_groups"]))
    for group, names in zip(groups, truth["param_groups"]):
        group["params"] = [named[n] for n in names]
    assert {n for n, p in named.items() if p.requires_grad} == trainable
    return model, torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.99))


def check(model, optim, truth: dict, rank: int) -> None:
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd = get_model_state_dict(model, options=full)
    osd = get_optimizer_state_dict(model, optim, options=full)
    if rank != 0:
        return
    want = {**truth["trainable"], **truth["frozen"], **truth["buffers"]}
    want.update({alias: want[source] for alias, source in truth["tied"].items()})
    assert sorted(msd) == sorted(want), (sorted(msd), sorted(want))
    for name, value in want.items():
        helpers.assert_bitwise_equal(msd[name], helpers.expected_value(value, torch.float32), name)
    assert sorted(osd["state"]) == sorted(truth["trainable"]), sorted(osd["state"])
    for key, values in truth["optimizer_states"].items():
        for name, value in values.items():
            helpers.assert_bitwise_equal(osd["state"][name][key], value, f"{name}.{key}")
    for name, state in osd["state"].items():
        step = torch.tensor(truth["optimizer_step"], dtype=torch.float32)
        helpers.assert_bitwise_equal(state["step"], step, f"{name}.step")


def one_more_step(model, optim, truth: dict) -> None:
    before = {n: p.detach().full_tensor().clone() for n, p in model.named_parameters() if p.requires_grad}
    gen = torch.Generator().manual_seed(7)
    vocab = models.model_kwargs(truth["spec"].get("model"))["vocab"]
    ids, targets = (torch.randint(0, vocab, (2, 6), generator=gen) for _ in range(2))
    model(ids, targets).backward()
    optim.step()
    after = {n: p.detach().full_tensor() for n, p in model.named_parameters() if p.requires_grad}
    assert all(torch.isfinite(v).all() for v in after.values())
    assert any(not torch.equal(before[n], after[n]) for n in before), "the step changed nothing"
    steps = {float(s["step"]) for s in optim.state.values()}
    assert steps == {truth["optimizer_step"] + 1}, steps


def main() -> None:
    # Every rank done before any tears gloo down (the helper's barrier): a rank still inside a
    # collective when its peer closes the connection dies with "terminate called without an active
    # exception" (seen once in a clean-clone run, after every check had passed).
    with gloo_job.process_group():
        rank = dist.get_rank()
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for case in json.loads(Path(sys.argv[1]).read_text()):
            truth = torch.load(case["truth"], weights_only=True)
            model, optim = build(truth, mesh)
            msd, osd = get_state_dict(model, optim)
            state = {"model": msd, "optim": osd}
            dcp.load(state, checkpoint_id=case["dcp"])
            set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
            check(model, optim, truth, rank)
            one_more_step(model, optim, truth)
            if rank == 0:
                print(f"checked {case['name']}", flush=True)


if __name__ == "__main__":
    main()
    gloo_job.exit_now()  # torn down and written: no finalization (tests/dsgen/gloo_job.py)
