"""zerofast.compat and `zerofast zero-to-fp32` against DeepSpeed's zero_to_fp32: same signatures, same
file names, and values judged against the live engine's ground truth. DeepSpeed itself runs only in
subprocesses, so this process never imports it."""
from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from zerofast import compat
from zerofast.cli import main
from zerofast.execute import Executor
from zerofast.hf import load_exported

from tests.conftest import needs_deepspeed
from tests.dsgen.models import build_model
from tests.helpers import assert_bitwise_equal, expected_value
from tests.helpers import real_root as _root, real_truth as _truth, stored_values as _stored

REPO = Path(__file__).resolve().parent.parent
SMALL = "s2_bf16_w2_frozen_tied"  # frozen bf16 weights, ties, int and bool buffers
TINY = 2000  # bytes: several shards for every test model
FUNCTIONS = ["get_fp32_state_dict_from_zero_checkpoint", "convert_zero_checkpoint_to_fp32_state_dict",
             "convert_zero_checkpoint_to_state_dict", "load_state_dict_from_zero_checkpoint"]


def _check(sd, truth, dtype=torch.float32, keys=None) -> None:
    stored = _stored(truth)
    assert list(sd) == (keys or truth["state_dict_keys"])
    for name in sd:
        assert_bitwise_equal(sd[name], expected_value(stored[truth["tied"].get(name, name)], dtype), name)


def _deepspeed(code: str) -> str:
    """Run ``code`` in a fresh interpreter that may import DeepSpeed; return its stdout."""
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                         timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


# ---------------------------------------------------------------------------------------------
# The API

def _signature(fn) -> list:
    return [(p.name, repr(p.default), p.kind.name) for p in inspect.signature(fn).parameters.values()
            if p.kind != p.KEYWORD_ONLY]


@needs_deepspeed
def test_signatures_and_defaults_match_deepspeed():
    theirs = json.loads(_deepspeed(f"""
        import inspect, json
        from deepspeed.utils import zero_to_fp32 as z
        print(json.dumps({{name: [(p.name, repr(p.default), p.kind.name)
                                  for p in inspect.signature(getattr(z, name)).parameters.values()]
                          for name in {FUNCTIONS!r}}}))
    """).strip().splitlines()[-1])
    for name in FUNCTIONS:
        assert [list(p) for p in _signature(getattr(compat, name))] == theirs[name], name


def test_eager_keeps_the_fp32_contract(real_ckpt):
    _, root, truth = real_ckpt
    sd = compat.get_fp32_state_dict_from_zero_checkpoint(root)
    _check(sd, truth)
    for alias, source in truth["tied"].items():
        assert sd[alias] is sd[source]


def test_dtype_none_keeps_what_the_checkpoint_holds(real_ckpt):
    _, root, truth = real_ckpt
    _check(compat.get_fp32_state_dict_from_zero_checkpoint(root, dtype=None), truth, dtype=None)


def test_lazy_values_are_built_by_contiguous(real_ckpt, monkeypatch):
    _, root, truth = real_ckpt
    built = []
    for method in ("run", "view"):  # a lookup either reads its tensor or views its source
        real = getattr(Executor, method)
        monkeypatch.setattr(Executor, method,
                            lambda self, tp, *rest, _real=real: built.append(tp.name) or _real(self, tp, *rest))
    sd = compat.get_fp32_state_dict_from_zero_checkpoint(root, truth["tag"], lazy_mode=True)
    assert list(sd) == truth["state_dict_keys"] and not built  # nothing read up front
    stored = _stored(truth)
    for name, lazy in sd.items():
        want = expected_value(stored[truth["tied"].get(name, name)], torch.float32)
        assert (lazy.shape, lazy.dtype) == (want.shape, want.dtype), name
        assert_bitwise_equal(lazy.contiguous(), want, name)
    assert len(built) == len(sd)
    for alias, source in truth["tied"].items():
        assert sd[alias] is sd[source]


@needs_deepspeed
def test_lazy_with_dtype_none_leaves_frozen_weights_in_the_model_dtype():
    truth = _truth(SMALL)
    sd = compat.get_fp32_state_dict_from_zero_checkpoint(_root(SMALL), lazy_mode=True, dtype=None)
    frozen = next(iter(truth["frozen"]))
    assert sd[frozen].dtype == torch.bfloat16
    assert_bitwise_equal(sd[frozen].contiguous(), truth["frozen"][frozen], frozen)


@needs_deepspeed
def test_exclude_frozen_parameters():
    truth = _truth(SMALL)
    sd = compat.get_fp32_state_dict_from_zero_checkpoint(_root(SMALL), exclude_frozen_parameters=True)
    _check(sd, truth, keys=[k for k in truth["state_dict_keys"] if k not in truth["frozen"]])


@needs_deepspeed
@pytest.mark.parametrize("layout", ["s2_bf16_w2_frozen_tied", "s3_bf16_w4_offload"])
def test_load_state_dict_from_zero_checkpoint(layout):
    truth = _truth(layout)
    model = build_model(truth["spec"].get("model")).bfloat16()
    loaded = compat.load_state_dict_from_zero_checkpoint(model, _root(layout), tag=truth["tag"])
    assert loaded is model and model.lm_head.weight is model.embed.weight
    stored = _stored(truth)
    for name, value in model.state_dict().items():
        assert_bitwise_equal(value, stored[truth["tied"].get(name, name)].to(value.dtype), name)


# ---------------------------------------------------------------------------------------------
# Converting to files

def _expected_names(safe: bool, shards: int) -> list[str]:
    # DeepSpeed: weights_name.replace(".bin", "{suffix}.bin"), suffix "-00001-of-0000N" (huggingface_hub)
    stem, ext = ("model", ".safetensors") if safe else ("pytorch_model", ".bin")
    if shards == 1:
        return [stem + ext]
    return [f"{stem}-{i:05d}-of-{shards:05d}{ext}" for i in range(1, shards + 1)] + [f"{stem}{ext}.index.json"]


def _listing(folder: Path) -> list[str]:
    return sorted(n for n in os.listdir(folder) if not n.startswith("."))


def _read(folder: Path, safe: bool) -> dict:
    if safe:
        return load_exported(folder)  # plain safetensors files; the recorded ties put back
    files = [n for n in _listing(folder) if n.endswith(".bin")]
    sd = {}
    for name in files:
        sd.update(torch.load(folder / name, weights_only=True))
    return sd


@needs_deepspeed
@pytest.mark.parametrize("safe", [False, True], ids=["torch", "safetensors"])
@pytest.mark.parametrize("shard", [TINY, "5GB", None], ids=["tiny", "default", "none"])
def test_convert_writes_deepspeeds_file_names_and_the_ground_truth(tmp_path, safe, shard):
    truth = _truth(SMALL)
    compat.convert_zero_checkpoint_to_fp32_state_dict(_root(SMALL), tmp_path, max_shard_size=shard,
                                                      safe_serialization=safe)
    listing = _listing(tmp_path)
    shards = len([n for n in listing if not n.endswith(".json")])
    assert (shards > 1) == (shard == TINY)
    assert listing == sorted(_expected_names(safe, shards))
    sd = _read(tmp_path, safe)
    _check({k: sd[k] for k in truth["state_dict_keys"]}, truth)
    assert set(sd) == set(truth["state_dict_keys"])


@needs_deepspeed
@pytest.mark.parametrize("dtype,want", [("bf16", torch.bfloat16), ("torch.float16", torch.float16),
                                        (torch.bfloat16, torch.bfloat16), (None, None)])
def test_convert_takes_deepspeeds_dtype_names(tmp_path, dtype, want):
    compat.convert_zero_checkpoint_to_state_dict(_root(SMALL), tmp_path, dtype=dtype)
    _check(_read(tmp_path, safe=False), _truth(SMALL), dtype=want)


def test_convert_refuses_an_unknown_dtype(tmp_path):
    with pytest.raises(ValueError, match="Unsupported output dtype 'fp8'"):
        compat.convert_zero_checkpoint_to_state_dict(tmp_path, tmp_path / "out", dtype="fp8")


@needs_deepspeed
def test_convert_writes_next_to_other_files_like_deepspeed(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    compat.convert_zero_checkpoint_to_fp32_state_dict(_root(SMALL), tmp_path)
    assert _listing(tmp_path) == ["config.json", "pytorch_model.bin"]


@needs_deepspeed
@pytest.mark.parametrize("layout", ["s2_fp32_w4_odd_3groups", "s2_bf16_w2_frozen_tied"])  # DeepSpeed drops nothing
def test_convert_writes_what_deepspeeds_converter_writes(tmp_path, layout):
    # Unsharded (huggingface_hub, which DeepSpeed needs for sharding, is not a test dependency).
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    _deepspeed(f"""
        from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict
        convert_zero_checkpoint_to_fp32_state_dict({str(_root(layout))!r}, {str(theirs)!r}, max_shard_size=None)
    """)
    compat.convert_zero_checkpoint_to_fp32_state_dict(_root(layout), ours, max_shard_size=None)
    assert _listing(ours) == _listing(theirs) == ["pytorch_model.bin"]
    got, want = _read(ours, safe=False), _read(theirs, safe=False)
    assert sorted(got) == sorted(want)  # DeepSpeed orders buffers first; zerofast keeps the model's order
    for name, value in want.items():  # DeepSpeed leaves frozen weights in bf16; zerofast upcasts them
        assert_bitwise_equal(got[name], expected_value(value, torch.float32), name)


# ---------------------------------------------------------------------------------------------
# The command

@needs_deepspeed
def test_cli_takes_zero_to_fp32_arguments(tmp_path, capsys):
    truth = _truth(SMALL)
    rc = main(["zero-to-fp32", str(_root(SMALL)), str(tmp_path), "--max_shard_size", "2KB", "--safe_serialization",
               "-t", truth["tag"], "--exclude_frozen_parameters", "-d"])
    assert rc == 0 and capsys.readouterr().out.startswith("saved model-00001-of-")
    shards = len([n for n in _listing(tmp_path) if n.endswith(".safetensors")])
    assert shards > 1 and _listing(tmp_path) == sorted(_expected_names(True, shards))
    keys = [k for k in truth["state_dict_keys"] if k not in truth["frozen"]]
    sd = load_exported(tmp_path)
    _check({k: sd[k] for k in keys}, truth, keys=keys)
    assert set(sd) == set(keys)


@needs_deepspeed
def test_cli_defaults_write_one_pytorch_model_bin(tmp_path):
    out = subprocess.run([sys.executable, "-m", "zerofast", "zero-to-fp32", str(_root(SMALL)), str(tmp_path)],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert _listing(tmp_path) == ["pytorch_model.bin"]
    _check(torch.load(tmp_path / "pytorch_model.bin", weights_only=True), _truth(SMALL))


def test_cli_error_is_one_line(tmp_path, capsys):
    assert main(["zero-to-fp32", str(tmp_path / "nope"), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("zerofast: error: ") and str(tmp_path / "nope") in err[0]
