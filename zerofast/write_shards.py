"""Step 5 for files (`zerofast.export`): write a checkpoint out in the Hugging Face layout, streaming.

Safetensors files are laid out here (header first, then the data region, sized up front) and each
tensor is gathered and cast by the native executor straight into a memory-mapped window of the
file: the data is written once, and only one window (``_WINDOW_BYTES``) is mapped at a time, so
memory stays flat whatever the model size. The torch format cannot stream (see ``_write_torch``).

Everything is written into a temporary folder inside the output folder and moved to its final
name only once every file is complete, the index last. An export that fails or is killed while
writing leaves no file under a final name (a write error is an ExportError naming the file and
the OS error); one killed during the moves, a few renames, may leave some complete files there,
never an index listing a missing one. A rerun cleans up either way.

The export runs as a sequence of steps (read, open the folder, write the data files, commit) led
by a ``team``: one process alone, or the ranks of ``zerofast.distributed``, which share the data
files out and agree after each step.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import mmap
import os
import re
import shutil
import struct
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Sequence

import torch

from . import hf
from .errors import ExportError, OutputExistsError, ZeroFastError
from .execute import Executor
from .ops import resolve_device
from .plan import Plan, TensorPlan
from .reconstruct import Prepared, prepare

if TYPE_CHECKING:
    from .distributed import Team

FORMATS = ("safetensors", "torch")
TIED_KEY = "zerofast_tied"  # metadata key: JSON string {alias: source} of tied names written once
# Lists the files the last export put in the folder. It sits under .cache/huggingface/, which
# huggingface_hub's upload_folder never uploads (its default ignore patterns); older versions
# wrote LEGACY_MARKER at the top, which is still read and then removed.
MARKER = ".cache/huggingface/zerofast-export.json"
LEGACY_MARKER = ".zerofast-export.json"
_HIDDEN = (".cache", LEGACY_MARKER)  # never counted as the user's files
_TMP_DIR = re.compile(r"^\.zerofast-tmp-\d+$")
_WINDOW_BYTES = 64 << 20

# format -> (single file, shard pattern, index): the names transformers and huggingface_hub use
_NAMES = {
    "safetensors": ("model.safetensors", "model-{:05d}-of-{:05d}.safetensors", "model.safetensors.index.json"),
    "torch": ("pytorch_model.bin", "pytorch_model-{:05d}-of-{:05d}.bin", "pytorch_model.bin.index.json"),
}
_WEIGHT_FILE = re.compile(r"^(model(-\d{5,}-of-\d{5,})?\.safetensors|pytorch_model(-\d{5,}-of-\d{5,})?\.bin)"
                          r"(\.index\.json)?$")

_ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class ExportResult:
    """What an export wrote. ``files`` are the data files in shard order; ``index`` is None for one file."""

    out_dir: Path
    format: str
    dtype: torch.dtype | None
    files: tuple[str, ...]
    index: str | None
    total_size: int  # tensor bytes written, as the index's metadata counts them
    tensors: int  # entries stored with their own data
    aliases: dict[str, str]  # tied names recorded as {alias: source} rather than stored again
    seconds: float
    optimizer_files: tuple[str, ...] = ()  # optimizer-state shards, their index, the scalars' JSON
    other_files: tuple[str, ...] = ()  # copied config, tokenizer and adapter config files

    @property
    def paths(self) -> list[Path]:
        names = (*self.files, *([self.index] if self.index else []), *self.optimizer_files, *self.other_files)
        return [self.out_dir / n for n in names]


# ---------------------------------------------------------------------------------------------
# Shard planning: pure functions of the plan and the size limit.

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """Bytes in a size limit as huggingface_hub reads it: ``"5GB"`` is 5*10**9, ``"5GiB"`` 5*2**30,
    and an int (or a string of digits) is a count of bytes."""
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise ValueError(f"max_shard_size must be an int or a string such as '5GB', got {size!r}")
    if isinstance(size, int):
        value = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*", size)
        unit = m.group(2).upper() if m else None
        if unit not in _UNITS:
            raise ValueError(f"max_shard_size {size!r}: expected a number of bytes or a size such as '500MB', "
                             "'5GB' or '4GiB'")
        value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"max_shard_size must be positive, got {size!r}")
    return value


def plan_shards(sizes: Iterable[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Group ``(name, nbytes)`` into shards as huggingface_hub does.

    Names stay in order; a shard closes when the next tensor would take it over ``max_bytes``; a
    tensor larger than the limit gets a shard of its own (appended as soon as it is met, while the
    open shard stays open). There is always at least one shard.
    """
    shards: list[list[str]] = []
    current: list[str] = []
    used = 0
    for name, nbytes in sizes:
        if nbytes > max_bytes:
            shards.append([name])
            continue
        if used + nbytes > max_bytes:
            shards.append(current)
            current, used = [], 0
        current.append(name)
        used += nbytes
    if current or not shards:
        shards.append(current)
    return shards


@dataclass(frozen=True)
class _File:
    name: str
    items: tuple[TensorPlan, ...]  # stored with their own data; ``tp.name`` is the name in the file
    aliases: tuple[tuple[str, str], ...]  # torch format: (alias, source) that share the source's storage
    keys: tuple[str, ...]  # every key of the file, in the model's order


def shard_names(fmt: str, count: int) -> list[str]:
    single, pattern, _ = _NAMES[fmt]
    return [single] if count == 1 else [pattern.format(i + 1, count) for i in range(count)]


def _stored_entries(plan: Plan, duplicate_tied: bool) -> list[TensorPlan]:
    """Every tensor that gets its own data, in model order: tied aliases too when duplicated."""
    out = []
    for name in plan.order:
        source = plan.aliases.get(name)
        if source is None:
            out.append(plan.tensors[name])
        elif duplicate_tied:
            out.append(dataclasses.replace(plan.tensors[source], name=name))
    return out


def layout(plan: Plan, fmt: str, max_bytes: int, duplicate_tied: bool = False,
           names: dict | None = None) -> tuple[list[_File], dict[str, str]]:
    """The files an export writes, and the tied names it records instead of storing them again.

    An alias costs no bytes: safetensors lists it in the metadata, torch files hold it next to its
    source so that the two keep sharing storage.
    """
    entries = {tp.name: tp for tp in _stored_entries(plan, duplicate_tied)}
    groups = plan_shards(((n, tp.nbytes) for n, tp in entries.items()), max_bytes)
    tied = {} if duplicate_tied else {a: plan.aliases[a] for a in plan.order if a in plan.aliases}
    files = []
    file_names = shard_names(fmt, len(groups)) if names is None else [names[fmt][0]]
    for name, group in zip(file_names, groups):
        members = set(group)
        aliases = tuple((a, s) for a, s in tied.items() if s in members) if fmt == "torch" else ()
        members.update(a for a, _ in aliases)
        keys = tuple(k for k in plan.order if k in members)
        files.append(_File(name, tuple(entries[n] for n in group), aliases, keys))
    return files, tied


def _index(fmt: str, files: Sequence[_File], tied: dict[str, str], total: int) -> dict:
    weight_map = {key: f.name for f in files for key in f.keys}
    metadata: dict = {"total_size": total}
    if fmt == "safetensors" and tied:
        metadata[TIED_KEY] = json.dumps(tied, sort_keys=True)
    return {"metadata": metadata, "weight_map": weight_map}


# ---------------------------------------------------------------------------------------------
# Writing one file.

def _st_dtype(tp: TensorPlan) -> str:
    try:
        return _ST_DTYPES[tp.out_dtype]
    except KeyError:
        raise ExportError(f"{tp.name!r} has dtype {tp.out_dtype}, which safetensors cannot store; "
                          "use --format torch") from None


def safetensors_header(items: Sequence[TensorPlan], metadata: dict[str, str]) -> tuple[bytes, list[tuple[TensorPlan, int]]]:
    """The file's first bytes (length prefix and JSON header) and each tensor's data offset.

    safetensors wants the data packed without gaps, so tensors go in by falling itemsize: every
    offset is then a multiple of its tensor's itemsize, and the typed views of the mapping are
    aligned (the header is padded so the data region starts at a multiple of 8).
    """
    header: dict = {"__metadata__": metadata}
    placed = []
    pos = 0
    for tp in sorted(items, key=lambda t: -t.out_dtype.itemsize):
        header[tp.name] = {"dtype": _st_dtype(tp), "shape": list(tp.shape), "data_offsets": [pos, pos + tp.nbytes]}
        placed.append((tp, pos))
        pos += tp.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, placed


def _write_safetensors(path: Path, file: _File, metadata: dict[str, str], executor: Executor,
                       advance: Callable[[int], None]) -> None:
    head, placed = safetensors_header(file.items, metadata)
    with _writing(path), open(path, "w+b") as f:
        f.write(head)
        f.flush()
        _reserve(f.fileno(), len(head) + sum(tp.nbytes for tp, _ in placed))
        for start, end, batch in _windows(_pieces(placed, len(head))):
            _fill(f.fileno(), start, end, batch, executor)
            advance(end - start)


def _reserve(fd: int, size: int) -> None:
    """Allocate the file's blocks up front: a full disk (ENOSPC) or a file-size limit (EFBIG) then
    fails here, as an OSError, rather than killing the process with SIGBUS when a mapped page finds
    no room."""
    try:
        os.posix_fallocate(fd, 0, size)
    except AttributeError:  # no posix_fallocate on this platform
        os.ftruncate(fd, size)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        os.ftruncate(fd, size)


def _pieces(placed: Iterable[tuple[TensorPlan, int]], base: int) -> Iterator[tuple[TensorPlan, int]]:
    """(tensor or slice of one, file offset), each at most one window long."""
    for tp, off in placed:
        size = tp.out_dtype.itemsize
        step = max(1, _WINDOW_BYTES // size)
        for lo in range(0, tp.numel, step):
            hi = min(tp.numel, lo + step)
            yield (tp if hi - lo == tp.numel else tp.slice(lo, hi)), base + off + lo * size


def _windows(pieces: Iterable[tuple[TensorPlan, int]]) -> Iterator[tuple[int, int, list[tuple[TensorPlan, int]]]]:
    """Consecutive pieces grouped into byte ranges of at most one window."""
    batch: list[tuple[TensorPlan, int]] = []
    start = end = 0
    for tp, off in pieces:
        if batch and off + tp.nbytes - start > _WINDOW_BYTES:
            yield start, end, batch
            batch = []
        if not batch:
            start = off
        batch.append((tp, off))
        end = off + tp.nbytes
    if batch:
        yield start, end, batch


def _fill(fd: int, start: int, end: int, batch: Sequence[tuple[TensorPlan, int]], executor: Executor) -> None:
    base = start - start % mmap.ALLOCATIONGRANULARITY
    # The tensor holds the only reference to the mapping, so returning unmaps it: written pages
    # leave this process's memory and wait in the page cache for write-back.
    window = torch.frombuffer(mmap.mmap(fd, end - base, offset=base), dtype=torch.uint8)
    for tp, off in batch:
        executor.run(tp, out=window[off - base:off - base + tp.nbytes].view(tp.out_dtype))


def _write_torch(path: Path, file: _File, executor: Executor, advance: Callable[[int], None]) -> None:
    # torch.save needs every tensor of a file in memory at once, so this format holds one shard
    # (at most max_shard_size, or a single larger tensor) instead of streaming tensor by tensor.
    made = {}
    for tp in file.items:
        made[tp.name] = executor.run(tp)
        advance(tp.nbytes)
    for alias, source in file.aliases:
        made[alias] = made[source]
    with _writing(path), open(path, "wb") as f:
        sink = _Sink(f)
        try:
            torch.save(OrderedDict((k, made[k]) for k in file.keys), sink)
        except RuntimeError:
            if sink.error is None:
                raise
            raise sink.error from None


class _Sink:
    """The file object torch.save writes through. torch turns a failed write into a RuntimeError
    about stream positions; holding on to the OSError lets the export say what failed (EFBIG, ENOSPC).
    (Given a path instead, torch writes from C++ and the OS error is lost entirely.)"""

    def __init__(self, f):
        self.f = f
        self.error: OSError | None = None

    def write(self, data) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()


@contextmanager
def _writing(path: Path) -> Iterator[None]:
    """Report an OS error while writing ``path`` (a full disk, a file-size limit, an I/O error) as
    an ExportError naming the file under its final name, and the error. Nothing written so far has
    left the temporary folder, which goes as the error unwinds the export."""
    try:
        yield
    except ZeroFastError:
        raise
    except OSError as e:
        raise ExportError(f"could not write this file: {_os_error(e)}; the export stopped and put no file in place",
                          _final_name(path)) from e


def _write_text(path: Path, text: str) -> None:
    with _writing(path):
        path.write_text(text)


def _write_bytes(path: Path, data: bytes) -> None:
    with _writing(path):
        path.write_bytes(data)


def _final_name(path: Path) -> Path:
    return path.parent.parent / path.name if _TMP_DIR.match(path.parent.name) else path


def _os_error(e: OSError) -> str:
    if e.strerror is None:
        return str(e)
    code = errno.errorcode.get(e.errno) if isinstance(e.errno, int) else None
    return f"{e.strerror} ({code})" if code else e.strerror


# ---------------------------------------------------------------------------------------------
# The output folder: ownership, locking, the temporary folder, and the final moves.

@contextmanager
def _output_dir(out_dir: Path, overwrite: bool) -> Iterator[tuple[Path, list[str]]]:
    """Lock ``out_dir``, check that it may be written, and yield a fresh temporary folder inside
    it plus the files the previous export left there. The temporary folder goes in any case."""
    _make_dir(out_dir)
    fd = os.open(out_dir, os.O_RDONLY)
    try:
        _lock(fd, out_dir)
        previous = _check_owner(out_dir, overwrite)
        for name in os.listdir(out_dir):
            if _TMP_DIR.match(name):  # the lock says no export is alive to own it
                shutil.rmtree(out_dir / name, ignore_errors=True)
        tmp = out_dir / f".zerofast-tmp-{os.getpid()}"
        try:
            tmp.mkdir()
        except OSError as e:
            raise ExportError(f"cannot create the temporary folder: {_os_error(e)}", tmp) from e
        try:
            yield tmp, previous
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        os.close(fd)  # releases the lock


def _make_dir(out_dir: Path) -> None:
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise OutputExistsError("expected an output folder, found a file", out_dir) from None
    except OSError as e:
        raise ExportError(f"cannot create the output folder: {e.strerror}", out_dir) from e


def _lock(fd: int, out_dir: Path) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise OutputExistsError("another zerofast export is writing into this folder", out_dir) from None


def _read_marker(out_dir: Path) -> list[str] | None:
    """The files the previous export wrote; None where no zerofast export was ever committed."""
    for name in (MARKER, LEGACY_MARKER):
        try:
            files = json.loads((out_dir / name).read_text())["files"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        return [f for f in files if isinstance(f, str) and "/" not in f and f not in ("", ".", "..")]
    return None


def _check_owner(out_dir: Path, overwrite: bool) -> list[str]:
    """The previous export's files. A folder zerofast never exported into must be empty (or
    ``overwrite`` given); files a user added to an export of ours stay and do not block a rerun."""
    previous = _read_marker(out_dir)
    ours = set(previous or ()) | set(_HIDDEN)
    foreign = sorted(n for n in os.listdir(out_dir) if n not in ours and not _TMP_DIR.match(n))
    if foreign and not overwrite and previous is None:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise OutputExistsError(
            f"the folder holds files zerofast did not write ({shown}); pass overwrite=True (--overwrite) to "
            "export into it anyway, replacing only model weight files", out_dir)
    return previous or []


def _commit(out_dir: Path, tmp: Path, data_files: Sequence[str], index: str | None, previous: Sequence[str]) -> None:
    """Move the finished files into place, the index last, after removing what they replace.

    The marker claims the new names before anything moves, so a rerun after an interruption here
    still recognizes every file as zerofast's. Old indexes go first: no index ever lists shards
    that are missing or half replaced.
    """
    final = [*data_files, *([index] if index else [])]
    _write_marker(out_dir, tmp, sorted(set(previous) | set(final)))
    try:
        stale = set(previous) | {n for n in os.listdir(out_dir) if _WEIGHT_FILE.match(n)}
        for name in sorted(stale, key=lambda n: not n.endswith(".index.json")):
            path = out_dir / name
            if name not in data_files and path.is_file():
                path.unlink()
        for name in final:
            os.replace(tmp / name, out_dir / name)
    except OSError as e:
        raise ExportError(f"stopped while moving the new files into place: {_os_error(e)}; the folder may hold "
                          "only some of them: run the export again", out_dir) from e
    # Every file is in place. The marker still lists the replaced names too, which only ever tells
    # a rerun what it may remove, so failing to shrink it (on a full disk) must not fail the export.
    with contextlib.suppress(OSError, ExportError):
        _write_marker(out_dir, tmp, final)


def _write_marker(out_dir: Path, tmp: Path, files: Sequence[str]) -> None:
    staged = tmp / Path(MARKER).name
    _write_text(staged, json.dumps({"written_by": "zerofast", "files": list(files)}, indent=2) + "\n")
    final = out_dir / MARKER
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ExportError(f"cannot create the folder for zerofast's list of files: {_os_error(e)}", final.parent) from e
    os.replace(staged, final)
    with contextlib.suppress(FileNotFoundError):
        (out_dir / LEGACY_MARKER).unlink()


# ---------------------------------------------------------------------------------------------

def export(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: torch.dtype | None = torch.float32,
           format: str = "safetensors", max_shard_size: int | str = "5GB", tag: str | None = None,
           exclude_frozen: bool = False, duplicate_tied: bool = False, overwrite: bool = False,
           optimizer_states: bool | Sequence[str] = False, progress: Progress | None = None,
           device: str | torch.device = "cpu", team: Team | None = None, adapter: bool = False,
           merge_adapters: bool = False, base_model: str | os.PathLike | None = None,
           hf_files: bool = True) -> ExportResult:
    """Write a DeepSpeed ZeRO checkpoint out as Hugging Face-layout weight files.

    Args:
        ckpt_dir: the checkpoint root (holding ``latest``) or a tag folder.
        out_dir: the folder to write; created if missing. A folder holding files zerofast did not
            write is refused unless ``overwrite`` is set; a previous zerofast export is replaced.
        dtype: as for :func:`zerofast.reconstruct` (``None`` keeps the checkpoint's dtypes).
        format: ``"safetensors"`` (streamed into the files) or ``"torch"`` (``torch.save``, one
            shard in memory at a time).
        max_shard_size: per-file limit, an int of bytes or a string such as ``"5GB"``/``"4GiB"``.
        tag, exclude_frozen: as for :func:`zerofast.reconstruct`.
        duplicate_tied: write tied weights as real copies instead of recording the aliases.
        overwrite: write into a non-empty folder that zerofast did not write; only model weight
            files (``model*.safetensors``, ``pytorch_model*.bin`` and their indexes) are replaced.
        optimizer_states: also write the wrapped optimizer's per-element states (stages 1-3):
            ``True`` for all of them, or a list of keys such as ``["exp_avg"]``. They go to
            ``optimizer.safetensors`` (sharded like the weights) as ``<param>.<key>``, as stored
            (fp32) whatever ``dtype`` is, and their scalars (``step``) and hyperparameters to
            ``optimizer_state.json``.
        progress: called as ``progress(bytes_done, bytes_total)``, first with 0, then as data lands.
        device: where the weights are gathered and cast: ``"cpu"``, or ``"cuda"``/``"cuda:N"``, which
            builds each tensor on the GPU and copies it back through pinned buffers to the writer.
        team: the ranks sharing this export (:class:`zerofast.distributed.Team`); None writes every
            file here. Use :func:`zerofast.distributed.export` rather than passing one.
        adapter: for a PEFT checkpoint, write only the adapter, as ``adapter_model.safetensors`` plus
            ``adapter_config.json`` under the names ``PeftModel.from_pretrained`` expects.
        merge_adapters: for a PEFT (LoRA) checkpoint, write the base model with the LoRA deltas
            merged, under the base model's names, as peft's ``merge_and_unload()`` computes them.
        base_model: the base model's ``save_pretrained`` folder, for merging an adapter whose
            checkpoint holds no frozen weights (the HF Trainer's PEFT saves); by default the
            adapter config's ``base_model_name_or_path`` when that is a folder.
        hf_files: copy ``config.json`` (its dtype set to the exported dtype), the generation
            config and tokenizer files found next to the checkpoint, so that ``from_pretrained``
            loads the folder as it is. ``ckpt_dir`` may then also be a Trainer's ``output_dir``
            holding one ``checkpoint-*`` folder.
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    limit = parse_size(max_shard_size)
    compute = resolve_device(device)
    started = time.monotonic()
    team = team or _ALONE
    out = Path(out_dir)
    if adapter and merge_adapters:
        raise ValueError("adapter and merge_adapters exclude each other")
    with team.step("reading the checkpoint", out):
        if hf_files:
            ckpt_dir = hf.resolve_checkpoint_dir(ckpt_dir)
        prepared = prepare(ckpt_dir, dtype, tag=tag, exclude_frozen=exclude_frozen or adapter,
                           warn_absent=not merge_adapters)
        prepared, names, extras = _hf_view(prepared, dtype, adapter, merge_adapters, base_model, hf_files)
        if names is not None:
            limit = max(limit, sum(tp.nbytes for tp in prepared.plan.tensors.values()) + 1)  # peft reads one file
        files, tied = layout(prepared.plan, format, limit, duplicate_tied, names=names)
        optim = _optimizer_layout(prepared.checkpoint, optimizer_states, limit)
        writes = _data_writes(files, tied, format, prepared.streaming_executor(compute=compute), optim)
    index = (names or _NAMES[format])[2] if len(files) > 1 else None
    extra = _optimizer_names(optim) if optim else []
    with team.output_dir(out, overwrite) as (tmp, previous):
        mine = team.share(writes, prepared.checkpoint.files.tag, out)
        advance = _counter(progress, sum(w.nbytes for w in mine))
        with team.step("writing the files", out):
            for w in mine:
                w.write(tmp, advance)
        with team.step("committing the export", out):
            if team.leader:
                _write_indexes(tmp, format, files, tied, index, optim)
                for name, content in extras.items():
                    _write_bytes(tmp / name, content)
                _commit(out, tmp, [f.name for f in files] + extra + list(extras), index, previous)
    total = sum(tp.nbytes for f in files for tp in f.items)
    return ExportResult(out, format, dtype, tuple(f.name for f in files), index, total,
                        sum(len(f.items) for f in files), tied, time.monotonic() - started, tuple(extra),
                        tuple(extras))


_ADAPTER_NAMES = {"safetensors": ("adapter_model.safetensors", "", ""), "torch": ("adapter_model.bin", "", "")}


def _hf_view(prepared: Prepared, dtype, adapter: bool, merge: bool, base_model, hf_files: bool):
    """The plan to write for a Hugging Face folder, the file names (None: the usual ones) and the
    config/tokenizer files to copy next to the weights."""
    folder = hf.trainer_folder(prepared)
    names, folders = None, [folder]
    if adapter:
        prepared = dataclasses.replace(prepared, plan=hf.adapter_plan(prepared.plan))
        hf.read_adapter_config(folder)
        names = _ADAPTER_NAMES
    elif merge:
        prepared, folders = hf.merged_plan(prepared, dtype, base_model, folder)
    elif hf_files and hf.is_peft(prepared.plan, folder):
        hf.warn_peft_as_is(prepared.plan, folder)
    extras = hf.extra_files(folders, prepared.plan, dtype, adapter) if hf_files or adapter else {}
    return prepared, names, extras


@dataclass(frozen=True)
class _Write:
    """One data file to write: the unit the ranks of a distributed export share out."""

    file: _File
    executor: Executor
    metadata: dict[str, str] | None  # the safetensors header's; None for a torch file

    @property
    def nbytes(self) -> int:
        return sum(tp.nbytes for tp in self.file.items)

    def write(self, tmp: Path, advance: Callable[[int], None]) -> None:
        if self.metadata is None:
            _write_torch(tmp / self.file.name, self.file, self.executor, advance)
        else:
            _write_safetensors(tmp / self.file.name, self.file, self.metadata, self.executor, advance)


def _data_writes(files: Sequence[_File], tied: dict[str, str], fmt: str, executor: Executor,
                 optim: _OptimizerFiles | None) -> list[_Write]:
    metadata = None if fmt == "torch" else _file_metadata(tied, len(files))
    writes = [_Write(f, executor, metadata) for f in files]
    if optim:
        states = optim.prepared.streaming_executor()
        writes += [_Write(f, states, {"format": "pt"}) for f in optim.files]
    return writes


def _write_indexes(tmp: Path, fmt: str, files: Sequence[_File], tied: dict[str, str], index: str | None,
                   optim: _OptimizerFiles | None) -> None:
    """What only rank 0 writes, once every data file is in: the indexes and the optimizer's JSON."""
    if index:
        total = sum(tp.nbytes for f in files for tp in f.items)
        _write_text(tmp / index, json.dumps(_index(fmt, files, tied, total), indent=2, sort_keys=True) + "\n")
    if optim:
        _write_optimizer_index(tmp, optim)


class _Alone:
    """The one process of a plain export: it writes every file, and steps need no agreement.
    ``zerofast.distributed.Team`` stands in for it when several processes share the work."""

    leader = True

    def step(self, what: str, where: Path) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def output_dir(self, out: Path, overwrite: bool):
        return _output_dir(out, overwrite)

    def share(self, writes: list[_Write], tag: str, where: Path) -> list[_Write]:
        return writes


_ALONE = _Alone()


# ---------------------------------------------------------------------------------------------
# Optimizer states: the same shard layout and safetensors writer as the weights, under their own
# names, next to them in the output folder.

OPTIMIZER_NAMES = ("optimizer.safetensors", "optimizer-{:05d}-of-{:05d}.safetensors", "optimizer.safetensors.index.json")
OPTIMIZER_JSON = "optimizer_state.json"


@dataclass(frozen=True)
class _OptimizerFiles:
    prepared: Prepared
    files: list[_File]
    keys: list[str]

    @property
    def nbytes(self) -> int:
        return sum(tp.nbytes for f in self.files for tp in f.items)


def _optimizer_layout(ckpt, wanted: bool | Sequence[str], max_bytes: int) -> _OptimizerFiles | None:
    from .optimizer_states import available_keys, plan_optimizer_states

    if wanted is False or (not isinstance(wanted, bool) and not wanted):
        return None
    keys = available_keys(ckpt) if wanted is True else list(wanted)
    if not keys:
        raise ExportError("optimizer_states: the optimizer keeps no per-element state in this checkpoint",
                          ckpt.files.tag_dir)
    prepared = plan_optimizer_states(ckpt, keys, None, qualified=True)
    files, _ = layout(prepared.plan, "safetensors", max_bytes)
    single, pattern, _ = OPTIMIZER_NAMES
    names = [single] if len(files) == 1 else [pattern.format(i + 1, len(files)) for i in range(len(files))]
    return _OptimizerFiles(prepared, [dataclasses.replace(f, name=n) for f, n in zip(files, names)], keys)


def _optimizer_names(optim: _OptimizerFiles) -> list[str]:
    """The files the optimizer states take: shards, their index when there are several, the JSON."""
    names = [f.name for f in optim.files]
    if len(optim.files) > 1:
        names.append(OPTIMIZER_NAMES[2])
    return [*names, OPTIMIZER_JSON]


def _write_optimizer_index(tmp: Path, optim: _OptimizerFiles) -> None:
    """Everything but the shards: the index when there are several, and the JSON."""
    from .optimizer_states import scalar_states

    names = _optimizer_names(optim)
    if len(optim.files) > 1:
        index = _index("safetensors", optim.files, {}, optim.nbytes)
        _write_text(tmp / OPTIMIZER_NAMES[2], json.dumps(index, indent=2, sort_keys=True) + "\n")
    ckpt = optim.prepared.checkpoint
    doc = {"keys": optim.keys, "tensors": names[-2], "stage": ckpt.stage, "world_size": ckpt.world_size,
           "tag": ckpt.files.tag, **scalar_states(ckpt)}
    _write_text(tmp / OPTIMIZER_JSON, json.dumps(doc, indent=2) + "\n")


def _file_metadata(tied: dict[str, str], count: int) -> dict[str, str]:
    # transformers refuses a safetensors file whose metadata lacks format "pt"
    metadata = {"format": "pt"}
    if tied and count == 1:
        metadata[TIED_KEY] = json.dumps(tied, sort_keys=True)
    return metadata


def _counter(progress: Progress | None, total: int) -> Callable[[int], None]:
    done = 0
    if progress is not None:
        progress(0, total)

    def advance(nbytes: int) -> None:
        nonlocal done
        done += nbytes
        if progress is not None:
            progress(done, total)

    return advance


# ---------------------------------------------------------------------------------------------
# Reading an export back.

def load_exported(out_dir: str | os.PathLike) -> "OrderedDict[str, torch.Tensor]":
    """Read an exported folder (either format, one file or an index of shards) with the plain
    safetensors/torch loaders and tie the recorded aliases back: ``sd[alias] is sd[source]``."""
    out = Path(out_dir)
    for fmt in FORMATS:
        single, _, index = _NAMES[fmt]
        if (out / single).is_file():
            tensors, metadata = _read_weights(out / single, fmt)
            return _tie(tensors, _tied_from(metadata, out / single), out / single)
        if (out / index).is_file():
            return _load_indexed(out / index, fmt)
    raise ExportError("expected model.safetensors, pytorch_model.bin or one of their index files, found none", out)


def _load_indexed(index_path: Path, fmt: str) -> "OrderedDict[str, torch.Tensor]":
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


def _read_weights(path: Path, fmt: str) -> tuple[dict[str, torch.Tensor], dict]:
    if not path.is_file():
        raise ExportError("the index lists this file, but it is missing", path)
    if fmt == "torch":
        return torch.load(path, map_location="cpu", weights_only=True), {}
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(path, framework="pt") as f:
        metadata = f.metadata() or {}
    return load_file(path), metadata


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
