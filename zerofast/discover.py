"""Step 1: find the tag folder and the rank files of a DeepSpeed checkpoint, and check the set.

Only file names are read here (plus the ``latest`` text file); nothing is unpickled. Whether the
number of rank files matches the world size recorded inside them is checked by ``safe_load``.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from .errors import (
    AmbiguousTagError,
    CheckpointNotFoundError,
    IncompleteCheckpointError,
    UnsafeCheckpointError,
    UnsupportedCheckpointError,
    few,
    short_repr,
)

# Symbolic links inside a checkpoint may not lead out of the folder the caller named, unless
# this environment variable is 1: a checkpoint from elsewhere could otherwise make zerofast
# read /proc, a device, or another user's files under a name that looks like its own.
FOLLOW_LINKS_ENV = "ZEROFAST_FOLLOW_SYMLINKS"

MODEL_FILE_STAGE012 = "mp_rank_00_model_states.pt"
_ZERO3_MODEL = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_00_model_states\.pt$")
_OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")
_TENSOR_PARALLEL = re.compile(r"mp_rank_(\d+)_")
# DeepSpeed's names: MoE experts "[layer_<L>_]expert_<E>_mp_rank_XX_model_states.pt" and
# "expp_rank_<R>_mp_rank_XX_optim_states.pt"; pipeline layers "layer_<NN>-model_states.pt".
_UNSUPPORTED = ((re.compile(r"^(layer_\d+_)?expert_\d+_|^expp_rank_"), "mixture-of-experts"),
                (re.compile(r"^layer_"), "pipeline-parallel"))


@dataclass(frozen=True)
class CheckpointFiles:
    """The files of one save. ``model_files`` has one entry (stages 0-2) or one per rank (stage 3)."""

    root: Path
    tag: str
    tag_dir: Path
    model_files: tuple[Path, ...]
    optim_files: tuple[Path, ...]

    @property
    def partitioned_model_states(self) -> bool:
        return len(self.model_files) > 0 and self.model_files[0].name != MODEL_FILE_STAGE012


def discover(ckpt_dir: str | os.PathLike, tag: str | None = None) -> CheckpointFiles:
    """Resolve ``ckpt_dir`` (a checkpoint root or a tag folder) and list its rank files."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        found = "a file" if root.exists() else "no such directory"
        raise CheckpointNotFoundError(f"expected a DeepSpeed checkpoint folder, found {found}", root)
    if tag is None and _holds_model_states(root):
        files = _list_files(root.parent, root.name, root)
    else:
        tag = tag if tag is not None else _pick_tag(root)
        tag_dir = root / tag
        if not tag_dir.is_dir():
            raise CheckpointNotFoundError(f"tag {short_repr(tag)} has no folder {short_repr(tag_dir.name)} here", root)
        _check_inside(root, tag_dir)
        files = _list_files(root, tag, tag_dir)
    for path in files.model_files + files.optim_files:
        _check_inside(root, path)
    return files


def _check_inside(root: Path, path: Path) -> None:
    """``path`` (in ``root``) must not be a link, or a file in a linked folder, that leaves ``root``."""
    if os.environ.get(FOLLOW_LINKS_ENV) == "1":
        return
    real_root, real = root.resolve(), path.resolve()
    if real != real_root and real_root not in real.parents:
        raise UnsafeCheckpointError(
            f"{path.relative_to(root)} is a symbolic link (or lies in a linked folder) that leads out of the "
            f"checkpoint folder, to {short_repr(str(real), 200)}; refused (set {FOLLOW_LINKS_ENV}=1 to follow such "
            "links)", root)


def _holds_model_states(folder: Path) -> bool:
    return any(name.endswith("_model_states.pt") for name in os.listdir(folder))


def _tag_folders(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir() and _holds_model_states(p))


def _pick_tag(root: Path) -> str:
    latest = root / "latest"
    if latest.is_file():
        _check_inside(root, latest)
        try:
            with open(latest, "rb") as f:
                data = f.read(4097)  # a tag is a folder name; never read a huge file whole
        except OSError as e:
            raise CheckpointNotFoundError(f"expected a readable text file, got: {e.strerror}", latest) from None
        try:
            tag = data.decode("utf-8").strip()
        except UnicodeDecodeError:
            raise CheckpointNotFoundError(f"expected a tag name in 'latest', found binary data {data[:20]!r}",
                                          latest) from None
        if not tag:
            raise CheckpointNotFoundError("expected a tag name in 'latest', found an empty file", latest)
        # 'latest' comes with the checkpoint; it must not send zerofast to another folder.
        if len(data) > 4096 or Path(tag).is_absolute() or ".." in Path(tag).parts:
            raise CheckpointNotFoundError(
                f"expected a tag name in 'latest' (a folder under {root.name}), found {tag[:80]!r}", latest)
        return tag
    tags = _tag_folders(root)
    if len(tags) == 1:
        return tags[0]
    if not tags:
        raise CheckpointNotFoundError(
            "expected a DeepSpeed checkpoint ('latest' plus a tag folder, or a tag folder holding "
            "*_model_states.pt files), found none", root)
    raise AmbiguousTagError(f"no 'latest' file and {len(tags)} tags {few(tags, 8)}; pass tag= (or --tag) to pick one",
                            root)


def _list_files(root: Path, tag: str, tag_dir: Path) -> CheckpointFiles:
    names = sorted(os.listdir(tag_dir))
    _reject_unsupported(tag_dir, names)
    zero3 = _ranked(tag_dir, names, _ZERO3_MODEL, group=1)
    optim = _ranked(tag_dir, names, _OPTIM, group=2)
    has_plain = MODEL_FILE_STAGE012 in names
    if zero3 and has_plain:
        raise IncompleteCheckpointError(
            f"expected either {MODEL_FILE_STAGE012} (stages 0-2) or zero_pp_rank_*_model_states.pt (stage 3), "
            "found both: the folder mixes two saves", tag_dir)
    if not zero3 and not has_plain and optim:
        raise IncompleteCheckpointError(
            f"expected {MODEL_FILE_STAGE012} or zero_pp_rank_*_mp_rank_00_model_states.pt next to {len(optim)} "
            "optimizer files, found neither", tag_dir)
    if not zero3 and not has_plain:
        raise CheckpointNotFoundError(
            f"expected {MODEL_FILE_STAGE012} or zero_pp_rank_*_mp_rank_00_model_states.pt, found neither", tag_dir)
    model_files = tuple(zero3) if zero3 else (tag_dir / MODEL_FILE_STAGE012,)
    if zero3 and len(zero3) != len(optim):
        raise IncompleteCheckpointError(
            f"expected one optimizer file per model-states file, found {len(zero3)} model-states and "
            f"{len(optim)} optimizer files", tag_dir)
    return CheckpointFiles(root=root, tag=tag, tag_dir=tag_dir, model_files=model_files, optim_files=tuple(optim))


def _reject_unsupported(tag_dir: Path, names: list[str]) -> None:
    for name in names:
        for pattern, what in _UNSUPPORTED:
            if pattern.match(name) and name.endswith(".pt"):
                raise UnsupportedCheckpointError(f"{what} checkpoints are not supported yet (found {name})", tag_dir)
        m = _TENSOR_PARALLEL.search(name)
        if m and name.endswith(".pt") and int(m.group(1)) != 0:
            raise UnsupportedCheckpointError(
                f"tensor-parallel checkpoints are not supported yet (found {name}: model-parallel rank "
                f"{int(m.group(1))})", tag_dir)


def _ranked(tag_dir: Path, names: list[str], pattern: re.Pattern, group: int) -> list[Path]:
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
        # A stray file can name any rank (99999999999): list what is missing without walking
        # the range, and only the first few.
        missing = _first_missing(sorted(by_rank), 5)
        example = pattern.pattern.strip("^$").replace("(bf16_)?", "").replace(r"(\d+)", str(missing[0]))
        shown = ", ".join(map(str, missing)) + (", ..." if top + 1 - len(by_rank) > len(missing) else "")
        raise IncompleteCheckpointError(
            f"expected rank files 0..{top}, {top + 1 - len(by_rank)} rank(s) missing: {shown} (e.g. "
            f"{example.replace(chr(92), '')})", tag_dir)
    return [tag_dir / by_rank[r][0] for r in sorted(by_rank)]


def _first_missing(ranks: list[int], count: int) -> list[int]:
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
