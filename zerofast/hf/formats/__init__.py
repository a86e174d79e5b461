"""The registry of output formats. Each format module gives its file names and its writer and
reader; :func:`zerofast.export`, the CLI and the compat layer look formats up here by name, so a
new format is one module plus one line below. (Writers of whole checkpoints rather than weight
shards, such as reshard, are in :mod:`zerofast.writers`.)
"""
from __future__ import annotations

from . import safetensors_files, torch_bin
from .base import TIED_KEY, Advance, WeightFormat, read_index, tied_names

__all__ = ["FORMATS", "TIED_KEY", "Advance", "WeightFormat", "get", "read_index", "tied_names"]

FORMATS: dict[str, WeightFormat] = {f.name: f for f in (safetensors_files.FORMAT, torch_bin.FORMAT)}


def get(name: str) -> WeightFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"format must be one of {tuple(FORMATS)}, got {name!r}") from None
