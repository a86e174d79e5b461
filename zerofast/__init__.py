"""zerofast: consolidate DeepSpeed ZeRO checkpoints on a native core, without DeepSpeed.

The package tree is the pipeline: ``discover`` -> ``load`` -> ``plan`` -> ``execute`` -> ``results``
(in memory), ``hf`` (Hugging Face weight folders) or ``writers`` (DeepSpeed checkpoints), the last
two through ``output`` (the output-folder transaction and the team protocol); ``prepare`` composes
the first three steps for the later ones. Beside it: ``base``
(errors, settings, dtypes, checkpoint keys: what every layer speaks), ``native`` (the compiled
core, its ops and their pure-torch reference), ``devices``, ``layouts`` (one module per kind of
save), ``checks`` (verify and diff), ``cli`` (every command) and ``api`` (the entry points that are
not a step of their own); ``testing`` holds the checkpoint synthesizer and the demo, for users'
own tests. Everything public is named here, in ``__all__``; ``compat`` is the one public module.

The public names load their modules on first use (PEP 562): ``import zerofast`` costs only the
errors module, and torch is imported by the first call that needs it, so a CLI that fails on its
arguments, or a script that only catches zerofast's exceptions, does not pay for it.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .base.errors import (
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
    SettingsError,
    ZeroFastError,
)

if TYPE_CHECKING:
    from . import compat
    from .hf import ExportResult, export, load_exported
    from .api.load_into import IncompatibleKeys, load_into
    from .api.names import sequential_names
    from .api.optimizer_states import optimizer_state
    from .api.reconstruct import reconstruct
    from .results import LazyStateDict, TensorMeta
    from .checks import Diff, Report, diff, verify
    from .writers.reshard import reshard
    from .writers.universal import to_universal, universal_module_state
    from .writers.dcp import to_dcp

# public name -> the module that defines it
_LAZY = {
    "reconstruct": ".api.reconstruct",
    "export": ".hf",
    "load_exported": ".hf",
    "ExportResult": ".hf",
    "LazyStateDict": ".results",
    "TensorMeta": ".results",
    "load_into": ".api.load_into",
    "IncompatibleKeys": ".api.load_into",
    "optimizer_state": ".api.optimizer_states",
    "sequential_names": ".api.names",
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
    "SettingsError",
    "UnsafeCheckpointError",
    "UnsupportedCheckpointError",
]
