"""Discovery and the errors for checkpoint sets that are incomplete, ambiguous or unsupported."""
import shutil

import pytest
import torch

import zerofast
from tests.conftest import needs_deepspeed
from tests.dsgen.catalog import ensure_checkpoint
from zerofast import discover


@pytest.fixture(scope="module")
def stage2():
    return ensure_checkpoint("s2_bf16_w2_frozen_tied")


@pytest.fixture(scope="module")
def stage3():
    return ensure_checkpoint("s3_bf16_w2_frozen_tied")


def _copy(root, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(root, dst)
    return dst, dst / (dst / "latest").read_text().strip()


pytestmark = needs_deepspeed


def test_missing_latest_with_one_tag_uses_it(stage2, tmp_path):
    root, _ = _copy(stage2, tmp_path)
    (root / "latest").unlink()
    assert list(zerofast.reconstruct(root))


def test_missing_latest_with_several_tags_lists_them(stage2, tmp_path):
    root, tag_dir = _copy(stage2, tmp_path)
    (root / "latest").unlink()
    shutil.copytree(tag_dir, root / "global_step9")
    with pytest.raises(zerofast.AmbiguousTagError, match=r"global_step3.*global_step9"):
        zerofast.reconstruct(root)
    assert list(zerofast.reconstruct(root, tag="global_step9"))


def test_tags_named_like_trainer_checkpoints_are_tags(stage2, tmp_path):
    # A save whose own tags are checkpoint-N (engine.save_checkpoint(dir, tag=...), no latest):
    # a tag passed by name is that tag, not an output folder's ambiguous checkpoints.
    root, tag_dir = _copy(stage2, tmp_path)
    (root / "latest").unlink()
    tag_dir.rename(root / "checkpoint-1")
    shutil.copytree(root / "checkpoint-1", root / "checkpoint-2")
    with pytest.raises(zerofast.AmbiguousTagError, match="checkpoint-1.*checkpoint-2"):
        zerofast.reconstruct(root)
    found = discover.locate(root, tag="checkpoint-2")
    assert (found.root, found.tag) == (root, "checkpoint-2")
    assert list(zerofast.reconstruct(root, tag="checkpoint-2"))


def test_unknown_tag(stage2):
    with pytest.raises(zerofast.CheckpointNotFoundError, match="tag 'nope'"):
        zerofast.reconstruct(stage2, tag="nope")


def test_empty_and_missing_folders(tmp_path):
    with pytest.raises(zerofast.CheckpointNotFoundError, match="found none"):
        zerofast.reconstruct(tmp_path)
    with pytest.raises(zerofast.CheckpointNotFoundError, match="no such directory"):
        zerofast.reconstruct(tmp_path / "absent")


def test_missing_rank_file_is_named(stage3, tmp_path):
    _, tag_dir = _copy(stage3, tmp_path)
    (tag_dir / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()
    with pytest.raises(zerofast.IncompleteCheckpointError, match="missing: zero_pp_rank_1_mp_rank_00_model_states.pt$"):
        zerofast.reconstruct(tag_dir)


def test_missing_middle_rank_is_named(stage2, tmp_path):
    _, tag_dir = _copy(stage2, tmp_path)
    optim = sorted(tag_dir.glob("*optim_states.pt"))
    shutil.copy(optim[0], tag_dir / optim[0].name.replace("pp_rank_0_", "pp_rank_3_"))
    with pytest.raises(zerofast.IncompleteCheckpointError, match=r"found 3; missing: \w*zero_pp_rank_2_mp_rank_00_optim_states.pt$"):
        zerofast.reconstruct(tag_dir)


def test_stray_rank_files_from_another_world_size(stage2, tmp_path):
    _, tag_dir = _copy(stage2, tmp_path)
    optim = sorted(tag_dir.glob("*optim_states.pt"))
    for r in (2, 3):
        shutil.copy(optim[0], tag_dir / optim[0].name.replace("pp_rank_0_", f"pp_rank_{r}_"))
    with pytest.raises(zerofast.IncompleteCheckpointError, match=r"partition_count is 2 but 4 rank files.*rank_2"):
        zerofast.reconstruct(tag_dir)


def test_truncated_file_is_corrupt(stage2, tmp_path):
    _, tag_dir = _copy(stage2, tmp_path)
    victim = next(tag_dir.glob("*optim_states.pt"))
    victim.write_bytes(victim.read_bytes()[:1000])
    with pytest.raises(zerofast.CorruptCheckpointError) as e:
        zerofast.reconstruct(tag_dir)
    assert victim.name in str(e.value)


def test_tensor_parallel_without_autotp_map_and_old_moe_are_refused(stage2, tmp_path):
    _, tag_dir = _copy(stage2, tmp_path)
    copies = [tag_dir / "mp_rank_01_model_states.pt"]
    shutil.copy(tag_dir / "mp_rank_00_model_states.pt", copies[0])
    for path in (tag_dir / "mp_rank_00_model_states.pt", copies[0]):
        # The engine records its degrees (DeepSpeed 0.19.5 on): a consistent two-rank grid says 2.
        states = torch.load(path, weights_only=False)
        states["checkpoint_parallel_dimensions"] = {**(states.get("checkpoint_parallel_dimensions") or {}), "tp_degree": 2}
        torch.save(states, path)
    with pytest.raises(zerofast.IncompleteCheckpointError, match="every .data-parallel, tensor-parallel. rank pair"):
        zerofast.reconstruct(tag_dir)
    for r in (0, 1):
        copies.append(tag_dir / f"bf16_zero_pp_rank_{r}_mp_rank_01_optim_states.pt")
        shutil.copy(tag_dir / f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt", copies[-1])
    # A complete grid of rank files, but neither AutoTP's affine_map nor Megatron-DeepSpeed's pattern
    # lists say how the shards fit together (and the names are not Megatron's: no preset is named).
    with pytest.raises(zerofast.UnsupportedCheckpointError, match="expected universal_checkpoint_info") as e:
        zerofast.reconstruct(tag_dir)
    assert "--tp-rules FILE" in str(e.value) and "megatron-gpt" not in str(e.value)
    for path in copies:
        path.unlink()
    (tag_dir / "expert_0_mp_rank_00_model_states.pt").write_bytes(b"")
    with pytest.raises(zerofast.UnsupportedCheckpointError, match="mixture-of-experts"):
        zerofast.reconstruct(tag_dir)


def test_refused_global_is_named_and_nothing_runs(stage2, tmp_path):
    _, tag_dir = _copy(stage2, tmp_path)
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    victim = next(tag_dir.glob("*optim_states.pt"))
    torch.save({"optimizer_state_dict": {"x": Payload()}}, victim)
    with pytest.raises(zerofast.UnsafeCheckpointError, match="builtins.open|io.open|refused"):
        zerofast.reconstruct(tag_dir)
    assert not marker.exists()


def test_shape_disagreeing_with_flat_buffers(stage2, tmp_path):
    _, tag_dir = _copy(stage2, tmp_path)
    for f in tag_dir.glob("*optim_states.pt"):
        sd = torch.load(f, weights_only=False)
        groups = sd["optimizer_state_dict"]["single_partition_of_fp32_groups"]
        groups[0] = groups[0][:10].clone()
        torch.save(sd, f)
    with pytest.raises(zerofast.InconsistentCheckpointError, match="partitions hold only 20"):
        zerofast.reconstruct(tag_dir)
