"""The exceptions zerofast raises. Each names the file it is about and what was expected.

Every class derives from :class:`ZeroFastError`, so ``except zerofast.ZeroFastError`` catches
all input problems while programming errors still surface as themselves.
"""
from __future__ import annotations

import errno
import os
import re


def first_line(e: BaseException) -> str:
    """The first line of an underlying error, for one-line messages that name our file."""
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def short_repr(value: object, limit: int = 80) -> str:
    """``repr`` for values that come from an untrusted file, at most about ``limit`` characters.

    The builtin repr is unbounded: a pickle can share one list under many others, so that a
    90 KB file has a repr of gigabytes, and a huge int or tensor is costly to print. This one
    stops once ``limit`` characters are written and never looks more than a few levels deep.
    """
    out: list[str] = []
    budget = [limit]
    _short(value, out, budget, 3)
    text = "".join(out)
    return text if budget[0] >= 0 else text[:limit] + "..."


def _emit(out: list[str], budget: list[int], text: str) -> bool:
    out.append(text[:max(budget[0], 0) + 1])
    budget[0] -= len(text)
    return budget[0] >= 0


def _short(value: object, out: list[str], budget: list[int], depth: int) -> bool:
    kind = type(value)
    if kind is str or kind is bytes:
        return _emit(out, budget, repr(value[:budget[0] + 1]))
    if kind is int:
        # str(int) of a huge number is quadratic, and refused past 4300 digits.
        return _emit(out, budget, repr(value) if value.bit_length() <= 256 else f"<int of {value.bit_length()} bits>")
    if kind in (type(None), bool, float):
        return _emit(out, budget, repr(value))
    base = next((b for b in (list, tuple, set, frozenset, dict) if isinstance(value, b)), None)
    if base is not None:
        if depth == 0:
            return _emit(out, budget, f"<{kind.__name__} of {len(value)}>")
        opening, closing = {list: "[]", tuple: "()", dict: "{}"}.get(base, "{}")
        kind = base
        if not _emit(out, budget, opening):
            return False
        for i, item in enumerate(value.items() if kind is dict else value):
            if i and not _emit(out, budget, ", "):
                return False
            if kind is dict:
                if not (_short(item[0], out, budget, depth - 1) and _emit(out, budget, ": ")):
                    return False
                item = item[1]
            if not _short(item, out, budget, depth - 1):
                return False
        return _emit(out, budget, ("," if kind is tuple and len(value) == 1 else "") + closing)
    shape = getattr(value, "shape", None)
    if kind.__module__.startswith("torch") and shape is not None:
        return _emit(out, budget, f"<tensor {tuple(shape)} {getattr(value, 'dtype', '')}>"[:200])
    if kind.__module__ == "torch" and kind.__name__ in ("dtype", "device"):
        return _emit(out, budget, str(value))
    return _emit(out, budget, f"<{kind.__name__}>")


def few(items, shown: int = 5) -> str:
    """At most ``shown`` items of a list (each with a short repr), and how many there are in all."""
    items = list(items) if not isinstance(items, (list, tuple)) else items
    head = ", ".join(short_repr(x, 60) for x in items[:shown])
    return f"[{head}]" if len(items) <= shown else f"[{head}, ... ({len(items)} in all)]"


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
        self.message = message  # without the path: for a report that names the file itself
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


class UnplacedOptimizerStateError(UnsupportedCheckpointError):
    """A writer (reshard, to-universal, export of the optimizer states) met a partitioned
    optimizer value that no layout rule places, and refuses it instead of copying the old
    rank's partition through."""


class MappingLimitError(ZeroFastError, OSError):
    """The system refused to map one more file (ENOMEM): the process holds as many mappings as
    ``vm.max_map_count`` allows (a save of tens of thousands of rank or expert files), or its
    address space is limited. The file itself may be fine. ``errno`` is ENOMEM."""

    def __init__(self, message: str, path: str | os.PathLike | None = None):
        super().__init__(message, path)
        self.errno, self.strerror, self.filename = errno.ENOMEM, message, self.path

    __str__ = ZeroFastError.__str__  # OSError's would print "[Errno 12]" and the filename again


# torch's from_file: "unable to mmap <n> bytes from file <path>: <strerror> (<errno>)"
_TORCH_MMAP_ERROR = re.compile(r"unable to mmap .*\((\d+)\)$")


def mapping_refused(e: BaseException) -> bool:
    """Whether ``e`` (from ``mmap``, or torch's ``from_file``) is the kernel refusing one more
    mapping (ENOMEM), not a bad file."""
    if isinstance(e, OSError):
        return e.errno == errno.ENOMEM
    if not isinstance(e, RuntimeError):
        return False
    m = _TORCH_MMAP_ERROR.search(first_line(e))
    return m is not None and int(m.group(1)) == errno.ENOMEM


def mapping_limit_error(path: str | os.PathLike) -> MappingLimitError:
    """The error for a refused mapping of ``path``, blaming ``vm.max_map_count`` only where the
    process is at that limit (else an address-space limit or overcommit refused it)."""
    held, limit = _count_lines("/proc/self/maps"), _read_int("/proc/sys/vm/max_map_count")
    if held is not None and limit is not None and held >= limit - 16:
        return MappingLimitError(
            f"cannot map the file: the process holds {held} mappings and the system allows {limit} "
            "(vm.max_map_count); a save of this many files needs the limit raised (sysctl -w vm.max_map_count=...)",
            path)
    return MappingLimitError(
        f"cannot map the file: the system refused the mapping (ENOMEM) though the process holds "
        f"{'?' if held is None else held} of the {'?' if limit is None else limit} mappings it may "
        "(vm.max_map_count): an address-space limit (ulimit -v) or the overcommit settings refused it, not the file",
        path)


def _count_lines(path: str) -> int | None:
    try:
        with open(path, "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


class SettingsError(ZeroFastError, ValueError):
    """An environment setting (``ZEROFAST_*``), or the keyword that stands for one, holds a value
    zerofast cannot use. A ValueError too, as these were before they had a type of their own."""


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
