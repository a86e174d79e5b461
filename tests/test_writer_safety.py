"""Every writer (export, reshard, to-universal) keeps a user's data: one output-folder transaction
that respects the other commands' folders and never writes over its own input, and inputs and
messages that are the same at every entry point. On real DeepSpeed 0.19.8 checkpoints.
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

import zerofast
import zerofast.discover as discover_module
from zerofast.cli import human_bytes, main
from zerofast.base.errors import CheckpointNotFoundError, DeviceError, ExportError, OutputExistsError
from zerofast.hf.shards import parse_size
from zerofast.output.transaction import MARKER
from zerofast.writers.reshard import write_resharded

from tests.conftest import needs_deepspeed
from tests.helpers import assert_bitwise_equal, assert_same_state, real_root, real_truth
from tests.planting import copy_checkpoint, optim_name, rewrite

pytestmark = needs_deepspeed

SMALL = "s2_bf16_w2_frozen_tied"
STAGE3 = "s3_bf16_w2_frozen_tied"
REPO = Path(__file__).resolve().parent.parent
MARKER_TOP = MARKER.split("/")[0]


def _one_error_line(err: str, *fragments: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("zerofast: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def _snapshot(folder: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every entry under ``folder``: (inode, mtime, bytes of a file)."""
    out = {}
    for p in sorted(folder.rglob("*")):
        st = p.lstat()
        out[str(p.relative_to(folder))] = (st.st_ino, st.st_mtime_ns, p.read_bytes() if p.is_file() else b"")
    return out


# ---------------------------------------------------------------------------------------------
# One transaction: another command's folder is refused; --overwrite touches only what it replaces

def test_reshard_refuses_an_export_and_with_overwrite_leaves_it_alone(tmp_path, capsys):
    ck, out = real_root(SMALL), tmp_path / "mix"
    assert main(["export", str(ck), str(out), "--quiet"]) == 0
    (out / "README.md").write_text("my model card")
    before = _snapshot(out)
    assert main(["reshard", str(ck), str(out), "--world-size", "1"]) == 1
    _one_error_line(capsys.readouterr().err, "the output of `zerofast export`", "model.safetensors", "--overwrite")
    assert _snapshot(out) == before

    assert main(["reshard", str(ck), str(out), "--world-size", "1", "--overwrite", "--quiet"]) == 0
    after = _snapshot(out)
    for name in ("model.safetensors", "README.md"):
        assert after[name] == before[name], name  # the export's weights and the user's file, untouched
    assert (out / "latest").read_text() == real_truth(SMALL)["tag"]
    assert_same_state(out, ck)
    # The folder is the reshard's now: its own rerun goes through without --overwrite.
    assert main(["reshard", str(ck), str(out), "--world-size", "2", "--quiet"]) == 0
    assert _snapshot(out)["model.safetensors"] == before["model.safetensors"]


def test_export_refuses_a_resharded_checkpoint_and_keeps_latest(tmp_path, capsys):
    ck, out = real_root(SMALL), tmp_path / "o"
    assert main(["reshard", str(ck), str(out), "--world-size", "1", "--quiet"]) == 0
    before = _snapshot(out)
    assert main(["export", str(ck), str(out)]) == 1
    _one_error_line(capsys.readouterr().err, "the output of `zerofast reshard`", "latest")
    assert _snapshot(out) == before
    assert main(["export", str(ck), str(out), "--overwrite", "--quiet"]) == 0
    after = _snapshot(out)
    for name in ("latest", "zero_to_fp32.py", "zero_to_torch.py"):
        assert after[name] == before[name], name
    assert_same_state(out, ck)  # still a checkpoint DeepSpeed (and zerofast) reads
    got = zerofast.load_exported(out)
    want = zerofast.reconstruct(ck)
    for name in want:
        assert_bitwise_equal(got[name], want[name], name)


@pytest.fixture
def universal_out(tmp_path):
    return zerofast.to_universal(real_root(SMALL), tmp_path / "u" / "global_step3")


def test_to_universal_reruns_into_its_own_output_and_refuses_another(universal_out, tmp_path, capsys):
    ck = real_root(SMALL)
    # Its own earlier output: replaced, no --overwrite needed (it used to say "files zerofast did not write").
    assert main(["to-universal", str(ck), str(universal_out), "--quiet"]) == 0
    assert capsys.readouterr().err == ""
    state = zerofast.reconstruct(universal_out, dtype=None)
    for name, value in real_truth(SMALL)["trainable"].items():
        assert_bitwise_equal(state[name], value, name)
    before = _snapshot(universal_out)
    assert main(["export", str(ck), str(universal_out)]) == 1
    _one_error_line(capsys.readouterr().err, "the output of `zerofast to-universal`")
    assert main(["reshard", str(ck), str(universal_out), "--world-size", "1"]) == 1
    _one_error_line(capsys.readouterr().err, "the output of `zerofast to-universal`")
    assert _snapshot(universal_out) == before


def test_overwrite_says_what_it_replaced(tmp_path, capsys):
    ck, out = real_root(SMALL), tmp_path / "o"
    out.mkdir()
    (out / "latest").write_text("someone else's tag")
    (out / "notes.txt").write_text("mine")
    assert main(["reshard", str(ck), str(out), "--world-size", "1"]) == 1
    _one_error_line(capsys.readouterr().err, "files zerofast did not write", "latest", "notes.txt")
    assert main(["reshard", str(ck), str(out), "--world-size", "1", "--overwrite"]) == 0
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert summary.endswith("; replaced latest)"), summary
    assert (out / "notes.txt").read_text() == "mine"
    written = write_resharded(ck, out, 2)  # its own output now: nothing of others
    assert written.replaced == ()


def test_export_overwrite_replaces_weight_files_only_and_reports_them(tmp_path):
    ck, out = real_root(SMALL), tmp_path / "o"
    out.mkdir()
    (out / "pytorch_model.bin").write_bytes(b"old weights")
    (out / "config.json").write_text("{}")
    with pytest.raises(OutputExistsError, match="files zerofast did not write"):
        zerofast.export(ck, out)
    result = zerofast.export(ck, out, overwrite=True, format="torch")
    assert result.replaced == ("pytorch_model.bin",)
    assert (out / "config.json").read_text() == "{}"


# ---------------------------------------------------------------------------------------------
# Never over the input, whatever the flags

def _inputs_untouched(root: Path, run) -> None:
    before = _snapshot(root)
    with pytest.raises(OutputExistsError, match="checkpoint being read"):
        run()
    assert _snapshot(root) == before


def test_no_writer_writes_over_its_own_input(tmp_path):
    root, tag_dir = copy_checkpoint(real_root(SMALL), tmp_path / "ck")
    (tmp_path / "link").symlink_to(root)
    cases = [
        lambda: zerofast.reshard(root, root, 2, overwrite=True),  # equal
        lambda: zerofast.reshard(root, tmp_path / "link", 1, overwrite=True),  # equal, through a link
        lambda: zerofast.to_universal(root, tag_dir, overwrite=True),  # the tag folder itself
        lambda: zerofast.to_universal(root, tag_dir / "universal", overwrite=True),  # inside it
        lambda: zerofast.export(root, tag_dir / "hf", overwrite=True),
        lambda: zerofast.export(root, tmp_path, overwrite=True),  # holding it
        lambda: zerofast.reshard(tmp_path / "link" / tag_dir.name, root, 1, overwrite=True),
    ]
    for run in cases:
        _inputs_untouched(tmp_path, run)
    # Next to the tag folder, as ds_to_universal writes by default, is not over the input.
    zerofast.to_universal(root, root / "global_step3_universal")
    assert (root / "latest_universal").read_text() == "global_step3_universal"


@pytest.mark.parametrize("listed_from", [None, 1], ids=["lstat", "listing"])
def test_an_input_file_linked_into_the_output_folder_is_refused(tmp_path, monkeypatch, listed_from):
    """A rank file that is a link into the output folder: writing there would destroy it, whether
    the links of its folder are found by an lstat each or by one listing (many files)."""
    if listed_from is not None:
        monkeypatch.setattr(discover_module, "LISTED_FROM", listed_from)
    root, tag_dir = copy_checkpoint(real_root(SMALL), tmp_path / "ck")
    out = root / "hf"
    out.mkdir()
    linked = tag_dir / optim_name(1, bf16=True)
    linked.rename(out / "rank1.pt")
    linked.symlink_to(out / "rank1.pt")
    with pytest.raises(OutputExistsError, match=r"the output folder holds the checkpoint being read \(.*rank_1"):
        zerofast.export(root, out, overwrite=True)
    assert (out / "rank1.pt").is_file() and linked.is_symlink()


def test_cli_refuses_its_input_in_one_line(tmp_path, capsys):
    root, tag_dir = copy_checkpoint(real_root(SMALL), tmp_path / "ck")
    before = _snapshot(root)
    assert main(["reshard", str(root), str(root), "--world-size", "2", "--overwrite"]) == 1
    _one_error_line(capsys.readouterr().err, "the output folder holds the checkpoint being read")
    assert main(["to-universal", str(root), str(tag_dir), "--overwrite"]) == 1
    _one_error_line(capsys.readouterr().err, "checkpoint being read")
    assert _snapshot(root) == before


# ---------------------------------------------------------------------------------------------
# Messages that say what exists and what to run

def test_missing_tag_lists_the_tags_and_says_where_the_name_came_from(tmp_path):
    root, _ = copy_checkpoint(real_root(SMALL), tmp_path / "ck")
    with pytest.raises(CheckpointNotFoundError, match=r"tag 'nope', which has no folder here; the tags here: "
                                                      r"\['global_step3'\]"):
        zerofast.reconstruct(root, tag="nope")
    (root / "latest").write_text("global_step9")
    with pytest.raises(CheckpointNotFoundError, match=r"'latest' names tag 'global_step9', which has no folder "
                                                      r"here; the tags here: \['global_step3'\]"):
        zerofast.reconstruct(root)


def test_a_pt_file_suggests_its_folder(tmp_path):
    root = real_root(SMALL)
    pt = root / "global_step3" / "mp_rank_00_model_states.pt"
    with pytest.raises(CheckpointNotFoundError, match=f"found a file; pass the folder that holds it, {pt.parent}"):
        zerofast.reconstruct(pt)


def test_a_folder_of_lightning_checkpoints_names_them(tmp_path):
    for name in ("epoch=0-step=3.ckpt", "epoch=1-step=6.ckpt"):
        # Lightning's DeepSpeed strategy saves each checkpoint as a folder: latest + checkpoint/.
        shutil.copytree(real_root(SMALL), tmp_path / name)
    with pytest.raises(CheckpointNotFoundError, match=r"found none here, but 2 in its subfolders "
                                                      r"\(epoch=0-step=3.ckpt, epoch=1-step=6.ckpt\)"):
        zerofast.reconstruct(tmp_path)


@pytest.mark.parametrize("url", ["s3://bucket/ckpt", "hf://user/model", "gs://b/c", "https://host/ckpt"])
def test_remote_urls_are_refused_with_a_line_saying_to_download(tmp_path, capsys, monkeypatch, url):
    monkeypatch.chdir(tmp_path)
    assert main(["export", url, "out"]) == 1
    _one_error_line(capsys.readouterr().err, f"zerofast: error: {url}: expected a local folder, found a remote "
                    "location", "download the checkpoint first")
    assert main(["export", str(real_root(SMALL)), url]) == 1
    _one_error_line(capsys.readouterr().err, f"{url}: expected a local output folder", "upload")
    assert main(["reshard", str(real_root(SMALL)), url, "--world-size", "1"]) == 1
    _one_error_line(capsys.readouterr().err, f"{url}: expected a local output folder")
    assert os.listdir(tmp_path) == []  # no local folder named "hf:" or "s3:"


def test_unknown_device_is_a_device_error(tmp_path, capsys):
    with pytest.raises(DeviceError, match="'tpu': not a device torch knows"):
        zerofast.export(real_root(SMALL), tmp_path / "o", device="tpu")
    assert main(["export", str(real_root(SMALL)), str(tmp_path / "o"), "--device", "tpu"]) == 1
    _one_error_line(capsys.readouterr().err, "device='tpu'")
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------------------------------------
# One vocabulary for dtypes and sizes

@pytest.mark.parametrize("spelling", ["bf16", "BF16", "bfloat16", "torch.bfloat16", "BFloat16", torch.bfloat16])
def test_dtype_spellings_agree_across_the_api_the_cli_and_compat(tmp_path, spelling):
    ck = real_root(SMALL)
    want = zerofast.reconstruct(ck, dtype=torch.bfloat16)
    got = zerofast.reconstruct(ck, dtype=spelling)
    assert all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want)
    assert zerofast.export(ck, tmp_path / "api", dtype=spelling).dtype == torch.bfloat16
    from zerofast.compat import convert_zero_checkpoint_to_state_dict

    convert_zero_checkpoint_to_state_dict(ck, tmp_path / "compat", dtype=spelling, safe_serialization=True)
    exported = zerofast.load_exported(tmp_path / "compat")
    if isinstance(spelling, str):
        assert main(["export", str(ck), str(tmp_path / "cli"), "--dtype", spelling, "--quiet"]) == 0
        exported = zerofast.load_exported(tmp_path / "cli")
    for name in want:
        assert_bitwise_equal(exported[name], want[name], name)


def test_dtype_that_is_no_output_dtype_is_refused_everywhere(tmp_path, capsys):
    with pytest.raises(ValueError, match="Unsupported output dtype 'fp8'"):
        zerofast.reconstruct(real_root(SMALL), dtype="fp8")
    with pytest.raises(SystemExit):
        main(["export", str(real_root(SMALL)), str(tmp_path), "--dtype", "fp8"])
    assert "expected fp32, bf16, fp16 or keep" in capsys.readouterr().err


@pytest.mark.parametrize("text,want", [("5G", 5 * 10**9), ("5GB", 5 * 10**9), ("5GiB", 5 * 2**30), ("500M", 5 * 10**8),
                                       ("4KiB", 4096), ("2K", 2000), ("1024", 1024), ("1.5GB", 15 * 10**8)])
def test_size_units_as_huggingface_writes_them(text, want):
    assert parse_size(text) == want


def test_export_summary_counts_the_optimizer_bytes(tmp_path, capsys):
    assert main(["export", str(real_root(SMALL)), str(tmp_path / "o"), "--optimizer-states"]) == 0
    result = zerofast.export(real_root(SMALL), tmp_path / "p", optimizer_states=True)
    optim = sum((tmp_path / "p" / n).stat().st_size for n in result.optimizer_files if n.endswith(".safetensors"))
    assert 0 < result.optimizer_size < optim  # tensor bytes, as total_size counts them
    line = capsys.readouterr().out.strip()
    assert f"{human_bytes(result.optimizer_size)} of optimizer states" in line, line
    assert f"({human_bytes(result.total_size + result.optimizer_size)}," in line, line


# ---------------------------------------------------------------------------------------------
# The raw exceptions a hostile-input run found, now ZeroFastErrors naming the file

def test_a_tensor_keyed_adam_state_names_the_file(tmp_path):
    root, tag_dir = copy_checkpoint(real_root(SMALL), tmp_path / "ck")
    victim = tag_dir / optim_name(1)

    def edit(obj):
        state = obj["optimizer_state_dict"]["base_optimizer_state"]["state"][0]
        state[torch.tensor([1.0, 2.0])] = state.pop("exp_avg")

    rewrite(victim, edit)
    with pytest.raises(zerofast.InconsistentCheckpointError, match="a dict keyed by other than names") as e:
        zerofast.export(root, tmp_path / "o", optimizer_states=True)
    assert e.value.path == str(victim)


def test_a_rank_file_that_is_a_symlink_loop_names_the_file(tmp_path):
    root, tag_dir = copy_checkpoint(real_root(SMALL), tmp_path / "ck")
    victim = tag_dir / optim_name(1)
    victim.unlink()
    victim.symlink_to(victim.name)  # points at itself
    with pytest.raises(zerofast.ZeroFastError) as e:
        zerofast.reconstruct(root)
    assert e.value.path == str(victim), str(e.value)


def test_load_exported_with_list_valued_weight_map_names_the_index(tmp_path):
    out = tmp_path / "o"
    result = zerofast.export(real_root(SMALL), out, max_shard_size="2KB")
    index = out / result.index
    index.write_text(index.read_text().replace(f'"{result.files[0]}"', f'["{result.files[0]}"]'))
    with pytest.raises(ExportError, match=r"expected the index to name files in its folder, found \['model-00001") as e:
        zerofast.load_exported(out)
    assert e.value.path == str(index)


# ---------------------------------------------------------------------------------------------
# Progress and --quiet for reshard and to-universal

@pytest.mark.parametrize("writer", ["reshard", "to_universal"])
def test_progress_is_reported_from_zero_to_the_total(tmp_path, writer):
    calls = []
    out = tmp_path / "u" / "global_step3"
    if writer == "reshard":
        zerofast.reshard(real_root(STAGE3), out, 3, progress=lambda d, t: calls.append((d, t)))
    else:
        zerofast.to_universal(real_root(STAGE3), out, progress=lambda d, t: calls.append((d, t)))
    total = calls[0][1]
    assert calls[0] == (0, total) and calls[-1] == (total, total) and total > 0
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)


def test_quiet_and_the_bar_for_reshard_and_to_universal(tmp_path, capsys, monkeypatch):
    ck = real_root(STAGE3)
    assert main(["reshard", str(ck), str(tmp_path / "r"), "--world-size", "3", "--quiet"]) == 0
    assert main(["to-universal", str(ck), str(tmp_path / "u" / "g"), "--quiet"]) == 0
    assert capsys.readouterr() == ("", "")
    pytest.importorskip("tqdm")
    import io

    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty = Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    assert main(["reshard", str(ck), str(tmp_path / "r2"), "--world-size", "3"]) == 0
    assert "reshard" in tty.getvalue() and "B/s" in tty.getvalue()
    assert "wrote" in capsys.readouterr().out


def test_an_interrupt_while_marking_the_temporary_folder_leaves_nothing(tmp_path, monkeypatch):
    # The CLI's signal handler raises in the main thread wherever it is; the narrowest window is
    # between making the temporary folder and marking it as ours.
    from zerofast.output import transaction

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(transaction.Path, "touch", interrupted)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        with transaction.output_dir(out, False):
            pass
    assert not out.exists()  # a folder this call made is not left behind (issue 45)


def test_a_folder_named_like_ours_that_this_run_did_not_make_is_kept(tmp_path, monkeypatch):
    from zerofast.output import transaction

    out = tmp_path / "out"
    theirs = out / f".zerofast-tmp-{os.getpid()}"
    theirs.mkdir(parents=True)
    (theirs / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match="temporary folder"):
        with transaction.output_dir(out, True):  # past the check that refuses a folder of others' files
            pass
    assert (theirs / "notes.txt").read_text() == "mine"
