"""The one output-folder transaction of every writer: export, reshard, to-universal.

- **Ownership.** Each writer records what it wrote (names and each file's inode and mtime) in a
  marker, with its command's name. It removes or replaces only files it can prove it wrote, or,
  with ``overwrite``, the names its new output replaces. A folder holding another command's output
  or anything else zerofast did not write is refused without ``overwrite``.
- **Never over the input.** An output folder equal to the checkpoint, inside it, or holding it
  (after resolving symlinks) is refused whatever the flags, before anything is created.
- **Atomic enough.** Everything is written into a temporary folder inside the output folder and
  moved to its final name only once every file is complete, the pointers (an index, ``latest``)
  last. A writer that fails or is killed while writing leaves no file under a final name (a write
  error is an ExportError naming the file and the OS error); one killed during the moves, a few
  renames, may leave some complete files there, never a pointer naming a missing one. A rerun
  cleans up either way.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import json
import os
import re
import shutil
import stat
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch

from ..discover import CheckpointFiles, links_among, remote_url
from ..base.errors import ExportError, OutputExistsError, ZeroFastError, some
from ..base.jsonfile import read_json

# Lists the files the last writer put in the folder. It sits under .cache/huggingface/, which
# huggingface_hub's upload_folder never uploads (its default ignore patterns); older versions
# wrote LEGACY_MARKER at the top, which is still read and then removed.
MARKER = ".cache/huggingface/zerofast-export.json"
LEGACY_MARKER = ".zerofast-export.json"
_HIDDEN = (".cache", LEGACY_MARKER)  # never counted as the user's files
MARKER_LIMIT = 64 << 20  # a marker lists names and their identities; never read more
TMP_DIR = re.compile(r"^\.zerofast-tmp-\d+$")
TMP_MARK = ".zerofast-tmp"  # inside each temporary folder: only such folders are ever removed
EXPORT = "export"  # the command name each writer records; markers of old versions had none


@dataclass
class Folder:
    """An open output folder: where to write (``tmp``), and what the last run of the same command
    left (``previous``). ``replaced`` lists, after :meth:`commit`, the files of others that the new
    output replaced (``overwrite``)."""

    out: Path
    tmp: Path
    command: str
    previous: list[str]
    replaces: Callable[[str], bool] = lambda name: False  # more names the output replaces (weights)
    replaced: list[str] = field(default_factory=list)

    @classmethod
    def follower(cls, out: Path, tmp: Path) -> "Folder":
        """What a rank other than the leader sees: the temporary folder only."""
        return cls(out, tmp, "", [])

    def commit(self, names: Sequence[str], pointer: Callable[[str], bool] = lambda name: False) -> None:
        """Move ``names`` (files or folders in ``tmp``) into place after removing what they and the
        previous run replace. Pointers (an index, ``latest``) are removed first and moved last, so
        that none ever names something missing or half replaced.

        The marker claims every name first, so a rerun after an interruption here still
        recognizes them as zerofast's.
        """
        final = sorted(names, key=pointer)  # stable: the data in the caller's order, then the pointers
        stale = set(self.previous) | {n for n in _listdir(self.out) if self.replaces(n)}
        self.replaced = sorted(n for n in (stale | set(final)) - set(self.previous) - set(_HIDDEN)
                               if _exists(self.out / n))
        write_marker(self.out, self.tmp, self.command, sorted(set(self.previous) | set(final)))
        try:
            for name in sorted(stale | set(final), key=lambda n: not pointer(n)):
                path = self.out / name
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)  # a folder is replaced whole: os.replace cannot
                elif (name not in final or pointer(name)) and _exists(path):
                    path.unlink()
            for name in final:
                os.replace(self.tmp / name, self.out / name)
        except OSError as e:
            raise ExportError(f"stopped while moving the new files into place: {os_error(e)}; the folder may hold "
                              "only some of them: run the command again", self.out) from e
        # Every file is in place. The marker still lists the replaced names too, which only ever
        # tells a rerun what it may remove, so failing to shrink it (on a full disk) must not fail.
        with contextlib.suppress(OSError, ExportError):
            write_marker(self.out, self.tmp, self.command, final)


@contextmanager
def output_dir(out_dir: str | os.PathLike, overwrite: bool, *, command: str = EXPORT,
               inputs: Sequence[Path] = (), replaces: Callable[[str], bool] | None = None) -> Iterator[Folder]:
    """Check that ``out_dir`` may be written by ``command``, lock it, and yield a :class:`Folder`
    with a fresh temporary folder inside it. The temporary folder goes in any case; the output
    folder and the parents this call made go too if the run fails or is interrupted (a run
    leaves nothing that was not there before it), unless something else was put in them.

    ``inputs``: the folders and files the command reads; the output may not be any of them, lie
    inside one, or hold one. ``replaces``: names in the folder that the new output replaces even
    when another writer left them (``overwrite``): the export's model weight files.
    """
    out = local_folder(out_dir)
    refuse_input(out, inputs)
    made = _make_dir(out)
    try:
        with _locked(out):
            previous = _check_owner(out, command, overwrite)
            for name in _listdir(out):
                if _our_tmp(out / name):  # the lock says no writer is alive to own it
                    shutil.rmtree(out / name, ignore_errors=True)
            with _temporary(out) as tmp:
                yield Folder(out, tmp, command, previous, replaces or (lambda name: False))
    except BaseException:
        _finish(lambda: _remove_empty(made))
        raise


@contextmanager
def _locked(out: Path) -> Iterator[None]:
    fd = os.open(out, os.O_RDONLY)
    try:
        _lock(fd, out)
        yield
    finally:
        os.close(fd)  # releases the lock


@contextmanager
def _temporary(out: Path) -> Iterator[Path]:
    """This process's temporary folder in ``out``, marked as zerofast's, removed in any case."""
    tmp = out / f".zerofast-tmp-{os.getpid()}"
    made = False
    # One try from the mkdir on: a signal landing between making the folder and marking it
    # (an exception raised by the CLI's handler) must not leave it behind either.
    try:
        try:
            tmp.mkdir()
            made = True
            (tmp / TMP_MARK).touch()
        except OSError as e:
            # Named by the folder the user gave: the temporary folder's name means nothing to them.
            raise ExportError(f"cannot create a temporary folder in the output folder: {os_error(e)}", out) from e
        yield tmp
    finally:
        if made:  # never a folder of that name that this run did not make
            _remove_all(tmp)


def _remove_all(folder: Path) -> None:
    _finish(lambda: shutil.rmtree(folder, ignore_errors=True))


def _remove_empty(folders: Sequence[Path]) -> None:
    """Remove ``folders`` (deepest first) where they are empty; rmdir leaves any other alone."""
    for folder in folders:
        with contextlib.suppress(OSError):
            folder.rmdir()


def _finish(cleanup: Callable[[], None]) -> None:
    """Run ``cleanup`` to its end even if a signal lands meanwhile: the CLI's handlers raise
    (KeyboardInterrupt, ``team.Stopped``), and one arriving as a finished command removes its
    temporary folder would leave the folder behind. ``cleanup`` is run again until it completes
    (it must be repeatable), then that exception goes on."""
    pending: BaseException | None = None
    while True:
        try:
            cleanup()
            break
        except BaseException as e:  # the signal's exception, raised inside the cleanup
            pending = pending or e
    if pending is not None:
        raise pending


def local_folder(out_dir: str | os.PathLike) -> Path:
    """``out_dir`` as a local path; a remote URL (``s3://``, ``hf://``...) is refused, not made into
    a local folder named ``hf:``."""
    url = remote_url(out_dir)
    if url:
        raise ExportError("expected a local output folder, found a remote location: zerofast writes local folders "
                          "only: write here, then upload the folder (aws s3 sync, huggingface-cli upload, ...)", url)
    return Path(out_dir)


def checkpoint_inputs(files: CheckpointFiles) -> list[Path]:
    """What a writer reads of a checkpoint: its tag folder and every file its layout lists (which
    may be links to elsewhere)."""
    return [files.tag_dir, *files.paths()]


def refuse_input(out: Path, inputs: Sequence[Path]) -> None:
    """Refuse an output folder that is, lies inside, or holds what the command reads."""
    real_out = _resolve(out)
    out_in = os.path.join(real_out, "")
    by_folder: dict[str, list[Path]] = {}
    for path in inputs:
        by_folder.setdefault(os.path.dirname(os.fspath(path)), []).append(path)
    for folder, here in by_folder.items():
        for path, real in zip(here, _resolved_in(folder, here)):
            real_in = real if real.endswith(os.sep) else real + os.sep  # os.path.join(real, ""), per file
            if real == real_out or out_in.startswith(real_in) or real.startswith(out_in):
                how = "is" if real == real_out else ("lies inside" if out_in.startswith(real_in) else "holds")
                raise OutputExistsError(f"the output folder {how} the checkpoint being read ({path}); writing "
                                        "there would destroy it: choose another output folder", out)


def _resolved_in(folder: str, paths: Sequence[Path]) -> Iterator[str]:
    """:func:`_resolve` of each of ``paths`` (all in ``folder``): a file that is not itself a link
    lies where its folder resolves to (a save of thousands of files has one folder), and which
    are links one listing of the folder says."""
    links = links_among(folder, paths)
    real_folder = None
    for path in paths:
        tail = os.path.basename(os.fspath(path))
        if tail in ("", ".", "..") or tail in links:
            yield _resolve(path)
        else:
            real_folder = real_folder or os.path.join(_resolve(Path(folder or ".")), "")
            yield real_folder + tail


def _resolve(path: Path) -> str:
    try:
        return os.path.realpath(path)  # realpath does not raise on a link loop, resolve() does
    except (OSError, ValueError):
        return os.path.abspath(path)


def _make_dir(out_dir: Path) -> list[Path]:
    """Make the output folder and its missing parents. Returns the ones it made, deepest first,
    for a failed run to remove again: never a folder the user already had."""
    made = list(itertools.takewhile(lambda p: not os.path.lexists(p), (out_dir, *out_dir.parents)))
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise OutputExistsError("expected an output folder, found a file", out_dir) from None
    except OSError as e:
        _remove_empty(made)  # the parents made before a deeper one failed
        raise ExportError(f"cannot create the output folder: {os_error(e)}", out_dir) from e
    return made


def _lock(fd: int, out_dir: Path) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise OutputExistsError("another zerofast export (or reshard, to-universal) is writing into this folder", out_dir) from None


def _listdir(folder: Path) -> list[str]:
    try:
        return os.listdir(folder)
    except OSError as e:
        raise ExportError(f"cannot list the output folder: {os_error(e)}", folder) from e


def _exists(path: Path) -> bool:
    return path.exists() or path.is_symlink()


def _our_tmp(path: Path) -> bool:
    """A temporary folder of an earlier zerofast run: the name, a real folder, and our mark
    (or empty: killed between making it and marking it). A user's folder that happens to be
    named ``.zerofast-tmp-7`` is left alone."""
    if not TMP_DIR.match(path.name) or path.is_symlink() or not path.is_dir():
        return False
    try:
        return (path / TMP_MARK).is_file() or not os.listdir(path)
    except OSError:
        return False


def _identity(path: Path) -> list[int] | None:
    """What tells a file (or folder) zerofast moved into place from another under the same name:
    a forged marker can name a user's files, but not their inode and nanosecond mtime."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    kind = 0 if stat.S_ISREG(st.st_mode) else 1 if stat.S_ISDIR(st.st_mode) else None
    if kind is None:
        return None
    return [st.st_size if kind == 0 else -1, st.st_ino, st.st_mtime_ns if kind == 0 else 0]


def _read_marker(out_dir: Path) -> tuple[str, list[str]] | None:
    """The command that wrote the folder last, and the files it wrote that are still as it left
    them; None where no zerofast run can be shown to have been committed."""
    for name in (MARKER, LEGACY_MARKER):
        record = read_json(out_dir / name, MARKER_LIMIT)
        if not isinstance(record, dict):
            continue
        files, identities = record.get("files"), record.get("identities")
        if not isinstance(files, list) or not isinstance(identities, dict):
            continue
        verified = [f for f in files if isinstance(f, str) and "/" not in f and f not in ("", ".", "..")
                    and identities.get(f) is not None and identities.get(f) == _identity(out_dir / f)]
        command = record.get("command")
        if not isinstance(command, str):  # written before markers named their command
            command = "reshard" if "latest" in files else "to-universal" if "zero" in files else EXPORT
        return (command, verified) if verified else None
    return None


def _check_owner(out_dir: Path, command: str, overwrite: bool) -> list[str]:
    """The files the previous run of ``command`` left. A folder it never wrote into must be empty
    (or ``overwrite`` given); files a user added to an output of its own stay and do not block a
    rerun; another command's output is refused without ``overwrite``."""
    marker = _read_marker(out_dir)
    previous = marker[1] if marker and marker[0] == command else []
    foreign = sorted(n for n in _listdir(out_dir) if n not in set(previous) | set(_HIDDEN)
                     and not _our_tmp(out_dir / n))
    if overwrite or not foreign:
        return previous
    if marker and marker[0] != command:
        raise OutputExistsError(
            f"the folder holds the output of `zerofast {marker[0]}` ({some(sorted(marker[1]), 5)}); pass "
            f"overwrite=True (--overwrite) to write the {command} next to it, replacing only the names it writes",
            out_dir)
    if not previous:
        raise OutputExistsError(
            f"the folder holds files zerofast did not write ({some(foreign, 5)}); pass overwrite=True (--overwrite) to "
            f"write the {command} into it anyway, replacing only the names it writes", out_dir)
    return previous


def write_marker(out_dir: Path, tmp: Path, command: str, files: Sequence[str]) -> None:
    # A staged file keeps its inode and mtime when it is moved into place.
    identities = {n: _identity(tmp / n) or _identity(out_dir / n) for n in files}
    staged = tmp / Path(MARKER).name
    record = {"written_by": "zerofast", "command": command, "files": list(files), "identities": identities}
    write_text(staged, json.dumps(record, indent=2) + "\n")
    final = out_dir / MARKER
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ExportError(f"cannot create the folder for zerofast's list of files: {os_error(e)}", final.parent) from e
    os.replace(staged, final)
    with contextlib.suppress(FileNotFoundError):
        (out_dir / LEGACY_MARKER).unlink()


@contextmanager
def writing(path: Path) -> Iterator[None]:
    """Report an OS error while writing ``path`` (a full disk, a file-size limit, an I/O error) as
    an ExportError naming the file under its final name, and the error. Nothing written so far has
    left the temporary folder, which goes as the error unwinds the writer."""
    try:
        yield
    except ZeroFastError:
        raise
    except OSError as e:
        raise ExportError(f"could not write this file: {os_error(e)}; the command stopped and put no file in place",
                          final_name(path)) from e


def torch_save(obj: object, path: Path, **options) -> None:
    """``torch.save(obj)`` into ``path``, an OS error reported as by :func:`writing`.

    torch turns an exception raised by the file object's ``write`` (ENOSPC, EFBIG, or Ctrl-C
    arriving there) into a RuntimeError about stream positions, chained to a second one; the sink
    keeps the original, which is raised alone."""
    with writing(path), open(path, "wb") as f:
        sink = _Sink(f)
        try:
            torch.save(obj, sink, **options)
        except BaseException:
            if sink.error is None:
                raise
            raise sink.error from None


class _Sink:
    """The file object torch.save writes through, holding on to what its writes raised.
    (Given a path instead, torch writes from C++ and the OS error is lost entirely.)"""

    def __init__(self, f):
        self.f = f
        self.error: BaseException | None = None

    def write(self, data) -> int:
        return self._kept(self.f.write, data)

    def seek(self, *args) -> int:  # torch seeks over the storages it skips (skip_data)
        return self._kept(self.f.seek, *args)

    def tell(self) -> int:
        return self.f.tell()

    def flush(self) -> None:
        self._kept(self.f.flush)

    def _kept(self, call, *args):
        try:
            return call(*args)
        except BaseException as e:
            self.error = e
            raise


def write_text(path: Path, text: str) -> None:
    with writing(path):
        path.write_text(text)


def write_bytes(path: Path, data: bytes) -> None:
    with writing(path):
        path.write_bytes(data)


def copy_file(src: Path, dst: Path) -> None:
    with writing(dst):
        shutil.copyfile(src, dst)


def final_name(path: Path) -> Path:
    """Where a file staged in a temporary folder lands (``out/.zerofast-tmp-7/tag/x`` -> ``out/tag/x``)."""
    parts = path.parts
    for i, part in enumerate(parts):
        if TMP_DIR.match(part):
            return Path(*parts[:i], *parts[i + 1:])
    return path


def os_error(e: OSError) -> str:
    if e.strerror is None:
        return str(e)
    code = errno.errorcode.get(e.errno) if isinstance(e.errno, int) else None
    return f"{e.strerror} ({code})" if code else e.strerror
