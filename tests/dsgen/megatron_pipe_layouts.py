"""Layouts of Megatron-DeepSpeed's tensor x pipeline parallel training (train_megatron_pipe.py makes them).

Keys as in catalog.LAYOUTS, plus ``family`` ("megatron_pipe"), ``tp`` (tensor-parallel degree) and ``pp``
(pipeline stages); the data-parallel degree is ``world_size // (tp * pp)``. catalog.ensure_checkpoint
generates and caches them like the others (the key hashes train_megatron_pipe.py, train_megatron.py,
train.py and this file). Kept out of families.FAMILY_LAYOUTS, which other tests read as "every save
here reconstructs"; tests/test_megatron_pipe.py judges them. No DeepSpeed import here.
"""
from __future__ import annotations

MEGATRON_PIPE_LAYOUTS: dict[str, dict] = {
    # ZeRO 1, bf16: [bf16_]zero_pp_rank files per (stage, tp rank), the masters in flat groups
    "megatron_pipe_s1_bf16_tp2_pp2": {"family": "megatron_pipe", "stage": 1, "world_size": 4, "dtype": "bf16",
                                      "tp": 2, "pp": 2},
    # ZeRO off, fp32: no optimizer files; the values only in the layer files, the torch optimizer's
    # state in each mp_rank file's ``optimizer``
    "megatron_pipe_s0_fp32_tp2_pp2": {"family": "megatron_pipe", "stage": 0, "world_size": 4, "dtype": "fp32",
                                      "tp": 2, "pp": 2},
    # ZeRO 1 with a frozen parameter of each tensor-parallel kind in the first layer: each tp rank's
    # layer files hold its shard (tests/test_megatron_frozen.py; the other pipe tests leave it out)
    "megatron_pipe_s1_bf16_tp2_pp2_frozen": {"family": "megatron_pipe", "stage": 1, "world_size": 4,
                                             "dtype": "bf16", "tp": 2, "pp": 2, "frozen": True},
}
