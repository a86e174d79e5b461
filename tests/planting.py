"""Writing hostile and damaged copies of real checkpoint files, without importing DeepSpeed.

A file is read with zerofast's own loader (DeepSpeed classes come back as stand-ins), changed
as a Python object, and written again by ``torch.save`` through a pure-python pickler that can
emit any global by name: ``Global("os.system")`` becomes the GLOBAL opcode ``os system`` without
``os.system`` (or ``deepspeed``) being looked up or imported here.
"""
from __future__ import annotations

import os
import pickle
import shutil
import struct
import subprocess
import sys
import types
import zipfile
from collections import OrderedDict
from pathlib import Path

import torch

from zerofast.load import load_file
from zerofast.load.stand_ins import DeepSpeedRecord

REPO_ROOT = Path(__file__).resolve().parent.parent
ZERO_STAGE_ENUM = "deepspeed.runtime.zero.config.ZeroStageEnum"
FRAGMENT_ADDRESS = "deepspeed.utils.tensor_fragment.fragment_address"
LOSS_SCALER = "deepspeed.runtime.fp16.loss_scaler.LossScaler"


class Global:
    """A global named by string. Pickled as a bare GLOBAL opcode; never resolved here."""

    def __init__(self, qualified: str):
        self.module, self.name = qualified.rsplit(".", 1)

    def __call__(self, *args):  # save_reduce insists that the function be callable
        raise AssertionError("a planted Global is only ever pickled")


class Call:
    """``qualified(*args)`` when unpickled: GLOBAL, the argument tuple, REDUCE."""

    def __init__(self, qualified: str, *args):
        self.func = Global(qualified)
        self.args = args

    def __reduce__(self):
        return self.func, self.args


class Build:
    """An instance of ``qualified`` with ``state``, pickled as DeepSpeed's own objects are:
    GLOBAL, EMPTY_TUPLE, NEWOBJ, the state, BUILD."""

    def __init__(self, qualified: str, state):
        self.cls = Global(qualified)
        self.state = state


class Oversized:
    """``tensor`` (on a storage of its own) pickled as a 1-D tensor of ``numel`` elements, with the
    persistent id declaring ``numel`` elements too: a storage that claims more than its zip entry."""

    def __init__(self, tensor: torch.Tensor, numel: int):
        self.storage = torch.storage.TypedStorage(wrap_storage=tensor.clone().untyped_storage(), dtype=tensor.dtype,
                                                  _internal=True)
        self.numel = numel

    def __reduce__(self):
        return (Global("torch._utils._rebuild_tensor_v2"),
                (self.storage, 0, (self.numel,), (1,), False, OrderedDict()))


class _Pickler(pickle._Pickler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.declared_numel: dict[int, int] = {}  # id(storage) -> the numel its persistent id claims

    def save(self, obj, save_persistent_id=True):
        if isinstance(obj, Global):
            self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
            return
        if isinstance(obj, Build):
            self.save(obj.cls)
            self.write(pickle.EMPTY_TUPLE + pickle.NEWOBJ)
            self.save(obj.state)
            self.write(pickle.BUILD)
            return
        if isinstance(obj, Oversized):
            self.declared_numel[id(obj.storage)] = obj.numel
        if id(obj) in self.declared_numel:
            pid = self.persistent_id(obj)  # torch.save's, which names the storage's zip entry
            self.save_pers((*pid[:4], self.declared_numel[id(obj)]))
            return
        if isinstance(obj, type) and issubclass(obj, DeepSpeedRecord):
            self.save(Global(obj.ds_name))  # a stand-in goes back under its DeepSpeed name
            return
        super().save(obj, save_persistent_id)


_PICKLE_MODULE = types.ModuleType("tests_planting_pickle")
_PICKLE_MODULE.Pickler = _Pickler


def load(path: Path):
    """A checkpoint file as objects; ``zero_stage`` goes back to a ZeroStageEnum call."""
    obj = load_file(Path(path))
    osd = obj.get("optimizer_state_dict") if isinstance(obj, dict) else None
    if isinstance(osd, dict) and type(osd.get("zero_stage")) is int:
        osd["zero_stage"] = Call(ZERO_STAGE_ENUM, osd["zero_stage"])
    return obj


def save(obj, path: Path) -> None:
    """torch.save through the planting pickler (protocol 2, as torch.save always writes)."""
    tmp = Path(path).with_suffix(".planting")
    torch.save(obj, tmp, pickle_module=_PICKLE_MODULE, pickle_protocol=2)
    os.replace(tmp, path)  # the objects may be memory maps of ``path`` itself


def rewrite(path: Path, edit) -> None:
    """Load ``path``, let ``edit(obj)`` change it in place, write it back."""
    obj = load(path)
    edit(obj)
    save(obj, path)


MODEL = "mp_rank_00_model_states.pt"  # the model-states file of stages 0-2


def optim_name(rank: int, bf16: bool = True) -> str:
    """The optimizer file of ``rank`` as DeepSpeed names it (stages 1-3)."""
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def zero3_model_name(rank: int) -> str:
    """The model-states file of ``rank`` at stage 3."""
    return f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"


def copy_checkpoint(root: Path, dst: Path) -> tuple[Path, Path]:
    """Copy a cached checkpoint; return (root, tag folder) of the copy."""
    shutil.copytree(root, dst)
    return dst, dst / (dst / "latest").read_text().strip()


def replace_member(path: Path, suffix: str, data: bytes) -> None:
    """Rewrite the zip, with the entry whose name ends in ``suffix`` replaced by ``data``."""
    tmp = Path(path).with_suffix(".rezip")
    with zipfile.ZipFile(path) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as zout:
        names = [i.filename for i in zin.infolist()]
        assert sum(n.endswith(suffix) for n in names) == 1, names
        for info in zin.infolist():
            zout.writestr(info.filename, data if info.filename.endswith(suffix) else zin.read(info))
    os.replace(tmp, path)


def member(path: Path, suffix: str) -> zipfile.ZipInfo:
    with zipfile.ZipFile(path) as zf:
        (info,) = [i for i in zf.infolist() if i.filename.endswith(suffix)]
        return info


def patch_central_directory(path: Path, suffix: str, **fields: int) -> None:
    """Overwrite 32-bit fields of one central-directory record in place (the zip then lies):
    ``compress_size``, ``file_size`` or ``header_offset``."""
    offsets = {"compress_size": 20, "file_size": 24, "header_offset": 42}
    data = bytearray(Path(path).read_bytes())
    name = member(path, suffix).filename.encode()
    start = 0
    while True:
        start = data.index(b"PK\x01\x02", start)
        name_len = struct.unpack_from("<H", data, start + 28)[0]
        if bytes(data[start + 46:start + 46 + name_len]) == name:
            break
        start += 4
    for field, value in fields.items():
        struct.pack_into("<I", data, start + offsets[field], value)
    Path(path).write_bytes(bytes(data))


def run_isolated(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter at the repository root. A crash (SIGSEGV, SIGBUS)
    shows up as a negative return code instead of killing pytest."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    return subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
