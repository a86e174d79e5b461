"""The suite's torchrun jobs (issue 46): each tears its process group down and ends without the
interpreter's finalization (tests/dsgen/gloo_job.py), and a failed job runs again only for what is
not ours (catalog.not_ours)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.dsgen.catalog import _free_port, not_ours, worth_retrying
from tests.dsgen.gloo_job import process_group


def _summary(exitcode: int, traceback: str) -> str:
    """torchrun's ChildFailedError summary, as it prints it where a rank ran and failed."""
    return ("torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
            "============================================================\n"
            "Failures:\n  <NO_OTHER_FAILURES>\n"
            "------------------------------------------------------------\n"
            "Root Cause (first observed failure):\n[0]:\n  time      : 2026-12-06_03:30:00\n"
            "  host      : ci\n  rank      : 1 (local_rank: 1)\n"
            f"  exitcode  : {exitcode} (pid: 4242)\n  error_file: <N/A>\n  traceback : {traceback}\n"
            "============================================================\n")


ABORTED = "terminate called without an active exception\n" + _summary(-6, "Signal 6 (SIGABRT) received by PID 4242")
PORT_TAKEN = ("torch.distributed.DistNetworkError: The server socket has failed to listen on any local network "
              "address. port: 29500, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use\n")
RENDEZVOUS = ("torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The connection to the C10d store "
              "has failed.\n")
RAISED = "[rank1]: RuntimeError: boom\n" + _summary(1, "To enable traceback see: https://pytorch.org/docs/")
SEGFAULT = _summary(-11, "Signal 11 (SIGSEGV) received by PID 4242")
LOST_PEER = "[rank0]: DistNetworkError: Connection closed by peer\n" + _summary(1, "...")


@pytest.mark.parametrize("output, ours, signal", [
    (PORT_TAKEN, False, False),
    (RENDEZVOUS, False, False),
    (ABORTED, True, True),
    (RAISED, True, False),
    (SEGFAULT, True, True),
    (LOST_PEER, True, False),  # a rank ran: the lost connection is the job's own failure
])
def test_what_runs_again(output, ours, signal):
    assert not_ours(output) is not ours
    # only for the jobs that do not end through gloo_job.exit_now yet
    assert worth_retrying(output) is (not ours or signal)


@pytest.fixture
def one_rank(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_the_group_is_torn_down_at_the_end(one_rank):
    with process_group():
        assert dist.is_initialized() and dist.get_world_size() == 1
    assert not dist.is_initialized()


def test_the_group_is_torn_down_where_the_job_raised(one_rank):
    with pytest.raises(RuntimeError, match="the job's own"):
        with process_group():
            raise RuntimeError("the job's own")
    assert not dist.is_initialized()


def test_the_caller_makes_the_group(one_rank):
    made = []
    with process_group(lambda: made.append(dist.init_process_group("gloo"))):
        assert made and dist.is_initialized()
    assert not dist.is_initialized()


def test_exit_now_flushes_and_skips_the_finalization():
    dsgen = Path(__file__).resolve().parent / "dsgen"
    code = ("import atexit, sys; sys.path.insert(0, sys.argv[1]); from gloo_job import exit_now; "
            "atexit.register(lambda: print('finalized')); print('written', end=''); exit_now(3)")
    proc = subprocess.run([sys.executable, "-c", code, str(dsgen)], capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout) == (3, "written")
