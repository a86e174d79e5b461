"""The process group of a torchrun job of the suite, set up and torn down in one place (issue 46).

    from gloo_job import exit_now, process_group    # a script run from tests/dsgen
    def main():
        with process_group(lambda: deepspeed.init_distributed(dist_backend="gloo")):
            ...                                      # the job
    if __name__ == "__main__":
        main()
        exit_now()

``process_group``: where the body finished, a barrier (every rank done with its collectives), then
``destroy_process_group()``, which also frees the subgroups DeepSpeed made (expert, pipeline,
tensor-parallel); where it raised, ``destroy_process_group()`` at once, with no barrier, since a
peer may be gone (torchrun stops the others), and the error goes on.

``exit_now``: that alone does not end "terminate called without an active exception" (SIGABRT
at a rank's exit: 5 runs in 176 of the FSDP2 job on 2 cores, none in 250 with ``exit_now``; see
docs/development.md, "Flaky torchrun jobs"). A core dump of one shows why: gloo's worker threads
still run after ``destroy_process_group`` (the mesh and FSDP's state still hold the group), and a
worker that drops its last finished work (the barrier, holding the collective before it) a moment
after the main thread went on frees tensors whose Python objects need the GIL; the interpreter is
finalizing by then, so ``take_gil`` ends the thread with ``pthread_exit``, whose unwinding through
a ``noexcept`` destructor calls ``std::terminate``. A job that has torn its group down and written
its files ends with ``os._exit``, so that no finalization runs for such a thread to meet.

Scripts in tests/dsgen import it as ``gloo_job`` (they run with this folder first on
``sys.path``); others load it by path or as ``tests.dsgen.gloo_job``. No DeepSpeed import here.
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Callable, Iterator, NoReturn


@contextlib.contextmanager
def process_group(init: Callable[[], object] | None = None) -> Iterator[None]:
    """Run the body in the job's default process group: made by ``init`` (``deepspeed.init_distributed``,
    accelerate's ``PartialState``), else ``init_process_group("gloo")``; torn down at the end as the
    module says."""
    import torch.distributed as dist

    if init is None:
        dist.init_process_group("gloo")
    else:
        init()
    finished = False
    try:
        yield
        finished = True
    finally:
        try:
            if finished and dist.is_initialized():
                dist.barrier()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


def exit_now(code: int = 0) -> NoReturn:
    """End a job that finished: flush what it printed and logged, then ``os._exit`` without the
    interpreter's finalization (atexit handlers and module teardown do not run: call it last,
    once every file is written and closed)."""
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
