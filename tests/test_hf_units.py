"""zerofast.hf without DeepSpeed runs: PEFT names, config dtype, the safetensors reader, the merge
formula against peft itself (fan_in_fan_out, rsLoRA, rank/alpha patterns)."""
from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import assert_bitwise_equal
from zerofast.hf import trainer as hf
from zerofast.base.errors import AmbiguousTagError, ExportError


@pytest.mark.parametrize("key,want", [
    ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight",
     "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"),
    ("base_model.model.lm_head.modules_to_save.default.weight", "base_model.model.lm_head.weight"),
    ("base_model.model.model.layers.0.mlp.lora_magnitude_vector.default", "base_model.model.model.layers.0.mlp"
                                                                          ".lora_magnitude_vector"),
    ("base_model.model.default.lora_B.default.weight", "base_model.model.default.lora_B.weight"),
])
def test_adapter_names_are_peft_save_names(key, want):
    assert hf.adapter_name_of(key) == want


def test_adapter_names_match_peft_own_function():
    from peft.tuners.tuners_utils import _remove_adapter_name_from_state_dict_key

    for key in ("a.b.lora_A.default.weight", "x.default.lora_B.default.weight", "m.lora_magnitude_vector.default"):
        assert hf.adapter_name_of(key) == _remove_adapter_name_from_state_dict_key(key, "default")


@pytest.mark.parametrize("present,expected_keys", [
    ({"dtype": "bfloat16"}, {"dtype"}),
    ({"torch_dtype": "bfloat16"}, {"torch_dtype"}),
    ({}, {"dtype", "torch_dtype"}),
])
def test_config_dtype_is_set_under_the_keys_it_uses(tmp_path, present, expected_keys):
    raw = json.dumps({"model_type": "llama", **present}).encode()
    out = json.loads(hf._with_dtype(raw, [tmp_path], torch.float32))
    assert {k for k in ("dtype", "torch_dtype") if k in out} == expected_keys
    assert all(out[k] == "float32" for k in expected_keys)
    assert out["model_type"] == "llama"


def test_safetensors_reader_equals_the_safetensors_package(tmp_path):
    from safetensors.torch import load_file, save_file

    gen = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(3, 5, generator=gen), "b": torch.randn(7, generator=gen).to(torch.bfloat16),
               "c": torch.arange(6, dtype=torch.int64).reshape(2, 3), "d": torch.zeros(0, 4),
               "e": torch.randn(2, 2, generator=gen).half()}
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    mine, theirs = hf.read_safetensors_folder(tmp_path), load_file(tmp_path / "model.safetensors")
    assert set(mine) == set(theirs)
    for k in theirs:
        assert_bitwise_equal(mine[k], theirs[k], k)


def test_safetensors_reader_refuses_lying_headers(tmp_path):
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 64]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 16)
    with pytest.raises(ExportError, match="do not fit"):
        hf.read_safetensors_folder(tmp_path)
    (tmp_path / "model.safetensors").write_bytes((10**9).to_bytes(8, "little") + b"{}")
    with pytest.raises(ExportError, match="header"):
        hf.read_safetensors_folder(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ExportError, match="save_pretrained"):
        hf.read_safetensors_folder(tmp_path)


def test_output_dir_resolution(tmp_path):
    from zerofast.discover import trainer_checkpoint

    for n in (3, 12):
        (tmp_path / f"checkpoint-{n}" / "global_step1").mkdir(parents=True)
        (tmp_path / f"checkpoint-{n}" / "latest").write_text("global_step1")
    with pytest.raises(AmbiguousTagError, match="checkpoint-3, checkpoint-12"):
        trainer_checkpoint(tmp_path)
    (tmp_path / "checkpoint-3" / "latest").unlink()
    assert trainer_checkpoint(tmp_path) == tmp_path / "checkpoint-12"
    assert trainer_checkpoint(tmp_path / "checkpoint-12") == tmp_path / "checkpoint-12"


@pytest.mark.parametrize("options", [
    {"fan_in_fan_out": True},
    {"fan_in_fan_out": False, "use_rslora": True},
    {"fan_in_fan_out": False, "rank_pattern": {"fc2": 2}, "alpha_pattern": {"fc2": 3}},
])
def test_merge_formula_equals_peft_merge_and_unload(options):
    """The same fp32 weights through peft's merge_and_unload and through zerofast's formula."""
    peft = pytest.importorskip("peft")
    from transformers.pytorch_utils import Conv1D

    fan = options["fan_in_fan_out"]
    torch.manual_seed(0)
    layer = (lambda i, o: Conv1D(o, i)) if fan else torch.nn.Linear
    model = torch.nn.Sequential()
    model.add_module("fc1", layer(24, 40))
    model.add_module("fc2", layer(40, 8))
    config = peft.LoraConfig(r=4, lora_alpha=7, target_modules=["fc1", "fc2"], **options)
    wrapped = peft.get_peft_model(model, config)
    with torch.no_grad():
        for n, p in wrapped.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn_like(p))
    lora = {n: p.detach().clone() for n, p in wrapped.named_parameters() if "lora_" in n}
    base = {n: p.detach().clone() for n, p in wrapped.named_parameters() if "base_layer.weight" in n}
    merged = wrapped.merge_and_unload().state_dict()
    cfg = config.to_dict()
    for module in ("fc1", "fc2"):
        a = lora[f"base_model.model.{module}.lora_A.default.weight"]
        b = lora[f"base_model.model.{module}.lora_B.default.weight"]
        scaling = hf._scaling(cfg, module, a.shape[0])
        got = hf._merge(base[f"base_model.model.{module}.base_layer.weight"], a, b, scaling, fan, module)
        assert_bitwise_equal(got, merged[f"{module}.weight"], module)


def test_every_entry_point_takes_a_trainer_output_dir(tmp_path):
    """reconstruct, inspect and verify find the one checkpoint-N save, as export does."""
    import shutil

    import zerofast
    from zerofast.cli import describe
    from tests.helpers import real_root

    shutil.copytree(real_root("s2_bf16_w2_frozen_tied"), tmp_path / "out" / "checkpoint-3", symlinks=True)
    (tmp_path / "out" / "runs").mkdir()  # what else a Trainer leaves there
    direct = zerofast.reconstruct(tmp_path / "out" / "checkpoint-3")
    via = zerofast.reconstruct(tmp_path / "out")
    assert list(via) == list(direct) and all(torch.equal(via[k], direct[k]) for k in direct)
    assert describe(tmp_path / "out")["tag"] == describe(tmp_path / "out" / "checkpoint-3")["tag"]
    assert zerofast.verify(tmp_path / "out").ok
