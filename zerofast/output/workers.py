"""``--workers N``: the ranks of one command started on this machine as ``torchrun`` would start
them, each then joining the team (:mod:`.team`) as under torchrun."""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from typing import Iterator, Sequence

from ..base.errors import ExportError
from .team import Stopped, launched


# ---------------------------------------------------------------------------------------------
def launch_local(workers: int, argv: Sequence[str]) -> None:
    """Run ``python -m zerofast *argv`` as ``workers`` ranks of one job on this machine, over
    loopback, as ``torchrun --standalone --nproc-per-node workers`` would; raise if any rank fails."""
    if launched():
        raise ExportError("--workers starts ranks of its own; under torchrun, leave it out and set the ranks with "
                          "--nproc-per-node")
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=workers, run_id=f"zerofast-{os.getpid()}",
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", local_addr="127.0.0.1",
                          max_restarts=0)
    threads = str(max(1, (os.cpu_count() or 1) // workers))
    with _environ(OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", threads)), _quiet_launcher():
        try:
            elastic_launch(config, sys.executable)("-m", "zerofast", *argv)
        except ChildFailedError as e:
            exits = ", ".join(f"rank {r} {_exit(f.exitcode, f.signal_name())}" for r, f in sorted(e.failures.items()))
            raise ExportError(f"the export on {workers} workers failed: {exits} (the ranks' errors are above)") from None
        except SignalException as e:  # the launcher's own name for a signal; it stops the ranks first
            signum = getattr(e, "sigval", signal.SIGINT)
            raise (KeyboardInterrupt() if signum == signal.SIGINT else Stopped(signum)) from None


def _exit(code: int, signal_name: str) -> str:
    return f"exited with code {code}" if code >= 0 else f"was killed by {signal_name}"


@contextlib.contextmanager
def _environ(**values: str) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _quiet_launcher() -> Iterator[None]:
    """The launcher logs each rank's exit and a traceback of its own; the ranks' own one-line
    errors, and ours, say what went wrong."""
    log = logging.getLogger("torch.distributed.elastic")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)
