"""Property-based tests: random layouts, synthesized in DeepSpeed's on-disk format, through the
whole pipeline. The synthesizer's ground truth is the values it partitioned; the native path and
the pure-torch reference path must both give it back, in every dtype mode, eager and lazy, and
in the files export writes, read back with the plain loaders."""
import os
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import zerofast
from tests.helpers import assert_bitwise_equal, expected_value
from zerofast.testing.strategies import layouts
from zerofast.testing.synthesize import synthesize
from zerofast.hf import export, load_exported

DTYPES = [torch.float32, None, torch.bfloat16, torch.float16]


def _expected(truth, dtype, exclude_frozen):
    kinds = (truth.trainable, truth.buffers) if exclude_frozen else (truth.trainable, truth.frozen, truth.buffers)
    values = {k: v for d in kinds for k, v in d.items()}
    keys = [k for k in truth.state_dict_keys if truth.tied.get(k, k) in values]
    return keys, {k: expected_value(values[truth.tied.get(k, k)], dtype) for k in keys}


def _check(sd, truth, dtype, exclude_frozen=False):
    keys, expected = _expected(truth, dtype, exclude_frozen)
    assert list(sd) == keys
    for k in keys:
        assert_bitwise_equal(sd[k], expected[k], k)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=layouts(), dtype=st.sampled_from(DTYPES), lazy=st.booleans())
def test_random_layouts_match_ground_truth(spec, dtype, lazy):
    with tempfile.TemporaryDirectory() as tmp:
        truth = synthesize(tmp, spec)
        root = tmp if spec.write_latest else os.path.join(tmp, spec.tag)
        _check(zerofast.reconstruct(root, dtype=dtype, lazy=lazy), truth, dtype)
        for alias, source in ({} if lazy else truth.tied).items():
            sd = zerofast.reconstruct(root, dtype=dtype)
            assert sd[alias] is sd[source]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=layouts(max_world_size=4), dtype=st.sampled_from(DTYPES))
def test_reference_path_equals_native_path(spec, dtype):
    with tempfile.TemporaryDirectory() as tmp:
        truth = synthesize(tmp, spec)
        root = tmp if spec.write_latest else os.path.join(tmp, spec.tag)
        native = zerofast.reconstruct(root, dtype=dtype)
        os.environ["ZEROFAST_NATIVE"] = "0"
        try:
            ref = zerofast.reconstruct(root, dtype=dtype)
        finally:
            del os.environ["ZEROFAST_NATIVE"]
        assert list(native) == list(ref)
        for k in native:
            assert_bitwise_equal(native[k], ref[k], k)
        _check(native, truth, dtype)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=layouts(max_world_size=4))
def test_exclude_frozen_on_random_layouts(spec):
    with tempfile.TemporaryDirectory() as tmp:
        truth = synthesize(tmp, spec)
        root = tmp if spec.write_latest else os.path.join(tmp, spec.tag)
        if spec.stage == 0 and spec.model_dtype == torch.float32:
            # No masters and no names: only complete optimizer state proves nothing was frozen.
            try:
                sd = zerofast.reconstruct(root, exclude_frozen=True)
            except zerofast.UnsupportedCheckpointError:
                return
            # Zero-element trainables count as frozen only where DeepSpeed records them so
            # (stages 2-3); stage 0 records nothing, and they trained, so they stay.
            assert all(v.numel() == 0 for v in truth.frozen.values()) and spec.with_optimizer_states
            _check(sd, truth, torch.float32)
            return
        else:
            sd = zerofast.reconstruct(root, exclude_frozen=True)
        _check(sd, truth, torch.float32, exclude_frozen=True)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fp16_training(tmp_path, stage, dtype):
    """DeepSpeed cannot train fp16 on a CPU, so fp16 runs are synthesized."""
    from zerofast.testing.synthesize import BufferSpec, LayoutSpec, ParamSpec

    spec = LayoutSpec(
        stage=stage, world_size=3, model_dtype=torch.float16,
        groups=[[ParamSpec("embed.weight", (11, 5)), ParamSpec("fc.weight", (7, 5))], [ParamSpec("fc.bias", (7,))]],
        frozen=[ParamSpec("base.weight", (5, 5))],
        buffers=[BufferSpec("steps", (2,), torch.int64), BufferSpec("scale", (5,), torch.float16)],
        tied={"head.weight": "embed.weight"}, seed=stage)
    truth = synthesize(tmp_path, spec)
    _check(zerofast.reconstruct(tmp_path, dtype=dtype), truth, dtype)
    _check(zerofast.reconstruct(tmp_path, dtype=dtype, lazy=True), truth, dtype)


# ---------------------------------------------------------------------------------------------
# export: the files, read back with the plain libraries, hold the ground truth.

FORMATS = ["safetensors", "torch"]
# A limit of a few bytes puts every tensor in a shard of its own; "5GB" writes one file.
SHARD_SIZES = st.one_of(st.integers(1, 300), st.just("5GB"))


def _read_files(out, result):
    """The export's data files merged, each read with the plain loader; no alias restored."""
    from safetensors.torch import load_file

    merged = {}
    for name in result.files:
        path = os.path.join(out, name)
        part = load_file(path) if result.format == "safetensors" else torch.load(path, weights_only=True)
        assert not set(part) & set(merged), f"{name} repeats keys of another shard"
        merged.update(part)
    return merged


def _export_root(tmp, spec):
    truth = synthesize(os.path.join(tmp, "ckpt"), spec)
    return truth, os.path.join(tmp, "ckpt") if spec.write_latest else os.path.join(tmp, "ckpt", spec.tag)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=layouts(max_world_size=4), dtype=st.sampled_from(DTYPES), fmt=st.sampled_from(FORMATS),
       shard=SHARD_SIZES, duplicate_tied=st.booleans())
def test_export_on_random_layouts_reads_back_as_the_ground_truth(spec, dtype, fmt, shard, duplicate_tied):
    with tempfile.TemporaryDirectory() as tmp:
        truth, root = _export_root(tmp, spec)
        out = os.path.join(tmp, "out")
        result = export(root, out, dtype=dtype, format=fmt, max_shard_size=shard, duplicate_tied=duplicate_tied)
        keys, expected = _expected(truth, dtype, False)
        tied = {} if duplicate_tied else truth.tied
        assert result.aliases == tied

        plain = _read_files(out, result)
        # Torch files hold each alias next to its source, sharing its storage; safetensors lists
        # it in the metadata only.
        assert sorted(plain) == sorted(k for k in keys if fmt == "torch" or k not in tied)
        for k, value in plain.items():
            assert_bitwise_equal(value, expected[k], k)

        loaded = load_exported(out)
        rebuilt = zerofast.reconstruct(root, dtype=dtype)
        assert sorted(loaded) == sorted(keys)
        for k in keys:
            assert_bitwise_equal(loaded[k], rebuilt[k], k)
            assert_bitwise_equal(loaded[k], expected[k], k)
        for alias, source in truth.tied.items():
            shared = loaded[alias].untyped_storage().data_ptr() == loaded[source].untyped_storage().data_ptr()
            if not duplicate_tied:
                assert shared, alias
            elif loaded[source].numel():
                assert not shared, alias


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=layouts(max_world_size=4), dtype=st.sampled_from(DTYPES), fmt=st.sampled_from(FORMATS),
       shard=SHARD_SIZES)
def test_export_reference_path_equals_native_path(spec, dtype, fmt, shard):
    with tempfile.TemporaryDirectory() as tmp:
        truth, root = _export_root(tmp, spec)
        native = export(root, os.path.join(tmp, "native"), dtype=dtype, format=fmt, max_shard_size=shard)
        os.environ["ZEROFAST_NATIVE"] = "0"
        try:
            ref = export(root, os.path.join(tmp, "ref"), dtype=dtype, format=fmt, max_shard_size=shard)
        finally:
            del os.environ["ZEROFAST_NATIVE"]
        assert (native.files, native.index) == (ref.files, ref.index)
        if fmt == "safetensors":  # safetensors files are a pure function of their tensors
            for name in (*native.files, *([native.index] if native.index else [])):
                native_bytes = Path(tmp, "native", name).read_bytes()
                assert native_bytes == Path(tmp, "ref", name).read_bytes(), name
        got, want = load_exported(os.path.join(tmp, "native")), load_exported(os.path.join(tmp, "ref"))
        assert sorted(got) == sorted(want)
        keys, expected = _expected(truth, dtype, False)
        for k in keys:
            assert_bitwise_equal(got[k], want[k], k)
            assert_bitwise_equal(got[k], expected[k], k)
