"""zerofast: consolidate DeepSpeed ZeRO checkpoints on a native core, without DeepSpeed.

The package tree is the pipeline: ``discover`` -> ``load`` -> ``plan`` -> ``execute`` -> ``results``
(in memory), ``hf`` (Hugging Face weight folders) or ``writers`` (DeepSpeed checkpoints), the last
two through ``output`` (the output-folder transaction and the team protocol).

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
    DeviceError,
    ExportError,
    FrozenWeightsAbsentWarning,
    IncompleteCheckpointError,
    InconsistentCheckpointError,
    LoadIntoError,
    MappingLimitError,
    MissingOptimizerStateError,
    UnplacedOptimizerStateError,
    NativeExtensionError,
    OutputExistsError,
    PeftExportWarning,
    UnsafeCheckpointError,
    UnsupportedCheckpointError,
    ReshardError,
    ZeroFastError,
)

if TYPE_CHECKING:
    from . import compat
    from .hf import ExportResult, export, load_exported
    from .load_into import IncompatibleKeys, load_into
    from .names import sequential_names
    from .optimizer_states import optimizer_state
    from .reconstruct import reconstruct
    from .results import LazyStateDict, TensorMeta
    from .checks import Diff, Report, diff, verify
    from .writers.reshard import reshard
    from .writers.universal import to_universal, universal_module_state
    from .writers.dcp import to_dcp

# public name -> the module that defines it
_LAZY = {
    "reconstruct": ".reconstruct",
    "export": ".hf",
    "load_exported": ".hf",
    "ExportResult": ".hf",
    "LazyStateDict": ".results",
    "TensorMeta": ".results",
    "load_into": ".load_into",
    "IncompatibleKeys": ".load_into",
    "optimizer_state": ".optimizer_states",
    "sequential_names": ".names",
    "reshard": ".writers.reshard",
    "to_universal": ".writers.universal",
    "universal_module_state": ".writers.universal",
    "to_dcp": ".writers.dcp",
    "verify": ".checks",
    "diff": ".checks",
    "Report": ".checks",
    "Diff": ".checks",
}


def _installed_version() -> str:
    # Looked up on first use: importlib.metadata costs more than the rest of `zerofast --help`.
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("zerofast")  # the one place it is set is pyproject.toml
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "0+unknown"


def __getattr__(name: str) -> Any:
    if name == "__version__":
        globals()[name] = _installed_version()
        return globals()[name]
    if name == "compat":
        return importlib.import_module(".compat", __name__)
    if name not in _LAZY:
        raise AttributeError(f"module 'zerofast' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value


class _Package(types.ModuleType):
    """Keeps ``zerofast.reconstruct``, ``zerofast.export`` and ``zerofast.load_into`` the
    functions: importing the submodules of the same names (``from zerofast.reconstruct import
    ...``) would otherwise set the package attribute to the module, as the eager imports used to
    overwrite it."""

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
    "sequential_names",
    "MissingOptimizerStateError",
    "UnplacedOptimizerStateError",
    "compat",
    "reshard",
    "to_universal",
    "universal_module_state",
    "to_dcp",
    "verify",
    "diff",
    "Report",
    "Diff",
    "ReshardError",
    "ExportResult",
    "ExportError",
    "OutputExistsError",
    "LazyStateDict",
    "TensorMeta",
    "ZeroFastError",
    "FrozenWeightsAbsentWarning",
    "PeftExportWarning",
    "AmbiguousTagError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "DeviceError",
    "MappingLimitError",
    "IncompleteCheckpointError",
    "InconsistentCheckpointError",
    "NativeExtensionError",
    "UnsafeCheckpointError",
    "UnsupportedCheckpointError",
]
