"""Inert stand-ins for the DeepSpeed objects found inside checkpoint pickles.

A checkpoint names DeepSpeed classes as pickle globals. Importing DeepSpeed to resolve them
would make zerofast depend on it and would run its import-time code; instead each known name
maps to a stand-in here that only records the state the pickle gives it. No stand-in has
behaviour, so unpickling one runs nothing.
"""
from __future__ import annotations

from typing import Any


class DeepSpeedRecord:
    """Attribute bag for a DeepSpeed object (loss scaler, fragment address, ...)."""

    ds_name = "deepspeed"

    def __init__(self, *args: Any, **kwargs: Any):
        self.args = args
        self.__dict__.update(kwargs)

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict state, slot state)
            state = {**(state[0] or {}), **(state[1] or {})}
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.__dict__["state"] = state

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.__dict__.items() if k != "args")
        return f"<{self.ds_name}({fields})>"


def _record_class(qualified: str) -> type:
    short = qualified.rsplit(".", 1)[1]
    return type(short, (DeepSpeedRecord,), {"ds_name": qualified})


def zero_stage(value: Any) -> int:
    """Stand-in for ``ZeroStageEnum(value)``: the stage as a plain int."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"ZeroStageEnum expects an int, got {type(value).__name__}")
    return int(value)


_RECORD_CLASSES = (
    "deepspeed.utils.tensor_fragment.fragment_address",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.fp16.loss_scaler.LossScalerBase",
)

# Full DeepSpeed name -> stand-in. This is the whole allowlist beyond torch's own tensor globals.
STAND_INS: dict[str, Any] = {
    "deepspeed.runtime.zero.config.ZeroStageEnum": zero_stage,
    **{name: _record_class(name) for name in _RECORD_CLASSES},
}
