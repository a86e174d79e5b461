"""Step 1: find the tag folder and the rank files of a DeepSpeed checkpoint, and check the set.

Only file names are read here (plus the ``latest`` text file); nothing is unpickled. Whether the
number of rank files matches the world size recorded inside them is checked by the loader (``zerofast.load``).
The names also tell the family: expert files mean mixture-of-experts, ``layer_NN-model_states.pt``
files a pipeline, other ``mp_rank_XX`` files above 00 tensor parallelism (AutoTP).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from .errors import (
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

# Symbolic links inside a checkpoint may not lead out of the folder the caller named, unless
# this environment variable is 1: a checkpoint from elsewhere could otherwise make zerofast
# read /proc, a device, or another user's files under a name that looks like its own.
FOLLOW_LINKS_ENV = "ZEROFAST_FOLLOW_SYMLINKS"

MODEL_FILE_STAGE012 = "mp_rank_00_model_states.pt"
_ZERO3_MODEL = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_00_model_states\.pt$")
_OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")
_TENSOR_PARALLEL = re.compile(r"mp_rank_(\d+)_")
# DeepSpeed's names: MoE experts "layer_<L>_expert_<E>_mp_rank_00_model_states.pt" and (ZeRO off)
# "expp_rank_<R>_mp_rank_00_optim_states.pt"; pipeline layers "layer_<NN>-model_states.pt" next to
# one "mp_rank_<SS>_model_states.pt" per stage. Experts saved before DeepSpeed 0.6 had no layer id.
MOE_EXPERT = re.compile(r"^layer_(\d+)_expert_(\d+)_mp_rank_00_model_states\.pt$")
MOE_OPTIM = re.compile(r"^expp_rank_(\d+)_mp_rank_00_optim_states\.pt$")
PIPE_LAYER = re.compile(r"^layer_(\d+)-model_states\.pt$")
PIPE_MODEL = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
PIPE_OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_UNSUPPORTED = ((re.compile(r"^expert_\d+_"), "mixture-of-experts checkpoints without layer ids (DeepSpeed < 0.6)"),)
UNIVERSAL_DIR = "zero"  # ds_to_universal's per-parameter folders, next to the model states
UNIVERSAL_COMMON = "optimizer_state.pt"  # in UNIVERSAL_DIR: the optimizer state all ranks share
LATEST_FILES = ("latest", "latest_universal")  # the second is what ds_to_universal writes
# Remote locations people paste for a folder; pathlib would fold "s3://b/c" into the local "s3:/b/c".
_REMOTE = re.compile(r"^(s3|s3a|gs|gcs|hf|az|abfss?|https?)://?", re.IGNORECASE)


def optim_file_name(rank: int, bf16: bool) -> str:
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def zero3_model_file_name(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"


@dataclass(frozen=True)
class CheckpointFiles:
    """The files of one save. ``model_files`` has one entry (stages 0-2) or one per rank (stage 3);
    a pipeline has one per stage, a tensor-parallel save one per tp rank (per rank at stage 3).
    ``optim_files``: one per rank, in global-rank order (pipelines: stage by stage)."""

    root: Path
    tag: str
    tag_dir: Path
    model_files: tuple[Path, ...]
    optim_files: tuple[Path, ...]
    # "zero" (plain data parallelism), "moe", "pipeline" or "tensor"; the families' extra files:
    family: str = "zero"
    expert_files: tuple[Path, ...] = ()  # MoE: one per (layer, global expert id), in that order
    layer_files: tuple[Path, ...] = ()  # pipeline: one per saved layer, in layer order
    mp_size: int = 1  # tensor-parallel degree; rank files are in global-rank order dp * mp_size + tp
    universal: Path | None = None  # the ``zero`` folder of a ds_to_universal checkpoint
    other_mp_rank: str | None = None  # a file of model-parallel rank > 0: refused once labelled
    # A tensor-parallel rank grid found incomplete. Raised by the loader once rank 00's model
    # states have ruled out a pipeline save whose layer files are missing (the names cannot tell).
    incomplete: str | None = None

    @property
    def bf16_optim_files(self) -> bool | None:
        """Whether the optimizer files carry the ``bf16_`` prefix; None when there are none."""
        return self.optim_files[0].name.startswith("bf16_") if self.optim_files else None

    @property
    def partitioned_model_states(self) -> bool:
        return len(self.model_files) > 0 and self.model_files[0].name != MODEL_FILE_STAGE012


def discover(ckpt_dir: str | os.PathLike, tag: str | None = None) -> CheckpointFiles:
    """Resolve ``ckpt_dir`` (a checkpoint root or a tag folder) and list its rank files."""
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
    if tag is None and _holds_model_states(root):
        files = _list_files(root.parent, root.name, root)
    else:
        latest = None if tag is not None else next((n for n in LATEST_FILES if (root / n).is_file()), None)
        tag = tag if tag is not None else _pick_tag(root)
        tag_dir = root / tag
        if not tag_dir.is_dir():
            named = f"{latest!r} names tag" if latest else "tag"
            raise CheckpointNotFoundError(f"{named} {short_repr(tag)}, which has no folder here; the tags here: "
                                          f"{few(_tag_folders(root), 8) if _tag_folders(root) else 'none'}", root)
        _check_inside(root, tag_dir)
        files = _list_files(root, tag, tag_dir)
    for path in files.model_files + files.optim_files + ((files.universal,) if files.universal else ()):
        _check_inside(root, path)
    return files


def remote_url(path: str | os.PathLike) -> str | None:
    """``path`` when it is a remote URL rather than a local folder (``s3://``, ``hf://``, ``gs://``,
    ``http(s)://``; also once a Path has folded the double slash), else None."""
    text = os.fspath(path)
    if isinstance(text, bytes) or not _REMOTE.match(text) or os.path.exists(text):
        return None
    return re.sub(r"^([A-Za-z0-9]+):/(?!/)", r"\1://", text)


def _check_inside(root: Path, path: Path) -> None:
    """``path`` (in ``root``) must not be a link, or a file in a linked folder, that leaves ``root``."""
    if os.environ.get(FOLLOW_LINKS_ENV) == "1":
        return
    try:
        real_root, real = root.resolve(), path.resolve()
    except (RuntimeError, OSError) as e:  # a loop of links: pathlib raises RuntimeError before 3.13
        raise CorruptCheckpointError(f"cannot follow the symbolic links of {path.name} ({first_line(e)[:120]})",
                                     path) from None
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


def _list_files(root: Path, tag: str, tag_dir: Path) -> CheckpointFiles:
    names = sorted(os.listdir(tag_dir))
    _reject_unsupported(tag_dir, names)
    _reject_combined(tag_dir, names)
    # A universal conversion keeps neither layer files nor the ranks apart: the loader judges it.
    if not (tag_dir / UNIVERSAL_DIR).is_dir():
        if any(PIPE_LAYER.match(n) for n in names):
            return _pipeline_files(root, tag, tag_dir, names)
        if _other_model_parallel_rank(names):
            return _tensor_parallel_files(root, tag, tag_dir, names)
        if any(MOE_EXPERT.match(n) or MOE_OPTIM.match(n) for n in names):
            return _moe_files(root, tag, tag_dir, names)
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
                raise UnsupportedCheckpointError(f"{what} are not supported (found {name})", tag_dir)



def _reject_combined(tag_dir: Path, names: list[str]) -> None:
    """Each family is read on its own; a save combining two (experts inside a pipeline or next to
    tensor-parallel ranks) would lose one of them."""
    experts = next((n for n in names if MOE_EXPERT.match(n) or MOE_OPTIM.match(n)), None)
    other = next((n for n in names if PIPE_LAYER.match(n) or ((m := _TENSOR_PARALLEL.search(n)) and int(m.group(1))
                                                              and n.endswith(".pt"))), None)
    if experts and other:
        raise UnsupportedCheckpointError(
            f"mixture-of-experts together with pipeline or tensor parallelism is not supported (found {experts} "
            f"and {other})", tag_dir)


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
        files = [template.replace("(d+)", _rank_text(template, r), 1) for r in _first_missing(sorted(by_rank), 4)]
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


def _rank_text(template: str, rank: int) -> str:
    """A rank as its file name writes it: model-parallel ranks lead the name with two digits."""
    return f"{rank:02d}" if template.startswith("mp_rank_") else str(rank)


def _moe_files(root: Path, tag: str, tag_dir: Path, names: list[str]) -> CheckpointFiles:
    """ZeRO 1/2: the usual files plus the experts'. ZeRO off: the model file, one ``expp_rank``
    optimizer file per expert-parallel rank, and the experts'."""
    experts = sorted((int(m.group(1)), int(m.group(2)), n) for n in names if (m := MOE_EXPERT.match(n)))
    expp = _ranked(tag_dir, names, MOE_OPTIM, group=1)
    optim = _ranked(tag_dir, names, _OPTIM, group=2)
    if expp and optim:
        raise IncompleteCheckpointError(
            f"expected either expp_rank_* (MoE without ZeRO) or zero_pp_rank_* optimizer files, found both: the "
            "folder mixes two saves", tag_dir)
    if MODEL_FILE_STAGE012 not in names:
        raise IncompleteCheckpointError(f"expected {MODEL_FILE_STAGE012} next to the expert files, found none",
                                        tag_dir)
    return CheckpointFiles(root=root, tag=tag, tag_dir=tag_dir, model_files=(tag_dir / MODEL_FILE_STAGE012,),
                           optim_files=tuple(expp or optim), family="moe",
                           expert_files=tuple(tag_dir / n for _, _, n in experts))


def _pipeline_files(root: Path, tag: str, tag_dir: Path, names: list[str]) -> CheckpointFiles:
    """One model-states file per stage, optimizer files per (stage, data-parallel rank), layer files."""
    stages = _ranked(tag_dir, names, PIPE_MODEL, group=1)
    if not stages:
        raise IncompleteCheckpointError("expected mp_rank_<stage>_model_states.pt next to the pipeline layer files, "
                                        "found none", tag_dir)
    by_stage: dict[int, list[str]] = {}
    for n in names:
        m = PIPE_OPTIM.match(n)
        if m:
            by_stage.setdefault(int(m.group(3)), []).append(n)
    optim: list[Path] = []
    counts = set()
    for s in range(len(stages)):
        pattern = re.compile(rf"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_{s:02d}_optim_states\.pt$")
        ranked = _ranked(tag_dir, by_stage.get(s, []), pattern, group=2)
        counts.add(len(ranked))
        optim += ranked
    if len(counts) > 1 or set(by_stage) - set(range(len(stages))):
        raise IncompleteCheckpointError(
            f"expected the same number of optimizer files for each of the {len(stages)} stages, found "
            f"{ {s: len(v) for s, v in sorted(by_stage.items())} }", tag_dir)
    layers = sorted((int(m.group(1)), n) for n in names if (m := PIPE_LAYER.match(n)))
    return CheckpointFiles(root=root, tag=tag, tag_dir=tag_dir, model_files=tuple(stages), optim_files=tuple(optim),
                           family="pipeline", layer_files=tuple(tag_dir / n for _, n in layers))


_TP_MODEL_Z3 = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")


def _tensor_parallel_files(root: Path, tag: str, tag_dir: Path, names: list[str]) -> CheckpointFiles:
    """Model-states files per tensor-parallel rank (per rank at ZeRO-3), optimizer files per
    (data-parallel, tensor-parallel) rank; both listed in global-rank order ``dp * T + tp``."""
    z3 = _grid(tag_dir, names, _TP_MODEL_Z3, dp_group=1, mp_group=2)
    optim = _grid(tag_dir, names, PIPE_OPTIM, dp_group=2, mp_group=3)
    plain = _ranked(tag_dir, names, PIPE_MODEL, group=1)
    if z3 and plain:
        raise IncompleteCheckpointError("expected either mp_rank_XX_model_states.pt (stages 0-2) or "
                                        "zero_pp_rank_*_mp_rank_XX_model_states.pt (stage 3), found both", tag_dir)
    T = 1 + max([len(plain) - 1] + [t for _, t, _ in z3 + optim])
    if not plain and not z3:
        raise CheckpointNotFoundError("expected mp_rank_XX model-states files, found none", tag_dir)
    incomplete = None
    if plain and len(plain) != T:
        incomplete = (f"expected a model-states file for each of the {T} tensor-parallel ranks "
                      f"(mp_rank_00..{T - 1:02d}), found {some([p.name for p in plain])}")
    for what, grid in (("optimizer", optim), ("model-states", z3)):
        tps = {t for _, t, _ in grid}
        dps = {d for d, _, _ in grid}
        if grid and (tps != set(range(T)) or len(grid) != len(dps) * T or dps != set(range(len(dps)))):
            incomplete = incomplete or (
                f"expected {what} files for every (data-parallel, tensor-parallel) rank pair of {T} tensor-parallel "
                f"ranks, found {some([str(p) for p in sorted((d, t) for d, t, _ in grid)])}")
    model = tuple(tag_dir / n for _, _, n in z3) if z3 else tuple(plain)
    return CheckpointFiles(root=root, tag=tag, tag_dir=tag_dir, model_files=model,
                           optim_files=tuple(tag_dir / n for _, _, n in optim), family="tensor", mp_size=T,
                           incomplete=incomplete)


def _grid(tag_dir: Path, names: list[str], pattern: re.Pattern, dp_group: int, mp_group: int):
    found = {}
    for n in names:
        m = pattern.match(n)
        if m:
            key = (int(m.group(dp_group)), int(m.group(mp_group)))
            if key in found:
                raise IncompleteCheckpointError(
                    f"expected one file for rank pair {key}, found {found[key]} and {n}: the folder mixes saves of "
                    "two dtypes", tag_dir)
            found[key] = n
    return [(d, t, n) for (d, t), n in sorted(found.items())]
