"""zerofast: consolidate DeepSpeed ZeRO checkpoints on a native core, without DeepSpeed.

The public names load their modules on first use (PEP 562): ``import zerofast`` costs only the
errors module, and torch is imported by the first call that needs it, so a CLI that fails on its
arguments, or a script that only catches zerofast's exceptions, does not pay for it.
"""
from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from .errors import (
    AmbiguousTagError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ExportError,
    OutputExistsError,
    IncompleteCheckpointError,
    InconsistentCheckpointError,
    MissingOptimizerStateError,
    NativeExtensionError,
    UnsafeCheckpointError,
    UnsupportedCheckpointError,
    ZeroFastError,
)

if TYPE_CHECKING:
    from . import compat
    from .load_into import IncompatibleKeys, LoadIntoError, load_into
    from .optimizer_states import optimizer_state
    from .reconstruct import reconstruct
    from .write import LazyStateDict, TensorMeta
    from .write_shards import ExportResult, export, load_exported

__version__ = "0.1.0"

# public name -> the module that defines it
_LAZY = {
    "reconstruct": ".reconstruct",
    "export": ".write_shards",
    "load_exported": ".write_shards",
    "ExportResult": ".write_shards",
    "LazyStateDict": ".write",
    "TensorMeta": ".write",
    "load_into": ".load_into",
    "IncompatibleKeys": ".load_into",
    "LoadIntoError": ".load_into",
    "optimizer_state": ".optimizer_states",
}


def __getattr__(name: str) -> Any:
    if name == "compat":
        return importlib.import_module(".compat", __name__)
    if name not in _LAZY:
        raise AttributeError(f"module 'zerofast' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value


class _Package(types.ModuleType):
    """Keeps ``zerofast.reconstruct`` and ``zerofast.load_into`` the functions: importing the
    submodules of the same names (``from zerofast.reconstruct import prepare``) would otherwise
    set the package attribute to the module, as the eager imports used to overwrite it."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _LAZY.get(name) == f".{name}":
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | {"compat"})


__all__ = [
    "reconstruct",
    "export",
    "load_exported",
    "load_into",
    "IncompatibleKeys",
    "LoadIntoError",
    "optimizer_state",
    "MissingOptimizerStateError",
    "compat",
    "ExportResult",
    "ExportError",
    "OutputExistsError",
    "LazyStateDict",
    "TensorMeta",
    "ZeroFastError",
    "AmbiguousTagError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "IncompleteCheckpointError",
    "InconsistentCheckpointError",
    "NativeExtensionError",
    "UnsafeCheckpointError",
    "UnsupportedCheckpointError",
]
