"""zerofast: consolidate DeepSpeed ZeRO checkpoints on a native core, without DeepSpeed.

The package tree is the pipeline: ``discover`` -> ``load`` -> ``plan`` -> ``execute`` -> ``export``.
"""
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("zerofast")  # the one place it is set is pyproject.toml
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

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
    MissingOptimizerStateError,
    NativeExtensionError,
    OutputExistsError,
    PeftExportWarning,
    UnsafeCheckpointError,
    UnsupportedCheckpointError,
    ReshardError,
    ZeroFastError,
)
from .export import ExportResult, LazyStateDict, TensorMeta, export, load_exported
from .reconstruct import reconstruct
from .load_into import IncompatibleKeys, load_into
from .optimizer_states import optimizer_state
from .export.formats.reshard import reshard
from .export.formats.universal import to_universal, universal_module_state
from .names import sequential_names
from . import compat

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
    "compat",
    "reshard",
    "to_universal",
    "universal_module_state",
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
    "IncompleteCheckpointError",
    "InconsistentCheckpointError",
    "NativeExtensionError",
    "UnsafeCheckpointError",
    "UnsupportedCheckpointError",
]
