"""Inert stand-ins for the DeepSpeed objects found inside checkpoint pickles.

A checkpoint names DeepSpeed classes as pickle globals. Importing DeepSpeed to resolve them
would make zerofast depend on it and would run its import-time code; instead each known name
maps to a stand-in here that only records the state the pickle gives it. No stand-in has
behaviour, so unpickling one runs nothing.
"""
from __future__ import annotations

from typing import Any

import torch

from ..base.errors import short_repr


class RefusedState(Exception):
    """A stand-in was handed something no DeepSpeed object holds. Raised while unpickling, so
    ``safe_load`` reports it as an unsafe checkpoint that names ``global_name``."""

    def __init__(self, global_name: str, reason: str):
        super().__init__(f"{global_name}: {reason}")
        self.global_name = global_name
        self.reason = reason


# What DeepSpeed's objects hold: numbers, flags, strings, dtypes (DynamicLossScaler.dtype), and
# tensors for versions that keep a scale on the device. Nothing callable, no other object.
_PLAIN = (type(None), bool, int, float, str)


def _plain(value: Any, depth: int = 0, seen: set | None = None) -> bool:
    if type(value) in _PLAIN or isinstance(value, (torch.dtype, torch.Tensor)):
        return True
    if depth >= 4:
        return False
    # The memo shares containers: without ``seen``, a 4 KB pickle is a tree of 200**4 nodes.
    seen = set() if seen is None else seen
    if (id(value), depth) in seen:
        return True
    if type(value) in (list, tuple, torch.Size):
        ok = all(_plain(v, depth + 1, seen) for v in value)
    elif type(value) is dict:
        ok = all(type(k) is str and _plain(v, depth + 1, seen) for k, v in value.items())
    else:
        return False
    seen.add((id(value), depth))  # ``value`` lives as long as the check: its id stays its own
    return ok


def _check_fields(name: str, fields: Any) -> dict:
    # The native reader (csrc/load/unpickle.cpp, set_plain_state) sets a state without calling
    # __setstate__ only where these checks pass by type alone (an exact dict, exact str keys
    # without "__", values of _PLAIN's exact types); a change here must be made there too.
    if not isinstance(fields, dict):
        raise RefusedState(name, f"expected a dict of attributes, got {type(fields).__name__}")
    for key, value in fields.items():
        # A dunder key would shadow object machinery (__reduce_ex__, __class__, ...) on the instance.
        if type(key) is not str or key.startswith("__"):
            raise RefusedState(name, f"refused attribute name {short_repr(key)}")
        if not _plain(value):
            raise RefusedState(name, f"attribute {short_repr(key)} holds a {type(value).__name__}, not plain data")
    return fields


class Frozen:
    """A read-only callable that stands for a function in the allowlist. The function itself
    could be changed by the pickle (BUILD sets ``__defaults__`` with ``setattr``) for every later
    load in the process; this wrapper has no attribute that can be set."""

    __slots__ = ("_func",)

    def __init__(self, func):
        object.__setattr__(self, "_func", func)

    def __call__(self, *args, **kwargs):
        return self._func(*args, **kwargs)

    def __setattr__(self, name, value):
        raise AttributeError("read-only")

    __delattr__ = __setattr__

    def __repr__(self) -> str:
        return f"<zerofast {self._func.__name__}>"


class _ReadOnlyClass(type):
    """The metaclass of the stand-in classes: the pickle gets the class itself (NEWOBJ needs a
    type), and must not be able to change it for later loads."""

    def __setattr__(cls, name, value):
        raise AttributeError(f"{cls.__name__} is read-only")

    __delattr__ = __setattr__


class DeepSpeedRecord(metaclass=_ReadOnlyClass):
    """Attribute bag for a DeepSpeed object (loss scaler, fragment address, ...).

    It accepts only plain data (see ``_plain``): the state comes from an untrusted pickle, and
    whatever it stores here stays reachable through ``LoadedCheckpoint.raw``."""

    ds_name = "deepspeed"

    def __init__(self, *args: Any, **kwargs: Any):
        if not _plain(args):
            raise RefusedState(self.ds_name, "called with arguments that are not plain data")
        self.args = args
        self.__dict__.update(_check_fields(self.ds_name, kwargs))

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict state, slot state)
            state = {**_check_fields(self.ds_name, state[0] or {}), **_check_fields(self.ds_name, state[1] or {})}
        self.__dict__.update(_check_fields(self.ds_name, state))

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={short_repr(v)}" for k, v in list(self.__dict__.items())[:8] if k != "args")
        return f"<{self.ds_name}({fields})>"


def _record_class(qualified: str) -> type:
    short = qualified.rsplit(".", 1)[1]
    return _ReadOnlyClass(short, (DeepSpeedRecord,), {"ds_name": qualified})


_ZERO_STAGE_ENUM = "deepspeed.runtime.zero.config.ZeroStageEnum"


def zero_stage(value: Any) -> int:
    """Stand-in for ``ZeroStageEnum(value)``: the stage as a plain int. Whether the stage is one
    zerofast knows is decided later, with the file in hand (an unknown stage is unsupported, not
    unsafe)."""
    if type(value) is not int:
        raise RefusedState(_ZERO_STAGE_ENUM, f"expects an int stage, got {type(value).__name__}")
    return value


_RECORD_CLASSES = (
    "deepspeed.utils.tensor_fragment.fragment_address",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.fp16.loss_scaler.LossScalerBase",
)

# Full DeepSpeed name -> stand-in. With the tensor, container and dtype names in
# ``unpickle.ALLOWED``, this is the whole allowlist.
STAND_INS: dict[str, Any] = {
    _ZERO_STAGE_ENUM: Frozen(zero_stage),
    **{name: _record_class(name) for name in _RECORD_CLASSES},
}
