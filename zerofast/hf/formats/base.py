"""What every weight format module fills in: :class:`WeightFormat`, and the names they share."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

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
