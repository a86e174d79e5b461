"""Every setting that changes what zerofast does, read from the environment in one place.

:func:`settings` returns a frozen :class:`Settings` read from the environment; nothing else in
the package reads ``os.environ`` for its own behaviour (the distributed team reads torchrun's
``RANK``/``WORLD_SIZE``, which are the launcher's, not zerofast's). Nothing here imports torch,
so ``zerofast --version`` can read it. The native
kernels never read the environment either: their knobs are op arguments, filled from here by
:mod:`zerofast.native.ops`, so an op is a function of its arguments.

A public keyword (``follow_symlinks=``, ``tp_rules=``) wins over its variable: the reading
functions pass theirs to :func:`overriding`, which lays them over the settings for the calls
made in that block in the calling thread (the CLI's flags go the same way). A variable changed while the
process runs (a test's monkeypatch) is seen at the next public call: inside one
(:func:`read_once`, around the per-file reading of a save of thousands of files) the reading made
where it began stands, so the files are not each charged a dozen environment lookups. The
README's "Settings" table lists the same variables.
"""
from __future__ import annotations

import contextvars
import dataclasses
import math
import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Iterator, Mapping

from .errors import NativeExtensionError, SettingsError

NATIVE_ENV = "ZEROFAST_NATIVE"
CACHE_DIR_ENV = "ZEROFAST_CACHE_DIR"
# ZEROFAST_NATIVE's values -> the mode they select.
NATIVE_MODES = {"auto": "auto", "": "auto", "1": "required", "0": "off"}
FOLLOW_SYMLINKS_ENV = "ZEROFAST_FOLLOW_SYMLINKS"
READERS_ENV = "ZEROFAST_READERS"
HUGEPAGES_ENV = "ZEROFAST_HUGEPAGES"
NODES_HOLE_ENV = "ZEROFAST_NODES_HOLE_BYTES"
NODES_CHUNK_ENV = "ZEROFAST_NODES_CHUNK_BYTES"
COPY_FILE_RANGE_ENV = "ZEROFAST_COPY_FILE_RANGE"
CUDA_KERNELS_ENV = "ZEROFAST_CUDA_KERNELS"
DIST_TIMEOUT_ENV = "ZEROFAST_DIST_TIMEOUT"
TP_REPLICATED_ENV = "ZEROFAST_TP_REPLICATED"
TP_REPLICATED_MODES = ("equal", "mean")
TP_RULES_ENV = "ZEROFAST_TP_RULES"
UNSTACK_LAYERS_ENV = "ZEROFAST_UNSTACK_LAYERS"
# A collective waits for the slowest rank to finish its share of the files, so the timeout must
# cover the imbalance between ranks (at most one file), not a whole export.
DEFAULT_DIST_TIMEOUT_S = 1800
# A reader thread spends a cold read blocked in pread, so a small machine gains from more reads in
# flight than it has cores: cold eager ZeRO-3 (503M, 2 cores, virtio disk) took 2.73 s with 2
# readers and 1.50 s with 16. Warm, a read is a copy and threads beyond the cores only contend:
# 0.46 s with 2 or 4 readers, 0.55 s with 16 (docs/performance.md). So the floor holds only for
# a batch whose sampled pages are not all in the page cache (load.residency).
DEFAULT_MIN_READERS = 16
WARM_SHARE = 0.9  # the share of a batch's sampled pages in the page cache that makes it warm


@dataclass(frozen=True)
class Settings:
    """What the environment asked for. Each field names its variable and default."""

    # ZEROFAST_NATIVE: "auto" (default) runs the native core, or the pure-torch reference with one
    # warning where it cannot be built; "1" makes that an error; "0" always runs the reference.
    # As written; ``mode`` checks it where the native core is loaded.
    native: str = "auto"
    # ZEROFAST_CACHE_DIR (else $XDG_CACHE_HOME/zerofast, else ~/.cache/zerofast): built native
    # cores live in cache_dir / "native", one folder per torch, Python, sources and devices.
    cache_dir: Path = field(default_factory=lambda: Path.home() / ".cache" / "zerofast")
    # CXX: the compiler torch's builder calls (it reads CXX itself; this is for the checks).
    cxx: str = "c++"
    # FORCE_CUDA=1: compile the CUDA kernels even where torch has no CUDA or nvcc is not found.
    force_cuda: bool = False
    # TORCH_CUDA_ARCH_LIST: the GPUs the CUDA kernels are built for (default: the visible ones).
    cuda_arch_list: str | None = None
    # ZEROFAST_CUDA_KERNELS=0: build the native core without its CUDA kernels even where torch has
    # CUDA and nvcc is found (device="cuda" then runs on torch's own GPU ops); also what a test or
    # a GPU machine sets to stand for a CUDA torch without nvcc. Default 1; FORCE_CUDA does not
    # override it.
    cuda_kernels: bool = True
    # CUDA_HOME, else CUDA_PATH: where nvcc is looked for first (bin/nvcc), before the PATH and
    # /usr/local/cuda, as torch's builder looks (native/cudaplan.find_nvcc).
    cuda_home: str | None = None
    # ZEROFAST_FOLLOW_SYMLINKS=1: follow links that lead out of the checkpoint folder (default:
    # refused, see zerofast.discover.check_inside). The public follow_symlinks= keyword wins.
    follow_symlinks: bool = False
    # ZEROFAST_READERS: reader threads of the batched pread reader; 0 (default) is torch's
    # intra-op thread count, but at least DEFAULT_MIN_READERS for cold copies (see reader_count).
    readers: int = 0
    # ZEROFAST_HUGEPAGES=1: ask for transparent huge pages on the eager dict's outputs (default
    # off: with defrag=madvise a huge-page fault may compact memory synchronously, which cost
    # more than it saved on a machine whose page cache holds the checkpoint; README, Settings).
    hugepages: bool = False
    # ZEROFAST_COPY_FILE_RANGE=0: export through pread/pwrite only, never copy_file_range.
    copy_file_range: bool = True
    # ZEROFAST_DIST_TIMEOUT: seconds a rank of a shared export waits for the slowest (default
    # 1800), as written; dist_timeout_s() checks it where it is used.
    dist_timeout: str = str(DEFAULT_DIST_TIMEOUT_S)
    # ZEROFAST_NODES_HOLE_BYTES: for a save spread over the nodes' disks (zerofast.load.node_view),
    # storages of at least this many bytes are moved per output file; smaller ones go to every
    # rank with the file's pickle (default 64 KiB, at least 256 bytes; the tests set 256 to move
    # nearly every storage).
    nodes_hole_bytes: int = 64 << 10
    # ZEROFAST_NODES_CHUNK_BYTES: the bytes of one message between the nodes (default 64 MiB).
    nodes_chunk_bytes: int = 64 << 20
    # ZEROFAST_TP_REPLICATED: what a Megatron-DeepSpeed save's tensor-parallel replicated
    # parameter whose copies differ between the tp ranks gets: "equal" (default) refuses it,
    # "mean" averages the copies as ds_to_universal averages (BLOOM's drifted layer norms). As
    # written; ``tp_replicated_mode`` checks it where it is used. The CLI's --tp-replicated and the
    # keyword tp_replicated= override it.
    tp_replicated: str = "equal"
    # ZEROFAST_TP_RULES: how a tensor-parallel save's slices go together where the save does not
    # say (no pattern lists in universal_checkpoint_info), or instead of what it says: a JSON file
    # in that vocabulary, or a preset ("megatron-gpt:mlp=swiglu,vocab=50257"); see
    # zerofast/layouts/tp_rules.py. Default none. The CLI's --tp-rules and the keyword tp_rules=
    # (which also takes the rules as a dict) override it.
    tp_rules: str | dict | None = None
    # ZEROFAST_UNSTACK_LAYERS=1: a Megatron-Core save's stacked layers (one key per layer type,
    # a leading layer dimension) come out per layer, as the model's state_dict names them
    # (default: kept as stored). The CLI's --unstack-layers and the keyword unstack_layers=
    # override it.
    unstack_layers: bool = False

    @cached_property  # read on every native op: strip and lower once per reading
    def mode(self) -> str:
        """The native core's mode, "auto", "required" or "off"; a NativeExtensionError for any
        other ZEROFAST_NATIVE."""
        raw = self.native.strip().lower()
        if raw not in NATIVE_MODES:
            raise NativeExtensionError(f"ZEROFAST_NATIVE={raw!r}: expected 1 (native core required), 0 (pure-torch "
                                       "reference) or auto (native, else the reference with a warning)")
        return NATIVE_MODES[raw]

    def tp_replicated_mode(self) -> str:
        """ZEROFAST_TP_REPLICATED, "equal" or "mean"; a :class:`SettingsError` for anything else."""
        mode = self.tp_replicated.strip().lower()
        if mode not in TP_REPLICATED_MODES:
            raise SettingsError(f"{TP_REPLICATED_ENV} must be one of {', '.join(TP_REPLICATED_MODES)}, "
                                f"got {self.tp_replicated!r}")
        return mode

    def dist_timeout_s(self) -> float:
        """ZEROFAST_DIST_TIMEOUT in seconds; a :class:`SettingsError` (a ValueError) for anything
        but a positive, finite number, which the CLI prints as one line."""
        try:
            value = float(self.dist_timeout)
        except ValueError:
            value = -1
        if not 0 < value < math.inf:
            raise SettingsError(f"{DIST_TIMEOUT_ENV} must be a positive number of seconds, got {self.dist_timeout!r}")
        return value


def reader_count(s: Settings, resident: float | None = None) -> int:
    """The reader threads a batched op gets: ZEROFAST_READERS, else torch's intra-op thread
    count, raised to :data:`DEFAULT_MIN_READERS` unless the batch is warm (``resident``: the
    share of its pages in the page cache, at least :data:`WARM_SHARE`). A batch of fewer pieces
    starts fewer."""
    if s.readers:
        return s.readers
    import torch  # here, not at the top: ``zerofast --version`` reads the settings without torch

    threads = torch.get_num_threads()
    if resident is not None and resident >= WARM_SHARE:
        return threads
    return max(DEFAULT_MIN_READERS, threads)


def from_environment(env: Mapping[str, str]) -> Settings:
    """The settings ``env`` asks for; a value that is not understood keeps the default."""
    cache = env.get(CACHE_DIR_ENV) or os.path.join(
        env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "zerofast")
    return Settings(
        native=env.get(NATIVE_ENV, "auto"),
        cache_dir=Path(cache),
        cxx=env.get("CXX") or "c++",
        force_cuda=env.get("FORCE_CUDA", "0") == "1",
        cuda_arch_list=env.get("TORCH_CUDA_ARCH_LIST") or None,
        cuda_kernels=env.get(CUDA_KERNELS_ENV, "1") != "0",
        cuda_home=env.get("CUDA_HOME") or env.get("CUDA_PATH") or None,
        follow_symlinks=env.get(FOLLOW_SYMLINKS_ENV) == "1",
        readers=_count(env.get(READERS_ENV)),
        hugepages=env.get(HUGEPAGES_ENV, "0") == "1",
        copy_file_range=env.get(COPY_FILE_RANGE_ENV, "1") != "0",
        dist_timeout=env.get(DIST_TIMEOUT_ENV, str(DEFAULT_DIST_TIMEOUT_S)),
        nodes_hole_bytes=_count(env.get(NODES_HOLE_ENV)) or 64 << 10,
        nodes_chunk_bytes=_count(env.get(NODES_CHUNK_ENV)) or 64 << 20,
        tp_replicated=env.get(TP_REPLICATED_ENV, "equal"),
        tp_rules=env.get(TP_RULES_ENV) or None,
        unstack_layers=env.get(UNSTACK_LAYERS_ENV, "0") == "1",
    )


def _count(value: str | None) -> int:
    try:
        return max(0, int(value)) if value is not None else 0
    except ValueError:
        return 0


_VARIABLES = (NATIVE_ENV, CACHE_DIR_ENV, "XDG_CACHE_HOME", "HOME", "CXX", "FORCE_CUDA", "TORCH_CUDA_ARCH_LIST",
              CUDA_KERNELS_ENV, "CUDA_HOME", "CUDA_PATH", FOLLOW_SYMLINKS_ENV, READERS_ENV, HUGEPAGES_ENV,
              COPY_FILE_RANGE_ENV, DIST_TIMEOUT_ENV, NODES_HOLE_ENV, NODES_CHUNK_ENV, TP_REPLICATED_ENV,
              TP_RULES_ENV, UNSTACK_LAYERS_ENV)
_cache: tuple[tuple, Settings] | None = None
# The reading that stands while a public call runs (read_once), and how many such calls are in
# flight; a plain global, not thread-local, so that the call's reader threads see it too.
_held: Settings | None = None
_holders = 0
_HOLD_LOCK = threading.Lock()


# What the public call running in this thread was given by keyword (overriding), as the fields
# to replace and the last (reading, result) pair, so that settings() replaces once per reading.
_OVERRIDES: contextvars.ContextVar[tuple[dict, list] | None] = contextvars.ContextVar("zerofast_overrides",
                                                                                     default=None)
# The fields a public keyword may override.
OVERRIDABLE = ("tp_rules", "tp_replicated", "unstack_layers")


def settings() -> Settings:
    """This process's settings. Read again only when one of the variables changed (a test's
    monkeypatch, a launcher), so a call costs a few dictionary lookups; inside :func:`read_once`,
    one attribute read. What :func:`overriding` was given in this thread is laid over them."""
    held = _held
    base = held if held is not None else _read()
    given = _OVERRIDES.get()
    if given is None:
        return base
    fields, last = given
    if last[0] is not base:
        last[:] = [base, dataclasses.replace(base, **fields)]
    return last[1]


@contextmanager
def overriding(**keywords) -> Iterator[None]:
    """Lay a public call's keywords (one of :data:`OVERRIDABLE`; None: not given) over the
    settings, for the calls made in this block in this thread. A value of the wrong kind is a
    :class:`SettingsError` naming the keyword."""
    fields = {k: _checked_keyword(k, v) for k, v in keywords.items() if v is not None}
    if not fields:
        yield
        return
    outer = _OVERRIDES.get()
    if outer is not None:
        fields = {**outer[0], **fields}
    token = _OVERRIDES.set((fields, [None, None]))
    try:
        yield
    finally:
        _OVERRIDES.reset(token)


def _checked_keyword(name: str, value):
    if name not in OVERRIDABLE:
        raise TypeError(f"overriding() got an unexpected keyword {name!r}")
    if name == "unstack_layers":
        if type(value) is not bool:
            raise SettingsError(f"unstack_layers= expects True or False, got {value!r:.60}")
        return value
    if name == "tp_replicated":
        if not isinstance(value, str) or value.strip().lower() not in TP_REPLICATED_MODES:
            raise SettingsError(f"tp_replicated= expects one of {', '.join(TP_REPLICATED_MODES)}, got {value!r:.60}")
        return value
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if not isinstance(value, (str, dict)) or not value:
        raise SettingsError("tp_rules= expects a preset (\"megatron-gpt:mlp=swiglu,vocab=N\"), the path of a JSON "
                            f"rules file or the rules as a dict, got {value!r:.60}")
    return value


def _read() -> Settings:
    global _cache
    values = tuple(os.environ.get(name) for name in _VARIABLES)
    if _cache is None or _cache[0] != values:
        _cache = (values, from_environment(os.environ))
    return _cache[1]


@contextmanager
def read_once() -> Iterator[Settings]:
    """The environment read now, and that reading returned by :func:`settings` until the block
    ends: one public call's settings. Each entry reads again (a nested or concurrent call that
    starts later sees what the environment says then)."""
    global _held, _holders
    with _HOLD_LOCK:
        held = _held = _read()
        _holders += 1
    try:
        yield held
    finally:
        with _HOLD_LOCK:
            _holders -= 1
            if not _holders:
                _held = None
