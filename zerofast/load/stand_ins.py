"""Inert stand-ins for the DeepSpeed objects found inside checkpoint pickles.

A checkpoint names DeepSpeed classes as pickle globals. Importing DeepSpeed to resolve them
would make zerofast depend on it and would run its import-time code; instead each known name
maps to a stand-in here that only records the state the pickle gives it. No stand-in has
behaviour, so unpickling one runs nothing.
"""
from __future__ import annotations

from typing import Any

import torch


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


def _plain(value: Any, depth: int = 0) -> bool:
    if type(value) in _PLAIN or isinstance(value, (torch.dtype, torch.Tensor)):
        return True
    if depth >= 4:
        return False
    if type(value) in (list, tuple, torch.Size):
        return all(_plain(v, depth + 1) for v in value)
    if type(value) is dict:
        return all(type(k) is str and _plain(v, depth + 1) for k, v in value.items())
    return False


def _check_fields(name: str, fields: Any) -> dict:
    if not isinstance(fields, dict):
        raise RefusedState(name, f"expected a dict of attributes, got {type(fields).__name__}")
    for key, value in fields.items():
        # A dunder key would shadow object machinery (__reduce_ex__, __class__, ...) on the instance.
        if type(key) is not str or key.startswith("__"):
            raise RefusedState(name, f"refused attribute name {key!r}")
        if not _plain(value):
            raise RefusedState(name, f"attribute {key!r} holds a {type(value).__name__}, not plain data")
    return fields


class DeepSpeedRecord:
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
        fields = ", ".join(f"{k}={v!r}" for k, v in self.__dict__.items() if k != "args")
        return f"<{self.ds_name}({fields})>"


def _record_class(qualified: str) -> type:
    short = qualified.rsplit(".", 1)[1]
    return type(short, (DeepSpeedRecord,), {"ds_name": qualified})


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
    _ZERO_STAGE_ENUM: zero_stage,
    **{name: _record_class(name) for name in _RECORD_CLASSES},
}
