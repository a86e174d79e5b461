"""``torch.save`` files (``pytorch_model.bin``): tied aliases stay in the file sharing storage.

torch.save needs every tensor of a file in memory at once, so this format holds one shard (at
most max_shard_size, or a single larger tensor) instead of streaming tensor by tensor.
"""
from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import torch

from ...execute import Executor
from ...output.transaction import torch_save
from ..shards import ShardFile
from .base import Advance, WeightFormat


def write(path: Path, file: ShardFile, metadata: dict[str, str] | None, executor: Executor,
          advance: Advance) -> None:
    made = {}
    for tp in file.tensors.values():
        made[tp.name] = executor.run(tp)
        advance(tp.nbytes)
    for alias, source in file.aliases:
        made[alias] = made[source]
    torch_save(OrderedDict((k, made[k]) for k in file.keys), path)


def read(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    return torch.load(path, map_location="cpu", weights_only=True), {}


FORMAT = WeightFormat("torch", "pytorch_model.bin", "pytorch_model-{:05d}-of-{:05d}.bin",
                      "pytorch_model.bin.index.json", aliases_in_files=True, write=write, read=read,
                      file_metadata=lambda tied, count: None, index_metadata=lambda tied: {})
