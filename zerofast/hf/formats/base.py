"""What every weight format module fills in: :class:`WeightFormat`, and the names they share;
the one reading of what the formats share, the index file and the tied names (for
``load_exported``, ``verify`` and a merge's base model alike)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ...base.errors import ExportError, first_line, short_repr

if TYPE_CHECKING:
    import torch

    from ...execute import Executor
    from ..shards import ShardFile

Advance = Callable[[int], None]
TIED_KEY = "zerofast_tied"  # metadata key: JSON string {alias: source} of tied names written once


@dataclass(frozen=True)
class WeightFormat:
    """A way to store state-dict shards in the Hugging Face folder layout."""

    name: str
    single: str  # the file name when one file holds everything
    pattern: str  # shard names: pattern.format(i, count)
    index: str  # the index file's name when there are several shards
    aliases_in_files: bool  # tied aliases stored in the files (sharing storage), not in metadata
    write: "Callable[[Path, ShardFile, dict[str, str] | None, Executor, Advance], None]"
    read: "Callable[[Path], tuple[dict[str, torch.Tensor], dict]]"  # tensors and string metadata
    file_metadata: Callable[[dict[str, str], int], "dict[str, str] | None"]  # (tied, file count)
    index_metadata: Callable[[dict[str, str]], dict]  # extra index metadata for the tied names

    @property
    def names(self) -> tuple[str, str]:
        return self.single, self.pattern


def read_index(path: Path) -> tuple[dict[str, str], dict]:
    """An index's weight map ({tensor name: file name}) and its metadata. The index may come from
    anywhere: anything but a JSON object with a 'weight_map' of strings is an ExportError naming it."""
    try:
        doc = json.loads(path.read_text())
        weight_map, metadata = dict(doc["weight_map"]), dict(doc.get("metadata") or {})
    # RecursionError: a deeply nested document; OSError: a file that cannot be read
    except (ValueError, KeyError, TypeError, AttributeError, OSError, RecursionError) as e:
        raise ExportError(f"expected an index with a 'weight_map', could not read it "
                          f"({type(e).__name__}: {first_line(e)[:200]})", path) from None
    odd = [v for v in weight_map.values() if not isinstance(v, str)]  # a list is unhashable, and no file name
    if odd:
        raise ExportError(f"expected the index to name files in its folder, found {short_repr(odd[0])}", path)
    return weight_map, metadata


def tied_names(metadata: dict, where: Path) -> dict[str, str]:
    """The tied aliases ``metadata`` records ({alias: source}, under :data:`TIED_KEY`); {} for none."""
    raw = metadata.get(TIED_KEY)
    if raw is None:
        return {}
    try:
        tied = json.loads(raw) if isinstance(raw, str) else raw
        return {str(a): str(s) for a, s in tied.items()}
    except (ValueError, AttributeError, TypeError, RecursionError):
        raise ExportError(f"expected {TIED_KEY!r} to hold a JSON object {{alias: source}}, found {short_repr(raw)}",
                          where) from None
