"""The exceptions zerofast raises. Each names the file it is about and what was expected.

Every class derives from :class:`ZeroFastError`, so ``except zerofast.ZeroFastError`` catches
all input problems while programming errors still surface as themselves.
"""
from __future__ import annotations

import os


def first_line(e: BaseException) -> str:
    """The first line of an underlying error, for one-line messages that name our file."""
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def some(names, limit: int = 4) -> str:
    """``names`` for a message: the first ``limit`` of them, then how many more, so that a folder
    missing ten thousand files still gets a one-line error."""
    names = [str(n) for n in names]
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown} and {len(names) - limit} more"


class ZeroFastError(Exception):
    """Base class of every error zerofast raises about its input or its build."""

    def __init__(self, message: str, path: str | os.PathLike | None = None):
        self.path = None if path is None else os.fspath(path)
        super().__init__(f"{self.path}: {message}" if self.path is not None else message)


class CheckpointNotFoundError(ZeroFastError, FileNotFoundError):
    """The folder does not exist or holds no DeepSpeed checkpoint."""


class AmbiguousTagError(ZeroFastError):
    """Several tags exist, no ``latest`` file says which one, and no tag was passed."""


class IncompleteCheckpointError(ZeroFastError):
    """Rank files are missing, or stray rank files from another save are present."""


class CorruptCheckpointError(ZeroFastError):
    """A file is truncated or is not a readable ``torch.save`` archive."""


class UnsafeCheckpointError(ZeroFastError):
    """A pickle references a global that no DeepSpeed checkpoint needs; nothing was run."""


class InconsistentCheckpointError(ZeroFastError):
    """The metadata disagrees with the tensors (sizes, partition counts, shapes)."""


class UnsupportedCheckpointError(ZeroFastError):
    """A layout zerofast does not handle (an unknown stage, a layout no builder reads)."""


class NativeExtensionError(ZeroFastError, ImportError):
    """The compiled extension is missing or was built against another torch."""


class ExportError(ZeroFastError):
    """The export's output folder cannot be written, or an exported folder cannot be read back."""


class OutputExistsError(ExportError, FileExistsError):
    """The output folder holds files zerofast did not write, or another export is writing there."""


class MissingOptimizerStateError(ZeroFastError, KeyError):
    """The optimizer keeps no per-element state under the requested key (``exp_avg``, ...).
    A KeyError too, so that code probing for a state with ``except KeyError`` keeps working."""

    __str__ = ZeroFastError.__str__  # KeyError's would quote the message


class DeviceError(ZeroFastError, RuntimeError):
    """The requested device cannot run zerofast: an unknown device type, or no CUDA GPU visible."""


class LoadIntoError(ZeroFastError, RuntimeError):
    """The model does not fit the checkpoint: missing or unexpected names (strict), or shapes."""


class ReshardError(ZeroFastError, ValueError):
    """The requested resharding cannot be written: a world size that cannot hold the model's
    partitions, or a layout the target format cannot express."""


class FrozenWeightsAbsentWarning(UserWarning):
    """The checkpoint was saved without its frozen parameters (``exclude_frozen_parameters=True``,
    as the HF Trainer saves PEFT models): the full state dict asked for holds only the trainable
    parameters and buffers."""


class PeftExportWarning(UserWarning):
    """A PEFT checkpoint exported as it is: its names are PEFT's, which transformers does not load."""
