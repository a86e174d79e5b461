"""Small JSON records on disk, read and written one way everywhere: the cache's memos
(zerofast/native/) and the output folder's marker (zerofast/output/transaction.py).

A record is read without following a link, without blocking on a FIFO and to a bounded size, since
the folder may come from anywhere (a marker linked to /dev/zero never ends); anything unreadable
reads as None. It is written whole, through a temporary file renamed over it, so a reader sees the
old record or the new one; where the folder cannot be written (a cache shared read-only) nothing
is written and nothing raised.
"""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

LIMIT = 64 << 20  # the largest record read; a marker lists names and their identities


def read_json(path: Path, limit: int = LIMIT) -> object:
    """The JSON value in ``path``, or None where it is missing, not a regular file, larger than
    ``limit`` bytes or not JSON."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(limit + 1)
        return json.loads(data) if len(data) <= limit else None
    except (OSError, ValueError, RecursionError):
        return None
    finally:
        os.close(fd)


def read_dict(path: Path) -> dict:
    """:func:`read_json` where only a JSON object will do: {} for anything else."""
    value = read_json(path)
    return value if isinstance(value, dict) else {}


def write_json(path: Path, value: object) -> bool:
    """Write ``value`` to ``path`` whole (temporary file, then rename); False where it could not."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(value, f, indent=1)
        os.replace(tmp, path)
        return True
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return False
