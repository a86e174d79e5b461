"""An export folder read for checking: its files parsed and checked against themselves, its
tensors read in chunks by ``pread`` (safetensors) or from the mapped file (torch format).

Checked here, without the checkpoint: every file the index names exists and holds the tensors
the index puts in it, and no file holds a tensor the index does not list; each safetensors file
is as long as its header says (a truncated copy shows here); the tied aliases point at stored
tensors; the config's dtype is the dtype of most of the weights (as ``export`` writes it).
"""
from __future__ import annotations

import json
import os
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch

from ..base import dtypes
from ..base.errors import ExportError
from ..hf import trainer as hf
from ..hf.formats import FORMATS, read_index, safetensors_files, tied_names
from ..hf.run import OPTIMIZER_NAMES
from .report import Report
from .ranges import Located
from .tensors import Chunk, Meta, ahead, batches

CONFIG = "config.json"


@dataclass(frozen=True)
class _Where:
    path: Path
    offset: int  # safetensors: byte offset of the data in the file; torch: unused
    key: str  # the name inside the file


def weight_files(folder: Path, optimizer: bool = False) -> tuple[str, Path, bool] | None:
    """(format name, the file or index, is it an index) of the weights in ``folder``, or of its
    optimizer states with ``optimizer``; None when there are none."""
    if optimizer:
        single, _, index = OPTIMIZER_NAMES
        candidates = [("safetensors", single, index)]
    else:
        candidates = [(f.name, f.single, f.index) for f in FORMATS.values()]
        candidates += [(name, file, None) for name, file in hf.ADAPTER_FILES.items()]
    for name, single, index in candidates:
        if (folder / single).is_file():
            return name, folder / single, False
        if index and (folder / index).is_file():
            return name, folder / index, True
    return None


def is_export(path: str | os.PathLike) -> bool:
    return Path(path).is_dir() and weight_files(Path(path)) is not None


class ExportFolder:
    """The tensors of an export folder (a :class:`~zerofast.checks.tensors.TensorSource`).
    Problems with the files are added to ``report``; unreadable tensors are left out."""

    def __init__(self, folder: str | os.PathLike, report: Report, optimizer: bool = False):
        self.folder = Path(folder)
        self.report = report
        self.where: dict[str, _Where] = {}
        self.metas: dict[str, Meta] = {}
        self.aliases: dict[str, str] = {}
        self.cut: set[str] = set()  # tensors past the end of a truncated file
        found = weight_files(self.folder, optimizer)
        self.format, self.adapter = (found[0], found[1].name.startswith("adapter_")) if found else (None, False)
        if found is None:
            if not optimizer:
                report.add("files", str(self.folder), "expected model.safetensors, pytorch_model.bin, an index of "
                           "their shards or an adapter file, found none")
        elif found[2]:
            self._read_index(found[1])
        else:
            self._read_file(found[1], None)
        self._tie_shared()
        self.order = tuple(self.where)

    # -- reading the files ------------------------------------------------------------------

    def _read_index(self, index: Path) -> None:
        try:
            weight_map, metadata = read_index(index)
        except ExportError as e:
            self.report.add("index", index.name, e.message)
            return
        by_file: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            by_file.setdefault(file, []).append(name)
        for file, names in by_file.items():
            path = self.folder / file
            if "/" in file or not path.is_file():
                self.report.add("index", file, f"the index lists {len(names)} tensors in this file, which is missing")
                continue
            self._read_file(path, set(names))
        self._check_total(index, metadata)
        self._read_tied(metadata, index)

    def _check_total(self, index: Path, metadata: dict) -> None:
        total = metadata.get("total_size")
        stored = sum(m.nbytes for m in self.metas.values())
        if isinstance(total, int) and total != stored:
            self.report.add("index", index.name, f"metadata total_size is {total:,} bytes, the tensors it lists that "
                            f"were found hold {stored:,}", total_size=total, stored=stored)

    def _read_file(self, path: Path, listed: set[str] | None) -> None:
        found = self._safetensors(path) if self.format == "safetensors" else self._torch(path)
        if found is None:
            return
        names, metadata = found
        if listed is not None:
            for name in sorted(listed - set(names) - self.cut):
                self.report.add("index", name, f"the index puts it in {path.name}, which does not hold it")
            for name in sorted(set(names) - listed):
                self.report.add("index", name, f"{path.name} holds it, but the index does not list it")
        elif metadata:
            self._read_tied(metadata, path)
        for name, found in names.items():
            if found is not None and (listed is None or name in listed):
                self.where[name], self.metas[name] = found

    def _safetensors(self, path: Path):
        """The file's tensors as its header places them; every problem of the header is reported
        (:func:`~zerofast.hf.formats.safetensors_files.read_header`, report-and-go-on), and tensors past
        the end of a truncated file are left out and remembered in ``cut``."""
        try:
            head = safetensors_files.read_header(path, self.report.add)
        except OSError as e:
            self.report.add("files", path.name, f"expected a safetensors file, could not read it ({e.strerror})")
            return None
        if head is None:
            return None
        self.cut.update(head.cut)
        return {name: (_Where(path, head.start + e.begin, name), Meta(name, e.shape, e.dtype, "stored"))
                for name, e in head.entries.items()}, head.metadata

    def _torch(self, path: Path):
        try:
            sd = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
        except Exception as e:  # torch fails in its own ways on a file it did not write
            self.report.add("files", path.name, f"expected a torch.save file of tensors, could not read it "
                            f"({type(e).__name__})")
            return None
        seen: dict[tuple, str] = {}
        out = {}
        for name, t in sd.items():
            ident = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
            if ident in seen:  # the torch format keeps a tie as one storage under two names
                self.aliases[name] = seen[ident]
                out[name] = None  # held by this file, as an alias
                continue
            seen[ident] = name
            out[name] = (_Where(path, 0, name), Meta(name, tuple(t.shape), t.dtype, "stored"))
        return out, {}

    def _read_tied(self, metadata: dict, where: Path) -> None:
        try:
            self.aliases.update(tied_names(metadata, where))
        except ExportError as e:
            self.report.add("aliases", where.name, e.message)

    def _tie_shared(self) -> None:
        for alias, source in list(self.aliases.items()):
            if source not in self.where:
                self.report.add("aliases", alias, f"recorded as a tie to {source!r}, which the export does not hold")
                del self.aliases[alias]

    # -- checks and reading -----------------------------------------------------------------

    def check_config(self) -> None:
        """The config's dtype must be the dtype of most floating bytes, as ``export`` writes it."""
        path = self.folder / CONFIG
        if self.adapter or not path.is_file():
            return
        try:
            config = json.loads(path.read_text())
        except (ValueError, OSError) as e:
            self.report.add("config-dtype", CONFIG, f"expected JSON, could not read it ({e})")
            return
        counts = Counter()
        for m in self.metas.values():
            if m.dtype.is_floating_point:
                counts[dtypes.name(m.dtype)] += m.nbytes
        weights = counts.most_common(1)[0][0] if counts else None
        for key in ("dtype", "torch_dtype"):
            said = config.get(key) if isinstance(config, dict) else None
            if isinstance(said, str) and weights and said.removeprefix("torch.") != weights:
                self.report.add("config-dtype", CONFIG, f"{key} is {said!r}, but the weights are {weights}: "
                                f"from_pretrained(dtype='auto') would load them as {said}", config=said,
                                weights=weights)
        if weights:
            self.report.checks.append(f"config: dtype matches the weights ({weights})")

    def meta(self, name: str) -> Meta:
        return self.metas[name]

    def chunks(self, names: Sequence[str]) -> Iterator[Chunk]:
        fds: dict[Path, int] = {}
        loaded: dict[Path, dict] = {}

        def read(batch: list[tuple[str, int, int]]) -> list[Chunk]:
            return [(name, lo, self._read(self.where[name], self.metas[name], lo, hi, fds, loaded))
                    for name, lo, hi in batch]

        try:
            yield from ahead(read, batches(self, names))
        finally:
            for fd in fds.values():
                os.close(fd)

    @contextmanager
    def located(self, names: Sequence[str]) -> Iterator[Located]:
        """Where ``names`` are, for the native checks (:mod:`.ranges`): a safetensors tensor is read
        from its file by offset (its source is a stand-in of its dtype and length), a torch-format
        one from the file's mapping."""
        fds: dict[Path, int] = {}
        loaded: dict[Path, dict] = {}
        found = Located([], [], [], {})
        try:
            for name in names:
                where, meta = self.where[name], self.metas[name]
                if self.format == "safetensors":
                    if where.path not in fds:
                        fds[where.path] = os.open(where.path, os.O_RDONLY)
                    stand_in = torch.empty(min(meta.numel, 1), dtype=meta.dtype).expand(meta.numel)
                    found.sources.append(stand_in)
                    found.fds.append(fds[where.path])
                    found.offsets.append(where.offset)
                else:
                    if where.path not in loaded:
                        loaded[where.path] = torch.load(where.path, mmap=True, weights_only=True, map_location="cpu")
                    # A tensor saved as a strided view loads as one; the op reads contiguous sources.
                    found.sources.append(loaded[where.path][where.key].reshape(-1).contiguous())
                    found.fds.append(-1)
                    found.offsets.append(0)
                found.rows[name] = [(len(found.sources) - 1, 0, 0, meta.numel)]
            yield found
        finally:
            for fd in fds.values():
                os.close(fd)

    def _read(self, where: _Where, meta: Meta, lo: int, hi: int, fds: dict, loaded: dict) -> torch.Tensor:
        if hi == lo:
            return torch.empty(0, dtype=meta.dtype)
        if self.format != "safetensors":
            if where.path not in loaded:
                loaded.clear()  # one torch file mapped at a time
                loaded[where.path] = torch.load(where.path, mmap=True, weights_only=True, map_location="cpu")
            return loaded[where.path][where.key].reshape(-1)[lo:hi].clone()
        if where.path not in fds:
            fds[where.path] = os.open(where.path, os.O_RDONLY)
        size = meta.dtype.itemsize
        raw = bytearray((hi - lo) * size)
        if os.preadv(fds[where.path], [raw], where.offset + lo * size) != len(raw):
            raise OSError(f"{where.path}: short read (the file changed while it was read)")
        return torch.frombuffer(raw, dtype=meta.dtype)
