"""Megatron-DeepSpeed-style tensor-parallel saves (TP x DP, an ``mpu``, no Megatron installed) that
real DeepSpeed 0.19.8 wrote on the CPU (tests/dsgen/train_megatron.py): the generator's own
invariants. The files are named and shaped as a Megatron-DeepSpeed save, the ground truth holds the
full (vocabulary-trimmed) tensors, and DeepSpeed's own ds_to_universal, where it ran on the save,
gives the same full tensors bit for bit."""
from __future__ import annotations

import os

import pytest
import torch

from tests.conftest import needs_deepspeed
from tests.dsgen.families import FAMILY_LAYOUTS
from tests.helpers import real_root, real_truth

pytestmark = needs_deepspeed

MEGATRON = sorted(n for n, s in FAMILY_LAYOUTS.items() if s["family"] == "megatron")
KEYS = ("exp_avg", "exp_avg_sq")

VOCAB, PADDED_VOCAB, HIDDEN, FFN, MAX_POS = 21, 24, 8, 12, 8


def _full_shapes() -> dict:
    """Megatron-DeepSpeed GPT names (``--no-pipeline-parallel``) -> full shape, the vocabulary trimmed."""
    shapes = {"language_model.embedding.word_embeddings.weight": (VOCAB, HIDDEN),
              "language_model.embedding.position_embeddings.weight": (MAX_POS, HIDDEN)}
    for i in range(2):
        layer = f"language_model.encoder.layers.{i}."
        shapes.update({
            layer + "input_layernorm.weight": (HIDDEN,), layer + "input_layernorm.bias": (HIDDEN,),
            layer + "self_attention.query_key_value.weight": (3 * HIDDEN, HIDDEN),
            layer + "self_attention.query_key_value.bias": (3 * HIDDEN,),
            layer + "self_attention.dense.weight": (HIDDEN, HIDDEN), layer + "self_attention.dense.bias": (HIDDEN,),
            layer + "post_attention_layernorm.weight": (HIDDEN,), layer + "post_attention_layernorm.bias": (HIDDEN,),
            layer + "mlp.dense_h_to_4h.weight": (2 * FFN, HIDDEN), layer + "mlp.dense_h_to_4h.bias": (2 * FFN,),
            layer + "mlp.dense_4h_to_h.weight": (HIDDEN, FFN), layer + "mlp.dense_4h_to_h.bias": (HIDDEN,),
        })
    shapes["language_model.encoder.final_layernorm.weight"] = (HIDDEN,)
    shapes["language_model.encoder.final_layernorm.bias"] = (HIDDEN,)
    return shapes


FULL_SHAPES = _full_shapes()


def _degrees(layout: str) -> tuple[int, int]:
    spec = FAMILY_LAYOUTS[layout]
    return spec["tp"], spec["world_size"] // spec["tp"]


def _tag_dir(layout: str):
    root = real_root(layout)
    return root / (root / "latest").read_text().strip()


def _model_files(layout: str) -> list[str]:
    spec = FAMILY_LAYOUTS[layout]
    tp, dp = _degrees(layout)
    if spec["stage"] == 3:
        return [f"zero_pp_rank_{d}_mp_rank_{t:02d}_model_states.pt" for t in range(tp) for d in range(dp)]
    return [f"mp_rank_{t:02d}_model_states.pt" for t in range(tp)]


def _optim_files(layout: str) -> list[str]:
    spec = FAMILY_LAYOUTS[layout]
    tp, dp = _degrees(layout)
    prefix = "bf16_" if spec["dtype"] == "bf16" else ""
    return [f"{prefix}zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt" for t in range(tp) for d in range(dp)]


@pytest.mark.parametrize("layout", MEGATRON)
def test_files_named_by_tp_and_dp_rank(layout):
    names = set(os.listdir(_tag_dir(layout)))
    assert names == set(_model_files(layout)) | set(_optim_files(layout))


@pytest.mark.parametrize("layout", MEGATRON)
def test_model_states_carry_universal_checkpoint_info(layout):
    spec = FAMILY_LAYOUTS[layout]
    tp, dp = _degrees(layout)
    truth = real_truth(layout)
    for name in _model_files(layout):
        sd = torch.load(_tag_dir(layout) / name, map_location="cpu", weights_only=True)
        assert sd["universal_checkpoint_info"] == truth["universal_checkpoint_info"], name
        assert sd["iteration"] == spec.get("steps", 2)
        assert sd["mp_world_size"] == tp and sd["dp_world_size"] == dp
        assert sd["checkpoint_parallel_dimensions"] == {"pp_degree": 1, "tp_degree": tp}
        # Every trainable parameter, under its Megatron name, with this tp rank's shard shape.
        shapes = {n: list(s) for group in sd["param_shapes"] for n, s in group.items()}
        assert shapes == truth["shard_shapes"]
        assert list(sd["module"]) == list(FULL_SHAPES)


@pytest.mark.parametrize("layout", MEGATRON)
def test_ground_truth_holds_full_tensors(layout):
    tp, dp = _degrees(layout)
    truth = real_truth(layout)  # weights_only=True
    assert truth["layout"] == {"family": "megatron", "dp": dp, "tp": tp, "pp": 1}
    assert truth["state_dict_keys"] == list(FULL_SHAPES)
    assert truth["frozen"] == {} and truth["buffers"] == {} and truth["tied"] == {}
    assert (truth["original_vocab_size"], truth["padded_vocab_size"]) == (VOCAB, PADDED_VOCAB)
    assert set(truth["trainable"]) == set(FULL_SHAPES)
    for name, shape in FULL_SHAPES.items():
        values = [truth["trainable"][name]] + [truth["optimizer_states"][k][name] for k in KEYS]
        for v in values:
            assert v.dtype == torch.float32 and tuple(v.shape) == shape, (name, v.dtype, v.shape)
        # The shards put together are the full (padded) tensor.
        part = truth["tp_partition"][name]
        shard = truth["shard_shapes"][name]
        padded = (PADDED_VOCAB,) + shape[1:] if part["kind"] == "vocab" else shape
        if part["dim"] is None:
            assert tuple(shard) == padded, name
        else:
            want = list(padded)
            want[part["dim"]] //= tp
            assert shard == want, name
    # Training moved every parameter and gave it optimizer state.
    assert truth["optimizer_step"] == float(FAMILY_LAYOUTS[layout].get("steps", 2))
    assert all(truth["optimizer_states"]["exp_avg_sq"][n].abs().sum() > 0 for n in FULL_SHAPES)


def _universal_tag_dir(layout: str):
    root = real_root(layout)
    error = root / "ds_to_universal.error"
    if error.is_file():
        assert not (root / "universal").exists()
        pytest.skip(f"DeepSpeed's ds_to_universal failed on {layout}: {error.read_text().strip()}")
    folder = root / "universal"
    return folder / (folder / "latest_universal").read_text().strip()


def _load_state(path):
    obj = torch.load(path, map_location="cpu", weights_only=True)
    return obj["param"] if isinstance(obj, dict) else obj


@pytest.mark.parametrize("layout", MEGATRON)
def test_ds_to_universal_params_match_truth(layout):
    tag_dir = _universal_tag_dir(layout)
    truth = real_truth(layout)
    for name, want in truth["trainable"].items():
        got = _load_state(tag_dir / "zero" / name / "fp32.pt")
        assert got.dtype == want.dtype and got.shape == want.shape, (name, got.dtype, got.shape)
        assert torch.equal(got, want), name


@pytest.mark.parametrize("layout", MEGATRON)
def test_ds_to_universal_optimizer_states_match_truth(layout):
    tag_dir = _universal_tag_dir(layout)
    truth = real_truth(layout)
    for key in KEYS:
        for name, want in truth["optimizer_states"][key].items():
            got = _load_state(tag_dir / "zero" / name / f"{key}.pt")
            assert got.shape == want.shape and torch.equal(got, want), (key, name)
