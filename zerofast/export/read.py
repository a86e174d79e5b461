"""``zerofast.load_exported``: read an exported folder back with the plain safetensors/torch
loaders, and tie the recorded aliases back together."""
from __future__ import annotations

import json
import os
from collections import OrderedDict
from pathlib import Path

import torch

from ..errors import ExportError
from .formats import FORMATS, TIED_KEY, WeightFormat


def load_exported(out_dir: str | os.PathLike) -> "OrderedDict[str, torch.Tensor]":
    """Read an exported folder (any registered format, one file or an index of shards) and tie
    the recorded aliases back: ``sd[alias] is sd[source]``."""
    out = Path(out_dir)
    for fmt in FORMATS.values():
        if (out / fmt.single).is_file():
            tensors, metadata = _read_weights(out / fmt.single, fmt)
            return _tie(tensors, _tied_from(metadata, out / fmt.single), out / fmt.single)
        if (out / fmt.index).is_file():
            return _load_indexed(out / fmt.index, fmt)
    names = ", ".join(f.single for f in FORMATS.values())
    raise ExportError(f"expected {names} or one of their index files, found none", out)


def _load_indexed(index_path: Path, fmt: WeightFormat) -> "OrderedDict[str, torch.Tensor]":
    try:
        index = json.loads(index_path.read_text())
        weight_map, metadata = dict(index["weight_map"]), dict(index.get("metadata") or {})
    except (ValueError, KeyError, TypeError) as e:
        raise ExportError(f"expected an index with a 'weight_map', could not read it ({e})", index_path) from None
    merged: dict[str, torch.Tensor] = {}
    for name in dict.fromkeys(weight_map.values()):
        merged.update(_read_weights(index_path.parent / name, fmt)[0])
    missing = sorted(set(weight_map) - set(merged))
    if missing:
        raise ExportError(f"the index lists {len(missing)} tensors its files do not hold, e.g. {missing[:3]}",
                          index_path)
    return _tie(merged, _tied_from(metadata, index_path), index_path)


def _read_weights(path: Path, fmt: WeightFormat) -> tuple[dict[str, torch.Tensor], dict]:
    if not path.is_file():
        raise ExportError("the index lists this file, but it is missing", path)
    return fmt.read(path)


def _tied_from(metadata: dict, where: Path) -> dict[str, str]:
    raw = metadata.get(TIED_KEY)
    if raw is None:
        return {}
    try:
        tied = json.loads(raw) if isinstance(raw, str) else raw
        return {str(a): str(s) for a, s in tied.items()}
    except (ValueError, AttributeError):
        raise ExportError(f"expected {TIED_KEY!r} to hold a JSON object {{alias: source}}, found {raw!r}",
                          where) from None


def _tie(tensors: dict[str, torch.Tensor], tied: dict[str, str], where: Path) -> "OrderedDict[str, torch.Tensor]":
    out = OrderedDict(tensors)
    for alias, source in tied.items():
        if source not in out:
            raise ExportError(f"tied weight {alias!r} points to {source!r}, which the export does not hold", where)
        out[alias] = out[source]
    return out
