"""The registry of output formats. Each format module gives its file names and its writer and
reader; :func:`zerofast.export`, the CLI and the compat layer look formats up here by name, so a
new format is one module plus one line below.

Two more modules here write DeepSpeed checkpoints rather than weight shards, so they are not in
the registry of weight formats: :mod:`.reshard` (a native ZeRO checkpoint for another
data-parallel world size) and :mod:`.universal` (DeepSpeed's universal checkpoint layout). They
stream through the same executor into ``torch.save`` files (:mod:`..torch_stream`) and commit
through the same output-folder transaction (:mod:`..outdir`).
"""
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


# The format modules build on the names above, so they are imported after them.
from . import safetensors, torch  # noqa: E402

FORMATS: dict[str, WeightFormat] = {f.name: f for f in (safetensors.FORMAT, torch.FORMAT)}


def get(name: str) -> WeightFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"format must be one of {tuple(FORMATS)}, got {name!r}") from None
