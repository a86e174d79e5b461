"""Reading a PyTorch Distributed Checkpoint (DCP) folder, as ``dcp.save`` writes it, safely.

    <folder>/.metadata          a plain pickle of ``Metadata``: per flat key, the tensor's global
                                size, dtype and chunks (offsets, sizes), and where each chunk is
    <folder>/__<rank>_<n>.distcp  each saved item as its own ``torch.save`` archive, back to back

``.metadata`` goes through the restricted unpickler with the stand-ins of
:mod:`.dcp_stand_ins` (nothing in it runs) and comes out as the plain records below. A chunk is
read by offset: its archive's zip directory is checked like any ``.pt`` file's, its small
pickle goes through the same restricted unpickler, and its tensor is a view of one private
mapping of the ``.distcp`` file. No ``.distcp`` file is ever unpickled whole.
"""
from __future__ import annotations

import json
import math
import os
import pickle
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..discover import DCP_METADATA
from ..base.errors import (CheckpointNotFoundError, CorruptCheckpointError, InconsistentCheckpointError,
                      UnsafeCheckpointError, UnsupportedCheckpointError, ZeroFastError, first_line, short_repr)
from .dcp_cover import check_cover
from .dcp_stand_ins import DCP_ALLOWED, DcpRecord
from .pickle_bounds import BoundsExceeded
from .reader import bounded_natively
from .stand_ins import RefusedState
from .unpickle import Refused, load_embedded_archive, load_pickle, map_file

METADATA = DCP_METADATA
METADATA_LIMIT = 1 << 30  # a .metadata of a 100k-tensor, 1k-rank save is tens of MB
_DATA_FILE = re.compile(r"^__(\d+)_(\d+)\.distcp$")
_TENSOR = "torch.distributed.checkpoint.metadata.TensorStorageMetadata"
_BYTES = "torch.distributed.checkpoint.metadata.BytesStorageMetadata"


@dataclass(frozen=True)
class DcpChunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str  # relative to the folder
    offset: int  # where the chunk's archive starts in the file
    length: int

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass(frozen=True)
class DcpTensor:
    key: str  # the flat key, e.g. "model.embed.weight"
    path: tuple  # the nested path it was flattened from, e.g. ("model", "embed.weight")
    dtype: torch.dtype
    size: tuple[int, ...]
    chunks: tuple[DcpChunk, ...]
    # Megatron-Core 0.13 and earlier store some N-d tensors as (grid..., chunk numel): each of
    # the ranks' equal boxes flattened into the last dimension. The real shape, or None.
    real_size: tuple[int, ...] | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        """The tensor's shape as the model has it."""
        return self.real_size or self.size


@dataclass(frozen=True)
class DcpRecords:
    folder: Path
    tensors: dict[str, DcpTensor]  # in the order of the metadata (the saved state dict's order)
    others: tuple[str, ...]  # flat keys of non-tensor items (hyperparameters, ...), never read
    ranks: int  # how many ranks wrote data files
    version: str | None
    # Megatron-Core dist_checkpointing: the folder's metadata.json ({"sharded_backend": ...}), else None
    mcore: dict | None = None


def read_dcp(folder: str | os.PathLike) -> DcpRecords:
    """The folder's metadata as plain records, checked against the files it names."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointNotFoundError("expected a PyTorch DCP folder, found no such directory", folder)
    meta = _unpickle_metadata(folder / METADATA)
    entries = meta.get("state_dict_metadata")
    storage = meta.get("storage_data")
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        raise CorruptCheckpointError("expected Metadata with state_dict_metadata and storage_data dicts",
                                     folder / METADATA)
    places = _places(folder, storage)
    paths = meta.get("planner_data") if isinstance(meta.get("planner_data"), dict) else {}
    mcore = read_mcore_json(folder)
    reformulated = _reformulated(meta, folder) if mcore is not None else {}
    tensors, others = {}, []
    for key, entry in entries.items():
        if not isinstance(key, str) or not isinstance(entry, DcpRecord):
            raise CorruptCheckpointError(f"expected a str key and a storage record, found {short_repr(key)}",
                                         folder / METADATA)
        if entry.dcp_name == _BYTES:
            others.append(key)
        elif entry.dcp_name == _TENSOR:
            tensors[key] = _tensor(folder, key, entry, places, paths.get(key), reformulated.get(key))
        else:
            raise CorruptCheckpointError(f"entry {key!r}: expected tensor or bytes storage metadata, found "
                                         f"{entry.dcp_name}", folder / METADATA)
    ranks = {int(_DATA_FILE.match(c.file).group(1)) for t in tensors.values() for c in t.chunks}
    version = meta.get("version")
    return DcpRecords(folder, tensors, tuple(others), len(ranks), version if isinstance(version, str) else None,
                      mcore)


MCORE_JSON = "metadata.json"  # what Megatron-Core's dist_checkpointing writes beside .metadata
_MCORE_JSON_LIMIT = 1 << 16


def read_mcore_json(folder: Path) -> dict | None:
    """Megatron-Core's ``metadata.json`` (``{"sharded_backend": "torch_dist", ...}``), or None
    where the folder has none; a file that is not such a record is refused."""
    path = folder / MCORE_JSON
    if not path.is_file():
        return None
    with open(path, "rb") as f:
        data = f.read(_MCORE_JSON_LIMIT + 1)
    try:
        if len(data) > _MCORE_JSON_LIMIT:
            raise ValueError(f"larger than {_MCORE_JSON_LIMIT} bytes")
        record = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(f"expected Megatron-Core's metadata.json, got: {first_line(e)}", path) from None
    if not isinstance(record, dict) or not isinstance(record.get("sharded_backend"), str):
        raise CorruptCheckpointError(f"expected a JSON object naming a sharded_backend, found {short_repr(record)}",
                                     path)
    if record["sharded_backend"] != "torch_dist":
        raise UnsupportedCheckpointError(f"a Megatron-Core save with the {record['sharded_backend']!r} backend is not "
                                         "read (only 'torch_dist' is)", path)
    return record


def _reformulated(meta: DcpRecord, folder: Path) -> dict[str, tuple[int, ...]]:
    """Flat key -> real shape of the tensors Megatron-Core <= 0.13 stored flattened, from
    ``mcore_data`` (on Metadata, or on the ranks' MCoreSavePlans)."""
    sources = [meta.get("mcore_data")]
    plans = meta.get("all_local_plans")
    if isinstance(plans, list):
        sources += [p.get("mcore_data") for p in plans if isinstance(p, DcpRecord)]
    out = {}
    for data in sources:
        for key, entry in (data.items() if isinstance(data, dict) else ()):
            shape = entry.get("nd_reformulated_orig_global_shape") if isinstance(entry, dict) else None
            if shape is not None:
                out[key] = _ints(shape, folder)
    return out


def _unpickle_metadata(path: Path) -> DcpRecord:
    try:
        # A link is followed: discovery vetted every path of the folder (links that lead out of
        # it are refused there unless follow_symlinks); O_NONBLOCK so that a FIFO cannot block.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise CorruptCheckpointError(f"expected a readable .metadata file, got: {e.strerror}", path) from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise CorruptCheckpointError("expected .metadata to be a regular file", path)
        data = f.read(METADATA_LIMIT + 1)
    if len(data) > METADATA_LIMIT:
        raise UnsafeCheckpointError(f"refused .metadata: larger than {METADATA_LIMIT} bytes", path)
    try:
        meta = load_pickle(data, DCP_ALLOWED, bounded=bounded_natively(data))
    except Refused as e:
        raise UnsafeCheckpointError(f"refused pickle global {e.global_name!r}: a DCP .metadata does not need it; "
                                    "nothing was executed", path) from None
    except RefusedState as e:
        raise UnsafeCheckpointError(f"refused pickle global {e.global_name!r}: {e.reason}; nothing was executed",
                                    path) from None
    except (BoundsExceeded, RecursionError) as e:
        raise UnsafeCheckpointError(f"refused .metadata: {first_line(e)}; nothing was executed", path) from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError, AttributeError,
            UnicodeDecodeError, OverflowError, MemoryError) as e:
        raise CorruptCheckpointError(f"expected a pickled DCP Metadata, got: {first_line(e)}", path) from None
    if not isinstance(meta, DcpRecord) or not meta.dcp_name.endswith((".Metadata", ".MCoreMetadata")):
        raise CorruptCheckpointError(f"expected a DCP Metadata object, found {short_repr(meta)}", path)
    return meta


def _places(folder: Path, storage: dict) -> dict[tuple[str, tuple[int, ...]], tuple[str, int, int]]:
    """(flat key, chunk offsets) -> (data file, offset, length), each file checked to be one of
    the folder's own data files."""
    out = {}
    for index, info in storage.items():
        if not isinstance(index, DcpRecord) or not isinstance(info, DcpRecord):
            raise CorruptCheckpointError("expected storage_data to map MetadataIndex to _StorageInfo",
                                         folder / METADATA)
        name, offset, length = info.get("relative_path"), info.get("offset"), info.get("length")
        if info.get("transform_descriptors"):
            raise UnsupportedCheckpointError(f"{name}: items stored through storage transforms (compression, "
                                             f"{short_repr(info.get('transform_descriptors'))}) are not read",
                                             folder)
        if not (isinstance(name, str) and _DATA_FILE.match(name) and type(offset) is int and type(length) is int
                and offset >= 0 and length >= 0):
            raise UnsafeCheckpointError(f"expected storage records naming a __<rank>_<n>.distcp file of this folder "
                                        f"with an offset and length, found {short_repr(vars(info))}", folder / METADATA)
        at = index.get("offset")  # None for a bytes item
        out[(index.get("fqn"), None if at is None else _ints(at, folder))] = (name, offset, length)
    return out


def _ints(value: Any, folder: Path) -> tuple[int, ...]:
    if isinstance(value, (tuple, list)) and len(value) <= 64 and all(type(v) is int and v >= 0 for v in value):
        return tuple(value)
    raise CorruptCheckpointError(f"expected a tuple of at most 64 ints >= 0, found {short_repr(value)}",
                                 folder / METADATA)


def _tensor(folder: Path, key: str, entry: DcpRecord, places: dict, path: Any,
            real_size: tuple[int, ...] | None = None) -> DcpTensor:
    where = folder / METADATA
    props = entry.get("properties")
    fields = props.get("fields") if isinstance(props, DcpRecord) else None
    dtype = fields[0] if isinstance(fields, tuple) and fields else props.get("dtype") if props else None
    if not isinstance(dtype, torch.dtype):
        raise CorruptCheckpointError(f"entry {key!r}: expected tensor properties with a dtype", where)
    size = _ints(entry.get("size"), folder)
    chunks = []
    for chunk in entry.get("chunks") or []:
        offsets, sizes = _ints(chunk.get("offsets"), folder), _ints(chunk.get("sizes"), folder)
        if len(offsets) != len(size) or len(sizes) != len(size) or any(o + s > n for o, s, n in zip(offsets, sizes, size)):
            raise InconsistentCheckpointError(f"entry {key!r}: chunk at {offsets} of size {sizes} is not inside the "
                                              f"tensor's size {size}", where)
        place = places.get((key, offsets))
        if place is None:
            raise CorruptCheckpointError(f"entry {key!r}: no storage record for its chunk at {offsets}", where)
        chunks.append(DcpChunk(offsets, sizes, *place))
    check_cover(key, size, [c.offsets for c in chunks], [c.sizes for c in chunks], where)
    nested = tuple(path) if isinstance(path, tuple) and all(type(p) in (str, int) for p in path) else (key,)
    if real_size is not None:
        grid = size[:-1]
        if len(real_size) != len(grid) or any(g == 0 or n % g for n, g in zip(real_size, grid)) \
                or math.prod(n // g for n, g in zip(real_size, grid)) != size[-1]:
            raise InconsistentCheckpointError(f"entry {key!r}: stored as {size}, which is no flattening of the real "
                                              f"shape {real_size} that mcore_data gives", where)
    return DcpTensor(key, nested, dtype, size, tuple(chunks), real_size)


class ChunkReader:
    """Reads chunks by offset out of their ``.distcp`` files, one private mapping per file."""

    def __init__(self, ckpt: DcpRecords):
        self.ckpt = ckpt
        self._mappings: dict[str, torch.UntypedStorage] = {}

    def read(self, tensor: DcpTensor, chunk: DcpChunk) -> torch.Tensor:
        """The chunk's tensor: a contiguous view of the file mapping, checked against the metadata."""
        path = self._file(chunk.file)
        mapping = self._mappings.get(chunk.file)
        if mapping is None:
            mapping = self._mappings[chunk.file] = map_file(path)
        value = _load_item(path, chunk, mapping)
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != chunk.sizes or value.dtype != tensor.dtype \
                or not value.is_contiguous():
            raise InconsistentCheckpointError(
                f"{tensor.key!r} at {chunk.offsets}: expected a contiguous {tensor.dtype} tensor of size "
                f"{chunk.sizes}, found {short_repr(value)}", path)
        return value

    def _file(self, name: str) -> Path:
        path = self.ckpt.folder / name
        try:
            st = os.stat(path)  # through a link: discovery vetted where the folder's links lead
        except OSError:
            raise CheckpointNotFoundError(f"expected the data file {name} that .metadata names", path) from None
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeCheckpointError("expected a regular data file, found a special file (FIFO, device, socket)",
                                        path)
        return path


def _load_item(path: Path, chunk: DcpChunk, mapping: torch.UntypedStorage) -> Any:
    where = f"the item at byte {chunk.offset}"
    try:
        return load_embedded_archive(path, chunk.offset, chunk.length, mapping)
    except ZeroFastError:
        raise
    except Refused as e:
        raise UnsafeCheckpointError(f"{where}: refused pickle global {e.global_name!r}: a DCP item does not need it; "
                                    "nothing was executed", path) from None
    except (RefusedState, BoundsExceeded, RecursionError) as e:
        raise UnsafeCheckpointError(f"{where}: refused its pickle: {first_line(e)}; nothing was executed",
                                    path) from None
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError, TypeError, IndexError, KeyError,
            AttributeError, UnicodeDecodeError, OverflowError, MemoryError) as e:
        raise CorruptCheckpointError(f"{where}: expected a torch.save archive, got: {first_line(e)}", path) from None
