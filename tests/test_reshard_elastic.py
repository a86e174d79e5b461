"""Reshard of elastic_checkpoint saves (issue 25, item 4), judged by DeepSpeed loading the result.

An elastic save keeps, per rank, a list of one lean optimizer state per param group (the rank's
share of the group padding stripped) instead of the torch optimizer's state_dict(). reshard
writes that layout at the new size; DeepSpeed 0.19.8 loads it at that size with a plain
``engine.load_checkpoint`` and gives back the run's masters, Adam moments, steps, frozen params
and buffers bit for bit, then trains a step (tests/dsgen/resume.py). to-universal of the same saves is loaded with
``load_universal`` at those sizes in the same jobs: an elastic save keeps no param groups, so the
universal folder's groups hold ``params`` only and the loading engine keeps its hyperparameters,
as DeepSpeed's own elastic resume does.
"""
from __future__ import annotations

import pytest
import torch

import zerofast
from zerofast.writers.reshard import reshard
from zerofast.writers.universal import to_universal, universal_module_state

from tests.conftest import needs_deepspeed
from tests.helpers import assert_bitwise_equal, real_root, real_truth
from tests.test_reshard import _case, _resume

# layout -> the world sizes it is resharded to (the resume jobs run at 2 and 4 ranks).
ELASTIC = {"s2_fp32_w3_elastic": [2, 4], "s1_bf16_w2_elastic": [4]}
KEYS = ("exp_avg", "exp_avg_sq")

pytestmark = needs_deepspeed


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    base = tmp_path_factory.mktemp("elastic")
    return {(layout, world): reshard(real_root(layout), base / f"{layout}_w{world}", world).parent
            for layout, worlds in ELASTIC.items() for world in worlds}


@pytest.fixture(scope="module")
def universals(tmp_path_factory):
    base = tmp_path_factory.mktemp("elastic_universal")
    out = {}
    for layout in ELASTIC:
        folder = to_universal(real_root(layout), base / layout / real_truth(layout)["tag"]).parent
        torch.save(universal_module_state(folder / real_truth(layout)["tag"]), folder / "module_state.pt")
        out[layout] = folder
    return out


@pytest.mark.parametrize("layout,world", [(l, w) for l, ws in ELASTIC.items() for w in ws])
def test_written_elastic_at_the_new_size(outputs, layout, world):
    out = outputs[(layout, world)]
    truth = real_truth(layout)
    tag = out / truth["tag"]
    for r in range(world):
        optim = torch.load(tag / f"{'bf16_' if truth['spec']['dtype'] == 'bf16' else ''}zero_pp_rank_{r}_mp_rank_00"
                           "_optim_states.pt", weights_only=False)["optimizer_state_dict"]
        base = optim["base_optimizer_state"]
        assert isinstance(base, list) and len(base) == len(optim["single_partition_of_fp32_groups"])
        for state, master in zip(base, optim["single_partition_of_fp32_groups"]):
            assert all(state[k].shape == master.shape for k in KEYS)  # lean: no padding, like the masters
    state = zerofast.reconstruct(out, dtype=None)
    for name, value in {**truth["trainable"], **truth["frozen"], **truth["buffers"]}.items():
        assert_bitwise_equal(state[name], value, name)
    for key in KEYS:
        got = zerofast.optimizer_state(out, key)
        for name, value in truth["optimizer_states"][key].items():
            assert_bitwise_equal(got[name], value, f"{key} {name}")


@pytest.mark.parametrize("world", [2, 4])
def test_deepspeed_resumes_at_the_new_size(outputs, universals, tmp_path, world):
    cases = [_case(layout, outputs[(layout, w)], w) for (layout, w) in outputs if w == world]
    cases += [_case(layout, folder, world, universal=True) for layout, folder in universals.items()]
    results = _resume(tmp_path, world, cases)
    assert set(results) == {c["name"] for c in cases}
    assert {name: errors for name, errors in results.items() if errors} == {}
