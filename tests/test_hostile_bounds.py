"""Hostile input, second round: small files that would crash the process, change how zerofast
reads every later file, or burn unbounded CPU or memory. Each is read in a child process under
an address-space limit and a timeout; the child writes a marker file as its last act, so a child
that was killed (a crash, the memory limit, the timeout) is told apart from one that answered.
"""
from __future__ import annotations

import io
import json
import os
import pickle
import re
import struct
import subprocess
import sys
import time

import pytest
import torch

import zerofast
import zerofast.discover as discover_module
from tests.conftest import needs_deepspeed
from tests.dsgen.catalog import ensure_checkpoint
from tests.helpers import module_like
from tests.planting import LOSS_SCALER, REPO_ROOT, Call, copy_checkpoint, replace_member, rewrite
from tests.test_fuzz import run_limited
from zerofast.output.transaction import LEGACY_MARKER, MARKER

pytestmark = needs_deepspeed

S2 = "s2_bf16_w2_frozen_tied"
MODEL = "mp_rank_00_model_states.pt"
OPTIM0 = "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
LIMIT = 2 << 30  # importing torch maps about 0.7 GiB
P2 = pickle.PROTO + b"\x02"

_CHILD = """
import json, sys, time
from pathlib import Path
import torch, zerofast
root, marker, op = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
start = time.monotonic()
try:
    if op == "export":
        zerofast.export(root, sys.argv[4])
    else:
        zerofast.reconstruct(root)
    result = {"class": None, "message": "ok"}
except zerofast.ZeroFastError as e:
    result = {"class": type(e).__name__, "message": str(e), "path": e.path}
result["seconds"] = time.monotonic() - start
print(json.dumps(result))
marker.write_text("done")
"""


def read_in_child(root, tmp_path, op: str = "reconstruct", *extra, timeout: float = 120) -> dict:
    """``op`` on ``root`` in a child under RLIMIT_AS and a timeout; its JSON result."""
    marker = tmp_path / "answered"
    try:
        proc = run_limited([sys.executable, "-c", _CHILD, str(root), str(marker), op, *map(str, extra)], timeout,
                           LIMIT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the child ran past {timeout} s")
    assert proc.returncode == 0, f"the child died ({proc.returncode}): {proc.stderr[-3000:]}"
    assert marker.read_text() == "done"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture
def ckpt(tmp_path):
    return copy_checkpoint(ensure_checkpoint(S2), tmp_path / "ckpt")


def _text(s: str) -> bytes:
    return pickle.BINUNICODE + len(s.encode()).to_bytes(4, "little") + s.encode()


def _global(name: str) -> bytes:
    module, attr = name.rsplit(".", 1)
    return pickle.GLOBAL + f"{module}\n{attr}\n".encode()


# ---------------------------------------------------------------------------------------------
# 1. Nesting: hashing a deep tuple recurses in C and kills CPython 3.11.

def _deep_key(depth: int) -> bytes:
    return P2 + pickle.EMPTY_DICT + pickle.EMPTY_TUPLE + pickle.TUPLE1 * depth + pickle.NONE + pickle.SETITEM + b"."


def _deep_set_member(depth: int) -> bytes:
    return (P2 + _global("builtins.set") + pickle.EMPTY_LIST + pickle.EMPTY_TUPLE + pickle.TUPLE1 * depth
            + pickle.APPEND + pickle.TUPLE1 + pickle.REDUCE + b".")


def test_control_a_deep_dict_key_kills_a_plain_unpickler(tmp_path):
    (tmp_path / "deep.pkl").write_bytes(_deep_key(10 ** 6))
    proc = run_limited([sys.executable, "-c", f"import pickle; pickle.loads(open({str(tmp_path / 'deep.pkl')!r}, "
                        "'rb').read())"], 120, LIMIT)
    assert proc.returncode < 0, proc.returncode  # SIGSEGV


@pytest.mark.parametrize("build", [_deep_key, _deep_set_member], ids=["dict-key", "set-member"])
def test_deep_nesting_is_refused_before_unpickling(ckpt, tmp_path, build):
    root, tag_dir = ckpt
    replace_member(tag_dir / MODEL, "/data.pkl", build(10 ** 6))
    result = read_in_child(root, tmp_path)
    assert result["class"] == "UnsafeCheckpointError", result
    assert result["path"] == str(tag_dir / MODEL)
    assert "containers nest deeper than 100 levels" in result["message"]


def test_nesting_of_real_files_is_far_below_the_bound(ckpt):
    """The bound leaves room: real checkpoints load (every real layout does in the other tests)."""
    root, _ = ckpt
    assert len(zerofast.reconstruct(root)) > 0


# ---------------------------------------------------------------------------------------------
# 2. Poisoning: BUILD on an allowlisted object would change it for the rest of the process.

def _build(target: bytes, attr: str, value: bytes) -> bytes:
    """BUILD with a slot state: ``setattr(target, attr, value)`` in a plain unpickler."""
    return (P2 + target + pickle.NONE + pickle.EMPTY_DICT + _text(attr) + value + pickle.SETITEM + pickle.TUPLE2
            + pickle.BUILD + b".")


POISONS = {
    "BFloat16Storage.dtype=float16": _build(_global("torch.BFloat16Storage"), "dtype", _global("torch.float16")),
    "FloatStorage.dtype=int32": _build(_global("torch.FloatStorage"), "dtype", _global("torch.int32")),
    "FloatStorage.__class__": _build(_global("torch.FloatStorage"), "__class__", _global("collections.OrderedDict")),
    "_rebuild_tensor_v2.__defaults__": _build(_global("torch._utils._rebuild_tensor_v2"), "__defaults__",
                                              pickle.BININT1 + b"\x01" + pickle.TUPLE1),
    "LossScaler.ds_name": _build(_global(LOSS_SCALER), "ds_name", _text("x")),
    "LossScaler.__setstate__": _build(_global(LOSS_SCALER), "__setstate__", _global("builtins.set")),
    "ZeroStageEnum.__defaults__": _build(_global("deepspeed.runtime.zero.config.ZeroStageEnum"), "__defaults__",
                                         pickle.BININT1 + b"\x01" + pickle.TUPLE1),
    # Item and append opcodes on allowlisted objects: none of them takes items.
    "OrderedDict[k]=v": P2 + _global("collections.OrderedDict") + _text("k") + pickle.NONE + pickle.SETITEM + b".",
    "FloatStorage[k]=v": P2 + _global("torch.FloatStorage") + _text("k") + pickle.NONE + pickle.SETITEM + b".",
    "_rebuild_tensor.append": P2 + _global("torch._utils._rebuild_tensor_v2") + pickle.NONE + pickle.APPEND + b".",
    "set.add": P2 + _global("builtins.set") + pickle.MARK + pickle.EMPTY_SET + pickle.ADDITEMS + b".",
}

_POISONED_THEN_PRISTINE = """
import json, sys
from pathlib import Path
import torch, zerofast
hostile, pristine, marker = sys.argv[1], sys.argv[2], Path(sys.argv[3])
before = zerofast.reconstruct(pristine, dtype=None)
try:
    zerofast.reconstruct(hostile)
    outcome = "ok"
except zerofast.ZeroFastError as e:
    outcome = type(e).__name__ + ": " + str(e)
after = zerofast.reconstruct(pristine, dtype=None)
same = list(before) == list(after) and all(
    before[k].dtype == after[k].dtype and torch.equal(before[k].view(torch.uint8), after[k].view(torch.uint8))
    for k in before)
print(json.dumps({"outcome": outcome, "same": same}))
marker.write_text("done")
"""


def test_control_build_poisons_a_plain_object():
    """What BUILD with a slot state does to a mutable allowlisted object in a plain unpickler."""
    class Storage:
        dtype = torch.bfloat16

    class Unpickler(pickle.Unpickler):
        def find_class(self, module, name):
            return s if name == "BFloat16Storage" else torch.float16

    s = Storage()
    data = _build(_global("torch.BFloat16Storage"), "dtype", _global("torch.float16"))
    assert Unpickler(io.BytesIO(data)).load() is s
    assert s.dtype is torch.float16


@pytest.mark.parametrize("case", sorted(POISONS))
def test_build_cannot_poison_later_loads(ckpt, tmp_path, case):
    root, tag_dir = ckpt
    pristine = ensure_checkpoint(S2)
    replace_member(tag_dir / MODEL, "/data.pkl", POISONS[case])
    marker = tmp_path / "answered"
    proc = run_limited([sys.executable, "-c", _POISONED_THEN_PRISTINE, str(root), str(pristine), str(marker)], 300,
                       LIMIT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert marker.read_text() == "done"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["outcome"].startswith(f"CorruptCheckpointError: {tag_dir / MODEL}: expected a valid pickle"), result
    # Set on a read-only object, or (a stand-in class) BUILD finds the instance method unbound,
    # or the object takes no items.
    assert any(reason in result["outcome"] for reason in (
        "read-only", "__setstate__() missing", "does not support item assignment", "has no attribute 'append'",
        "descriptor 'add'", "argument")), result
    assert result["same"], "a later load of a pristine checkpoint read different tensors"


# ---------------------------------------------------------------------------------------------
# 3. CPU from small inputs

def test_a_stray_huge_rank_number_is_reported_at_once(ckpt, tmp_path):
    root, tag_dir = ckpt
    (tag_dir / "zero_pp_rank_99999999999_mp_rank_00_optim_states.pt").write_bytes(b"")
    result = read_in_child(root, tmp_path, timeout=60)
    assert result["class"] == "IncompleteCheckpointError", result
    assert result["message"].endswith("missing: bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt, "
                                      "bf16_zero_pp_rank_3_mp_rank_00_optim_states.pt, "
                                      "bf16_zero_pp_rank_4_mp_rank_00_optim_states.pt, "
                                      "bf16_zero_pp_rank_5_mp_rank_00_optim_states.pt and 99999999993 more"), result
    assert len(result["message"]) < 500


def test_a_huge_partition_count_is_reported_at_once(ckpt, tmp_path):
    root, tag_dir = ckpt
    for name in (OPTIM0, OPTIM0.replace("pp_rank_0", "pp_rank_1")):
        rewrite(tag_dir / name, lambda o: o["optimizer_state_dict"].__setitem__("partition_count", 10 ** 12))
    result = read_in_child(root, tmp_path, timeout=60)
    assert result["class"] == "IncompleteCheckpointError", result
    assert result["message"].endswith(" and 999999999994 more"), result
    assert len(result["message"]) < 600


def _shared_tuple_key(levels: int, width: int) -> bytes:
    body = pickle.EMPTY_DICT + pickle.EMPTY_TUPLE
    for i in range(levels):
        body += pickle.BINPUT + bytes([i]) + pickle.MARK + (pickle.BINGET + bytes([i])) * width + pickle.TUPLE
    return P2 + body + pickle.NONE + pickle.SETITEM + b"."


def test_a_shared_tuple_as_dict_key_is_refused(ckpt, tmp_path):
    root, tag_dir = ckpt
    data = _shared_tuple_key(4, 200)  # hashing it would take 200**4 steps
    assert len(data) < 2000
    replace_member(tag_dir / MODEL, "/data.pkl", data)
    result = read_in_child(root, tmp_path, timeout=60)
    assert result["class"] == "UnsafeCheckpointError", result
    assert "would take more than" in result["message"] and "to hash" in result["message"]


def _shared_list(levels: int, width: int) -> list:
    value: list = [0]
    for _ in range(levels):
        value = [value] * width
    return value


def test_a_stand_in_given_shared_lists_is_checked_once_per_list(ckpt, tmp_path):
    root, tag_dir = ckpt
    # Four levels of 200 references: 200**4 nodes to a walk without a memo, a few KB on disk.
    rewrite(tag_dir / OPTIM0, lambda o: o["optimizer_state_dict"].__setitem__(
        "loss_scaler", Call(LOSS_SCALER, _shared_list(3, 200))))
    result = read_in_child(root, tmp_path, timeout=120)
    assert result["seconds"] < 30, result
    assert result["class"] in (None, "UnsafeCheckpointError"), result


def test_a_shared_list_in_an_error_message_is_shown_short(ckpt, tmp_path):
    root, tag_dir = ckpt
    rewrite(tag_dir / MODEL, lambda o: o.__setitem__("dp_world_size", _shared_list(30, 2)))  # repr: 2**30 items
    result = read_in_child(root, tmp_path, timeout=60)
    assert result["class"] == "CorruptCheckpointError", result
    assert "expected 'dp_world_size' to be an int >= 1, found [[[" in result["message"]
    assert len(result["message"]) < 400


def test_a_shared_list_as_a_persistent_id_is_shown_short(ckpt, tmp_path):
    root, tag_dir = ckpt
    body = pickle.EMPTY_LIST + pickle.BINPUT + b"\x00"
    for i in range(30):
        body += pickle.MARK + (pickle.BINGET + bytes([i])) * 2 + pickle.LIST + pickle.BINPUT + bytes([i + 1])
    replace_member(tag_dir / MODEL, "/data.pkl", P2 + body + pickle.BINPERSID + b".")
    result = read_in_child(root, tmp_path, timeout=60)
    assert result["class"] == "CorruptCheckpointError", result
    assert "expected a torch storage reference in the pickle, found [[[" in result["message"]
    assert len(result["message"]) < 400


def test_stage0_matching_of_same_valued_params_is_bounded():
    """k parameters of distinct sizes, all zeros: the offsets a tiling can reach grow about as
    k**2 and each costs a digest per size; past a budget linear in the buffer it is refused."""
    from types import SimpleNamespace

    from zerofast.plan.builders import stage0

    k = 100
    params = {f"p{i}": torch.zeros(i + 1, dtype=torch.bfloat16) for i in range(k)}
    flat = torch.zeros(sum(i + 1 for i in range(k)))
    ckpt = SimpleNamespace(meta=SimpleNamespace(path="model.pt"))
    start = time.process_time()  # CPU time: a loaded machine (two test workers) stretches wall time
    with pytest.raises(zerofast.InconsistentCheckpointError, match="too many parameters share their values"):
        stage0._walk_flat(ckpt, 0, flat, params, torch.bfloat16, "optimizer.fp32_groups[0]")
    assert time.process_time() - start < 20


# ---------------------------------------------------------------------------------------------
# 4. Memory from small inputs

def test_a_memo_index_far_ahead_is_refused(ckpt, tmp_path):
    root, tag_dir = ckpt
    data = P2 + pickle.EMPTY_DICT + pickle.LONG_BINPUT + (134217728).to_bytes(4, "little") + b"."
    assert len(data) == 9
    replace_member(tag_dir / MODEL, "/data.pkl", data)
    result = read_in_child(root, tmp_path, timeout=60)
    assert result["class"] == "UnsafeCheckpointError", result
    assert "memo index 134217728 runs ahead of the 0 values stored so far" in result["message"]


def test_many_views_of_one_storage_are_refused(ckpt, tmp_path):
    root, tag_dir = ckpt
    base = torch.zeros(1 << 20)  # 4 MiB

    def edit(obj):
        for i in range(320):
            obj["module"][f"view{i}"] = base[:]  # one storage, 320 tensors over all of it
    rewrite(tag_dir / MODEL, edit)
    result = read_in_child(root, tmp_path, timeout=120)
    assert result["class"] == "UnsafeCheckpointError", result
    assert "its tensors hold more than" in result["message"]


def test_quantized_storages_are_refused(ckpt, tmp_path):
    root, tag_dir = ckpt
    ref = (pickle.MARK + _text("storage") + _global("torch.QInt8Storage") + _text("0") + _text("cpu")
           + pickle.BININT1 + b"\x04" + pickle.TUPLE + pickle.BINPERSID)
    replace_member(tag_dir / MODEL, "/data.pkl", P2 + ref + b".")
    result = read_in_child(root, tmp_path, timeout=60)
    assert result["class"] == "UnsafeCheckpointError", result
    assert "refused pickle global 'torch.QInt8Storage'" in result["message"]


# ---------------------------------------------------------------------------------------------
# 5. Typed errors where a scalar is expected, and in inspect --json

@pytest.mark.parametrize("key, value", [("dp_world_size", torch.zeros(3)), ("mp_world_size", torch.ones(4)),
                                        ("buffer_names", torch.zeros(2)), ("shared_params", torch.zeros(2)),
                                        ("frozen_param_fragments", torch.zeros(3))])
def test_a_tensor_where_a_scalar_or_container_is_expected(ckpt, key, value):
    root, tag_dir = ckpt
    rewrite(tag_dir / MODEL, lambda o: o.__setitem__(key, value))
    with pytest.raises(zerofast.ZeroFastError) as e:
        zerofast.reconstruct(root)
    assert e.value.path == str(tag_dir / MODEL)


@pytest.mark.parametrize("groups", [torch.zeros(2), [{"params": torch.zeros(3)}], ["x"], [{"params": ["a"]}]],
                         ids=["tensor", "params-tensor", "group-str", "params-str"])
def test_malformed_param_groups_in_the_optimizer_state_path(ckpt, groups):
    root, tag_dir = ckpt
    rewrite(tag_dir / OPTIM0, lambda o: o["optimizer_state_dict"]["base_optimizer_state"].__setitem__(
        "param_groups", groups))
    with pytest.raises(zerofast.InconsistentCheckpointError, match="param_groups") as e:
        zerofast.optimizer_state(root, "exp_avg")
    assert e.value.path == str(tag_dir / OPTIM0)


def test_inspect_json_prints_only_json(ckpt, tmp_path):
    root, tag_dir = ckpt
    rewrite(tag_dir / MODEL, lambda o: (o.__setitem__("global_steps", float("nan")),
                                        o.__setitem__("ds_version", torch.zeros(2)),
                                        o["ds_config"].__setitem__("bf16", {"enabled": torch.ones(3)})))
    proc = subprocess.run([sys.executable, "-m", "zerofast", "inspect", str(root), "--json"], cwd=REPO_ROOT,
                          env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)  # strict: NaN would not parse back as JSON data here
    assert report["global_steps"] is None
    assert report["deepspeed_version"] == "<tensor (2,) torch.float32>"


# ---------------------------------------------------------------------------------------------
# 8. Symlinks that lead out of the checkpoint

def test_latest_linked_to_proc_is_refused(ckpt):
    root, _ = ckpt
    (root / "latest").unlink()
    (root / "latest").symlink_to("/proc/self/mem")
    with pytest.raises(zerofast.UnsafeCheckpointError, match="leads out of the checkpoint folder") as e:
        zerofast.reconstruct(root)
    assert e.value.path == str(root)


def test_a_tag_folder_linked_outside_is_refused_unless_allowed(ckpt, tmp_path, monkeypatch):
    root, tag_dir = ckpt
    elsewhere = tmp_path / "elsewhere"
    tag_dir.rename(elsewhere)
    tag_dir.symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(zerofast.UnsafeCheckpointError, match=f"{tag_dir.name} is a symbolic link"):
        zerofast.reconstruct(root)
    monkeypatch.setenv("ZEROFAST_FOLLOW_SYMLINKS", "1")
    assert list(zerofast.reconstruct(root)) == list(zerofast.reconstruct(ensure_checkpoint(S2)))


def test_follow_symlinks_keyword_allows_and_refuses_over_the_variable(ckpt, tmp_path, monkeypatch):
    """The keyword decides, whatever the environment says; None leaves it to the variable."""
    root, tag_dir = ckpt
    (tag_dir / OPTIM0).rename(tmp_path / "outside.pt")
    (tag_dir / OPTIM0).symlink_to(tmp_path / "outside.pt")
    truth = zerofast.reconstruct(ensure_checkpoint(S2))
    got = zerofast.reconstruct(root, follow_symlinks=True)
    assert list(got) == list(truth) and all(torch.equal(got[k], truth[k]) for k in truth)
    assert list(zerofast.optimizer_state(root, "exp_avg", follow_symlinks=True)) == \
        list(zerofast.optimizer_state(ensure_checkpoint(S2), "exp_avg"))
    monkeypatch.setenv("ZEROFAST_FOLLOW_SYMLINKS", "1")
    with pytest.raises(zerofast.UnsafeCheckpointError, match=f"{OPTIM0} is a symbolic link"):
        zerofast.reconstruct(root, follow_symlinks=False)
    assert list(zerofast.reconstruct(root)) == list(truth)


def _linked_out(ckpt, tmp_path):
    root, tag_dir = ckpt
    (tag_dir / OPTIM0).rename(tmp_path / "outside.pt")
    (tag_dir / OPTIM0).symlink_to(tmp_path / "outside.pt")
    return root


# Every public call that reads a checkpoint takes follow_symlinks=, as reconstruct does.
READERS = {
    "export": lambda root, out, **kw: zerofast.export(root, out / "hf", **kw),
    "reshard": lambda root, out, **kw: zerofast.reshard(root, out / "w1", 1, **kw),
    "to_universal": lambda root, out, **kw: zerofast.to_universal(root, out / "universal", **kw),
    "to_dcp": lambda root, out, **kw: zerofast.to_dcp(root, out / "dcp", **kw),
    "verify": lambda root, out, **kw: zerofast.verify(root, **kw),
    "diff": lambda root, out, **kw: zerofast.diff(root, ensure_checkpoint(S2), **kw),
    "load_into": lambda root, out, **kw: zerofast.load_into(module_like(zerofast.reconstruct(ensure_checkpoint(S2))), root, **kw),
    "sequential_names": lambda root, out, **kw: zerofast.sequential_names(root, **kw),
}


@pytest.mark.parametrize("call", list(READERS))
def test_every_reader_takes_follow_symlinks(ckpt, tmp_path, call):
    root = _linked_out(ckpt, tmp_path)
    read = READERS[call]
    refusal = f"{OPTIM0} is a symbolic link.*--follow-symlinks"
    if call == "verify":  # a report: the refusal is its files finding
        report = read(root, tmp_path)
        assert not report.ok and re.search(refusal, report.failures[0].line()), report.failures
    else:
        with pytest.raises(zerofast.UnsafeCheckpointError, match=refusal):
            read(root, tmp_path)
    result = read(root, tmp_path, follow_symlinks=True)
    if call == "verify":
        assert result.ok, result.failures
    if call == "diff":
        assert result.identical, result.lines()


@pytest.mark.parametrize("command", ["inspect", "verify", "export"])
def test_the_cli_takes_follow_symlinks(ckpt, tmp_path, command):
    root = _linked_out(ckpt, tmp_path)
    args = [str(root)] + ([str(tmp_path / "hf")] if command == "export" else [])
    env = {k: v for k, v in os.environ.items() if k != "ZEROFAST_FOLLOW_SYMLINKS"}
    run = lambda *extra: subprocess.run([sys.executable, "-m", "zerofast", command, *args, *extra], cwd=REPO_ROOT,
                                        env=dict(env, PYTHONPATH=str(REPO_ROOT)), capture_output=True, text=True,
                                        timeout=300)
    refused = run()
    assert refused.returncode != 0 and "is a symbolic link" in refused.stderr + refused.stdout
    followed = run("--follow-symlinks")
    assert followed.returncode == 0, followed.stderr


# Which names are links: an lstat per file, or (from discover.LISTED_FROM files in a folder, a
# thousand-file MoE save) one listing of the folder.
BY_LISTING = pytest.mark.parametrize("listed_from", [None, 1], ids=["lstat", "listing"])


@BY_LISTING
def test_a_rank_file_linked_outside_is_refused(ckpt, tmp_path, monkeypatch, listed_from):
    if listed_from is not None:
        monkeypatch.setattr(discover_module, "LISTED_FROM", listed_from)
    root, tag_dir = ckpt
    outside = tmp_path / "outside.pt"
    (tag_dir / OPTIM0).rename(outside)
    (tag_dir / OPTIM0).symlink_to(outside)
    with pytest.raises(zerofast.UnsafeCheckpointError, match=f"{OPTIM0} is a symbolic link"):
        zerofast.reconstruct(root)


@BY_LISTING
def test_links_inside_the_checkpoint_are_followed(ckpt, monkeypatch, listed_from):
    if listed_from is not None:
        monkeypatch.setattr(discover_module, "LISTED_FROM", listed_from)
    root, tag_dir = ckpt
    (root / "real").mkdir()
    moved = root / "real" / OPTIM0
    (tag_dir / OPTIM0).rename(moved)
    (tag_dir / OPTIM0).symlink_to(moved)
    assert list(zerofast.reconstruct(root)) == list(zerofast.reconstruct(ensure_checkpoint(S2)))


# ---------------------------------------------------------------------------------------------
# 6, 7. The export's output folder: names that would corrupt the file, files that are not ours

def test_a_tensor_named_metadata_is_refused_by_safetensors(ckpt, tmp_path):
    root, tag_dir = ckpt

    def edit(obj):
        obj["module"]["__metadata__"] = torch.zeros(2)
        obj["buffer_names"].append("__metadata__")
    rewrite(tag_dir / MODEL, edit)
    out = tmp_path / "out"
    with pytest.raises(zerofast.ExportError, match="a tensor named '__metadata__' cannot be stored in safetensors"):
        zerofast.export(root, out)
    assert not out.exists()  # the refused export leaves no folder it made (issue 45)
    zerofast.export(root, out, format="torch")  # the torch format has no such name
    assert torch.equal(zerofast.load_exported(out)["__metadata__"], torch.zeros(2))


@pytest.mark.parametrize("where", [MARKER, LEGACY_MARKER])
@pytest.mark.parametrize("forged", [{"files": ["notes.txt", "model.safetensors"]},
                                    {"files": ["notes.txt"], "identities": {"notes.txt": [5, 1, 1]}}],
                         ids=["names-only", "wrong-identity"])
def test_a_forged_marker_does_not_get_user_files_deleted(ckpt, tmp_path, forged, where):
    root, _ = ckpt
    out = tmp_path / "out"
    (out / where).parent.mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    (out / where).write_text(json.dumps(forged))
    with pytest.raises(zerofast.OutputExistsError, match=r"files zerofast did not write \(notes.txt\)"):
        zerofast.export(root, out)
    zerofast.export(root, out, overwrite=True)  # replaces weight files only
    assert (out / "notes.txt").read_text() == "mine"


def test_a_rerun_still_replaces_what_zerofast_wrote(ckpt, tmp_path):
    root, _ = ckpt
    out = tmp_path / "out"
    zerofast.export(root, out, max_shard_size=2_000)
    first = sorted(os.listdir(out))
    zerofast.export(root, out)  # one file now: the shards and their index go
    assert sorted(os.listdir(out)) == [".cache", "model.safetensors"]
    assert len(first) > 3
    assert json.loads((out / MARKER).read_text())["files"] == ["model.safetensors"]


def test_a_user_folder_named_like_a_temporary_folder_is_kept(ckpt, tmp_path):
    root, _ = ckpt
    out = tmp_path / "out"
    (out / ".zerofast-tmp-7").mkdir(parents=True)
    (out / ".zerofast-tmp-7" / "thesis.tex").write_text("mine")
    with pytest.raises(zerofast.OutputExistsError, match=r"\.zerofast-tmp-7"):
        zerofast.export(root, out)
    zerofast.export(root, out, overwrite=True)
    assert (out / ".zerofast-tmp-7" / "thesis.tex").read_text() == "mine"


def test_a_temporary_folder_left_by_a_killed_export_is_removed(ckpt, tmp_path):
    root, _ = ckpt
    out = tmp_path / "out"
    zerofast.export(root, out)
    left = out / ".zerofast-tmp-99999"
    left.mkdir()
    (left / ".zerofast-tmp").touch()
    (left / "model.safetensors").write_bytes(b"half")
    zerofast.export(root, out)
    assert not left.exists()


@pytest.mark.parametrize("where", [MARKER, LEGACY_MARKER])
@pytest.mark.parametrize("kind", ["fifo", "link-to-dev-zero"])
def test_a_marker_that_is_not_a_file_neither_blocks_nor_fills_memory(ckpt, tmp_path, kind, where):
    root, _ = ckpt
    out = tmp_path / "out"
    (out / where).parent.mkdir(parents=True)
    if kind == "fifo":
        os.mkfifo(out / where)
    else:
        (out / where).symlink_to("/dev/zero")
    result = read_in_child(root, tmp_path, "export", out, timeout=120)
    assert result["class"] is None, result  # the names are zerofast's; the export replaces the entry
    assert result["seconds"] < 60
    assert not (out / MARKER).is_symlink() and (out / MARKER).is_file()


# ---------------------------------------------------------------------------------------------
# 8, 9. load_exported on folders zerofast did not write

@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/passwd", "", "sub/x.safetensors", 7])
def test_load_exported_reads_only_plain_file_names_from_an_index(tmp_path, shard):
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "outside.safetensors").write_bytes(b"")
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": shard}}))
    with pytest.raises(zerofast.ExportError, match="expected the index to name files in its folder"):
        zerofast.load_exported(out)


def test_load_exported_refuses_an_index_entry_linked_outside(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "outside.safetensors").write_bytes(b"")
    (out / "shard.safetensors").symlink_to(tmp_path / "outside.safetensors")
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "shard.safetensors"}}))
    with pytest.raises(zerofast.ExportError, match="a link that leads out of the folder"):
        zerofast.load_exported(out)


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch '{self.marker}'",)


@pytest.mark.parametrize("content", ["payload", "garbage", "list"])
def test_load_exported_on_foreign_files_gives_a_typed_error_and_no_dangerous_advice(tmp_path, content):
    out = tmp_path / "out"
    out.mkdir()
    marker = tmp_path / "ran"
    if content == "payload":
        torch.save({"w": _Payload(marker)}, out / "pytorch_model.bin")
    elif content == "garbage":
        (out / "pytorch_model.bin").write_bytes(b"PK\x03\x04 not really")
    else:
        torch.save([torch.zeros(1)], out / "pytorch_model.bin")
    with pytest.raises(zerofast.ExportError) as e:
        zerofast.load_exported(out)
    assert e.value.path == str(out / "pytorch_model.bin")
    assert "weights_only" not in str(e.value)
    assert not marker.exists()


def test_load_exported_on_a_broken_safetensors_file(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(struct.pack("<Q", 10 ** 12) + b"{}")
    with pytest.raises(zerofast.ExportError, match="expected a safetensors weight file as zerofast writes them"):
        zerofast.load_exported(out)
