"""Layouts of the checkpoint families beyond plain data parallelism (train_families.py makes them).

Keys as in catalog.LAYOUTS, plus ``family`` ("moe" | "pipe" | "autotp" | "megatron"), ``ep``
(expert-parallel degree), ``pp`` (pipeline stages) and ``tp`` (AutoTP degree, which needs
transformers; or the Megatron tensor-parallel degree). catalog.ensure_checkpoint generates and caches
them like the others; the "megatron" family is made by train_megatron.py (a Megatron-DeepSpeed-style
GPT with an ``mpu``, TP x DP, no Megatron installed).
"""
from __future__ import annotations

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
    # -- Megatron-DeepSpeed-style GPT, --no-pipeline-parallel: tp 2 (global rank = dp * 2 + tp) --
    "megatron_s1_bf16_tp2_dp2": {"family": "megatron", "stage": 1, "world_size": 4, "dtype": "bf16", "tp": 2},
    "megatron_s2_bf16_tp2_dp2": {"family": "megatron", "stage": 2, "world_size": 4, "dtype": "bf16", "tp": 2},
    "megatron_s1_fp32_tp2_dp1": {"family": "megatron", "stage": 1, "world_size": 2, "dtype": "fp32", "tp": 2},
    "megatron_s3_bf16_tp2_dp2": {"family": "megatron", "stage": 3, "world_size": 4, "dtype": "bf16", "tp": 2},
}
