"""The stage comes from what the files say, never from a guess: a ZeRO save whose optimizer or
rank files are gone fails naming them, instead of reading as ZeRO-0 (the bf16 module weights
upcast in place of the fp32 masters). Every case damages a copy of a real DeepSpeed save."""
from __future__ import annotations

import re

import pytest

import zerofast
from zerofast.cli import describe
from tests.conftest import needs_deepspeed
from tests.dsgen.catalog import ensure_checkpoint
from tests.planting import MODEL, copy_checkpoint, rewrite
from tests.planting import optim_name as _optim, zero3_model_name as _model3

pytestmark = needs_deepspeed


@pytest.fixture
def ckpt(tmp_path):
    return lambda layout: copy_checkpoint(ensure_checkpoint(layout), tmp_path / layout)


def _error(error: type, root, **kwargs) -> str:
    with pytest.raises(zerofast.ZeroFastError) as e:
        zerofast.reconstruct(root, **kwargs)
    assert type(e.value) is error, f"{type(e.value).__name__}: {e.value}"
    return str(e.value)


def _missing(message: str) -> list[str]:
    return message.split("; missing: ", 1)[1].split(", ")


@pytest.mark.parametrize("layout, bf16", [("s2_bf16_w2_frozen_tied", True), ("s1_bf16_w2_fp32accum", True),
                                          ("s1_fp32_w3", False)])
def test_zero12_save_without_its_optimizer_files_is_not_stage0(ckpt, layout, bf16):
    root, tag_dir = ckpt(layout)
    files = sorted(tag_dir.glob("*optim_states.pt"))
    for f in files:
        f.unlink()
    message = _error(zerofast.IncompleteCheckpointError, root)
    assert message.startswith(f"{tag_dir}: expected the ZeRO optimizer files (ds_config says ZeRO stage {layout[1]})")
    assert _missing(message) == [f.name for f in files] == [_optim(r, bf16) for r in range(len(files))]
    with pytest.raises(zerofast.IncompleteCheckpointError):
        describe(root)  # inspect says so too, instead of "ZeRO-0"


@pytest.mark.parametrize("rank", [0, 1])
def test_zero2_missing_one_optimizer_file_is_named(ckpt, rank):
    root, tag_dir = ckpt("s2_bf16_w2_frozen_tied")
    (tag_dir / _optim(rank)).unlink()
    message = _error(zerofast.IncompleteCheckpointError, root)
    assert _missing(message) == [_optim(rank)]


@pytest.mark.parametrize("gone", [[_optim(1)], [_model3(1)], [_optim(1), _model3(1)], [_model3(0)]],
                         ids=["optim", "model", "both", "rank0-model"])
def test_stage3_missing_rank_files_are_named(ckpt, gone):
    root, tag_dir = ckpt("s3_bf16_w2_frozen_tied")
    for name in gone:
        (tag_dir / name).unlink()
    message = _error(zerofast.IncompleteCheckpointError, root)
    assert message.startswith(f"{tag_dir}: ")
    assert sorted(_missing(message)) == sorted(gone)


def test_stage3_without_optimizer_files_names_them(ckpt):
    root, tag_dir = ckpt("s3_bf16_w2_frozen_tied")
    for r in (0, 1):
        (tag_dir / _optim(r)).unlink()
    message = _error(zerofast.IncompleteCheckpointError, root)
    assert "model states are partitioned per rank (ZeRO-3)" in message
    assert _missing(message) == [_optim(0), _optim(1)]


def test_a_long_list_of_missing_files_is_bounded(ckpt):
    root, tag_dir = ckpt("s2_bf16_w2_frozen_tied")
    rewrite(tag_dir / MODEL, lambda o: o.__setitem__("dp_world_size", 5000))
    for f in tag_dir.glob("*optim_states.pt"):
        f.unlink()
    message = _error(zerofast.IncompleteCheckpointError, root)
    assert message.endswith(f"missing: {', '.join(_optim(r) for r in range(4))} and 4996 more")
    assert len(message) < 500


def test_config_stage_must_agree_with_the_optimizer_files(ckpt):
    root, tag_dir = ckpt("s2_bf16_w2_frozen_tied")
    rewrite(tag_dir / MODEL, lambda o: o["ds_config"]["zero_optimization"].__setitem__("stage", 1))
    message = _error(zerofast.InconsistentCheckpointError, root)
    assert message == (f"{tag_dir / MODEL}: the DeepSpeed config (ds_config) says ZeRO stage 1, but the optimizer "
                       "files hold a stage-2 save")


def test_stage0_save_whose_config_says_zero_is_incomplete(ckpt):
    """A stage-0 folder whose config asks for ZeRO-2 lacks the files ZeRO-2 writes."""
    root, tag_dir = ckpt("s0_bf16_w2")
    rewrite(tag_dir / MODEL, lambda o: o["ds_config"].__setitem__("zero_optimization", {"stage": 2}))
    message = _error(zerofast.IncompleteCheckpointError, root)
    assert _missing(message) == [_optim(0), _optim(1)]


def test_stage0_saves_still_read(ckpt):
    root, _ = ckpt("s0_bf16_w2")
    assert describe(root)["stage"] == 0


# ---------------------------------------------------------------------------------------------
# Pipeline parallel is called pipeline parallel

# The files DeepSpeed 0.19.8 writes for a 2-stage pipeline at ZeRO-1, dp 2 (format doc,
# "Pipeline parallel"). Discovery reads names only, so the folder need not hold real data.
def test_pipeline_save_is_reported_as_pipeline_parallel(ckpt):
    """A real two-stage pipeline save has mp_rank_00 and mp_rank_01 files, as a tensor-parallel
    save does; it must be read and reported as a pipeline, not as tensor parallelism."""
    root, _ = ckpt("pipe_s1_bf16_pp2_dp2")
    report = describe(root)
    assert report["parallelism"]["pp"] == 2
    assert report["parallelism"].get("tp", 1) == 1
    assert "pipeline" in report["parallelism"]["family"]


def test_recorded_pipeline_degree_wins_over_the_model_parallel_size(ckpt):
    root, tag_dir = ckpt("s2_bf16_w2_frozen_tied")
    rewrite(tag_dir / MODEL, lambda o: (o.__setitem__("mp_world_size", 2),
                                        o.__setitem__("checkpoint_parallel_dimensions", {"pp_degree": 2, "tp_degree": 1})))
    message = _error(zerofast.IncompleteCheckpointError, root)
    assert "expected pp_degree 1 in a folder with only mp_rank_00 files, found 2" in message
    assert "pipeline-parallel save are missing" in message


def test_pipeline_save_without_layer_files_is_labelled_by_its_model_states(ckpt):
    """A pipeline save whose layer files are gone keeps mp_rank_00 and mp_rank_01, which by name
    alone look tensor-parallel; the model states say pipeline, and the error must too."""
    import shutil

    root, tag_dir = ckpt("s2_bf16_w2_frozen_tied")
    rewrite(tag_dir / MODEL, lambda o: o.__setitem__("checkpoint_parallel_dimensions", {"pp_degree": 2, "tp_degree": 1}))
    shutil.copy(tag_dir / MODEL, tag_dir / "mp_rank_01_model_states.pt")
    message = _error(zerofast.IncompleteCheckpointError, root)
    assert "pipeline-parallel save (pp_degree 2)" in message and "layer files of this save are missing" in message
    assert "tensor-parallel" not in message


def test_only_another_model_parallel_rank_names_the_missing_rank_00(ckpt):
    root, tag_dir = ckpt("s2_bf16_w2_frozen_tied")
    (tag_dir / MODEL).rename(tag_dir / "mp_rank_01_model_states.pt")
    message = _error(zerofast.IncompleteCheckpointError, root)
    assert message.endswith("missing: mp_rank_00_model_states.pt"), message