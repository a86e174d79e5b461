"""Writing pickles that name DeepSpeed's classes, without importing DeepSpeed.

DeepSpeed's checkpoint files reference a few of its classes (``ZeroStageEnum``, the loss
scalers, ``fragment_address``). Files zerofast writes for DeepSpeed to read (the synthesizer's
test checkpoints, ``reshard``, ``to_universal``) must name the same classes. Local stand-in
classes registered here are written under those names by a pickler that emits the GLOBAL opcode
itself, so ``deepspeed`` is neither needed nor imported, and nothing is put into ``sys.modules``.
"""
from __future__ import annotations

import copyreg
import pickle
import types
from typing import Any

import torch

_DS_GLOBALS: dict[type, tuple[str, str]] = {}


def ds_global(module: str, qualname: str):
    """Class decorator: pickle instances of the class as ``module.qualname``."""

    def register(cls: type) -> type:
        _DS_GLOBALS[cls] = (module, qualname)
        return cls

    return register


@ds_global("deepspeed.runtime.zero.config", "ZeroStageEnum")
class ZeroStageEnum:
    """Stands in for deepspeed.runtime.zero.config.ZeroStageEnum (an int Enum)."""

    def __init__(self, value: int):
        self.value = value

    def __reduce_ex__(self, protocol):
        # What Enum.__reduce_ex__ returns: the class called with the value.
        return (type(self), (self.value,))


class Record:
    """A DeepSpeed object given by its class name and attributes, pickled the way a plain Python
    object is (``copyreg.__newobj__`` then its ``__dict__``): DeepSpeed rebuilds its own class."""

    def __init__(self, **fields: Any):
        self.__dict__.update(fields)

    def __reduce_ex__(self, protocol):
        return (copyreg.__newobj__, (type(self),), dict(self.__dict__))


_RECORDS: dict[str, type] = {}


def record_class(qualified: str) -> type:
    """The :class:`Record` subclass written as ``qualified`` (one class per name)."""
    cls = _RECORDS.get(qualified)
    if cls is None:
        module, short = qualified.rsplit(".", 1)
        cls = ds_global(module, short)(type(short, (Record,), {}))
        _RECORDS[qualified] = cls
    return cls


class DeepSpeedNamePickler(pickle._Pickler):
    """Pure-python pickler that writes the registered stand-ins under DeepSpeed's names.

    The stock save_global imports the module to check the name; for the stand-ins the opcode is
    written directly. ``storage_hook``, when set, is called with every storage torch.save hands
    out a key for (see :func:`save`)."""

    storage_hook = None

    def save_global(self, obj, name=None):
        target = _DS_GLOBALS.get(obj) if isinstance(obj, type) else None
        if target is None:
            return super().save_global(obj, name)
        module, qualname = target
        if self.proto >= 4:
            self.save(module)
            self.save(qualname)
            self.write(pickle.STACK_GLOBAL)
        else:
            self.write(pickle.GLOBAL + module.encode("utf-8") + b"\n" + qualname.encode("utf-8") + b"\n")
        self.memoize(obj)

    def save(self, obj, save_persistent_id=True):
        # torch.save subclasses this pickler with its own persistent_id, which hands out the zip
        # entry of each storage; asking it once more (it is idempotent) tells which entry got which.
        hook = type(self).storage_hook
        if hook is not None and save_persistent_id and isinstance(obj, (torch.storage.TypedStorage,
                                                                         torch.UntypedStorage)):
            pid = self.persistent_id(obj)
            if pid is not None:
                hook(obj, pid)
        return super().save(obj, save_persistent_id)


# torch.save(pickle_module=...) only needs `Pickler` (and `__name__`). Not put in sys.modules.
PICKLE_MODULE = types.ModuleType("zerofast._deepspeed_names_pickle")
PICKLE_MODULE.Pickler = DeepSpeedNamePickler


def save(obj: Any, f) -> None:
    """``torch.save`` with DeepSpeed's class names, protocol 2 as DeepSpeed writes."""
    torch.save(obj, f, pickle_module=PICKLE_MODULE, pickle_protocol=2)
