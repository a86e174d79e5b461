"""A rank that fails halfway through its share of an export, for tests/test_distributed.py.

``python -m tests.dist_fault MODE ARGS...`` runs ``zerofast ARGS...`` with rank 1 failing as it
starts its second file: MODE ``raise`` raises an exception, ``exit`` ends the process on the
spot (as a crash or a kill would, with no cleanup). Run as a ``sitecustomize`` module with
``ZEROFAST_TEST_FAULT=MODE`` set, :func:`install` does the same to every Python process started
with it on the path, the ranks ``zerofast export --workers`` launches included.
"""
from __future__ import annotations

import os
import sys

FAULT_ENV = "ZEROFAST_TEST_FAULT"


def install(mode: str) -> None:
    from zerofast.hf import run as write_shards

    original = write_shards._Write.write
    started = 0

    def write(self, tmp, advance):
        nonlocal started
        started += 1
        if os.environ.get("RANK") == "1" and started == 2:
            if mode == "exit":
                os._exit(7)
            raise RuntimeError("injected failure in rank 1")
        original(self, tmp, advance)

    write_shards._Write.write = write


if __name__ == "__main__":
    from zerofast.cli import main

    install(sys.argv[1])
    raise SystemExit(main(sys.argv[2:]))
elif os.environ.get(FAULT_ENV):
    install(os.environ[FAULT_ENV])
