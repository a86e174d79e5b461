"""The output folder's transaction: ownership, locking, the temporary folder, the final moves.

Everything is written into a temporary folder inside the output folder and moved to its final
name only once every file is complete, the index last. An export that fails or is killed while
writing leaves no file under a final name (a write error is an ExportError naming the file and
the OS error); one killed during the moves, a few renames, may leave some complete files there,
never an index listing a missing one. A rerun cleans up either way.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

from ..errors import ExportError, OutputExistsError, ZeroFastError

# Lists the files the last export put in the folder. It sits under .cache/huggingface/, which
# huggingface_hub's upload_folder never uploads (its default ignore patterns); older versions
# wrote LEGACY_MARKER at the top, which is still read and then removed.
MARKER = ".cache/huggingface/zerofast-export.json"
LEGACY_MARKER = ".zerofast-export.json"
_HIDDEN = (".cache", LEGACY_MARKER)  # never counted as the user's files
MARKER_LIMIT = 64 << 20  # a marker lists names and their identities; never read more
TMP_DIR = re.compile(r"^\.zerofast-tmp-\d+$")
TMP_MARK = ".zerofast-tmp"  # inside each temporary folder: only such folders are ever removed
# Files an export replaces even in a folder it did not write (``overwrite``): model weights.
WEIGHT_FILE = re.compile(r"^(model(-\d{5,}-of-\d{5,})?\.safetensors|pytorch_model(-\d{5,}-of-\d{5,})?\.bin)"
                         r"(\.index\.json)?$")


@contextmanager
def output_dir(out_dir: Path, overwrite: bool) -> Iterator[tuple[Path, list[str]]]:
    """Lock ``out_dir``, check that it may be written, and yield a fresh temporary folder inside
    it plus the files the previous export left there. The temporary folder goes in any case."""
    _make_dir(out_dir)
    fd = os.open(out_dir, os.O_RDONLY)
    try:
        _lock(fd, out_dir)
        previous = _check_owner(out_dir, overwrite)
        for name in os.listdir(out_dir):
            if _our_tmp(out_dir / name):  # the lock says no export is alive to own it
                shutil.rmtree(out_dir / name, ignore_errors=True)
        tmp = out_dir / f".zerofast-tmp-{os.getpid()}"
        try:
            tmp.mkdir()
            (tmp / TMP_MARK).touch()
        except OSError as e:
            raise ExportError(f"cannot create the temporary folder: {os_error(e)}", tmp) from e
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


def _our_tmp(path: Path) -> bool:
    """A temporary folder of an earlier zerofast export: the name, a real folder, and our mark
    (or empty: killed between making it and marking it). A user's folder that happens to be
    named ``.zerofast-tmp-7`` is left alone."""
    if not TMP_DIR.match(path.name) or path.is_symlink() or not path.is_dir():
        return False
    try:
        return (path / TMP_MARK).is_file() or not os.listdir(path)
    except OSError:
        return False


def _identity(path: Path) -> list[int] | None:
    """What tells a file zerofast moved into place from another file under the same name: a
    forged marker can name a user's files, but not their inode and nanosecond mtime."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return [st.st_size, st.st_ino, st.st_mtime_ns] if stat.S_ISREG(st.st_mode) else None


def _read_marker(out_dir: Path) -> list[str] | None:
    """The files the previous export wrote and that are still as it left them; None where no
    zerofast export can be shown to have been committed (no marker, or none of its files)."""
    for name in (MARKER, LEGACY_MARKER):
        record = _read_json(out_dir / name)
        if not isinstance(record, dict):
            continue
        files, identities = record.get("files"), record.get("identities")
        if not isinstance(files, list) or not isinstance(identities, dict):
            continue
        verified = [f for f in files if isinstance(f, str) and "/" not in f and f not in ("", ".", "..")
                    and identities.get(f) is not None and identities.get(f) == _identity(out_dir / f)]
        return verified or None
    return None


def _read_json(path: Path) -> object:
    """A marker's JSON, or None. Not followed if it is a link, never blocking on a FIFO, read to
    a bounded size: the folder may come from anywhere (a marker linked to /dev/zero never ends)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(MARKER_LIMIT + 1)
        return json.loads(data) if len(data) <= MARKER_LIMIT else None
    except (OSError, ValueError, RecursionError):
        return None
    finally:
        os.close(fd)


def _check_owner(out_dir: Path, overwrite: bool) -> list[str]:
    """The previous export's files. A folder zerofast never exported into must be empty (or
    ``overwrite`` given); files a user added to an export of ours stay and do not block a rerun."""
    previous = _read_marker(out_dir)
    ours = set(previous or ()) | set(_HIDDEN)
    foreign = sorted(n for n in os.listdir(out_dir) if n not in ours and not _our_tmp(out_dir / n))
    if foreign and not overwrite and previous is None:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise OutputExistsError(
            f"the folder holds files zerofast did not write ({shown}); pass overwrite=True (--overwrite) to "
            "export into it anyway, replacing only model weight files", out_dir)
    return previous or []


def commit(out_dir: Path, tmp: Path, data_files: Sequence[str], index: str | None, previous: Sequence[str]) -> None:
    """Move the finished files into place, the index last, after removing what they replace.

    The marker claims the new names before anything moves, so a rerun after an interruption here
    still recognizes every file as zerofast's. Old indexes go first: no index ever lists shards
    that are missing or half replaced.
    """
    final = [*data_files, *([index] if index else [])]
    write_marker(out_dir, tmp, sorted(set(previous) | set(final)))
    try:
        stale = set(previous) | {n for n in os.listdir(out_dir) if WEIGHT_FILE.match(n)}
        for name in sorted(stale, key=lambda n: not n.endswith(".index.json")):
            path = out_dir / name
            if name not in data_files and path.is_file():
                path.unlink()
        for name in final:
            os.replace(tmp / name, out_dir / name)
    except OSError as e:
        raise ExportError(f"stopped while moving the new files into place: {os_error(e)}; the folder may hold "
                          "only some of them: run the export again", out_dir) from e
    # Every file is in place. The marker still lists the replaced names too, which only ever tells
    # a rerun what it may remove, so failing to shrink it (on a full disk) must not fail the export.
    with contextlib.suppress(OSError, ExportError):
        write_marker(out_dir, tmp, final)


def write_marker(out_dir: Path, tmp: Path, files: Sequence[str]) -> None:
    # A staged file keeps its inode and mtime when it is moved into place.
    identities = {n: _identity(tmp / n) or _identity(out_dir / n) for n in files}
    staged = tmp / Path(MARKER).name
    write_text(staged, json.dumps({"written_by": "zerofast", "files": list(files), "identities": identities},
                                  indent=2) + "\n")
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
    left the temporary folder, which goes as the error unwinds the export."""
    try:
        yield
    except ZeroFastError:
        raise
    except OSError as e:
        raise ExportError(f"could not write this file: {os_error(e)}; the export stopped and put no file in place",
                          _final_name(path)) from e


def write_text(path: Path, text: str) -> None:
    with writing(path):
        path.write_text(text)


def write_bytes(path: Path, data: bytes) -> None:
    with writing(path):
        path.write_bytes(data)


def _final_name(path: Path) -> Path:
    return path.parent.parent / path.name if TMP_DIR.match(path.parent.name) else path


def os_error(e: OSError) -> str:
    if e.strerror is None:
        return str(e)
    code = errno.errorcode.get(e.errno) if isinstance(e.errno, int) else None
    return f"{e.strerror} ({code})" if code else e.strerror
