"""Inert stand-ins for the DeepSpeed (and Megatron-DeepSpeed) objects found inside checkpoint pickles.

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
    if type(value) in _PLAIN or isinstance(value, (torch.dtype, torch.Tensor, Inert)):
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


class Inert:
    """A stand-in made here, holding only checked plain data: may sit inside a record."""

    __slots__ = ()


class DeepSpeedRecord(Inert, metaclass=_ReadOnlyClass):
    """Attribute bag for a DeepSpeed object (loss scaler, fragment address, ...).

    It accepts only plain data (see ``_plain``): the state comes from an untrusted pickle, and
    whatever it stores here stays reachable through ``LoadedCheckpoint.raw``."""

    __slots__ = ("__dict__",)
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
    return _ReadOnlyClass(short, (DeepSpeedRecord,), {"ds_name": qualified, "__slots__": ()})


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
    # ds_to_universal's record beside a parameter_with_sub_params tensor (patterns, shape, partition_dim)
    "deepspeed.checkpoint.universal_checkpoint.SubparamShape",
)

# -- what Megatron-DeepSpeed's save_checkpoint adds: args, RNG states (numpy's), enums -----------
# Its model-states files carry ``args`` (an argparse.Namespace, with Megatron enums among the
# values) and ``rng_state`` (numpy's generator state: an array and a dtype). They are read as
# records of their data; no numpy or Megatron code is imported or run.

class NumpyDtype(Inert):
    """``numpy.dtype(spec, align, copy)`` as a pickle builds it: the spec and the byte order."""

    __slots__ = ("spec", "order")

    def __init__(self, spec: Any, align: Any = False, copy: Any = False):
        if type(spec) is not str or len(spec) > 16 or type(align) is not bool or type(copy) is not bool:
            raise RefusedState("numpy.dtype", f"expects a short type code, got {short_repr(spec)}")
        self.spec, self.order = spec, "="

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, tuple) or len(state) < 2 or type(state[1]) is not str or not _plain(state):
            raise RefusedState("numpy.dtype", f"expects a tuple of plain fields, got {short_repr(state)}")
        self.order = state[1]

    def __repr__(self) -> str:
        return f"<numpy dtype {self.order}{self.spec}>"


class NumpyArray(Inert):
    """A numpy array as its pickle gives it: shape, dtype and raw bytes (object arrays refused)."""

    __slots__ = ("shape", "dtype", "data")

    def __init__(self):
        self.shape, self.dtype, self.data = (0,), None, b""

    def __setstate__(self, state: Any) -> None:
        ok = isinstance(state, tuple) and len(state) == 5
        if ok:
            _, shape, dtype, _, data = state
            ok = (type(shape) is tuple and all(type(d) is int and d >= 0 for d in shape) and len(shape) <= 32
                  and isinstance(dtype, NumpyDtype) and type(data) is bytes)
        if not ok:
            raise RefusedState("numpy.ndarray", "expects (version, shape, dtype, fortran, bytes) with raw bytes, "
                                                f"got {short_repr(state)}")
        self.shape, self.dtype, self.data = shape, dtype, data

    def __repr__(self) -> str:
        return f"<numpy array {list(self.shape)} {self.dtype!r}>"


class NumpyScalar(Inert):
    __slots__ = ("dtype", "data")

    def __init__(self, dtype: Any, data: Any = b""):
        if not isinstance(dtype, NumpyDtype) or type(data) is not bytes or len(data) > 64:
            raise RefusedState("numpy.scalar", f"expects a dtype and its bytes, got {short_repr((dtype, data))}")
        self.dtype, self.data = dtype, data

    def __repr__(self) -> str:
        return f"<numpy scalar {self.dtype!r}>"


class _NdarrayType(Inert):
    """What the name numpy.ndarray resolves to: only ever passed to _reconstruct."""

    __slots__ = ()


_NDARRAY = _NdarrayType()


def numpy_reconstruct(cls: Any, shape: Any = (0,), typecode: Any = b"b") -> NumpyArray:
    if cls is not _NDARRAY:
        raise RefusedState("numpy._core.multiarray._reconstruct", f"expects numpy.ndarray, got {short_repr(cls)}")
    return NumpyArray()


def latin1_encode(text: Any, encoding: Any = "utf-8") -> bytes:
    """``_codecs.encode(text, "latin1")``: how a protocol-2 pickle spells bytes. Only that."""
    if type(text) is not str or encoding not in ("latin1", "latin-1"):
        raise RefusedState("_codecs.encode", f"expects a str and 'latin1', got {short_repr((text, encoding))}")
    return text.encode("latin-1")


class EnumValue(Inert):
    """A Megatron enum member (``PositionEmbeddingType(1)``): its class name and value."""

    __slots__ = ("enum", "value")

    def __init__(self, enum: str, value: Any):
        self.enum, self.value = enum, value

    def __repr__(self) -> str:
        return f"<{self.enum}({self.value!r})>"


def _enum(qualified: str):
    def member(value: Any) -> EnumValue:
        if type(value) not in (int, str):
            raise RefusedState(qualified, f"expects an int or str member value, got {short_repr(value)}")
        return EnumValue(qualified.rsplit(".", 1)[1], value)

    member.__name__ = qualified.rsplit(".", 1)[1]
    return Frozen(member)


_MEGATRON_ENUMS = tuple(f"{module}.{name}" for module, names in (
    ("megatron.model.enums", ("LayerType", "AttnType", "AttnMaskType", "PositionEmbeddingType")),
    ("megatron.core.enums", ("ModelType",)),
    ("megatron.core.transformer.enums", ("ModelType", "LayerType", "AttnType", "AttnMaskType", "AttnBackend")),
) for name in names)

_OTHER_RECORDS = {
    "argparse.Namespace": _ReadOnlyClass("Namespace", (DeepSpeedRecord,), {"ds_name": "argparse.Namespace",
                                                                            "__slots__": ()}),
    "numpy.dtype": Frozen(NumpyDtype),
    "numpy.ndarray": _NDARRAY,
    "_codecs.encode": Frozen(latin1_encode),
    **{f"{m}.{n}": Frozen(f) for m in ("numpy.core.multiarray", "numpy._core.multiarray")
       for n, f in (("_reconstruct", numpy_reconstruct), ("scalar", NumpyScalar))},
    **{name: _enum(name) for name in _MEGATRON_ENUMS},
}

# Full DeepSpeed name -> stand-in. With the tensor, container and dtype names in
# ``unpickle.ALLOWED``, this is the whole allowlist.
STAND_INS: dict[str, Any] = {
    _ZERO_STAGE_ENUM: Frozen(zero_stage),
    **{name: _record_class(name) for name in _RECORD_CLASSES},
    **_OTHER_RECORDS,
}
