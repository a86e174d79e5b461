"""Megatron-DeepSpeed-style tensor x pipeline parallel saves (TP 2 x PP 2 x DP 1, a PipelineModule with
GPTModelPipe's layers, no Megatron installed) that real DeepSpeed 0.19.8 wrote on the CPU
(tests/dsgen/train_megatron_pipe.py, layouts in tests/dsgen/megatron_pipe_layouts.py).

The generator's own invariants: the files are named as a pipeline save per (layer, tp rank) and per
(stage, tp rank), every mp_rank file carries the universal_checkpoint_info, the layer files, flat
optimizer partitions (ZeRO 1) or torch optimizer states (ZeRO off) hold each tp rank's piece of the
ground truth, the ground truth holds full, vocabulary-trimmed tensors under the pipeline names, and
DeepSpeed's own ds_to_universal, where it ran, gives the same full tensors bit for bit."""
from __future__ import annotations

import functools
import os
import re
from pathlib import Path

import pytest
import torch

from tests.conftest import needs_deepspeed
from tests.dsgen.megatron_pipe_layouts import MEGATRON_PIPE_LAYOUTS
from tests.helpers import assert_bitwise_equal, real_root, real_truth

pytestmark = needs_deepspeed

# the frozen variant has its own tests (tests/test_megatron_frozen.py): here every parameter trains
LAYOUTS = sorted(n for n, spec in MEGATRON_PIPE_LAYOUTS.items() if not spec.get("frozen"))
KEYS = ("exp_avg", "exp_avg_sq")
VOCAB, PADDED_VOCAB, HIDDEN, FFN, MAX_POS = 21, 24, 8, 12, 8
FIRST_LAYER, LAYERS = 2, 4
FINAL_NORM = FIRST_LAYER + LAYERS  # 6; 7 is the tied head (a forward_fn: no layer file)
EMBED_LAYER = 1                    # the tied module's first occurrence: its only layer file
WORD = "tied_modules.embed.word_embeddings.weight"
POSITION = "tied_modules.embed.position_embeddings.weight"
TIED = (WORD, POSITION)


def _full_shapes() -> dict:
    """Pipeline name -> full shape (the vocabulary trimmed), in the consolidated state dict's order."""
    shapes = {WORD: (VOCAB, HIDDEN), POSITION: (MAX_POS, HIDDEN)}
    for i in range(FIRST_LAYER, FIRST_LAYER + LAYERS):
        shapes.update({
            f"{i}.input_layernorm.weight": (HIDDEN,), f"{i}.input_layernorm.bias": (HIDDEN,),
            f"{i}.self_attention.query_key_value.weight": (3 * HIDDEN, HIDDEN),
            f"{i}.self_attention.query_key_value.bias": (3 * HIDDEN,),
            f"{i}.self_attention.dense.weight": (HIDDEN, HIDDEN), f"{i}.self_attention.dense.bias": (HIDDEN,),
            f"{i}.post_attention_layernorm.weight": (HIDDEN,), f"{i}.post_attention_layernorm.bias": (HIDDEN,),
            f"{i}.mlp.dense_h_to_4h.weight": (2 * FFN, HIDDEN), f"{i}.mlp.dense_h_to_4h.bias": (2 * FFN,),
            f"{i}.mlp.dense_4h_to_h.weight": (HIDDEN, FFN), f"{i}.mlp.dense_4h_to_h.bias": (HIDDEN,),
        })
    shapes[f"{FINAL_NORM}.weight"] = (HIDDEN,)
    shapes[f"{FINAL_NORM}.bias"] = (HIDDEN,)
    return shapes


FULL_SHAPES = _full_shapes()


def _spec(layout: str) -> dict:
    return MEGATRON_PIPE_LAYOUTS[layout]


def _degrees(layout: str) -> tuple[int, int, int]:
    spec = _spec(layout)
    tp, pp = spec["tp"], spec["pp"]
    return tp, pp, spec["world_size"] // (tp * pp)


def _tag_dir(layout: str) -> Path:
    root = real_root(layout)
    return root / (root / "latest").read_text().strip()


@functools.lru_cache(maxsize=None)
def _load(path: Path, weights_only: bool = True):
    return torch.load(path, map_location="cpu", weights_only=weights_only)


def _layer_and_key(name: str) -> tuple[int, str]:
    """The layer file (index) that holds ``name`` and its key there."""
    if name.startswith("tied_modules.embed."):
        return EMBED_LAYER, name[len("tied_modules.embed."):]
    layer, key = name.split(".", 1)
    return int(layer), key


def _stage_names(truth: dict, stage: int) -> list[str]:
    """The names a stage's module holds, in its named_parameters order (tied module first)."""
    return [n for n in truth["state_dict_keys"] if stage in truth["param_stages"][n]]


def _no_weight_decay(name: str) -> bool:  # the generator's second AdamW group (Megatron's)
    return name.endswith(".bias") or "norm" in name or name == f"{FINAL_NORM}.weight"


def _truth_shard(full: torch.Tensor, kind: str, t: int, tp: int) -> torch.Tensor:
    """tp rank t's piece of a full truth tensor; for the (trimmed) vocabulary only the rows the truth
    has, so that the file's piece is compared on its first ``len(result)`` rows."""
    if kind == "replicated":
        return full
    if kind == "vocab":
        per = PADDED_VOCAB // tp
        return full[t * per:(t + 1) * per]
    if kind == "swiglu":
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[t], up.chunk(tp, dim=0)[t]], dim=0)
    return full.chunk(tp, dim={"column": 0, "row": 1}[kind])[t]


def _stage_truth(truth: dict, name: str, stage: int, what: str = "fp32") -> torch.Tensor:
    """The full value of ``name`` as ``stage`` holds it: the truth, or the last stage's own copy of a
    tied parameter."""
    if stage != 0 and name in TIED:
        return truth["pipe_copies"][name] if what == "fp32" else truth["pipe_copies_optimizer"][what][name]
    return truth["trainable"][name] if what == "fp32" else truth["optimizer_states"][what][name]


def _assert_piece(got: torch.Tensor, full: torch.Tensor, kind: str, t: int, tp: int, what: str) -> None:
    want = _truth_shard(full, kind, t, tp).to(got.dtype)
    assert_bitwise_equal(got[:want.shape[0]] if kind == "vocab" else got, want, what)


# -- files ------------------------------------------------------------------------------------------

def _expected_files(layout: str) -> set[str]:
    tp, pp, dp = _degrees(layout)
    layers = range(EMBED_LAYER, FINAL_NORM + 1)  # no file for functions (0, 8) or the forward_fn head (7)
    names = {f"layer_{i:02d}-model_{t:02d}-model_states.pt" for i in layers for t in range(tp)}
    names |= {f"mp_rank_{s * tp + t:02d}_model_states.pt" for s in range(pp) for t in range(tp)}
    if _spec(layout)["stage"] > 0:
        prefix = "bf16_" if _spec(layout)["dtype"] == "bf16" else ""
        names |= {f"{prefix}zero_pp_rank_{d}_mp_rank_{s * tp + t:02d}_optim_states.pt"
                  for s in range(pp) for t in range(tp) for d in range(dp)}
    return names


@pytest.mark.parametrize("layout", LAYOUTS)
def test_files_named_by_layer_stage_and_tp_rank(layout):
    assert set(os.listdir(_tag_dir(layout))) == _expected_files(layout)
    root = set(os.listdir(real_root(layout)))
    assert {"latest", "global_step2", "ground_truth.pt"} <= root
    # DeepSpeed copies its zero_to_fp32.py only where ZeRO is on
    assert ("zero_to_fp32.py" in root) == (_spec(layout)["stage"] > 0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_model_states_carry_universal_checkpoint_info(layout):
    tp, pp, dp = _degrees(layout)
    truth = real_truth(layout)
    stage = _spec(layout)["stage"]
    for s in range(pp):
        for t in range(tp):
            sd = _load(_tag_dir(layout) / f"mp_rank_{s * tp + t:02d}_model_states.pt")  # weights_only
            assert sd["module"] is None  # the values are in the layer files
            assert sd["universal_checkpoint_info"] == truth["universal_checkpoint_info"]
            assert sd["iteration"] == 2
            # mp_world_size counts every model-parallel rank of a replica (pp * tp)
            assert (sd["mp_world_size"], sd["dp_world_size"]) == (pp * tp, dp)
            assert sd["checkpoint_parallel_dimensions"] == {"pp_degree": pp, "tp_degree": tp}
            assert sd["buffer_names"] == [] and sd["lr_scheduler"] is None
            names = _stage_names(truth, s)
            if stage == 0:
                assert sd["param_shapes"] is None and sd["shared_params"] is None
                continue
            assert sd["optimizer"] is None and sd["shared_params"] == {} and sd["frozen_param_shapes"] is None
            # two groups (weight decay, none), this tp rank's shard shapes, the stage's names only
            shapes = [{n: list(v) for n, v in g.items()} for g in sd["param_shapes"]]
            assert [list(g) for g in shapes] == [[n for n in names if not _no_weight_decay(n)],
                                                 [n for n in names if _no_weight_decay(n)]]
            for g in shapes:
                for n, shape in g.items():
                    assert shape == truth["shard_shapes"][n], n


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layer_files_hold_each_tp_ranks_piece(layout):
    """layer_LL-model_TT files: the layer's own state_dict (layer-local keys) in the model dtype, tp
    rank TT's piece of the truth (the model copy of the master, cast); the tied module only in layer
    1's file, under the embedding's own keys."""
    tp, _pp, _dp = _degrees(layout)
    truth = real_truth(layout)
    dtype = torch.bfloat16 if _spec(layout)["dtype"] == "bf16" else torch.float32
    by_file = {}
    for name in FULL_SHAPES:
        layer, key = _layer_and_key(name)
        by_file.setdefault(layer, []).append((key, name))
    assert sorted(by_file) == list(range(EMBED_LAYER, FINAL_NORM + 1))
    for layer, entries in by_file.items():
        for t in range(tp):
            sd = _load(_tag_dir(layout) / f"layer_{layer:02d}-model_{t:02d}-model_states.pt")
            assert list(sd) == [key for key, _ in entries], (layer, list(sd))
            for key, name in entries:
                v = sd[key]
                assert v.dtype == dtype and list(v.shape) == truth["shard_shapes"][name], (name, v.dtype, v.shape)
                kind = truth["tp_partition"][name]["kind"]
                _assert_piece(v, truth["trainable"][name], kind, t, tp, f"{name} tp {t}")


@pytest.mark.parametrize("layout", [n for n in LAYOUTS if MEGATRON_PIPE_LAYOUTS[n]["stage"] == 1])
def test_flat_groups_per_stage_and_tp_rank(layout):
    """ZeRO 1 (dp 1): each (stage, tp rank) file's two flat fp32 groups hold that stage's names (the tied
    module in both stages' files), each the tp rank's piece; the last stage's word embeddings equal the
    first's, its position embeddings are its own copy."""
    tp, pp, _dp = _degrees(layout)
    truth = real_truth(layout)
    for s in range(pp):
        names = _stage_names(truth, s)
        for t in range(tp):
            prefix = "bf16_" if _spec(layout)["dtype"] == "bf16" else ""
            osd = _load(_tag_dir(layout) / f"{prefix}zero_pp_rank_0_mp_rank_{s * tp + t:02d}_optim_states.pt",
                        weights_only=False)["optimizer_state_dict"]
            assert osd["partition_count"] == [1, 1] and osd["group_paddings"] == [0, 0]
            mappings = osd["param_slice_mappings"]
            assert [list(m) for m in mappings] == [[n for n in names if not _no_weight_decay(n)],
                                                   [n for n in names if _no_weight_decay(n)]]
            state = osd["base_optimizer_state"]["state"]
            for g, mapping in enumerate(mappings):
                flat = osd["single_partition_of_fp32_groups"][g]
                assert flat.numel() == sum(m.numel for m in mapping.values())
                for name, frag in mapping.items():
                    shape = truth["shard_shapes"][name]
                    kind = truth["tp_partition"][name]["kind"]
                    for what, source in [("fp32", flat)] + [(k, state[g][k]) for k in KEYS]:
                        piece = source.narrow(0, frag.start, frag.numel).view(shape)
                        _assert_piece(piece, _stage_truth(truth, name, s, what), kind, t, tp,
                                      f"{name} {what} stage {s} tp {t}")


@pytest.mark.parametrize("layout", [n for n in LAYOUTS if MEGATRON_PIPE_LAYOUTS[n]["stage"] == 0])
def test_torch_optimizer_state_per_stage_and_tp_rank(layout):
    """ZeRO off: each mp_rank file's ``optimizer`` is the torch AdamW state dict of its (stage, tp rank),
    the parameters numbered by group (weight decay, then none) in the stage's named_parameters order."""
    tp, pp, _dp = _degrees(layout)
    truth = real_truth(layout)
    for s in range(pp):
        names = _stage_names(truth, s)
        order = [n for n in names if not _no_weight_decay(n)] + [n for n in names if _no_weight_decay(n)]
        for t in range(tp):
            opt = _load(_tag_dir(layout) / f"mp_rank_{s * tp + t:02d}_model_states.pt")["optimizer"]
            assert [len(g["params"]) for g in opt["param_groups"]] == [
                sum(not _no_weight_decay(n) for n in names), sum(_no_weight_decay(n) for n in names)]
            assert sorted(opt["state"]) == list(range(len(order)))
            for i, name in enumerate(order):
                kind = truth["tp_partition"][name]["kind"]
                for k in KEYS:
                    got = opt["state"][i][k]
                    assert list(got.shape) == truth["shard_shapes"][name], (name, got.shape)
                    _assert_piece(got, _stage_truth(truth, name, s, k), kind, t, tp, f"{name} {k} stage {s} tp {t}")


# -- ground truth -------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
def test_ground_truth_holds_full_tensors(layout):
    tp, pp, dp = _degrees(layout)
    truth = real_truth(layout)  # weights_only=True
    bf16 = _spec(layout)["dtype"] == "bf16"
    # layers 0 (_to_float16) .. 3 on stage 0; 4 .. 7 (the head) and, in bf16, 8 (float16_to_fp32) on stage 1
    assert truth["layout"] == {"family": "megatron_pipe", "tp": tp, "pp": pp, "dp": dp,
                               "layer_stage": [0] * 4 + [1] * (5 if bf16 else 4)}
    assert truth["state_dict_keys"] == list(FULL_SHAPES)
    assert truth["frozen"] == {} and truth["buffers"] == {} and truth["tied"] == {}
    assert (truth["original_vocab_size"], truth["padded_vocab_size"]) == (VOCAB, PADDED_VOCAB)
    assert list(truth["trainable"]) == list(FULL_SHAPES)
    for name, shape in FULL_SHAPES.items():
        values = [truth["trainable"][name]] + [truth["optimizer_states"][k][name] for k in KEYS]
        for v in values:
            assert v.dtype == torch.float32 and tuple(v.shape) == shape, (name, v.dtype, v.shape)
        part = truth["tp_partition"][name]
        padded = (PADDED_VOCAB,) + shape[1:] if part["kind"] == "vocab" else shape
        want = list(padded)
        if part["dim"] is not None:
            want[part["dim"]] //= tp
        assert truth["shard_shapes"][name] == want, name
        layer, _key = _layer_and_key(name)
        stages = [0, pp - 1] if name in TIED else [truth["layout"]["layer_stage"][layer]]
        assert truth["param_stages"][name] == stages, name
    assert truth["optimizer_step"] == 2.0
    assert all(truth["optimizer_states"]["exp_avg_sq"][n].abs().sum() > 0 for n in FULL_SHAPES)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_tied_embedding_copies(layout):
    """The word embeddings on the last stage (the head) are bit-identical to the first stage's (master
    and moments: DeepSpeed all-reduces their gradient over the tied group); the position embeddings there
    get no gradient (the head uses only the word embeddings) and stay apart, which is why Megatron lists
    both under pipeline_replicated_parameter_patterns (ds_to_universal keeps stage 0's)."""
    truth = real_truth(layout)
    assert truth["pipe_copies_identical"] == {WORD: True, POSITION: False}
    assert_bitwise_equal(truth["pipe_copies"][WORD], truth["trainable"][WORD], WORD)
    for k in KEYS:
        assert_bitwise_equal(truth["pipe_copies_optimizer"][k][WORD], truth["optimizer_states"][k][WORD], k)
    assert not torch.equal(truth["pipe_copies"][POSITION], truth["trainable"][POSITION])
    info = truth["universal_checkpoint_info"]
    assert [n for n in FULL_SHAPES if any(re.match(p, n) for p in info["pipeline_replicated_parameter_patterns"])] \
        == list(TIED)


# -- DeepSpeed's ds_to_universal ---------------------------------------------------------------------

def _universal_tag_dir(layout: str) -> Path:
    root = real_root(layout)
    error = root / "ds_to_universal.error"
    if error.is_file():
        assert not (root / "universal").exists()
        pytest.skip(f"DeepSpeed's ds_to_universal failed on {layout}: {error.read_text().strip()}")
    folder = root / "universal"
    return folder / (folder / "latest_universal").read_text().strip()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_ds_to_universal_ran_where_zero_is_on(layout):
    root = real_root(layout)
    if _spec(layout)["stage"] == 0:  # no optimizer files to read
        assert "_optim_states.pt" in (root / "ds_to_universal.error").read_text()
    else:
        assert not (root / "ds_to_universal.error").exists() and (root / "universal").is_dir()


def _load_state(path: Path) -> torch.Tensor:
    obj = torch.load(path, map_location="cpu", weights_only=True)
    return obj["param"] if isinstance(obj, dict) else obj


@pytest.mark.parametrize("layout", LAYOUTS)
def test_ds_to_universal_params_match_truth(layout):
    tag_dir = _universal_tag_dir(layout)
    truth = real_truth(layout)
    assert {p.name for p in (tag_dir / "zero").iterdir() if p.is_dir()} == set(FULL_SHAPES)
    for name, want in truth["trainable"].items():
        assert_bitwise_equal(_load_state(tag_dir / "zero" / name / "fp32.pt"), want, name)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_ds_to_universal_optimizer_states_match_truth(layout):
    tag_dir = _universal_tag_dir(layout)
    truth = real_truth(layout)
    for key in KEYS:
        for name, want in truth["optimizer_states"][key].items():
            assert_bitwise_equal(_load_state(tag_dir / "zero" / name / f"{key}.pt"), want, f"{name} {key}")


# -- zerofast on these saves: each tp rank's pipeline planned alone, the shards joined by the rules --

import zerofast  # noqa: E402
from tests.helpers import expected_value  # noqa: E402


def _universal_param(layout: str, name: str, state: str = "fp32"):
    folder = real_root(layout) / "universal"
    found = list(folder.glob(f"*/zero/{name}/{state}.pt"))
    return torch.load(found[0], weights_only=False)["param"] if found else None


@pytest.mark.parametrize("dtype", [None, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_reconstruct_equals_the_truth(layout, dtype):
    truth = real_truth(layout)["trainable"]
    sd = zerofast.reconstruct(real_root(layout), dtype=dtype)
    assert set(sd) == set(truth)
    for name, value in truth.items():
        assert_bitwise_equal(sd[name], expected_value(value, dtype), name)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_lazy_equals_the_truth(layout):
    truth = real_truth(layout)["trainable"]
    lazy = zerofast.reconstruct(real_root(layout), lazy=True)
    for name, value in truth.items():
        assert_bitwise_equal(lazy[name], value, name)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_export_reads_back_with_safetensors(layout, tmp_path):
    from safetensors.torch import load_file

    truth = real_truth(layout)["trainable"]
    zerofast.export(real_root(layout), tmp_path / "hf")
    got = {}
    for f in sorted((tmp_path / "hf").glob("*.safetensors")):
        got.update(load_file(f))
    assert set(got) == set(truth)
    for name, value in truth.items():
        assert_bitwise_equal(got[name], value, name)


@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize("layout", [n for n in LAYOUTS if MEGATRON_PIPE_LAYOUTS[n]["stage"] > 0])
def test_optimizer_states_equal_the_truth(layout, key):
    truth = real_truth(layout)
    states = zerofast.optimizer_state(real_root(layout), key)
    for name, value in truth["optimizer_states"][key].items():
        assert_bitwise_equal(states[name], value, name)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_reconstruct_equals_ds_to_universal(layout):
    if not (real_root(layout) / "universal").is_dir():
        pytest.skip(f"ds_to_universal did not run on {layout}: "
                    f"{(real_root(layout) / 'ds_to_universal.error').read_text().strip()[:200]}")
    sd = zerofast.reconstruct(real_root(layout), dtype=None)
    for name in sd:
        assert_bitwise_equal(sd[name], _universal_param(layout, name), name)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_inspect_shows_the_degrees_and_the_rules(layout):
    from zerofast.cli import describe

    p = describe(real_root(layout))["parallelism"]
    assert (p["pp"], p["tp"], p["dp"]) == (2, 2, 1)
    # at ZeRO off too: the tied module is named by pipeline_replicated_parameter_patterns
    assert p["tp_rules"][WORD] == "joined on dim 0 (first 21 rows: vocabulary)"
    assert p["tp_rules"][POSITION] == "replicated"
