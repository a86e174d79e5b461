"""Layouts of the checkpoint families beyond plain data parallelism (train_families.py makes them).

Keys as in catalog.LAYOUTS, plus ``family`` ("moe" | "pipe" | "autotp" | "megatron"), ``ep``
(expert-parallel degree), ``pp`` (pipeline stages) and ``tp`` (AutoTP degree, which needs
transformers; or the Megatron tensor-parallel degree). catalog.ensure_checkpoint generates and caches
them like the others; the "megatron" family is made by train_megatron.py (a Megatron-DeepSpeed-style
GPT with an ``mpu``, TP x DP, no Megatron installed).

:data:`MEGATRON_VARIANTS` are Megatron saves that zerofast must refuse, or read only when asked, or
that are written as Megatron-DeepSpeed itself writes them (drifted replicated copies, averaged
parameters, no ``universal_checkpoint_info``, Megatron's nested module and client state; see
train_megatron.py's docstring). They are kept out of :data:`FAMILY_LAYOUTS`, which
tests/test_families.py, tests/test_verify.py and tests/test_lazy_batched.py read as "every save
here reconstructs"; :func:`ensure_megatron_variant` generates and caches them as
``catalog.ensure_checkpoint`` does the others (same cache, lock and key scheme).
"""
from __future__ import annotations

from pathlib import Path

FAMILY_LAYOUTS: dict[str, dict] = {
    # -- mixture of experts: 2 MoE layers (4 and 2 experts), ep 2 --
    "moe_s0_bf16_w2_ep2": {"family": "moe", "stage": 0, "world_size": 2, "dtype": "bf16", "ep": 2},
    "moe_s1_bf16_w4_ep2": {"family": "moe", "stage": 1, "world_size": 4, "dtype": "bf16", "ep": 2},
    "moe_s2_bf16_w2_ep2": {"family": "moe", "stage": 2, "world_size": 2, "dtype": "bf16", "ep": 2},
    "moe_s2_fp32_w4_ep2": {"family": "moe", "stage": 2, "world_size": 4, "dtype": "fp32", "ep": 2},
    # -- pipeline: 6 layers on 2 stages, embedding tied to the head across the stages --
    "pipe_s1_bf16_pp2_dp1": {"family": "pipe", "stage": 1, "world_size": 2, "dtype": "bf16", "pp": 2},
    "pipe_s1_bf16_pp2_dp2": {"family": "pipe", "stage": 1, "world_size": 4, "dtype": "bf16", "pp": 2},
    "pipe_s1_bf16_pp2_dp1_fp32accum": {
        "family": "pipe", "stage": 1, "world_size": 2, "dtype": "bf16", "pp": 2,
        "ds_config": {"data_types": {"grad_accum_dtype": "fp32"}},
    },
    "pipe_s0_fp32_pp2_dp2": {"family": "pipe", "stage": 0, "world_size": 4, "dtype": "fp32", "pp": 2},
    # -- AutoTP on a tiny transformers Llama: tp 2 --
    "autotp_s1_bf16_w2_tp2": {"family": "autotp", "stage": 1, "world_size": 2, "dtype": "bf16", "tp": 2},
    "autotp_s2_bf16_w4_tp2": {"family": "autotp", "stage": 2, "world_size": 4, "dtype": "bf16", "tp": 2},
    "autotp_s3_bf16_w4_tp2": {"family": "autotp", "stage": 3, "world_size": 4, "dtype": "bf16", "tp": 2},
    # frozen column-, row-parallel and replicated parameters: each tp rank holds its shard
    "autotp_s2_bf16_w4_tp2_frozen": {"family": "autotp", "stage": 2, "world_size": 4, "dtype": "bf16", "tp": 2,
                                     "frozen": True},
    # -- Megatron-DeepSpeed-style GPT, --no-pipeline-parallel: tp 2 (global rank = dp * 2 + tp) --
    "megatron_s1_bf16_tp2_dp2": {"family": "megatron", "stage": 1, "world_size": 4, "dtype": "bf16", "tp": 2},
    "megatron_s2_bf16_tp2_dp2": {"family": "megatron", "stage": 2, "world_size": 4, "dtype": "bf16", "tp": 2},
    "megatron_s1_fp32_tp2_dp1": {"family": "megatron", "stage": 1, "world_size": 2, "dtype": "fp32", "tp": 2},
    "megatron_s3_bf16_tp2_dp2": {"family": "megatron", "stage": 3, "world_size": 4, "dtype": "bf16", "tp": 2},
}

# DeepSpeed AutoEP (expert_parallel.autoep_size) on a tiny transformers Qwen3-MoE (train_autoep.py): kept
# out of FAMILY_LAYOUTS (tests/test_autoep.py reads them; the ZeRO-off and ZeRO-3 saves are refused)
AUTOEP_LAYOUTS: dict[str, dict] = {
    "autoep_s1_bf16_w2_ep2_frozen": {"family": "autoep", "stage": 1, "world_size": 2, "dtype": "bf16", "ep": 2,
                                     "frozen": True},
    "autoep_s2_bf16_w4_ep2": {"family": "autoep", "stage": 2, "world_size": 4, "dtype": "bf16", "ep": 2},
    "autoep_s0_bf16_w2_ep2": {"family": "autoep", "stage": 0, "world_size": 2, "dtype": "bf16", "ep": 2},
    "autoep_s3_bf16_w2_ep2": {"family": "autoep", "stage": 3, "world_size": 2, "dtype": "bf16", "ep": 2},
    # ZeRO-3 with expert-data-parallel 2: each ep rank's experts partitioned over two ranks
    "autoep_s3_bf16_w4_ep2": {"family": "autoep", "stage": 3, "world_size": 4, "dtype": "bf16", "ep": 2},
}

# Megatron-DeepSpeed's MoE GPT (train_megatron_moe.py): the GPT of train_megatron.py with a native
# deepspeed.moe.layer.MoE as its second layer's MLP, tp 2 (an mpu), world 4. Kept out of FAMILY_LAYOUTS
# (tests/test_megatron_moe.py reads them). expert_tp: the experts are tensor-parallel too (their
# groups made from the mpu); without it, whole experts over expert groups of the global ranks.
_MOE_TP2 = {"family": "megatron_moe", "world_size": 4, "dtype": "bf16", "tp": 2}
MEGATRON_MOE_LAYOUTS: dict[str, dict] = {
    "megatron_moe_s1_bf16_tp2_ep2_expert_tp": {**_MOE_TP2, "stage": 1, "ep": 2, "expert_tp": True},
    # a frozen dense row-parallel weight and every expert's dense_h_to_4h.weight
    "megatron_moe_s2_bf16_tp2_ep2_expert_tp_frozen": {**_MOE_TP2, "stage": 2, "ep": 2, "expert_tp": True,
                                                      "frozen": True},
    "megatron_moe_s2_bf16_tp2_ep2_frozen": {**_MOE_TP2, "stage": 2, "ep": 2, "expert_tp": False, "frozen": True},
    # ep 1: every expert on every rank, its group partitioned over all four ranks (across the tp ranks).
    # DeepSpeed writes no mp_rank_01_model_states.pt here (tp rank 1's writer is not expert-data-parallel
    # rank 0): zerofast refuses it, naming the missing file
    "megatron_moe_s1_bf16_tp2_ep1_frozen": {**_MOE_TP2, "stage": 1, "ep": 1, "expert_tp": False, "frozen": True},
}

_TP2_DP2 = {"family": "megatron", "world_size": 4, "dtype": "bf16", "tp": 2}
MEGATRON_VARIANTS: dict[str, dict] = {
    # the replicated layer norms and row-parallel biases differ between the tp ranks
    "megatron_s2_bf16_tp2_dp2_drift": {**_TP2_DP2, "stage": 2, "drift": True},
    "megatron_s3_bf16_tp2_dp2_drift": {**_TP2_DP2, "stage": 3, "drift": True},
    # the same drift, named in parameter_to_average_patterns
    "megatron_s1_bf16_tp2_dp2_average": {**_TP2_DP2, "stage": 1, "drift": True, "average": True},
    # no universal_checkpoint_info in the client state
    "megatron_s1_fp32_tp2_dp1_no_info": {"family": "megatron", "stage": 1, "world_size": 2, "dtype": "fp32",
                                         "tp": 2, "universal_checkpoint_info": False},
    # saved as Megatron-DeepSpeed's save_checkpoint saves (nested module, args, rng_state)
    "megatron_s1_bf16_tp2_dp2_megatron_save": {**_TP2_DP2, "stage": 1, "megatron_save": True},
    "megatron_s3_bf16_tp2_dp2_megatron_save": {**_TP2_DP2, "stage": 3, "megatron_save": True},
    # a frozen parameter of each tensor-parallel kind: each tp rank's model states hold its shard
    "megatron_s1_bf16_tp2_dp2_frozen": {**_TP2_DP2, "stage": 1, "frozen": True},
    "megatron_s2_bf16_tp2_dp2_frozen": {**_TP2_DP2, "stage": 2, "frozen": True},
    # SwiGLU's dense_h_to_4h under parameter_with_sub_params (universal version 0.4, shard widths)
    "megatron_s1_bf16_tp2_dp2_sub_params": {**_TP2_DP2, "stage": 1, "sub_params": True},
}


def ensure_megatron_variant(name: str) -> Path:
    """The cached root of :data:`MEGATRON_VARIANTS` ``name`` (made on first use), by the catalog."""
    from tests.dsgen import catalog  # catalog imports this module

    if name not in MEGATRON_VARIANTS:
        raise KeyError(f"unknown Megatron variant {name!r}; known: {sorted(MEGATRON_VARIANTS)}")
    return catalog.ensure_checkpoint(name)

# A PipelineModule with a deepspeed.moe.layer.MoE in each of its 2 stages (train_moe_pipe.py), world 4:
# dp 2 per stage, ep 2. Kept out of FAMILY_LAYOUTS (tests/test_moe_pipe.py reads them).
MOE_PIPE_LAYOUTS: dict[str, dict] = {
    "moe_pipe_s1_bf16_pp2_dp2_ep2": {"family": "moe_pipe", "stage": 1, "world_size": 4, "dtype": "bf16", "pp": 2,
                                     "ep": 2},
}
