"""Step 1: find the tag folder of a DeepSpeed checkpoint and list what it holds.

Only file names are read here (plus the ``latest`` text file); nothing is unpickled.
:func:`locate` settles the tag and returns the folder's names as :class:`Found`; which layout
those names are, and which files it needs, each layout says for itself (:mod:`zerofast.layouts`,
whose ``discover`` composes the two). The helpers below are what the layouts share to list
rank files: ranks 0..N-1 with one file each, and the first few missing ones named.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from .base.errors import (
    AmbiguousTagError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    UnsafeCheckpointError,
    UnsupportedCheckpointError,
    few,
    first_line,
    short_repr,
    some,
)
from .base.settings import FOLLOW_SYMLINKS_ENV, settings

MODEL_FILE_STAGE012 = "mp_rank_00_model_states.pt"
ZERO3_MODEL = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_00_model_states\.pt$")
OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")
_MODEL_PARALLEL_RANK = re.compile(r"mp_rank_(\d+)_")
# The second is what ds_to_universal writes; the third Megatron-LM's (an iteration: iter_0000010/).
MEGATRON_LATEST = "latest_checkpointed_iteration.txt"
LATEST_FILES = ("latest", "latest_universal", MEGATRON_LATEST)
# Remote locations people paste for a folder; pathlib would fold "s3://b/c" into the local "s3:/b/c".
_REMOTE = re.compile(r"^(s3|s3a|gs|gcs|hf|az|abfss?|https?)://?", re.IGNORECASE)
_TRAINER_CHECKPOINT = re.compile(r"^checkpoint-\d+$")  # what transformers' Trainer names its saves
DCP_METADATA = ".metadata"  # the file that makes a folder a torch.distributed.checkpoint (zerofast.layouts.dcp)


def optim_file_name(rank: int, bf16: bool) -> str:
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def zero3_model_file_name(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"


@dataclass(frozen=True)
class Found:
    """A tag folder and the names in it, before any layout has looked at them."""

    root: Path
    tag: str
    tag_dir: Path
    names: tuple[str, ...]


@dataclass(frozen=True)
class CheckpointFiles:
    """The files of one save, as its layout listed them. ``model_files`` has one entry (stages
    0-2) or one per rank (stage 3); a pipeline has one per stage, a tensor-parallel save one per
    tp rank (per rank at stage 3). ``optim_files``: one per rank, in global-rank order (pipelines:
    stage by stage). Layouts with more files subclass this and list them in :meth:`paths`."""

    root: Path
    tag: str
    tag_dir: Path
    model_files: tuple[Path, ...]
    optim_files: tuple[Path, ...]
    layout: Any = None  # the Layout that listed these files (zerofast.layouts.base)

    @property
    def bf16_optim_files(self) -> bool | None:
        """Whether the optimizer files carry the ``bf16_`` prefix; None when there are none."""
        return self.optim_files[0].name.startswith("bf16_") if self.optim_files else None

    @property
    def partitioned_model_states(self) -> bool:
        return len(self.model_files) > 0 and self.model_files[0].name != MODEL_FILE_STAGE012

    def paths(self) -> tuple[Path, ...]:
        """Every file or folder of the save that will be read."""
        return self.model_files + self.optim_files


def locate(ckpt_dir: str | os.PathLike, tag: str | None = None, follow_symlinks: bool | None = None) -> Found:
    """Resolve ``ckpt_dir`` (a checkpoint root or a tag folder) and list its tag folder."""
    url = remote_url(ckpt_dir)
    if url:
        raise CheckpointNotFoundError("expected a local folder, found a remote location: zerofast reads local "
                                      "folders only: download the checkpoint first (aws s3 sync, gsutil rsync, "
                                      "huggingface-cli download, ...)", url)
    root = Path(ckpt_dir)
    if not root.is_dir():
        found = ("a file; pass the folder that holds it, " + str(root.parent) if root.exists() and
                 root.suffix == ".pt" else "a file" if root.exists() else "no such directory")
        raise CheckpointNotFoundError(f"expected a DeepSpeed checkpoint folder, found {found}", root)
    if tag is None or not (root / tag).is_dir():  # a tag of this root named checkpoint-N is that tag
        root = trainer_checkpoint(root)
    if tag is None and _holds_model_states(root):
        return Found(root.parent, root.name, root, tuple(sorted(os.listdir(root))))
    latest = None if tag is not None else next((n for n in LATEST_FILES if (root / n).is_file()), None)
    tag = tag if tag is not None else _pick_tag(root, follow_symlinks)
    tag_dir = root / tag
    if not tag_dir.is_dir():
        named = f"{latest!r} names tag" if latest else "tag"
        raise CheckpointNotFoundError(f"{named} {short_repr(tag)}, which has no folder here; the tags here: "
                                      f"{few(_tag_folders(root), 8) if _tag_folders(root) else 'none'}", root)
    check_inside(root, tag_dir, follow_symlinks)
    return Found(root, tag, tag_dir, tuple(sorted(os.listdir(tag_dir))))


def trainer_checkpoint(root: Path) -> Path:
    """``root`` itself, or the one ``checkpoint-N`` save in it when ``root`` is a Hugging Face
    Trainer's ``output_dir`` rather than a checkpoint; several such saves are ambiguous, and the
    error names them (picking the newest silently could convert the wrong run's weights)."""
    if _is_deepspeed_folder(root):
        return root
    found = sorted((p for p in _subfolders(root) if _TRAINER_CHECKPOINT.match(p.name) and _is_deepspeed_folder(p)),
                   key=lambda p: int(p.name.split("-")[1]))
    if len(found) > 1:
        raise AmbiguousTagError(f"a Trainer output folder with {len(found)} checkpoints "
                                f"({some([p.name for p in found], 8)}); pass one of them", root)
    return found[0] if found else root


def _is_deepspeed_folder(folder: Path) -> bool:
    """A checkpoint root or tag folder: a ``latest`` file, or model states here or one level down."""
    try:
        if any((folder / n).is_file() for n in LATEST_FILES) or _holds_model_states(folder):
            return True
        return any(_holds_model_states(p) for p in _subfolders(folder) if not _TRAINER_CHECKPOINT.match(p.name))
    except OSError:  # an unreadable folder is no checkpoint; locate's own reads then say why
        return False


def _subfolders(folder: Path) -> list[Path]:
    try:
        return [folder / n for n in os.listdir(folder) if (folder / n).is_dir()]
    except OSError:
        return []


def remote_url(path: str | os.PathLike) -> str | None:
    """``path`` when it is a remote URL rather than a local folder (``s3://``, ``hf://``, ``gs://``,
    ``http(s)://``; also once a Path has folded the double slash), else None."""
    text = os.fspath(path)
    if isinstance(text, bytes) or not _REMOTE.match(text) or os.path.exists(text):
        return None
    return re.sub(r"^([A-Za-z0-9]+):/(?!/)", r"\1://", text)


def check_inside(root: Path, path: Path, follow_symlinks: bool | None = None) -> None:
    """``path`` (in ``root``) must not be a link, or a file in a linked folder, that leaves ``root``.

    A checkpoint from elsewhere could otherwise make zerofast read /proc, a device, or another
    user's files under a name that looks like its own. ``follow_symlinks`` (None: the setting)
    allows it."""
    check_all_inside(root, (path,), follow_symlinks)


def check_all_inside(root: Path, paths, follow_symlinks: bool | None = None) -> None:
    """:func:`check_inside` for each of ``paths``. A path that is not itself a link lies where its
    folder resolves to, so a folder of thousands of expert files is resolved once, not per file,
    and which of its names are links is read from one listing of it, not one lstat per file."""
    if settings().follow_symlinks if follow_symlinks is None else follow_symlinks:
        return
    real_root = str(_resolved(root))
    inside = os.path.join(real_root, "")  # with its trailing separator
    by_folder: dict[str, list[Path]] = {}
    for path in paths:
        by_folder.setdefault(os.path.dirname(str(path)), []).append(path)
    for folder, here in by_folder.items():
        links = links_among(folder, here)
        real_folder = None
        for path in here:
            name = path.name
            if name in ("", ".", "..") or name in links:
                real = str(_resolved(path))
            else:
                real_folder = real_folder or str(_resolved(Path(folder or ".")))
                real = os.path.join(real_folder, name)
            if real != real_root and not real.startswith(inside):
                raise UnsafeCheckpointError(
                    f"{path.relative_to(root)} is a symbolic link (or lies in a linked folder) that leads out of the "
                    f"checkpoint folder, to {short_repr(real, 200)}; refused (pass follow_symlinks=True or "
                    f"--follow-symlinks, or set {FOLLOW_SYMLINKS_ENV}=1, to follow such links)", root)


# From this many paths in one folder, one listing of it is cheaper than an lstat each.
LISTED_FROM = 16


def links_among(folder: str, paths: Sequence[Path]) -> set[str]:
    """The names among ``paths`` (all in ``folder``) that are symbolic links."""
    if len(paths) >= LISTED_FROM:
        try:
            with os.scandir(folder or ".") as entries:  # the file type comes with each name
                return {e.name for e in entries if e.is_symlink()}
        except OSError:
            pass  # unreadable: each path on its own, as below
    return {os.path.basename(os.fspath(p)) for p in paths if os.path.islink(p)}


def _resolved(path: Path) -> Path:
    try:
        return path.resolve()
    except (RuntimeError, OSError) as e:  # a loop of links: pathlib raises RuntimeError before 3.13
        raise CorruptCheckpointError(f"cannot follow the symbolic links of {path.name} ({first_line(e)[:120]})",
                                     path) from None


def other_model_parallel_rank(names) -> str | None:
    """A file of model-parallel rank > 0. Its name cannot tell tensor from pipeline parallelism
    (a universal conversion of a pipeline save keeps no ``layer_*`` files); the model states can."""
    for name in names:
        m = _MODEL_PARALLEL_RANK.search(name)
        if m and name.endswith(".pt") and int(m.group(1)) != 0:
            return name
    return None


def plain_files(found: Found) -> tuple[tuple[Path, ...], tuple[Path, ...]]:
    """The model-states and optimizer files of a plain ZeRO 0-3 save (or its universal copy),
    checked for a mix of two saves and for missing ranks."""
    tag_dir, names = found.tag_dir, found.names
    zero3 = ranked(tag_dir, names, ZERO3_MODEL, group=1)
    optim = ranked(tag_dir, names, OPTIM, group=2)
    has_plain = MODEL_FILE_STAGE012 in names
    if zero3 and has_plain:
        raise IncompleteCheckpointError(
            f"expected either {MODEL_FILE_STAGE012} (stages 0-2) or zero_pp_rank_*_model_states.pt (stage 3), "
            "found both: the folder mixes two saves", tag_dir)
    other_mp_rank = other_model_parallel_rank(names)
    if not zero3 and not has_plain and other_mp_rank:
        raise UnsupportedCheckpointError(
            f"model-parallel (tensor or pipeline) checkpoints are not supported yet (found {other_mp_rank}, and no "
            "model-parallel rank 00 model states)", tag_dir)
    if not zero3 and not has_plain and optim:
        raise IncompleteCheckpointError(
            f"expected {MODEL_FILE_STAGE012} or zero_pp_rank_*_mp_rank_00_model_states.pt next to {len(optim)} "
            "optimizer files, found neither", tag_dir)
    if not zero3 and not has_plain:
        raise CheckpointNotFoundError(
            f"expected {MODEL_FILE_STAGE012} or zero_pp_rank_*_mp_rank_00_model_states.pt, found neither", tag_dir)
    # Whether every rank is here is settled once the files say what stage and world size they are.
    return (tuple(zero3) if zero3 else (tag_dir / MODEL_FILE_STAGE012,)), tuple(optim)


def _holds_model_states(folder: Path) -> bool:
    """A save's own folder: DeepSpeed's model states, or a PyTorch DCP ``.metadata``."""
    return any(name.endswith("_model_states.pt") or name == DCP_METADATA for name in os.listdir(folder))


def _tag_folders(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir() and _holds_model_states(p))


def _pick_tag(root: Path, follow_symlinks: bool | None) -> str:
    # A universal conversion written next to its source leaves both files; ``latest`` stays the
    # training run's own newest save, as DeepSpeed's loader reads it unless told otherwise.
    latest = next((root / n for n in LATEST_FILES if (root / n).is_file()), None)
    if latest is not None:
        check_inside(root, latest, follow_symlinks)
        try:
            with open(latest, "rb") as f:
                data = f.read(4097)  # a tag is a folder name; never read a huge file whole
        except OSError as e:
            raise CheckpointNotFoundError(f"expected a readable text file, got: {e.strerror}", latest) from None
        try:
            tag = data.decode("utf-8").strip()
        except UnicodeDecodeError:
            raise CheckpointNotFoundError(f"expected a tag name in {latest.name!r}, found binary data {data[:20]!r}",
                                          latest) from None
        if not tag:
            raise CheckpointNotFoundError(f"expected a tag name in {latest.name!r}, found an empty file", latest)
        if latest.name == MEGATRON_LATEST and tag.isascii() and tag.isdigit() and len(tag) < 20:
            tag = f"iter_{int(tag):07d}"  # Megatron-LM names its saves so; 'release' is a folder name already
        # 'latest' comes with the checkpoint; it must not send zerofast to another folder.
        if len(data) > 4096 or Path(tag).is_absolute() or ".." in Path(tag).parts:
            raise CheckpointNotFoundError(
                f"expected a tag name in {latest.name!r} (a folder under {root.name}), found {tag[:80]!r}", latest)
        return tag
    tags = _tag_folders(root)
    if len(tags) == 1:
        return tags[0]
    if not tags:
        inner = _checkpoint_subfolders(root)
        found = f"none here, but {len(inner)} in its subfolders ({some(inner, 6)}): pass one of them" if inner else "none"
        raise CheckpointNotFoundError(
            "expected a DeepSpeed checkpoint ('latest' plus a tag folder, or a tag folder holding "
            f"*_model_states.pt files), found {found}", root)
    raise AmbiguousTagError(f"no 'latest' file and {len(tags)} tags {few(tags, 8)}; pass tag= (or --tag) to pick one",
                            root)


def _checkpoint_subfolders(root: Path) -> list[str]:
    """Subfolders that are checkpoint roots themselves (Lightning's ``epoch=0-step=9.ckpt/``
    folders, one run's saves side by side): one level down, a few hundred at most."""
    try:
        subs = sorted(p for p in root.iterdir() if p.is_dir())[:256]
        return [p.name for p in subs if any((p / n).is_file() for n in LATEST_FILES) or _tag_folders(p)]
    except OSError:
        return []


def ranked(tag_dir: Path, names: list[str], pattern: re.Pattern, group: int) -> list[Path]:
    """Files matching ``pattern`` ordered by rank; ranks must run 0..N-1 with one file each."""
    by_rank: dict[int, list[str]] = {}
    for name in names:
        m = pattern.match(name)
        if m:
            by_rank.setdefault(int(m.group(group)), []).append(name)
    for rank, found in by_rank.items():
        if len(found) > 1:
            raise IncompleteCheckpointError(
                f"expected one file for rank {rank}, found {few(found)}: the folder mixes saves of two dtypes", tag_dir)
    top = max(by_rank, default=-1)
    if top + 1 != len(by_rank):
        # A stray file can name any rank (99999999999): list the first few missing files
        # without walking the range.
        prefix = "bf16_" if next(iter(by_rank.values()))[0].startswith("bf16_") else ""
        template = pattern.pattern.strip("^$").replace("(bf16_)?", prefix).replace(chr(92), "")
        files = [template.replace("(d+)", _rank_text(template, r), 1) for r in first_missing(sorted(by_rank), 4)]
        count = top + 1 - len(by_rank)
        shown = some(files) if count <= len(files) else f"{', '.join(files)} and {count - len(files)} more"
        raise IncompleteCheckpointError(
            f"expected a file for each rank 0..{top}, found {len(by_rank)}; missing: {shown}", tag_dir)
    return [tag_dir / by_rank[r][0] for r in sorted(by_rank)]


def first_missing(ranks: list[int], count: int) -> list[int]:
    """The first ``count`` numbers missing from the sorted ``ranks``, in time linear in ``ranks``."""
    missing: list[int] = []
    expected = 0
    for r in ranks:
        while expected < r and len(missing) < count:
            missing.append(expected)
            expected += 1
        expected = r + 1
        if len(missing) >= count:
            break
    return missing


def _rank_text(template: str, rank: int) -> str:
    """A rank as its file name writes it: model-parallel ranks lead the name with two digits."""
    return f"{rank:02d}" if template.startswith("mp_rank_") else str(rank)


