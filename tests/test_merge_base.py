"""Which base a merged adapter gets (issue 40, section 2): ``--base-dtype as-stored|as-trained``.

A Trainer checkpoint of a PEFT model leaves the frozen base out, so ``--merge-adapters`` takes it
from ``--base-model`` (saved in fp32 by the runs). The trained model held that base in the dtype
of DeepSpeed's mixed-precision mode. Both merges are compared bit for bit with peft's own
``merge_and_unload()`` in fp32 arithmetic: as stored on the folder's weights, as trained on the
base DeepSpeed itself held (the ground truth's gathered frozen weights, upcast). The runs are the
cached ones of tests/test_hf_trainer.py (tests/dsgen/hf_catalog.py).
"""
from __future__ import annotations

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
from tests.planting import copy_checkpoint, rewrite  # noqa: E402
from zerofast.cli import main  # noqa: E402
from zerofast.hf.trainer import MergeBase  # noqa: E402

PEFT = [n for n, s in HF_RUNS.items() if s["peft"]]
BF16 = [n for n in PEFT if HF_RUNS[n]["dtype"] == "bf16"]


def _reference(name: str, base_weights: dict | None) -> dict:
    """peft's merge_and_unload() in fp32 on the base folder's model, its base parameters replaced
    by ``base_weights`` (PEFT names) where given, with the trained fp32 LoRA weights."""
    out, truth = run(name)
    base = transformers.AutoModelForCausalLM.from_pretrained(out / "base", dtype=torch.float32).eval()
    model = peft.get_peft_model(base, peft.LoraConfig.from_pretrained(ckpt(name)))
    weights = {**(base_weights or {}), **truth["trainable"]}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected
    assert not [k for k in missing if "lora_" in k]
    if base_weights is not None:  # every base parameter replaced (a tied name loads with its source)
        assert set(missing) <= set(truth["tied"]), missing
    merged = model.merge_and_unload().state_dict()
    assert all(v.dtype == torch.float32 for v in merged.values())
    return merged


def _as_trained_base(name: str) -> dict:
    """The frozen base as DeepSpeed held it during the run (gathered from the engine), in fp32."""
    _, truth = run(name)
    assert truth["frozen"] and {v.dtype for v in truth["frozen"].values()} == {getattr(torch, truth["model_dtype"])}
    return {k: v.float() for k, v in truth["frozen"].items()}


def _export(name: str, out: Path, capsys, *flags: str) -> tuple[dict, str]:
    folder, _ = run(name)
    assert main(["export", str(ckpt(name)), str(out), "--merge-adapters", "--base-model", str(folder / "base"),
                 *flags]) == 0
    lines = capsys.readouterr().out.splitlines()
    return zerofast.load_exported(out), lines[-1]


def _assert_equal(got: dict, want: dict) -> None:
    """Bit for bit; a tied lm_head, which save_pretrained leaves out of the base folder, is left
    out of the merged folder too (from_pretrained ties it back)."""
    tied = set(want) - set(got)
    assert set(got) <= set(want) and tied <= {"lm_head.weight"}
    for key in tied:
        assert torch.equal(want[key], want["model.embed_tokens.weight"])
    for key in got:
        assert_bitwise_equal(got[key], want[key], key)


@pytest.mark.parametrize("name", PEFT)
def test_both_bases_equal_merge_and_unload_on_that_base(name, tmp_path, capsys):
    out, truth = run(name)
    trained = getattr(torch, truth["model_dtype"])

    default, said = _export(name, tmp_path / "default", capsys)
    assert said == f"merged onto the base as stored (float32) from {out / 'base'}"
    stored, said = _export(name, tmp_path / "stored", capsys, "--base-dtype", "as-stored")
    assert said == f"merged onto the base as stored (float32) from {out / 'base'}"
    as_trained, said = _export(name, tmp_path / "trained", capsys, "--base-dtype", "as-trained")
    assert said == (f"merged onto the base as trained (rounded to {str(trained).removeprefix('torch.')}, the dtype "
                    f"the run held it in) from {out / 'base'}")

    _assert_equal(default, _reference(name, None))
    _assert_equal(stored, default)
    _assert_equal(as_trained, _reference(name, _as_trained_base(name)))

    differ = {k for k in default if not torch.equal(default[k], as_trained[k])}
    if trained == torch.float32:  # nothing to round: the same merge
        assert differ == set()
    else:  # every base parameter was rounded: the merged projections and the untouched weights alike
        assert {"model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                "model.layers.1.mlp.down_proj.weight", "model.layers.0.self_attn.k_proj.weight"} <= differ


@pytest.mark.parametrize("name", BF16)
def test_as_trained_from_python_keeps_the_rounded_base_in_its_dtype(name, tmp_path):
    out, truth = run(name)
    result = zerofast.export(ckpt(name), tmp_path / "keep", merge_adapters=True, base_model=out / "base",
                             base_dtype="as-trained", dtype=None)
    assert result.merge_base == MergeBase("as-trained", torch.bfloat16, out / "base")
    got = zerofast.load_exported(tmp_path / "keep")
    want = _reference(name, _as_trained_base(name))
    lora = {k.removeprefix("base_model.model.").replace(".lora_A.default.weight", ".weight")
            for k in truth["trainable"] if ".lora_A." in k}
    assert lora and lora <= set(got)
    assert set(got) <= set(want)
    for key, value in want.items():
        if key not in got:  # the tied lm_head
            continue
        if key in lora:  # merged in fp32
            assert_bitwise_equal(got[key], value, key)
        else:  # the base as the run held it, bit for bit
            assert_bitwise_equal(got[key], truth["frozen"][f"base_model.model.{key}"], key)
            assert_bitwise_equal(got[key].float(), value, key)


@pytest.mark.parametrize("name", PEFT)
def test_a_checkpoint_with_its_frozen_weights_merges_onto_them_whatever_is_asked(name, tmp_path):
    out, truth = run(name)
    trained = getattr(torch, truth["model_dtype"])
    written = {}
    for choice in ("as-stored", "as-trained"):
        result = zerofast.export(out / "with-frozen", tmp_path / choice, merge_adapters=True,
                                 base_model=out / "base", base_dtype=choice)
        assert result.merge_base == MergeBase("as-trained", trained, None)
        assert result.merge_base.describe() == (f"merged onto the checkpoint's own frozen base weights (as trained, "
                                                f"{str(trained).removeprefix('torch.')})")
        written[choice] = zerofast.load_exported(tmp_path / choice)
    _assert_equal(written["as-stored"], written["as-trained"])
    _assert_equal(written["as-trained"], _reference(name, _as_trained_base(name)))


def _config_edit(**sections):
    def edit(obj):
        for key, value in sections.items():
            if value is ...:
                obj["ds_config"].pop(key, None)
            else:
                obj["ds_config"][key] = value
    return edit


@pytest.mark.parametrize("edit,match", [
    (lambda o: o.pop("ds_config"), "records no DeepSpeed config"),
    (_config_edit(bf16={"enabled": "auto"}), "bf16 'enabled' is 'auto', not true or false"),
    (_config_edit(bf16=True), "bf16 section is True, not a dict"),
    (_config_edit(fp16={"enabled": True}), "enables both fp16 and bf16"),
    # Neither mode: DeepSpeed kept the loaded dtypes, and the file holds bf16 parameters.
    (_config_edit(bf16=..., fp16=...), "enables neither fp16 nor bf16.*module parameters it holds are bfloat16"),
])
def test_as_trained_refuses_a_training_dtype_the_file_does_not_settle_naming_it(edit, match, tmp_path):
    name = "peft_z2_bf16_tied"
    out, _ = run(name)
    _, tag_dir = copy_checkpoint(ckpt(name), tmp_path / "checkpoint-2")
    model_file = tag_dir / "mp_rank_00_model_states.pt"
    rewrite(model_file, edit)
    with pytest.raises(zerofast.ExportError, match=match) as e:
        zerofast.export(tmp_path / "checkpoint-2", tmp_path / "merged", merge_adapters=True,
                        base_model=out / "base", base_dtype="as-trained")
    assert e.value.path == str(model_file)
    assert "--base-dtype as-stored" in str(e.value)
    assert not (tmp_path / "merged").exists()
    # The default needs no training dtype: the same file merges onto the base as stored.
    result = zerofast.export(tmp_path / "checkpoint-2", tmp_path / "merged", merge_adapters=True,
                             base_model=out / "base")
    assert result.merge_base.choice == "as-stored"
    _assert_equal(zerofast.load_exported(tmp_path / "merged"), _reference(name, None))


def test_as_trained_reads_the_legacy_bfloat16_section_and_checks_the_frozen_names_the_file_holds(tmp_path):
    """DeepSpeed reads "bfloat16" where there is no "bf16" section. At ZeRO-3 the file keeps the
    LoRA placeholders in fp32 (added after zero.Init) and the tied lm_head's, frozen, in bf16."""
    name = "peft_z3_bf16_tied"
    out, _ = run(name)
    _, tag_dir = copy_checkpoint(ckpt(name), tmp_path / "legacy")
    rank0 = tag_dir / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    for rank_file in sorted(tag_dir.glob("zero_pp_rank_*_model_states.pt")):
        rewrite(rank_file, _config_edit(bf16=..., bfloat16={"enabled": True}))
    result = zerofast.export(tmp_path / "legacy", tmp_path / "merged", merge_adapters=True, base_model=out / "base",
                             base_dtype="as-trained")
    assert result.merge_base.dtype == torch.bfloat16
    _assert_equal(zerofast.load_exported(tmp_path / "merged"), _reference(name, _as_trained_base(name)))

    def frozen_fp32(obj):
        module = obj["module"]
        assert module["base_model.model.lm_head.weight"].dtype == torch.bfloat16
        module["base_model.model.lm_head.weight"] = module["base_model.model.lm_head.weight"].float()
    rewrite(rank0, frozen_fp32)
    with pytest.raises(zerofast.ExportError, match="trains in bf16, but the frozen parameters it holds are float32") \
            as e:
        zerofast.export(tmp_path / "legacy", tmp_path / "refused", merge_adapters=True, base_model=out / "base",
                        base_dtype="as-trained")
    assert e.value.path == str(rank0)


def test_base_dtype_goes_with_merge_adapters_only(tmp_path, capsys):
    name = PEFT[0]
    out, _ = run(name)
    assert main(["export", str(ckpt(name)), str(tmp_path / "x"), "--base-dtype", "as-trained"]) == 2
    assert "--base-dtype chooses the base of --merge-adapters" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["export", str(ckpt(name)), str(tmp_path / "x"), "--merge-adapters", "--base-dtype", "bf16"])
    assert "invalid choice: 'bf16'" in capsys.readouterr().err
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zerofast.FrozenWeightsAbsentWarning)
        with pytest.raises(ValueError, match="needs merge_adapters=True"):
            zerofast.export(ckpt(name), tmp_path / "x", base_dtype="as-stored")
    with pytest.raises(ValueError, match="base_dtype must be one of 'as-stored', 'as-trained'"):
        zerofast.export(ckpt(name), tmp_path / "x", merge_adapters=True, base_model=out / "base", base_dtype="bf16")
    assert not (tmp_path / "x").exists()


def test_as_trained_leaves_the_module_buffers_as_stored(tmp_path):
    """DeepSpeed casts parameters, not buffers (unless data_types.buffer_dtype says so, which
    as-trained refuses): a persistent buffer of the base keeps its stored value."""
    from safetensors.torch import load_file, save_file

    name = "peft_z2_bf16_tied"
    out, _ = run(name)
    base = tmp_path / "base"
    shutil.copytree(out / "base", base)
    tensors = load_file(base / "model.safetensors")
    buffer = torch.linspace(0.1, 1.7, 24) / 3  # not a bf16 value among them
    assert not torch.equal(buffer.to(torch.bfloat16).float(), buffer)
    save_file({**tensors, "model.scale": buffer}, base / "model.safetensors", metadata={"format": "pt"})
    _, tag_dir = copy_checkpoint(ckpt(name), tmp_path / "checkpoint-2")
    model_file = tag_dir / "mp_rank_00_model_states.pt"
    rewrite(model_file, lambda o: o["buffer_names"].append("base_model.model.model.scale"))

    zerofast.export(tmp_path / "checkpoint-2", tmp_path / "merged", merge_adapters=True, base_model=base,
                    base_dtype="as-trained")
    got = zerofast.load_exported(tmp_path / "merged")
    assert_bitwise_equal(got["model.scale"], buffer, "model.scale")
    assert_bitwise_equal(got["model.layers.0.self_attn.k_proj.weight"],
                         tensors["model.layers.0.self_attn.k_proj.weight"].to(torch.bfloat16).float())

    rewrite(model_file, _config_edit(data_types={"buffer_dtype": "bf16"}))
    with pytest.raises(zerofast.UnsupportedCheckpointError, match="data_types.buffer_dtype.*'model.scale'") as e:
        zerofast.export(tmp_path / "checkpoint-2", tmp_path / "refused", merge_adapters=True, base_model=base,
                        base_dtype="as-trained")
    assert e.value.path == str(model_file)
    assert not (tmp_path / "refused").exists()


@pytest.mark.parametrize("name", BF16[:1])
def test_verify_checks_an_as_trained_merge_against_the_base_it_names(name, tmp_path, capsys):
    """verify --against computes the merge onto the base the export used: as-trained passes with
    --base-dtype as-trained, and the default (as-stored) finds the rounding of the base."""
    folder, _ = run(name)
    _export(name, tmp_path / "trained", capsys, "--base-dtype", "as-trained")
    common = ["verify", str(tmp_path / "trained"), "--against", str(ckpt(name)), "--base-model", str(folder / "base")]
    assert main([*common, "--base-dtype", "as-trained"]) == 0
    assert main(common) == 1
    assert "FAIL" in capsys.readouterr().out
