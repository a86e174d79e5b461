"""Inert stand-ins for the classes a PyTorch Distributed Checkpoint's ``.metadata`` pickle names.

torch writes ``.metadata`` with plain ``pickle`` and reads it back the same way
(``FileSystemReader.read_metadata``), so a folder from a stranger runs whatever its pickle
asks for. zerofast resolves only the names below, each to a record that keeps the plain data
the pickle gives it (numbers, strings, sizes, dtypes, other records) and does nothing else.
This allowlist is separate from the DeepSpeed one: a ``.pt`` file cannot name these classes.
"""
from __future__ import annotations

from typing import Any

import torch

from ..base.errors import short_repr
from .stand_ins import Frozen, RefusedState

_DCP = "torch.distributed.checkpoint"
_MCORE = "megatron.core.dist_checkpointing.strategies.torch"
_PLAIN = (type(None), bool, int, float, str)
_LAYOUTS = {"torch.strided": "strided", "torch.sparse_coo": "sparse_coo"}


class _ReadOnlyClass(type):
    """The pickle gets the class itself (NEWOBJ needs a type); it must not change it."""

    def __setattr__(cls, name, value):
        raise AttributeError(f"{cls.__name__} is read-only")

    __delattr__ = __setattr__


def _plain(value: Any, depth: int = 0) -> bool:
    """Plain data, other records (already checked when they were built), and shallow containers
    of them. The memo can share one container under many others, so depth is bounded."""
    if type(value) in _PLAIN or isinstance(value, (torch.dtype, torch.Size, DcpRecord)):
        return True
    if depth >= 3:
        return False
    if type(value) in (list, tuple):
        return all(_plain(v, depth + 1) for v in value)
    if type(value) is dict:
        return all(_plain(k, depth + 1) and _plain(v, depth + 1) for k, v in value.items())
    return False


class DcpRecord(metaclass=_ReadOnlyClass):
    """The fields of one DCP metadata object. Hashed by identity (``MetadataIndex`` is a dict key
    in ``storage_data``), so building a dict of them runs no code of the file's."""

    dcp_name = _DCP

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and (state[0] is None or isinstance(state[0], dict)) \
                and isinstance(state[1], dict):  # (dict state, slot state) of a slotted dataclass
            state = {**(state[0] or {}), **state[1]}
        if isinstance(state, tuple):  # TensorProperties pickles its fields as a tuple
            state = {"fields": state}
        if not isinstance(state, dict):
            raise RefusedState(self.dcp_name, f"expected a dict of fields, got {type(state).__name__}")
        for key, value in state.items():
            # A dunder or a method's name (``get``) would shadow the record's own attributes.
            if type(key) is not str or key.startswith("__") or hasattr(type(self), key):
                raise RefusedState(self.dcp_name, f"refused field name {short_repr(key)}")
            if not _plain(value):
                raise RefusedState(self.dcp_name, f"field {short_repr(key)} holds a {type(value).__name__}, "
                                                  "not plain data")
        self.__dict__.update(state)

    def get(self, field: str, default: Any = None) -> Any:
        return self.__dict__.get(field, default)

    def __repr__(self) -> str:
        return f"<{self.dcp_name}>"


def _record(qualified: str) -> type:
    return _ReadOnlyClass(qualified.rsplit(".", 1)[1], (DcpRecord,), {"dcp_name": qualified})


def _memory_format(value: Any) -> int:
    """Stand-in for ``_MEM_FORMAT_ENCODING(value)``: the code as an int."""
    if type(value) is not int:
        raise RefusedState(f"{_DCP}.metadata._MEM_FORMAT_ENCODING", f"expects an int, got {type(value).__name__}")
    return value


def _layout(name: Any) -> str:
    """Stand-in for ``torch.serialization._get_layout(name)``: the layout's name."""
    if name not in _LAYOUTS:
        raise RefusedState("torch.serialization._get_layout", f"expects a known layout, got {short_repr(name)}")
    return _LAYOUTS[name]


_WRITE_ITEM_TYPES = {1: "TENSOR", 2: "SHARD", 3: "BYTE_IO"}


def _write_item_type(value: Any) -> str:
    """Stand-in for the enum ``WriteItemType(value)`` (a write item of ``all_local_plans``): its name."""
    if type(value) is not int or value not in _WRITE_ITEM_TYPES:
        raise RefusedState(f"{_DCP}.planner.WriteItemType", f"expects 1, 2 or 3, got {short_repr(value)}")
    return _WRITE_ITEM_TYPES[value]


def _path(*parts: Any) -> str:
    """Stand-in for ``pathlib.PosixPath(...)`` (``StorageMeta.checkpoint_id``): the string."""
    if not all(type(p) is str for p in parts):
        raise RefusedState("pathlib.PosixPath", "expects strings")
    return "/".join(parts)


_RECORDS = (
    f"{_DCP}.metadata.Metadata",
    f"{_DCP}.metadata.TensorStorageMetadata",
    f"{_DCP}.metadata.BytesStorageMetadata",
    f"{_DCP}.metadata.ChunkStorageMetadata",
    f"{_DCP}.metadata.TensorProperties",
    f"{_DCP}.metadata.MetadataIndex",
    f"{_DCP}.metadata.StorageMeta",
    f"{_DCP}.filesystem._StorageInfo",
    # Megatron-Core's torch_dist saves keep every rank's plan in Metadata.all_local_plans; 0.13
    # writes its own SavePlan subclass (with mcore_data), 0.15 names an MCoreMetadata.
    f"{_DCP}.planner.SavePlan",
    f"{_DCP}.planner.WriteItem",
    f"{_DCP}.planner.TensorWriteData",
    f"{_DCP}.planner.BytesIOWriteData",
    f"{_MCORE}.MCoreSavePlan",
    f"{_MCORE}.MCoreMetadata",
)

DCP_ALLOWED: dict[str, Any] = {
    "torch.Size": torch.Size,
    "collections.OrderedDict": dict,
    **{str(v): v for v in vars(torch).values() if isinstance(v, torch.dtype)},
    **{name: _record(name) for name in _RECORDS},
    f"{_DCP}.metadata._MEM_FORMAT_ENCODING": Frozen(_memory_format),
    "torch.serialization._get_layout": Frozen(_layout),
    f"{_DCP}.planner.WriteItemType": Frozen(_write_item_type),
    "pathlib.PosixPath": Frozen(_path),
    "pathlib.Path": Frozen(_path),
}
