"""Real Hugging Face Trainer (+ PEFT LoRA) runs on DeepSpeed, read and exported end to end.

The runs (tests/dsgen/hf_catalog.py) train a tiny Llama on 2 ranks under torchrun on the CPU and
save DeepSpeed's own view of the weights as the ground truth. Everything is compared bit for bit.
"""
from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch

import zerofast
from tests.conftest import HAVE_DEEPSPEED
from tests.helpers import assert_bitwise_equal

transformers = pytest.importorskip("transformers", reason="transformers is needed for the HF Trainer runs")
peft = pytest.importorskip("peft", reason="peft is needed for the HF Trainer runs")
pytest.importorskip("accelerate", reason="accelerate is needed for the HF Trainer runs")
if not HAVE_DEEPSPEED:
    pytest.skip("DeepSpeed 0.19.8 is needed to make real checkpoints", allow_module_level=True)

from tests.dsgen.hf_catalog import HF_RUNS  # noqa: E402
from tests.dsgen.hf_catalog import hf_checkpoint as ckpt, hf_run as run  # noqa: E402
from zerofast.cli import main  # noqa: E402
from zerofast.output.transaction import LEGACY_MARKER, MARKER  # noqa: E402

FULL = [n for n, s in HF_RUNS.items() if not s["peft"]]
PEFT = [n for n, s in HF_RUNS.items() if s["peft"]]
IDS = torch.tensor([[5, 9, 17, 33, 4, 40, 21, 8]])


def _quiet_reconstruct(*args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zerofast.FrozenWeightsAbsentWarning)
        return zerofast.reconstruct(*args, **kwargs)


def _load(folder: Path, **kwargs):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True, **kwargs)
    assert not info["missing_keys"], info
    assert not info["unexpected_keys"], info
    assert not info.get("mismatched_keys"), info
    return model.eval()


def _truth_model(out: Path, weights: dict) -> torch.nn.Module:
    """The architecture of the run with the ground-truth weights put in by hand."""
    config = transformers.AutoConfig.from_pretrained(out / "base")
    config.dtype = torch.float32
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected
    assert set(missing) <= {"lm_head.weight"} and (not missing or config.tie_word_embeddings)
    return model.eval()


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


# ---------------------------------------------------------------------------------------------
# Reading: every entry point on the Trainer's saves

@pytest.mark.parametrize("name", FULL)
def test_full_finetune_reconstructs_bit_for_bit(name):
    _, truth = run(name)
    sd = zerofast.reconstruct(ckpt(name), dtype=None)
    assert list(sd) == truth["state_dict_keys"]
    for key, want in truth["trainable"].items():
        assert_bitwise_equal(sd[key], want, key)
    for alias, source in truth["tied"].items():
        assert sd[alias] is sd[source]


@pytest.mark.parametrize("name", PEFT)
def test_peft_save_without_frozen_weights_reads_at_every_entry_point(name, tmp_path, capsys):
    _, truth = run(name)
    path = ckpt(name)
    want = truth["trainable"]
    with pytest.warns(zerofast.FrozenWeightsAbsentWarning, match="exclude_frozen_parameters=True"):
        full = zerofast.reconstruct(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # asked for the adapter only: nothing to warn about
        adapter = zerofast.reconstruct(path, exclude_frozen=True)
        lazy = zerofast.reconstruct(path, exclude_frozen=True, lazy=True)
    for sd in (full, adapter, lazy):
        assert list(sd) == list(want)
        for key, value in want.items():
            assert_bitwise_equal(sd[key], value, key)
    with pytest.warns(zerofast.FrozenWeightsAbsentWarning):
        compat = zerofast.compat.get_fp32_state_dict_from_zero_checkpoint(path)
    assert list(compat) == list(want)

    assert main(["zero-to-fp32", str(path), str(tmp_path / "z2f"), "--safe_serialization"]) == 0
    assert "zerofast: warning:" in capsys.readouterr().err
    written = zerofast.load_exported(tmp_path / "z2f")
    for key, value in want.items():
        assert_bitwise_equal(written[key], value, key)


@pytest.mark.parametrize("name", PEFT)
def test_inspect_says_the_frozen_weights_are_absent(name, capsys):
    _, truth = run(name)
    assert main(["inspect", str(ckpt(name)), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["frozen_excluded"] is True
    assert report["tensors"]["trainable"]["count"] == len(truth["trainable"])
    assert report["tensors"]["frozen"]["count"] == 0
    # The tied pair is the only frozen pair the save still names.
    assert report["absent_frozen"] == sorted(p for pair in truth["tied"].items() for p in pair)
    assert main(["inspect", str(ckpt(name))]) == 0
    assert "frozen weights are not in this checkpoint" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# Exporting a folder from_pretrained loads as it is

@pytest.mark.parametrize("name", FULL)
def test_export_loads_in_transformers_with_the_truth(name, tmp_path):
    out, truth = run(name)
    result = zerofast.export(out, tmp_path / "hf")  # the Trainer's output_dir: one checkpoint in it
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= set(
        result.other_files)
    model = _load(tmp_path / "hf")
    assert next(model.parameters()).dtype == torch.float32
    loaded = model.state_dict()
    for key, want in truth["trainable"].items():
        assert_bitwise_equal(loaded[key], want, key)
    assert torch.equal(_logits(model), _logits(_truth_model(out, truth["trainable"])))
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tok("w5 w6")["input_ids"] == [5, 6]


@pytest.mark.parametrize("name", FULL)
def test_config_dtype_follows_the_exported_dtype(name, tmp_path):
    _, truth = run(name)
    for flag, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        assert main(["export", str(ckpt(name)), str(tmp_path / flag), "--dtype", flag, "--quiet"]) == 0
        config = json.loads((tmp_path / flag / "config.json").read_text())
        assert config["dtype"] == str(dtype).removeprefix("torch.")
        model = _load(tmp_path / flag)  # dtype="auto": the config decides
        for key, want in truth["trainable"].items():
            assert_bitwise_equal(model.state_dict()[key], want.to(dtype), key)


def test_trainer_output_dir_with_several_checkpoints_is_refused_naming_them(tmp_path):
    out = tmp_path / "output_dir"
    out.mkdir()
    for n in (2, 10):
        (out / f"checkpoint-{n}").symlink_to(ckpt(FULL[0]), target_is_directory=True)
    with pytest.raises(zerofast.AmbiguousTagError, match="checkpoint-2, checkpoint-10"):
        zerofast.export(out, tmp_path / "hf")


# ---------------------------------------------------------------------------------------------
# PEFT: as is (warns), adapter, merged

@pytest.mark.parametrize("name", PEFT)
def test_peft_export_as_is_warns_towards_adapter_and_merge(name, tmp_path, capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zerofast.FrozenWeightsAbsentWarning)
        with pytest.warns(UserWarning, match="--adapter.*--merge-adapters"):
            zerofast.export(ckpt(name), tmp_path / "as-is")
    assert main(["export", str(ckpt(name)), str(tmp_path / "cli"), "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "zerofast: warning:" in err and "--adapter" in err


def _base(out: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(out / "base", dtype=torch.float32).eval()


def _lora_truth(truth: dict) -> dict:
    return {k: v for k, v in truth["trainable"].items()}


@pytest.mark.parametrize("name", PEFT)
def test_adapter_export_loads_in_peft(name, tmp_path):
    out, truth = run(name)
    assert main(["export", str(ckpt(name)), str(tmp_path / "adapter"), "--adapter", "--quiet"]) == 0
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(os.listdir(tmp_path / "adapter"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # peft warns about missing/unexpected adapter keys
        model = peft.PeftModel.from_pretrained(_base(out), tmp_path / "adapter")
    loaded = model.state_dict()
    for key, want in _lora_truth(truth).items():
        assert_bitwise_equal(loaded[key], want, key)


def _reference_merge(out: Path, truth: dict) -> dict:
    """peft's own merge_and_unload() on the base weights and the trained fp32 LoRA weights."""
    config = peft.LoraConfig.from_pretrained(ckpt_for_truth(out, truth))
    model = peft.get_peft_model(_base(out), config)
    missing, unexpected = model.load_state_dict(_lora_truth(truth), strict=False)
    assert not unexpected and not [k for k in missing if "lora_" in k]
    return model.merge_and_unload().state_dict()


def ckpt_for_truth(out: Path, truth: dict) -> Path:
    return out / truth["checkpoint"]


@pytest.mark.parametrize("name", PEFT)
def test_merged_export_equals_merge_and_unload(name, tmp_path):
    out, truth = run(name)
    with pytest.raises(zerofast.ExportError, match="base_model="):
        zerofast.export(ckpt(name), tmp_path / "no-base", merge_adapters=True)
    assert main(["export", str(ckpt(name)), str(tmp_path / "merged"), "--merge-adapters", "--base-model",
                 str(out / "base"), "--quiet"]) == 0
    model = _load(tmp_path / "merged")
    want = _reference_merge(out, truth)
    got = model.state_dict()
    assert set(got) == set(want)
    for key in want:
        assert_bitwise_equal(got[key], want[key], key)
    reference = transformers.AutoModelForCausalLM.from_pretrained(out / "base", dtype=torch.float32)
    reference.load_state_dict(want)
    assert torch.equal(_logits(model), _logits(reference.eval()))

    # Sharded and in the torch format: the merged weights are built as the writer reaches them.
    zerofast.export(ckpt(name), tmp_path / "sharded", merge_adapters=True, base_model=out / "base",
                    format="torch", max_shard_size="20KB")
    sharded, single = zerofast.load_exported(tmp_path / "sharded"), zerofast.load_exported(tmp_path / "merged")
    assert len(os.listdir(tmp_path / "sharded")) > 4 and list(sharded) == list(single)
    for key in single:
        assert_bitwise_equal(sharded[key], single[key], key)


# ---------------------------------------------------------------------------------------------
# The marker: not uploaded, not in the way

def test_marker_is_not_uploaded_and_user_files_do_not_block_a_rerun(tmp_path):
    from huggingface_hub.utils import DEFAULT_IGNORE_PATTERNS, filter_repo_objects

    folder = tmp_path / "hf"
    zerofast.export(ckpt(FULL[0]), folder)
    assert (folder / MARKER).is_file()
    # What upload_folder lists and filters by default (hf_api._prepare_upload_folder_additions).
    listed = [p.relative_to(folder).as_posix() for p in sorted(folder.glob("**/*")) if p.is_file()]
    uploaded = list(filter_repo_objects(listed, ignore_patterns=list(DEFAULT_IGNORE_PATTERNS)))
    assert MARKER in listed and MARKER not in uploaded and "model.safetensors" in uploaded

    (folder / "README.md").write_text("my model card")
    (folder / LEGACY_MARKER).write_text(json.dumps({"files": ["model.safetensors"]}))  # an older zerofast's
    result = zerofast.export(ckpt(FULL[0]), folder, dtype=torch.bfloat16)
    assert (folder / "README.md").read_text() == "my model card"
    assert not (folder / LEGACY_MARKER).exists()
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    assert sorted(json.loads((folder / MARKER).read_text())["files"]) == sorted(result.files + result.other_files)

    fresh = tmp_path / "not-ours"
    fresh.mkdir()
    (fresh / "README.md").write_text("x")
    with pytest.raises(zerofast.OutputExistsError, match="README.md"):
        zerofast.export(ckpt(FULL[0]), fresh)
    shutil.rmtree(fresh)


# ---------------------------------------------------------------------------------------------
# PEFT saved by DeepSpeed directly: the frozen base is in the checkpoint

@pytest.mark.parametrize("name", PEFT)
def test_peft_save_with_frozen_weights_reconstructs_and_merges_from_the_checkpoint(name, tmp_path):
    out, truth = run(name)
    with warnings.catch_warnings():
        warnings.simplefilter("error", zerofast.FrozenWeightsAbsentWarning)
        sd = zerofast.reconstruct(out / "with-frozen", dtype=None)
    assert list(sd) == truth["state_dict_keys"]
    for key, want in {**truth["trainable"], **truth["frozen"]}.items():
        assert_bitwise_equal(sd[key], want, key)
    for alias, source in truth["tied"].items():
        assert sd[alias] is sd[source]

    # Base weights from the checkpoint (as trained, in the model dtype); config from --base-model.
    zerofast.export(out / "with-frozen", tmp_path / "merged", merge_adapters=True, base_model=out / "base")
    model = _load(tmp_path / "merged")
    config = peft.LoraConfig.from_pretrained(out / "with-frozen")
    reference = peft.get_peft_model(_base(out), config)
    weights = {**{k: v.float() for k, v in truth["frozen"].items()}, **truth["trainable"]}
    missing, unexpected = reference.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= set(truth["tied"])  # a tied name loads with its source
    want = reference.merge_and_unload().state_dict()
    got = model.state_dict()
    assert set(got) == set(want)
    for key in want:
        assert_bitwise_equal(got[key], want[key], key)


def test_two_worker_export_of_a_trainer_folder_is_the_single_process_one(tmp_path):
    name = next(n for n in FULL if HF_RUNS[n]["stage"] == 3)
    assert main(["export", str(ckpt(name)), str(tmp_path / "one"), "--quiet"]) == 0
    assert main(["export", str(ckpt(name)), str(tmp_path / "two"), "--workers", "2", "--quiet"]) == 0
    files = sorted(str(p.relative_to(tmp_path / "one")) for p in (tmp_path / "one").rglob("*") if p.is_file())
    assert "config.json" in files
    assert files == sorted(str(p.relative_to(tmp_path / "two")) for p in (tmp_path / "two").rglob("*") if p.is_file())
    # zerofast's marker records each file's inode and mtime: only its list of files is the same.
    assert [f for f in files
            if f != MARKER and (tmp_path / "one" / f).read_bytes() != (tmp_path / "two" / f).read_bytes()] == []

    assert main(["export", str(ckpt(name)), str(tmp_path / "one"), "--weights-only", "--quiet"]) == 0
    assert sorted(os.listdir(tmp_path / "one")) == [".cache", "model.safetensors"]  # its own copies go


@pytest.mark.parametrize("bad,match", [
    ({"lora_alpha": "8"}, "'lora_alpha' to be a number"),
    ({"r": 0}, "positive 'r'"),
    ({"alpha_pattern": {"q_proj": -1}}, "positive number"),
    ({"use_dora": True}, "DoRA"),
])
def test_merge_refuses_a_broken_adapter_config_naming_it(tmp_path, monkeypatch, bad, match):
    monkeypatch.setenv("ZEROFAST_FOLLOW_SYMLINKS", "1")  # the folder links to the cached checkpoint
    out, truth = run(PEFT[0])
    folder = tmp_path / "checkpoint-2"
    folder.mkdir()
    for entry in ("latest", "global_step2"):
        (folder / entry).symlink_to(ckpt(PEFT[0]) / entry)
    config = json.loads((ckpt(PEFT[0]) / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, **bad}))
    with pytest.raises(zerofast.ZeroFastError, match=match) as e:
        zerofast.export(folder, tmp_path / "merged", merge_adapters=True, base_model=out / "base")
    assert e.value.path == str(folder / "adapter_config.json")
    assert not (tmp_path / "merged").exists()


def test_a_dangling_tie_is_absent_only_in_a_save_that_left_frozen_weights_out(tmp_path):
    """Stage 2 records frozen_param_shapes as a dict unless frozen weights were left out; only
    then may a tie point at a name the module no longer holds."""
    from tests.planting import copy_checkpoint, rewrite

    _, tag_dir = copy_checkpoint(ckpt("full_z2_bf16_tied"), tmp_path / "ckpt")
    model_file = tag_dir / "mp_rank_00_model_states.pt"
    rewrite(model_file, lambda o: o["shared_params"].__setitem__("lm_head.weight", "model.gone.weight"))
    with pytest.raises(zerofast.InconsistentCheckpointError, match="points to unknown parameter 'model.gone.weight'"):
        zerofast.reconstruct(tmp_path / "ckpt")
    rewrite(model_file, lambda o: o.__setitem__("frozen_param_shapes", None))
    with pytest.warns(zerofast.FrozenWeightsAbsentWarning, match="lm_head.weight, model.gone.weight"):
        sd = zerofast.reconstruct(tmp_path / "ckpt")
    assert "lm_head.weight" not in sd and "model.embed_tokens.weight" in sd
