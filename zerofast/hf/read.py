"""``zerofast.load_exported``: read an exported folder back with the plain safetensors/torch
loaders, and tie the recorded aliases back together."""
from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path

import torch

from ..base.errors import ExportError, ZeroFastError, few, first_line, short_repr
from .formats import FORMATS, WeightFormat, read_index, tied_names


def load_exported(out_dir: str | os.PathLike) -> "OrderedDict[str, torch.Tensor]":
    """Read an exported folder (any registered format, one file or an index of shards) and tie
    the recorded aliases back: ``sd[alias] is sd[source]``."""
    out = Path(out_dir)
    for fmt in FORMATS.values():
        if (out / fmt.single).is_file():
            tensors, metadata = _read_weights(out / fmt.single, fmt)
            return _tie(tensors, tied_names(metadata, out / fmt.single), out / fmt.single)
        if (out / fmt.index).is_file():
            return _load_indexed(out / fmt.index, fmt)
    names = ", ".join(f.single for f in FORMATS.values())
    raise ExportError(f"expected {names} or one of their index files, found none", out)


def _load_indexed(index_path: Path, fmt: WeightFormat) -> "OrderedDict[str, torch.Tensor]":
    weight_map, metadata = read_index(index_path)
    merged: dict[str, torch.Tensor] = {}
    for name in dict.fromkeys(weight_map.values()):
        merged.update(_read_weights(_shard_path(index_path, name), fmt)[0])
    missing = sorted(set(weight_map) - set(merged))
    if missing:
        raise ExportError(f"the index lists {len(missing)} tensors its files do not hold, e.g. {few(missing, 3)}",
                          index_path)
    return _tie(merged, tied_names(metadata, index_path), index_path)


def _shard_path(index_path: Path, name: object) -> Path:
    """A file the index names: a plain file name in the index's own folder, nothing else (the
    index may come from anywhere; ``../x`` or ``/etc/passwd`` must not be read)."""
    folder = index_path.parent
    if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise ExportError(f"expected the index to name files in its folder, found {short_repr(name)}", index_path)
    path = folder / name
    if path.resolve().parent != folder.resolve():
        raise ExportError(f"the index names {short_repr(name)}, a link that leads out of the folder", index_path)
    return path


def _read_weights(path: Path, fmt: WeightFormat) -> tuple[dict[str, torch.Tensor], dict]:
    if not path.is_file():
        raise ExportError("the index lists this file, but it is missing", path)
    try:
        tensors, metadata = fmt.read(path)
    except ZeroFastError as e:  # the format's own reader checked the file: say what it found
        raise ExportError(f"expected a {fmt.name} weight file as zerofast writes them, could not read it "
                          f"({e.message[:300]})", path) from None
    except Exception as e:  # the readers fail in their own ways on a file zerofast did not write
        # torch's message advises weights_only=False, which would run whatever the file holds.
        detail = "" if "weights_only" in str(e) else f": {first_line(e)[:200]}"
        raise ExportError(f"expected a {fmt.name} weight file as zerofast writes them, could not read it "
                          f"({type(e).__name__}{detail})", path) from None
    if not isinstance(tensors, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                for k, v in tensors.items()):
        raise ExportError(f"expected a {fmt.name} file holding a dict of named tensors, found "
                          f"{type(tensors).__name__}", path)
    if not isinstance(metadata, dict):
        metadata = {}
    return tensors, metadata


def _tie(tensors: dict[str, torch.Tensor], tied: dict[str, str], where: Path) -> "OrderedDict[str, torch.Tensor]":
    out = OrderedDict(tensors)
    for alias, source in tied.items():
        if source not in out:
            raise ExportError(f"tied weight {short_repr(alias)} points to {short_repr(source)}, which the export does "
                              "not hold", where)
        out[alias] = out[source]
    return out
