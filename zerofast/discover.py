"""Step 1: find the tag folder and the rank files of a DeepSpeed checkpoint, and check the set.

Only file names are read here (plus the ``latest`` text file); nothing is unpickled. Whether the
number of rank files matches the world size recorded inside them is checked by the loader (``zerofast.load``).
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
    some,
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
# Checked over every name before the model-parallel rank: a pipeline save's optimizer files
# carry mp_rank_01 too, and must not be called tensor parallel for sorting first.
_UNSUPPORTED = ((re.compile(r"^(layer_\d+_)?expert_\d+_|^expp_rank_"), "mixture-of-experts"),
                (re.compile(r"^layer_"), "pipeline-parallel"))
UNIVERSAL_DIR = "zero"  # ds_to_universal's per-parameter folders, next to the model states
UNIVERSAL_COMMON = "optimizer_state.pt"  # in UNIVERSAL_DIR: the optimizer state all ranks share
LATEST_FILES = ("latest", "latest_universal")  # the second is what ds_to_universal writes


def optim_file_name(rank: int, bf16: bool) -> str:
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def zero3_model_file_name(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"


@dataclass(frozen=True)
class CheckpointFiles:
    """The files of one save. ``model_files`` has one entry (stages 0-2) or one per rank (stage 3)."""

    root: Path
    tag: str
    tag_dir: Path
    model_files: tuple[Path, ...]
    optim_files: tuple[Path, ...]
    universal: Path | None = None  # the ``zero`` folder of a ds_to_universal checkpoint
    other_mp_rank: str | None = None  # a file of model-parallel rank > 0: refused once labelled

    @property
    def bf16_optim_files(self) -> bool | None:
        """Whether the optimizer files carry the ``bf16_`` prefix; None when there are none."""
        return self.optim_files[0].name.startswith("bf16_") if self.optim_files else None

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
    for path in files.model_files + files.optim_files + ((files.universal,) if files.universal else ()):
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
    # A universal conversion written next to its source leaves both files; ``latest`` stays the
    # training run's own newest save, as DeepSpeed's loader reads it unless told otherwise.
    latest = next((root / n for n in LATEST_FILES if (root / n).is_file()), None)
    if latest is not None:
        _check_inside(root, latest)
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
        # 'latest' comes with the checkpoint; it must not send zerofast to another folder.
        if len(data) > 4096 or Path(tag).is_absolute() or ".." in Path(tag).parts:
            raise CheckpointNotFoundError(
                f"expected a tag name in {latest.name!r} (a folder under {root.name}), found {tag[:80]!r}", latest)
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
    other_mp_rank = _other_model_parallel_rank(names)
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
    model_files = tuple(zero3) if zero3 else (tag_dir / MODEL_FILE_STAGE012,)
    universal = tag_dir / UNIVERSAL_DIR
    if not universal.is_dir():
        universal = None
    elif optim:
        raise IncompleteCheckpointError(
            f"expected either optimizer files (a DeepSpeed save) or a {UNIVERSAL_DIR!r} folder (a universal "
            f"checkpoint), found both ({optim[0].name}): the folder mixes two saves", tag_dir)
    # Whether every rank is here is settled once the files say what stage and world size they are.
    return CheckpointFiles(root=root, tag=tag, tag_dir=tag_dir, model_files=model_files, optim_files=tuple(optim),
                           universal=universal, other_mp_rank=other_mp_rank)


def _reject_unsupported(tag_dir: Path, names: list[str]) -> None:
    for pattern, what in _UNSUPPORTED:
        for name in names:
            if pattern.match(name) and name.endswith(".pt"):
                raise UnsupportedCheckpointError(f"{what} checkpoints are not supported yet (found {name})", tag_dir)


def _other_model_parallel_rank(names: list[str]) -> str | None:
    """A file of model-parallel rank > 0. Its name cannot tell tensor from pipeline parallelism
    (a universal conversion of a pipeline save keeps no ``layer_*`` files); the model states can."""
    for name in names:
        m = _TENSOR_PARALLEL.search(name)
        if m and name.endswith(".pt") and int(m.group(1)) != 0:
            return name
    return None


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
        # A stray file can name any rank (99999999999): list the first few missing files
        # without walking the range.
        prefix = "bf16_" if next(iter(by_rank.values()))[0].startswith("bf16_") else ""
        template = pattern.pattern.strip("^$").replace("(bf16_)?", prefix).replace(chr(92), "")
        files = [template.replace("(d+)", str(r), 1) for r in _first_missing(sorted(by_rank), 4)]
        count = top + 1 - len(by_rank)
        shown = some(files) if count <= len(files) else f"{', '.join(files)} and {count - len(files)} more"
        raise IncompleteCheckpointError(
            f"expected a file for each rank 0..{top}, found {len(by_rank)}; missing: {shown}", tag_dir)
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
