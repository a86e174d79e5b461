"""Hostile checkpoints: planted pickle payloads are refused and nothing runs; zip archives that
lie about their sizes are reported as corrupt and never read outside their entries.

Every payload is planted into a copy of a real DeepSpeed checkpoint file. Each one, had it been
unpickled by a plain unpickler, would create a marker file (the control tests below show that it
does); after zerofast refuses the checkpoint the marker must not exist.
"""
from __future__ import annotations

import io
import json
import os
import pickle
import re
import subprocess
import sys
import zipfile

import pytest
import torch

import zerofast
from tests.conftest import needs_deepspeed
from tests.dsgen.catalog import ensure_checkpoint
from tests.planting import (
    FRAGMENT_ADDRESS,
    LOSS_SCALER,
    REPO_ROOT,
    ZERO_STAGE_ENUM,
    Build,
    Call,
    Global,
    Oversized,
    _Pickler,
    copy_checkpoint,
    member,
    patch_central_directory,
    replace_member,
    rewrite,
    run_isolated,
)

pytestmark = needs_deepspeed

STAGE2 = "s2_bf16_w2_frozen_tied"
STAGE3 = "s3_bf16_w2_frozen_tied"
MODEL2 = "mp_rank_00_model_states.pt"
OPTIM2 = "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
OPTIM3 = "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"


class Reduce:
    """A payload the ordinary way: ``__reduce__`` names a real function, pickled by reference."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def _qualified(func) -> str:
    return f"{func.__module__}.{func.__name__}"


# name -> (payload(marker) to plant, the global zerofast must name). Each payload creates ``marker``
# when run. os.system is "posix.system" on this platform: that is the name the pickle carries.
PAYLOADS = {
    "os.system": (lambda m: Reduce(os.system, f"touch '{m}'"), _qualified(os.system)),
    "subprocess.check_call": (lambda m: Reduce(subprocess.check_call, ["touch", str(m)]), "subprocess.check_call"),
    "subprocess.getoutput": (lambda m: Reduce(subprocess.getoutput, f"touch '{m}'"), "subprocess.getoutput"),
    "builtins.eval": (lambda m: Reduce(eval, f"open({str(m)!r}, 'w').close()"), "builtins.eval"),
    "builtins.exec": (lambda m: Reduce(exec, f"open({str(m)!r}, 'w').close()"), "builtins.exec"),
    "torch.save": (lambda m: Reduce(torch.save, {"ran": True}, str(m)), "torch.serialization.save"),
    # Creates the file it maps when shared=True; a torch function next to the storage classes.
    "torch.from_file": (lambda m: Call("torch.from_file", str(m), True, 8), "torch.from_file"),
    # Real DeepSpeed functions that write files, named in the pickle only (deepspeed is never
    # imported by this test process).
    "deepspeed.print_json_dist": (lambda m: Call("deepspeed.utils.logging.print_json_dist", {"ran": True}, None,
                                                 str(m)), "deepspeed.utils.logging.print_json_dist"),
    "deepspeed._save_checkpoint": (lambda m: Call("deepspeed.checkpoint.ds_to_universal._save_checkpoint",
                                                  str(m / "x.pt"), {"ran": True}),
                                   "deepspeed.checkpoint.ds_to_universal._save_checkpoint"),
}

DEEPSPEED_PAYLOADS = ("deepspeed.print_json_dist", "deepspeed._save_checkpoint")


def _osd(obj):
    return obj["optimizer_state_dict"]


def _first_key(mapping):
    return next(iter(mapping))


# name -> (layout, file, plant(obj, payload)). Most places are ones zerofast never reads (the
# Adam moments, the scheduler, the config): refusing happens while unpickling, wherever it sits.
PLACES = {
    "model.lr_scheduler": (STAGE2, MODEL2, lambda o, p: o.__setitem__("lr_scheduler", p)),
    "model.module[buffer]": (STAGE2, MODEL2, lambda o, p: o["module"].__setitem__("scale", p)),
    "model.ds_config.deep": (STAGE2, MODEL2,
                             lambda o, p: o["ds_config"]["zero_optimization"].__setitem__("x", [{"y": (1, p)}])),
    "optim.base_optimizer_state.exp_avg": (STAGE2, OPTIM2, lambda o, p: _osd(o)["base_optimizer_state"]["state"][0]
                                           .__setitem__("exp_avg", p)),
    "optim.param_slice_mappings": (STAGE2, OPTIM2, lambda o, p: _osd(o)["param_slice_mappings"][1].__setitem__(
        _first_key(_osd(o)["param_slice_mappings"][1]), p)),
    "optim3.optimizer_state_dict.exp_avg_sq": (STAGE3, OPTIM3, lambda o, p: _osd(o)["optimizer_state_dict"]["state"]
                                               [1].__setitem__("exp_avg_sq", p)),
}


@pytest.fixture(scope="module")
def sources():
    return {name: ensure_checkpoint(name) for name in (STAGE2, STAGE3)}


def _plant(sources, tmp_path, place: str, payload) -> tuple:
    layout, file, plant = PLACES[place]
    root, tag_dir = copy_checkpoint(sources[layout], tmp_path / "ckpt")
    victim = tag_dir / file
    rewrite(victim, lambda obj: plant(obj, payload))
    return root, victim


def _assert_refused(root, victim, refused: str):
    with pytest.raises(zerofast.UnsafeCheckpointError) as e:
        zerofast.reconstruct(root)
    assert e.value.path == str(victim)
    assert str(e.value).startswith(f"{victim}: refused pickle ")
    assert repr(refused) in str(e.value), str(e.value)
    assert "nothing was executed" in str(e.value)
    return e.value


def test_planting_round_trip_is_faithful(sources, tmp_path):
    """The machinery that plants payloads writes files zerofast reads exactly like the originals,
    so every refusal below is the payload's doing."""
    for layout in (STAGE2, STAGE3):
        root, tag_dir = copy_checkpoint(sources[layout], tmp_path / layout)
        for f in tag_dir.glob("*.pt"):
            rewrite(f, lambda obj: None)
        expected = zerofast.reconstruct(sources[layout], dtype=None)
        got = zerofast.reconstruct(root, dtype=None)
        assert list(got) == list(expected)
        for name in expected:
            assert got[name].dtype == expected[name].dtype
            assert torch.equal(got[name], expected[name]), name


@pytest.mark.parametrize("place", sorted(PLACES))
@pytest.mark.parametrize("payload", sorted(PAYLOADS))
def test_planted_payload_is_refused_and_nothing_runs(sources, tmp_path, payload, place):
    make, refused = PAYLOADS[payload]
    marker = tmp_path / "marker"
    root, victim = _plant(sources, tmp_path, place, make(marker))
    _assert_refused(root, victim, refused)
    assert not marker.exists()
    # The lazy path reads the same files the same way.
    with pytest.raises(zerofast.UnsafeCheckpointError):
        zerofast.reconstruct(root, lazy=True)
    assert not marker.exists()


@pytest.mark.parametrize("payload", sorted(set(PAYLOADS) - set(DEEPSPEED_PAYLOADS)))
def test_control_each_payload_would_create_its_marker(tmp_path, payload):
    """Unpickled without restriction, the planted object does run and leaves the marker."""
    marker = tmp_path / "marker"
    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(PAYLOADS[payload][0](marker))
    assert PAYLOADS[payload][1].rsplit(".", 1)[1].encode() in buf.getvalue()
    pickle.loads(buf.getvalue())
    assert marker.exists()


def test_control_deepspeed_payloads_would_create_their_markers(tmp_path):
    """The same for the DeepSpeed functions, in a child process (this one never imports DeepSpeed)."""
    blobs = {}
    for name in DEEPSPEED_PAYLOADS:
        buf = io.BytesIO()
        _Pickler(buf, protocol=2).dump(PAYLOADS[name][0](tmp_path / name))
        blobs[name] = buf.getvalue().hex()
    proc = run_isolated(
        "import os, pickle\nos.environ.setdefault('DS_ACCELERATOR', 'cpu')\n"
        f"for blob in {list(blobs.values())!r}:\n    pickle.loads(bytes.fromhex(blob))\n", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in DEEPSPEED_PAYLOADS:
        assert (tmp_path / name).exists(), name


# ---------------------------------------------------------------------------------------------
# Stand-in names with malicious payloads. The name itself is allowed (real checkpoints use it),
# what is done with it is not.

STAND_IN_ABUSE = {
    # ZeroStageEnum called with a shell command instead of a stage number.
    "ZeroStageEnum(str)": (OPTIM2, lambda o, m: _osd(o).__setitem__("zero_stage", Call(ZERO_STAGE_ENUM, f"touch {m}")),
                           ZERO_STAGE_ENUM),
    "ZeroStageEnum(tensor)": (OPTIM2, lambda o, m: _osd(o).__setitem__("zero_stage", Call(ZERO_STAGE_ENUM,
                                                                                          torch.zeros(1))),
                              ZERO_STAGE_ENUM),
    # A fragment_address whose BUILD state would shadow object machinery on the instance.
    "fragment_address.__reduce_ex__": (OPTIM2, lambda o, m: _osd(o)["param_slice_mappings"][0].__setitem__(
        "embed.weight", Build(FRAGMENT_ADDRESS, {"numel": 1, "start": 0,
                                                 "__reduce_ex__": Global("torch._utils._rebuild_tensor_v2")})),
                                       FRAGMENT_ADDRESS),
    # ... or whose state is not attributes at all.
    "fragment_address.state=list": (OPTIM2, lambda o, m: _osd(o)["param_slice_mappings"][0].__setitem__(
        "embed.weight", Build(FRAGMENT_ADDRESS, [Global("collections.OrderedDict"), str(m)])), FRAGMENT_ADDRESS),
    # A loss scaler smuggling a callable in as an attribute value.
    "LossScaler.cur_scale=class": (OPTIM2, lambda o, m: _osd(o).__setitem__(
        "loss_scaler", Build(LOSS_SCALER, {"cur_scale": Global("torch.Tensor"), "dynamic": False})), LOSS_SCALER),
    # A loss scaler called (REDUCE) with an allowed class as its argument.
    "LossScaler(OrderedDict)": (OPTIM2, lambda o, m: _osd(o).__setitem__(
        "loss_scaler", Call(LOSS_SCALER, Global("collections.OrderedDict"))), LOSS_SCALER),
    # A stand-in carrying a real payload in its state: refused at the payload's global.
    "fragment_address.numel=os.system": (OPTIM2, lambda o, m: _osd(o)["param_slice_mappings"][0].__setitem__(
        "embed.weight", Build(FRAGMENT_ADDRESS, {"numel": Reduce(os.system, f"touch '{m}'"), "start": 0})),
                                         _qualified(os.system)),
}


@pytest.mark.parametrize("case", sorted(STAND_IN_ABUSE))
def test_stand_in_names_with_malicious_payloads_are_refused(sources, tmp_path, case):
    file, plant, refused = STAND_IN_ABUSE[case]
    marker = tmp_path / "marker"
    root, tag_dir = copy_checkpoint(sources[STAGE2], tmp_path / "ckpt")
    victim = tag_dir / file
    rewrite(victim, lambda obj: plant(obj, marker))
    _assert_refused(root, victim, refused)
    assert not marker.exists()


@pytest.mark.parametrize("refused", ["torch._utils._rebuild_wrapper_subclass", "torch._utils._rebuild_nested_tensor",
                                     "torch._utils._rebuild_sparse_tensor", "torch._utils._rebuild_qtensor",
                                     "torch.serialization._get_layout", "collections.Counter"])
def test_globals_torch_allows_but_deepspeed_does_not_need_are_refused(sources, tmp_path, refused):
    """torch's weights_only allowlist reaches further into C++ than these checkpoints ever need.
    (``_codecs.encode`` is allowed, only as ``encode(str, "latin1")``: protocol-2 pickles of numpy
    arrays spell their bytes that way; tests/test_megatron_records.py.)"""
    root, tag_dir = copy_checkpoint(sources[STAGE2], tmp_path / "ckpt")
    victim = tag_dir / MODEL2
    rewrite(victim, lambda obj: obj.__setitem__("lr_scheduler", Global(refused)))
    _assert_refused(root, victim, refused)


# Hand-assembled pickles written straight into the archive's data.pkl: opcodes torch.save never
# emits, which look a global up without the GLOBAL opcode.
def _stack_global(marker) -> bytes:  # protocol 4: the name comes from two strings on the stack
    def short(s: str) -> bytes:
        return pickle.SHORT_BINUNICODE + bytes([len(s.encode())]) + s.encode()
    return (pickle.PROTO + b"\x04" + short("posix") + short("system") + pickle.STACK_GLOBAL
            + short(f"touch '{marker}'") + pickle.TUPLE1 + pickle.REDUCE + pickle.STOP)


def _inst(marker) -> bytes:  # protocol 0: INST names module and function inline
    return b"(S'touch " + str(marker).encode() + b"'\nios\nsystem\n."


@pytest.mark.parametrize("assemble, opcode, refused", [(_stack_global, "STACK_GLOBAL", "posix.system"),
                                                       (_inst, "INST", "os.system")])
def test_hand_assembled_pickles_are_refused(sources, tmp_path, assemble, opcode, refused):
    marker = tmp_path / "marker"
    data = assemble(marker)
    pickle.loads(data)  # control: it runs when unpickled without restriction
    assert marker.exists()
    marker.unlink()
    root, tag_dir = copy_checkpoint(sources[STAGE2], tmp_path / "ckpt")
    victim = tag_dir / OPTIM2
    replace_member(victim, "/data.pkl", data)
    # STACK_GLOBAL and INST reach the same find_class as GLOBAL, and are refused there.
    _assert_refused(root, victim, refused)
    assert not marker.exists()


def test_a_payload_behind_a_malformed_stretch_never_runs(sources, tmp_path):
    """Unpickling stops at the first opcode that makes no sense: the payload is never reached."""
    marker = tmp_path / "marker"
    data = (pickle.PROTO + b"\x02" + pickle.TUPLE + b"cos\nsystem\n" + pickle.SHORT_BINSTRING
            + bytes([len(f"touch {marker}")]) + f"touch {marker}".encode() + pickle.TUPLE1 + pickle.REDUCE + pickle.STOP)
    root, tag_dir = copy_checkpoint(sources[STAGE2], tmp_path / "ckpt")
    victim = tag_dir / MODEL2
    replace_member(victim, "/data.pkl", data)
    with pytest.raises(zerofast.CorruptCheckpointError, match="could not find MARK") as e:
        zerofast.reconstruct(root)
    assert e.value.path == str(victim)
    assert not marker.exists()


# ---------------------------------------------------------------------------------------------
# A fresh process: no side effect at all, and DeepSpeed is never imported.

_WATCH = """
import json, os, sys
events = []
armed = False
WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

def hook(event, args):
    if not armed:
        return
    if event in ("os.system", "subprocess.Popen", "os.posix_spawn", "os.spawn", "os.exec", "os.fork",
                 "os.forkpty", "ctypes.dlopen", "socket.connect"):
        events.append(event)
    elif event == "open":
        mode, flags = args[1], args[2] or 0
        if (isinstance(mode, str) and any(c in mode for c in "wax+")) or flags & WRITE:
            events.append(f"open for writing: {args[0]}")

sys.addaudithook(hook)
import zerofast
zerofast.reconstruct  # a lazy import: torch and the pipeline load here, before the watch starts
armed = True
try:
    zerofast.reconstruct(sys.argv[1])
    result = "ok"
except zerofast.ZeroFastError as e:
    result = f"{type(e).__name__}: {e}"
armed = False
print(json.dumps({"result": result, "events": events,
                  "deepspeed": sorted(m for m in sys.modules if m.split(".")[0] == "deepspeed")}))
"""


@pytest.mark.parametrize("payload", ["os.system", "builtins.exec", "deepspeed._save_checkpoint", None])
def test_fresh_process_reconstruct_has_no_side_effects(sources, tmp_path, payload):
    marker = tmp_path / "marker"
    if payload is None:  # control: an intact checkpoint goes through the same watch cleanly
        root, _ = copy_checkpoint(sources[STAGE2], tmp_path / "ckpt")
    else:
        root, victim = _plant(sources, tmp_path, "optim.base_optimizer_state.exp_avg", PAYLOADS[payload][0](marker))
    # No bytecode writes in the child: they would show up as files opened for writing.
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.run([sys.executable, "-c", _WATCH, str(root)], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["events"] == []
    assert report["deepspeed"] == []
    assert not marker.exists()
    if payload is None:
        assert report["result"] == "ok"
    else:
        assert report["result"].startswith(f"UnsafeCheckpointError: {victim}: refused pickle global "
                                           f"{PAYLOADS[payload][1]!r}")


# ---------------------------------------------------------------------------------------------
# Archives that lie about sizes. Each is read in a child process: a SIGSEGV or SIGBUS fails the
# test (negative return code) instead of killing pytest.

_READ = """
import json, sys
import zerofast
try:
    sd = zerofast.reconstruct(sys.argv[1])
    result = {"class": None, "message": "read " + str(len(sd)) + " tensors"}
except zerofast.ZeroFastError as e:
    result = {"class": type(e).__name__, "message": str(e), "path": e.path}
print(json.dumps(result))
"""


def _oversize(victim, factor: int) -> int:
    """Make ``module['step_count']`` (int64) claim ``factor`` times its storage; return its bytes."""
    nbytes = []

    def edit(obj):
        t = obj["module"]["step_count"]
        nbytes.append(t.numel() * t.element_size())
        obj["module"]["step_count"] = Oversized(t, t.numel() * factor)
    rewrite(victim, edit)
    return nbytes[0]


def _oversized_storage(victim):
    size = _oversize(victim, 40)  # still inside the file: torch would read the entries behind it
    return rf"the pickle declares {size * 40} bytes for storage '.*/data/\d+', but its zip entry holds {size}$"


def _oversized_past_the_end(victim):
    size = _oversize(victim, 10**6)
    return rf"the pickle declares {size * 10**6} bytes for storage '.*/data/\d+', but its zip entry holds {size}$"


def _central_sizes_past_the_end(victim):
    patch_central_directory(victim, "/data/3", compress_size=2**31, file_size=2**31)
    return rf"zip entry '.*/data/3' claims {2**31} bytes at offset \d+, but the file ends at \d+"


def _central_sizes_too_small(victim):
    size = member(victim, "/data/3").file_size
    patch_central_directory(victim, "/data/3", compress_size=4, file_size=4)
    return rf"the pickle declares {size} bytes for storage '.*/data/3', but its zip entry holds 4"


def _stored_size_mismatch(victim):
    size = member(victim, "/data/3").file_size
    patch_central_directory(victim, "/data/3", compress_size=4)
    return rf"expected stored entry '.*/data/3' to have equal sizes, found 4 bytes stored for {size}"


def _header_offset_past_the_end(victim):
    patch_central_directory(victim, "/data/3", header_offset=os.path.getsize(victim) + 100)
    return r"zip entry '.*/data/3': expected a local header at offset \d+, found the end of the file"


def _pickle_entry_too_long(victim):
    size = member(victim, "/data.pkl").file_size
    patch_central_directory(victim, "/data.pkl", compress_size=size + 64, file_size=size + 64)
    return r"expected data.pkl to end with its pickle, found 64 more bytes"


def _compressed_storage(victim):
    tmp = victim.with_suffix(".deflate")
    with zipfile.ZipFile(victim) as zin, zipfile.ZipFile(tmp, "w") as zout:
        for info in zin.infolist():
            method = zipfile.ZIP_DEFLATED if "/data/" in info.filename else zipfile.ZIP_STORED
            zout.writestr(info.filename, zin.read(info), compress_type=method)
    os.replace(tmp, victim)
    return r"expected storage entry '.*/data/\d+' stored uncompressed"


def _duplicate_pickle(victim):
    # Python's zipfile reads the last of two equal names; torch's reader matches names ignoring case.
    name = member(victim, "/data.pkl").filename
    with zipfile.ZipFile(victim, "a") as zf:
        zf.writestr(name.replace("/data.pkl", "/DATA.PKL"), b"\x80\x02N.")
    return r"expected unique zip entry names, found '.*/DATA.PKL' twice"


@pytest.mark.parametrize("damage", [_oversized_storage, _oversized_past_the_end, _central_sizes_past_the_end,
                                    _central_sizes_too_small, _stored_size_mismatch, _header_offset_past_the_end,
                                    _pickle_entry_too_long, _compressed_storage, _duplicate_pickle],
                         ids=lambda f: f.__name__.strip("_"))
def test_zip_that_lies_about_sizes_is_corrupt(sources, tmp_path, damage):
    root, tag_dir = copy_checkpoint(sources[STAGE2], tmp_path / "ckpt")
    victim = tag_dir / MODEL2
    pattern = damage(victim)
    proc = run_isolated(_READ.replace("sys.argv[1]", repr(str(root))))
    assert proc.returncode == 0, f"child died with {proc.returncode}: {proc.stderr[-3000:]}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["class"] == "CorruptCheckpointError", result
    assert result["path"] == str(victim)
    assert re.search(pattern, result["message"]), result["message"]


def test_oversized_storage_would_read_the_next_entries_without_the_check(sources, tmp_path):
    """Why the size check exists: torch's own mmap loader takes the pickle's byte count and
    returns a tensor whose tail is made of the zip entries that follow the storage."""
    root, tag_dir = copy_checkpoint(sources[STAGE2], tmp_path / "ckpt")
    victim = tag_dir / MODEL2
    original = torch.load(victim, weights_only=True)["module"]["step_count"]
    _oversize(victim, 40)
    loaded = torch.load(victim, mmap=True, weights_only=True)["module"]["step_count"]
    assert loaded.numel() == original.numel() * 40
    assert torch.equal(loaded[:original.numel()], original)
    with pytest.raises(zerofast.CorruptCheckpointError):
        zerofast.reconstruct(root)


class _ResizedOnBuild:
    """Pickles as a real tensor rebuild followed by BUILD, whose state re-points the tensor:
    Tensor.__setstate__ would make a 2**40-element view of a 1-element storage."""

    def __init__(self, base):
        self.base = base

    def __reduce_ex__(self, protocol):
        import collections

        storage = torch.storage.TypedStorage(wrap_storage=self.base.untyped_storage(), dtype=torch.float32,
                                             _internal=True)
        args = (storage, 0, (1,), (1,), False, collections.OrderedDict())
        return (torch._utils._rebuild_tensor_v2, args, (self.base, 0, (2 ** 40,), (0,)))


def test_build_on_a_tensor_is_refused(sources, tmp_path):
    root, tag_dir = copy_checkpoint(sources[STAGE2], tmp_path / "ckpt")
    victim = tag_dir / MODEL2
    state = torch.load(victim, weights_only=False, mmap=False)
    state["module"]["scale"] = _ResizedOnBuild(torch.zeros(1))
    torch.save(state, victim)
    with pytest.raises(zerofast.UnsafeCheckpointError, match="altered after building it") as e:
        zerofast.reconstruct(root)
    assert e.value.path == str(victim)


def test_torch_tensor_name_cannot_construct_tensors(sources, tmp_path):
    """``torch.Tensor`` is allowed only as a type tag; calling it would allocate any size."""
    root, tag_dir = copy_checkpoint(sources[STAGE2], tmp_path / "ckpt")
    victim = tag_dir / MODEL2
    replace_member(victim, "/data.pkl", b"\x80\x02ctorch\nTensor\nJ\x00\x00\x00\x40\x85R.")
    with pytest.raises(zerofast.CorruptCheckpointError) as e:
        zerofast.reconstruct(root)
    assert e.value.path == str(victim)
