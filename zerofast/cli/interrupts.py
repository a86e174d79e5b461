"""How the command line ends on Ctrl-C (or SIGTERM): one line, ``zerofast: interrupted``, and
exit 128 + the signal, whether it comes while the command starts or while it runs."""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Iterator


@contextlib.contextmanager
def ctrl_c_exits(as_program: bool) -> Iterator[None]:
    """While the command starts (its arguments parsed, torch imported: its first seconds), Ctrl-C
    ends the process at once with the line of a later Ctrl-C. Nothing is written yet, and a
    KeyboardInterrupt raised inside torch's import is no help: it can come out as another error
    (numpy's "cannot load module more than once"), be swallowed, or abort the process from C++.
    Only where main() is the program and Ctrl-C has Python's default handler: a caller in the
    same process, or one that set its own handler, keeps KeyboardInterrupt."""
    if not (as_program and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
        yield
        return
    signal.signal(signal.SIGINT, _exit_interrupted)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _exit_interrupted(signum, frame) -> None:
    os.write(2, b"zerofast: interrupted\n")  # no print: it may have been cut short mid-write
    os._exit(128 + signum)


def interrupted(e: KeyboardInterrupt) -> int:
    signum = getattr(e, "signum", signal.SIGINT)
    how = "" if signum == signal.SIGINT else f" ({signal.Signals(signum).name})"
    print(f"zerofast: interrupted{how}", file=sys.stderr)
    return 128 + signum
