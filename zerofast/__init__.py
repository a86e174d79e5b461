"""zerofast: consolidate DeepSpeed ZeRO checkpoints on a native core, without DeepSpeed."""
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
    ReshardError,
    ZeroFastError,
)
from .write_shards import ExportResult, export, load_exported
from .reconstruct import reconstruct
from .write import LazyStateDict, TensorMeta
from .load_into import IncompatibleKeys, LoadIntoError, load_into
from .optimizer_states import optimizer_state
from .reshard import reshard
from .universal import to_universal, universal_module_state
from . import compat

__version__ = "0.1.0"

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
    "AmbiguousTagError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "IncompleteCheckpointError",
    "InconsistentCheckpointError",
    "NativeExtensionError",
    "UnsafeCheckpointError",
    "UnsupportedCheckpointError",
]
