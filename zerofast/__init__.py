"""zerofast: consolidate DeepSpeed ZeRO checkpoints on a native core, without DeepSpeed."""
from .errors import (
    AmbiguousTagError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ExportError,
    OutputExistsError,
    IncompleteCheckpointError,
    InconsistentCheckpointError,
    NativeExtensionError,
    UnsafeCheckpointError,
    UnsupportedCheckpointError,
    ZeroFastError,
)
from .write_shards import ExportResult, export, load_exported
from .reconstruct import reconstruct
from .write import LazyStateDict, TensorMeta

__version__ = "0.1.0"

__all__ = [
    "reconstruct",
    "export",
    "load_exported",
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
