"""``zerofast build`` and ``zerofast doctor``: the command line's doors to the native core."""
from __future__ import annotations

import argparse


def add_native_commands(sub) -> None:
    b = sub.add_parser("build", help="build the native core for the installed torch now (else its first use does)",
                       description="Compile the native core against the installed torch into the cache (see "
                                   "`zerofast doctor`), showing each step, unless it is built already; an earlier "
                                   "failed build is retried.")
    b.add_argument("--force", action="store_true", help="rebuild it even if it is built")
    b.add_argument("--debug", action="store_true", help="show the traceback of an error")
    b.set_defaults(run=_build)
    d = sub.add_parser("doctor", help="what --version says, with the native core loaded (built if need be), the "
                                      "toolchain and the GPUs",
                       description="Print the versions, then load the native core (building it if need be) and say "
                                   "where it is and what it was built for, or why the pure-torch reference runs "
                                   "instead; then the threads, the cache, the compiler, ninja, nvcc and the GPUs.")
    d.add_argument("--debug", action="store_true", help="show the traceback of an error")
    d.set_defaults(run=_doctor)


def _build(args: argparse.Namespace) -> int:
    from ..native import loader, proof

    loaded = loader.build(force=args.force)
    print(f"native core for torch {loaded.manifest.get('torch')} ({', '.join(proof.kernel_devices())}): "
          f"{loaded.path}")
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from .. import __version__
    from ..native.report import doctor_lines

    print("\n".join(doctor_lines(__version__)))
    return 0
