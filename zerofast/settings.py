"""Every setting that changes what zerofast does, read from the environment in one place.

:func:`settings` returns a frozen :class:`Settings` read from the environment; nothing else in the package reads ``os.environ`` for its own behaviour (the distributed team
reads torchrun's ``RANK``/``WORLD_SIZE``, which are the launcher's, not zerofast's). The native
kernels never read the environment either: their knobs are op arguments, filled from here by
:mod:`zerofast.ops`, so an op is a function of its arguments.

A public keyword (``follow_symlinks=``) wins over its variable. A variable changed while the
process runs (a test's monkeypatch) is seen at the next call. The README's "Settings" table
lists the same variables.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

FOLLOW_SYMLINKS_ENV = "ZEROFAST_FOLLOW_SYMLINKS"
READERS_ENV = "ZEROFAST_READERS"
HUGEPAGES_ENV = "ZEROFAST_HUGEPAGES"
COPY_FILE_RANGE_ENV = "ZEROFAST_COPY_FILE_RANGE"
DIST_TIMEOUT_ENV = "ZEROFAST_DIST_TIMEOUT"
# A collective waits for the slowest rank to finish its share of the files, so the timeout must
# cover the imbalance between ranks (at most one file), not a whole export.
DEFAULT_DIST_TIMEOUT_S = 1800


@dataclass(frozen=True)
class Settings:
    """What the environment asked for. Each field names its variable and default."""

    # ZEROFAST_NATIVE, ZEROFAST_CACHE_DIR and the native core's build variables are read by
    # zerofast.native.settings, with the machinery they steer.
    # ZEROFAST_FOLLOW_SYMLINKS=1: follow links that lead out of the checkpoint folder (default:
    # refused, see zerofast.discover.check_inside). The public follow_symlinks= keyword wins.
    follow_symlinks: bool = False
    # ZEROFAST_READERS: reader threads of the batched pread reader; 0 (default) is torch's
    # intra-op thread count.
    readers: int = 0
    # ZEROFAST_HUGEPAGES=0: do not ask for transparent huge pages on the eager dict's outputs.
    hugepages: bool = True
    # ZEROFAST_COPY_FILE_RANGE=0: export through pread/pwrite only, never copy_file_range.
    copy_file_range: bool = True
    # ZEROFAST_DIST_TIMEOUT: seconds a rank of a shared export waits for the slowest (default
    # 1800), as written; dist_timeout_s() checks it where it is used.
    dist_timeout: str = str(DEFAULT_DIST_TIMEOUT_S)

    def dist_timeout_s(self) -> float:
        try:
            value = float(self.dist_timeout)
        except ValueError:
            value = -1
        if not value > 0:
            raise ValueError(f"{DIST_TIMEOUT_ENV} must be a positive number of seconds, got {self.dist_timeout!r}")
        return value


def from_environment(env: Mapping[str, str]) -> Settings:
    """The settings ``env`` asks for; a value that is not understood keeps the default."""
    return Settings(
        follow_symlinks=env.get(FOLLOW_SYMLINKS_ENV) == "1",
        readers=_count(env.get(READERS_ENV)),
        hugepages=env.get(HUGEPAGES_ENV, "1") != "0",
        copy_file_range=env.get(COPY_FILE_RANGE_ENV, "1") != "0",
        dist_timeout=env.get(DIST_TIMEOUT_ENV, str(DEFAULT_DIST_TIMEOUT_S)),
    )


def _count(value: str | None) -> int:
    try:
        return max(0, int(value)) if value is not None else 0
    except ValueError:
        return 0


_VARIABLES = (FOLLOW_SYMLINKS_ENV, READERS_ENV, HUGEPAGES_ENV, COPY_FILE_RANGE_ENV, DIST_TIMEOUT_ENV)
_cache: tuple[tuple, Settings] | None = None


def settings() -> Settings:
    """This process's settings. Read again only when one of the variables changed (a test's
    monkeypatch, a launcher), so a call costs a few dictionary lookups."""
    global _cache
    values = tuple(os.environ.get(name) for name in _VARIABLES)
    if _cache is None or _cache[0] != values:
        _cache = (values, from_environment(os.environ))
    return _cache[1]
