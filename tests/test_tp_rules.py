"""Megatron-DeepSpeed's tensor-parallel merge rules (zerofast/layouts/tp_rules.py), as properties.

The joins are checked against the torch operations ``ds_to_universal``'s ``merge_tp_slices``
performs (``torch.cat``, ``torch.chunk``, ``narrow``, the vocabulary slice), applied to random
slices; the pieces the rules give are applied with ``as_strided``, as the layout's gather reads
them. The real saves are in tests/test_megatron_tp.py.
"""
from __future__ import annotations

import re
import time

import pytest
import torch

from zerofast.base.errors import CorruptCheckpointError, UnsupportedCheckpointError
from zerofast.layouts import tp_presets, tp_rules


def rules(**info):
    return tp_rules.read_rules(info, None)


def joined(merge, slices):
    """The full tensor the rules' pieces describe, put together from ``slices``."""
    shapes = [tuple(s.shape) for s in slices]
    entry = tp_rules.affine_entry(merge, shapes)
    full = torch.full(entry["logical_shape"], float("nan"))
    for t, s in enumerate(slices):
        for piece in entry["ranks"][t]["pieces"]:
            src_off, src_strides = piece["source"]
            dst_off, dst_strides = piece["dest"]
            full.as_strided(piece["shape"], src_strides, src_off).copy_(
                s.as_strided(piece["shape"], dst_strides, dst_off))
    assert not full.isnan().any(), "a piece left part of the full tensor unwritten"
    return full


def random_slices(T, shape, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(T)]


@pytest.mark.parametrize("T", [1, 2, 4])
@pytest.mark.parametrize("seed", range(3))
def test_column_and_row_joins_equal_torch_cat(T, seed):
    r = rules(parameter_with_row_parallelism_patterns=[r"\d+\.dense\.weight"])
    col = random_slices(T, (3, 5), seed)
    row = random_slices(T, (4, 2), seed + 10)
    bias = random_slices(T, (6,), seed + 20)
    assert torch.equal(joined(r.merge("0.qkv.weight", [c.shape for c in col]), col), torch.cat(col, 0))
    assert torch.equal(joined(r.merge("1.dense.weight", [c.shape for c in row]), row), torch.cat(row, 1))
    assert torch.equal(joined(r.merge("0.qkv.bias", [c.shape for c in bias]), bias), torch.cat(bias, 0))
    assert r.merge("1.dense.weight", [c.shape for c in row]).rule == tp_rules.ROW_PARALLEL


@pytest.mark.parametrize("T", [1, 2, 3])
def test_two_sub_params_equal_chunk_then_cat(T):
    r = rules(parameter_with_2_sub_params_cat_dim_0=[r"layers\.\d+\.mlp\.dense_h_to_4h"])
    for shape in [(4, 3), (6,)]:
        slices = random_slices(T, shape, T)
        halves = [torch.chunk(s, 2, dim=0) for s in slices]
        want = torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
        name = "layers.0.mlp.dense_h_to_4h.weight"
        assert torch.equal(joined(r.merge(name, [s.shape for s in slices]), slices), want)


@pytest.mark.parametrize("version", [0.2, 0.4])
def test_sub_params_with_widths_equal_narrow_then_cat(version):
    """Uneven sub-parameters (GQA's q, k, v: 8, 4, 4 rows over 2 ranks as 5+3, 2+2, 2+2)."""
    widths = [[4, 4], [2, 2], [2, 2]] if version < 0.4 else [[5, 3], [2, 2], [2, 2]]
    info = {"universal_checkpoint_version": version,
            "parameter_with_sub_params": [{"patterns": [r"\d+\.qkv\.weight"], "shape": [[8, 4, 4], 3],
                                           "partition_dim": 0}]}
    if version >= 0.4:
        info["sub_param_shard_widths"] = {r"\d+\.qkv\.weight": widths}
    r = rules(**info)
    slices = [torch.randn(sum(w[t] for w in widths), 3) for t in range(2)]
    offsets, pieces = [0, 0], []
    for w in widths:
        for t in range(2):
            pieces.append(slices[t].narrow(0, offsets[t], w[t]))
            offsets[t] += w[t]
    assert torch.equal(joined(r.merge("0.qkv.weight", [s.shape for s in slices]), slices), torch.cat(pieces))


def test_vocabulary_rows_past_the_original_size_are_dropped():
    r = rules(vocabulary_parameter_patterns=["word_embeddings"], original_vocab_size=21)
    slices = random_slices(2, (12, 4), 0)
    merge = r.merge("word_embeddings.weight", [s.shape for s in slices])
    assert torch.equal(joined(merge, slices), torch.cat(slices)[:21])
    # a whole rank's rows past the vocabulary: that rank gives no piece
    r = rules(vocabulary_parameter_patterns=["word_embeddings"], original_vocab_size=10)
    entry = tp_rules.affine_entry(r.merge("word_embeddings.weight", [s.shape for s in slices]),
                                  [s.shape for s in slices])
    assert entry["ranks"][1]["pieces"] == [] and entry["logical_shape"] == [10, 4]


def test_rule_order_is_ds_to_universals():
    r = rules(tp_replicated_parameter_patterns=["norm"], parameter_to_average_patterns=["norm", "bias"],
              parameter_with_row_parallelism_patterns=["bias"])
    assert r.merge("norm.weight", [(4,), (4,)]).kind == "replicated"
    assert r.merge("bias", [(4,), (4,)]).kind == "average"
    assert r.merge("other", [(4,), (4,)]).kind == "join"


def test_two_patterns_of_one_list_matching_one_name_are_refused():
    r = rules(tp_replicated_parameter_patterns=["norm", r"norm\.weight"])
    with pytest.raises(UnsupportedCheckpointError, match="at most one pattern"):
        r.merge("norm.weight", [(4,), (4,)])


def test_slices_that_disagree_are_refused():
    r = rules(parameter_with_row_parallelism_patterns=["dense"])
    with pytest.raises(CorruptCheckpointError, match="differ beyond dim 1"):
        r.merge("dense.weight", [(4, 2), (5, 2)])
    with pytest.raises(UnsupportedCheckpointError, match="joins its slices on dim 1"):
        r.merge("dense.bias", [(4,), (4,)])
    r = rules(parameter_with_2_sub_params_cat_dim_0=["h_to_4h"])
    with pytest.raises(UnsupportedCheckpointError, match="odd 3 rows"):
        r.merge("h_to_4h.weight", [(3, 2), (3, 2)])


@pytest.mark.parametrize("pattern, why", [
    ("(a+)+$", "repeats or alternates" if False else "repeated group"),
    ("(a|aa)*b", "repeated group"),
    ("(?:x*)+", "repeated group"),
    (r"(a)\1", "back-references"),
    ("(?=a)a", "look-arounds"),
    ("a" * 600, "longer than"),
])
def test_patterns_that_could_run_unbounded_are_refused(pattern, why):
    start = time.monotonic()
    with pytest.raises(UnsupportedCheckpointError, match=why):
        rules(tp_replicated_parameter_patterns=[pattern])
    assert time.monotonic() - start < 1


@pytest.mark.parametrize("info, what", [
    ({"tp_replicated_parameter_patterns": ["(unclosed"]}, "valid"),
    ({"tp_replicated_parameter_patterns": [3]}, "strings"),
    ({"tp_replicated_parameter_patterns": {"a": 1}}, "list"),
    ({"parameter_with_sub_params": [{"patterns": ["x"], "shape": [2], "partition_dim": 5}]}, "partition_dim"),
    ({"original_vocab_size": -1, "vocabulary_parameter_patterns": ["x"]}, "count"),
    ({"universal_checkpoint_version": "0.4", "tp_replicated_parameter_patterns": []}, "number"),
])
def test_malformed_metadata_gets_a_typed_error(info, what):
    with pytest.raises(CorruptCheckpointError, match=what):
        rules(**info)


def test_megatron_deepspeeds_own_patterns_are_accepted():
    """Patterns as Megatron-DeepSpeed's GPT writes them (pipeline naming) pass the safety check
    and match what they should."""
    own = [r"\d+.input_layernorm.weight", r"\d+.self_attention.dense.bias", r"tied_modules.embed.word_embeddings.weight",
           r"\d+.mlp.dense_h_to_4h.weight", r"\d+.final_layernorm.weight"]
    compiled = [tp_rules.safe_pattern(p, "test", None) for p in own]
    assert compiled[0].match("3.input_layernorm.weight")
    assert all(isinstance(c, re.Pattern) for c in compiled)


# -- rules the user gives (--tp-rules / ZEROFAST_TP_RULES) -------------------------------------------

@pytest.mark.parametrize("name, label", [
    ("language_model.encoder.layers.0.input_layernorm.weight", "replicated"),
    ("7.post_attention_layernorm.bias", "replicated"),
    ("language_model.encoder.final_layernorm.weight", "replicated"),
    ("9.weight", "replicated"),  # the pipeline's final norm: a layer of its own
    ("language_model.encoder.layers.1.mlp.dense_h_to_4h.weight", "two sub-params joined on dim 0"),
    ("3.mlp.dense_4h_to_h.weight", "joined on dim 1"),
    ("language_model.encoder.layers.0.self_attention.dense.weight", "joined on dim 1"),
    ("language_model.encoder.layers.0.self_attention.query_key_value.weight", "joined on dim 0"),
    ("tied_modules.embed.word_embeddings.weight", "joined on dim 0 (first 21 rows: vocabulary)"),
    ("language_model.embedding.word_embeddings.weight", "joined on dim 0 (first 21 rows: vocabulary)"),
])
def test_the_megatron_gpt_preset_covers_both_namings(name, label):
    r = tp_rules.read_rules(tp_presets.from_setting("megatron-gpt:mlp=swiglu,vocab=21"), None)
    assert r.merge(name, [(12, 4), (12, 4)]).label == label


def test_the_preset_with_gelu_joins_dense_h_to_4h_on_dim_0():
    r = tp_rules.read_rules(tp_presets.from_setting("megatron-gpt:mlp=gelu,vocab=21"), None)
    assert r.merge("2.mlp.dense_h_to_4h.weight", [(4, 2), (4, 2)]).label == "joined on dim 0"


@pytest.mark.parametrize("value", ["megatron-gpt", "megatron-gpt:mlp=swiglu", "megatron-gpt:vocab=3",
                                   "megatron-gpt:mlp=relu,vocab=3", "megatron-gpt:mlp=gelu,vocab=-1",
                                   "megatron-gpt:layers=3"])
def test_the_preset_asks_for_what_the_shapes_cannot_tell(value):
    from zerofast.base.errors import SettingsError

    with pytest.raises(SettingsError, match="mlp=swiglu"):
        tp_presets.from_setting(value)


def test_a_rules_file_is_read_and_checked(tmp_path):
    from zerofast.base.errors import SettingsError

    good = tmp_path / "rules.json"
    good.write_text('{"tp_replicated_parameter_patterns": ["norm"], "original_vocab_size": 5}')
    assert tp_rules.read_rules(tp_presets.from_setting(str(good)), None).merge("norm.w", [(2,), (2,)]).kind == "replicated"
    (tmp_path / "list.json").write_text("[1]")
    (tmp_path / "bad.json").write_text("{")
    (tmp_path / "huge.json").write_bytes(b" " * (tp_presets.MAX_RULES_FILE + 1))
    for name, why in (("list.json", "JSON object"), ("bad.json", "expected JSON"), ("huge.json", "at most"),
                      ("missing.json", "could not read")):
        with pytest.raises(SettingsError, match=why):
            tp_presets.from_setting(str(tmp_path / name))
    bad_pattern = tmp_path / "backtrack.json"
    bad_pattern.write_text('{"tp_replicated_parameter_patterns": ["(a+)+"]}')
    with pytest.raises(UnsupportedCheckpointError, match="repeated group"):
        tp_rules.read_rules(tp_presets.from_setting(str(bad_pattern)), None)
