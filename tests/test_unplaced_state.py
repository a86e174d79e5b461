"""Writers refuse a partitioned optimizer value they cannot place (issue 25, item 1).

Copying such a value through would give every new rank the old rank's partition: a reshard that
exits 0 with wrong optimizer state. Each case plants an extra per-element state into real suite
saves (ZeRO-1, 2 and 3, world 2, frozen params and a tied weight) and checks that reshard,
to-universal, to-dcp and export of the optimizer states all raise UnplacedOptimizerStateError naming the
key and the file, and leave no output behind. A key every rank keeps for one group, laid out like
the masters, is placed: it is carried per group, like Muon's momentum.
"""
from __future__ import annotations


import pytest
import torch

import zerofast
from zerofast.base import keys as K
from zerofast.cli import main
from zerofast.writers.reshard import reshard

from tests import planting
from tests.conftest import needs_deepspeed
from tests.helpers import assert_bitwise_equal, every_writer_refuses, real_root

SOURCES = {1: "s1_bf16_w2_frozen", 2: "s2_bf16_w2_frozen_tied", 3: "s3_bf16_w2_frozen_tied"}
KEY = "shadow_sum"

pytestmark = needs_deepspeed


def _plant(tmp_path, stage: int, ranks, length) -> tuple:
    """A copy of the stage's save with ``KEY`` in flat group 0 of ``ranks``: ``length(fp32
    partition)`` elements of arange. Returns (root, files planted)."""
    root, tag = planting.copy_checkpoint(real_root(SOURCES[stage]), tmp_path / "src")
    names = sorted(p.name for p in tag.glob("*optim_states.pt"))
    planted = []
    for r in ranks:
        path = tag / names[r]

        def edit(obj):
            osd = obj[K.OPTIMIZER_STATE_DICT]
            master = osd[K.flat_key(stage)][0]
            state = osd[K.inner_key(stage)][K.STATE]
            first = next(iter(state))  # flat group 0
            state[first][KEY] = torch.arange(length(master.numel()), dtype=torch.float32)

        planting.rewrite(path, edit)
        planted.append(path)
    return root, planted


@pytest.mark.parametrize("stage", sorted(SOURCES))
@pytest.mark.parametrize("plant", ["one_rank", "no_layout"])
def test_every_writer_refuses_a_value_it_cannot_place(tmp_path, stage, plant):
    if plant == "one_rank":  # kept by rank 1 only: the other rank has no partition of it
        root, planted = _plant(tmp_path, stage, [1], lambda n: n)
    else:  # kept by every rank, but 3 elements long: neither the masters' layout nor any other
        root, planted = _plant(tmp_path, stage, [0, 1], lambda n: 3)
    every_writer_refuses(root, tmp_path, KEY, planted)
    # Reading the states the save does keep stays possible; the planted one is refused by name.
    exp_avg = zerofast.optimizer_state(root, "exp_avg")
    assert exp_avg == {} or all(v.dtype == torch.float32 for v in exp_avg.values())
    with pytest.raises(zerofast.ZeroFastError, match=KEY):
        zerofast.optimizer_state(root, KEY)


def test_cli_prints_one_line_and_fails(tmp_path, capsys):
    root, _ = _plant(tmp_path, 2, [1], lambda n: n)
    assert main(["reshard", str(root), str(tmp_path / "out"), "--world-size", "3"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("zerofast: error:") and KEY in err, err


@pytest.mark.parametrize("stage", sorted(SOURCES))
def test_a_key_of_one_group_is_carried_per_group(tmp_path, stage):
    """Every rank keeps ``KEY`` for flat group 0 only, laid out like the masters: it is read for
    the parameters of that group alone, and reshard and export carry it there."""
    root, _ = _plant(tmp_path, stage, [0, 1], lambda n: n)
    before = zerofast.optimizer_state(root, KEY)
    adam = zerofast.optimizer_state(root, "exp_avg")
    assert before and set(before) <= set(adam)
    out = reshard(root, tmp_path / "out", 3).parent
    after = zerofast.optimizer_state(out, KEY)
    assert list(after) == list(before)
    for name, value in before.items():
        assert_bitwise_equal(after[name], value, name)
    for name, value in zerofast.optimizer_state(out, "exp_avg").items():
        assert_bitwise_equal(value, adam[name], name)
    zerofast.export(root, tmp_path / "export", optimizer_states=True)
    from safetensors.torch import load_file

    exported = load_file(tmp_path / "export" / "optimizer.safetensors")
    assert {n.rsplit(".", 1)[0] for n in exported if n.endswith(f".{KEY}")} == set(before)
    for name, value in before.items():
        assert_bitwise_equal(exported[f"{name}.{KEY}"], value, name)
