"""The C library's calls that Python's os module does not wrap (``mincore``, ``fallocate``).
Internal: for :mod:`zerofast.load.residency` and :mod:`zerofast.load.node_bytes`.

Each function is looked up once, with its prototype (so its argument types are set once), in the
process's own symbols: through ``ctypes.pythonapi``'s handle, open since ctypes was imported. No
library is loaded, which a reconstruct must not do (``ctypes.dlopen`` is an audited event that
tests/test_hostile.py watches for).
"""
from __future__ import annotations

import ctypes
import functools
from typing import Callable


@functools.cache
def function(name: str, restype: type, *argtypes: type) -> Callable[..., int] | None:
    """The C function ``name`` with this prototype (errno kept for ``ctypes.get_errno``), or None
    where this platform has no such call."""
    prototype = ctypes.CFUNCTYPE(restype, *argtypes, use_errno=True)
    try:
        return prototype((name, ctypes.pythonapi))
    except (AttributeError, OSError):
        return None
