"""zerofast.to_universal of pipeline-parallel saves (issue 47), against DeepSpeed 0.19.8's own
ds_to_universal run on the same real saves, field for field and bit for bit:

* the Megatron-DeepSpeed-style TP 2 x PP 2 save (tests/dsgen/train_megatron_pipe.py; its generator
  ran ds_to_universal, strict, into ``<save>/universal``): every file DeepSpeed writes, and no other;
  the tied module's parameters once, from the first stage (``pipeline_replicated_parameter_patterns``),
  though the last stage's position-embedding copy differs;
* the plain ``deepspeed.pipe`` saves of tests/dsgen/families.py (PP 2, ZeRO 1, also with the
  BF16_Optimizer; no ``universal_checkpoint_info``, so ds_to_universal ran with
  ``--inject_missing_state``: tests/dsgen/universal_pipe.py): every file DeepSpeed writes, and beside
  them the frozen parameters and buffers, which DeepSpeed leaves out of a pipeline save's universal
  folder (its ``module`` is None) and zerofast writes as it does for every other save.

The model-states files are copied byte for byte (DeepSpeed copies the ``mp_rank_*`` files, not the
layer files). Refused with a reason naming the file: a ZeRO-off pipeline save, and a padded
vocabulary at one tp rank (ds_to_universal trims its rows, zerofast keeps them there)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import zerofast

from tests.conftest import needs_deepspeed
from tests.dsgen.megatron_pipe_layouts import MEGATRON_PIPE_LAYOUTS
from tests.dsgen.universal_pipe import ERROR, PIPE_ZERO, ensure_pipe_universal
from tests.helpers import assert_bitwise_equal, real_root, real_truth
from tests.test_megatron_tp import _same

pytestmark = needs_deepspeed

MEGATRON_PIPE = sorted(n for n, s in MEGATRON_PIPE_LAYOUTS.items() if s["stage"] > 0 and not s.get("frozen"))
POSITION = "tied_modules.embed.position_embeddings.weight"


def _theirs(layout: str) -> Path:
    """DeepSpeed's universal tag folder of ``layout``; a skip with its recorded error where it failed."""
    root = real_root(layout) if layout in MEGATRON_PIPE_LAYOUTS else ensure_pipe_universal(layout)
    error = root / ERROR
    if error.is_file():
        pytest.skip(f"DeepSpeed's ds_to_universal failed on {layout}: {error.read_text().strip()}")
    folder = root / "universal" if layout in MEGATRON_PIPE_LAYOUTS else root
    return folder / (folder / "latest_universal").read_text().strip()


def _convert(layout: str, tmp_path: Path) -> tuple[Path, Path]:
    theirs = _theirs(layout)
    ours = zerofast.to_universal(real_root(layout), tmp_path / "u" / theirs.name)
    assert (tmp_path / "u" / "latest_universal").read_text() == theirs.name
    return theirs, ours


def _compare(theirs: Path, ours: Path) -> list[Path]:
    """Every file DeepSpeed wrote, equal in ours; returns the files only ours has."""
    files = sorted(p.relative_to(theirs) for p in theirs.rglob("*.pt"))
    mine = sorted(p.relative_to(ours) for p in ours.rglob("*.pt"))
    assert set(files) <= set(mine), sorted(set(files) - set(mine))
    for rel in files:
        if rel.parent == Path("."):  # the source's mp_rank model-states files, copied
            assert (ours / rel).read_bytes() == (theirs / rel).read_bytes(), rel
            continue
        _same(torch.load(ours / rel, weights_only=False), torch.load(theirs / rel, weights_only=False), str(rel))
    return sorted(set(mine) - set(files))


@pytest.mark.parametrize("layout", MEGATRON_PIPE)
def test_megatron_pipe_to_universal_writes_what_ds_to_universal_writes(layout, tmp_path, monkeypatch):
    monkeypatch.delenv("ZEROFAST_TP_REPLICATED", raising=False)
    monkeypatch.delenv("ZEROFAST_TP_RULES", raising=False)
    theirs, ours = _convert(layout, tmp_path)
    assert _compare(theirs, ours) == []
    assert sorted(p.name for p in ours.glob("*.pt")) == sorted(p.name for p in theirs.glob("*.pt"))
    assert not list(ours.glob("layer_*"))


@pytest.mark.parametrize("layout", MEGATRON_PIPE)
def test_tied_module_is_written_once_from_the_first_stage(layout, tmp_path, monkeypatch):
    """The last stage's position-embedding copy differs (no gradient there); the first stage's is
    written, master and moments, as the ground truth holds it."""
    monkeypatch.delenv("ZEROFAST_TP_REPLICATED", raising=False)
    truth = real_truth(layout)
    assert truth["pipe_copies_identical"][POSITION] is False
    _, ours = _convert(layout, tmp_path)
    got = torch.load(ours / "zero" / POSITION / "fp32.pt", weights_only=True)
    assert list(got) == ["param"]  # tp-replicated: no cat_dim
    assert_bitwise_equal(got["param"], truth["trainable"][POSITION], POSITION)
    assert not torch.equal(got["param"], truth["pipe_copies"][POSITION])
    for key in ("exp_avg", "exp_avg_sq"):
        moment = torch.load(ours / "zero" / POSITION / f"{key}.pt", weights_only=True)["param"]
        assert_bitwise_equal(moment, truth["optimizer_states"][key][POSITION], f"{POSITION} {key}")


@pytest.mark.parametrize("layout", PIPE_ZERO)
def test_pipe_to_universal_writes_what_ds_to_universal_writes(layout, tmp_path):
    """Every file DeepSpeed writes; beside them only the frozen parameters' and buffers' fp32.pt,
    each its stored value bit for bit."""
    theirs, ours = _convert(layout, tmp_path)
    extra = _compare(theirs, ours)
    truth = real_truth(layout)
    module = {**truth["frozen"], **truth["buffers"]}
    assert extra == sorted(Path("zero") / name / "fp32.pt" for name in module)
    for name, value in module.items():
        got = torch.load(ours / "zero" / name / "fp32.pt", weights_only=True)
        assert_bitwise_equal(got["param"], value, name)


def test_a_zero_off_pipeline_save_is_refused(tmp_path):
    with pytest.raises(zerofast.UnsupportedCheckpointError, match="stage 0") as e:
        zerofast.to_universal(real_root("megatron_pipe_s0_fp32_tp2_pp2"), tmp_path / "u" / "step")
    assert "mp_rank_00_model_states.pt" in str(e.value)


def _with_vocabulary(tmp_path: Path, original: int) -> Path:
    """pipe_s1_bf16_pp2_dp1 with Megatron's vocabulary rule naming its tied embedding (16 rows)."""
    root = tmp_path / "src"
    shutil.copytree(real_root("pipe_s1_bf16_pp2_dp1"), root)
    tag_dir = root / (root / "latest").read_text().strip()
    for path in sorted(tag_dir.glob("mp_rank_*_model_states.pt")):
        sd = torch.load(path, weights_only=False)
        sd["universal_checkpoint_info"] = {"universal_checkpoint_version": 0.2, "original_vocab_size": original,
                                           "vocabulary_parameter_patterns": [r"tied_modules\.embed\.weight"]}
        torch.save(sd, path)
    return root


def test_a_padded_vocabulary_at_one_tp_rank_is_refused(tmp_path):
    rows = real_truth("pipe_s1_bf16_pp2_dp1")["trainable"]["tied_modules.embed.weight"].shape[0]
    root = _with_vocabulary(tmp_path, rows - 3)
    with pytest.raises(zerofast.UnsupportedCheckpointError,
                       match=rf"'tied_modules.embed.weight'.*{rows} rows \(original_vocab_size {rows - 3}\)") as e:
        zerofast.to_universal(root, tmp_path / "u" / "step")
    assert "mp_rank_00_model_states.pt" in str(e.value)
    assert not (tmp_path / "u" / "step").exists()


def test_an_unpadded_vocabulary_at_one_tp_rank_is_marked(tmp_path):
    """As ds_to_universal writes it: the rule's fields, ``vocab_tensor`` after ``cat_dim``."""
    truth = real_truth("pipe_s1_bf16_pp2_dp1")
    full = truth["trainable"]["tied_modules.embed.weight"]
    out = zerofast.to_universal(_with_vocabulary(tmp_path, full.shape[0]), tmp_path / "u" / "step")
    got = torch.load(out / "zero" / "tied_modules.embed.weight" / "fp32.pt", weights_only=True)
    assert list(got) == ["cat_dim", "vocab_tensor", "param"] and got["cat_dim"] == 0 and got["vocab_tensor"] is True
    assert_bitwise_equal(got["param"], full, "tied_modules.embed.weight")
    other = torch.load(out / "zero" / "1.up.weight" / "fp32.pt", weights_only=True)
    assert list(other) == ["cat_dim", "param"] and other["cat_dim"] == 0
