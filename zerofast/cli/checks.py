"""The ``zerofast verify`` and ``zerofast diff`` commands, added to the ``zerofast`` parser by
:mod:`zerofast.cli`. Each prints one line per finding (or change) and a summary, or ``--json``;
``verify`` exits 1 unless the report is clean; ``diff`` exits 0 whatever it finds, or with
``--exit-code`` 1 when A and B differ, as ``git diff --exit-code`` does."""
from __future__ import annotations

import argparse
import json


def add_verify_commands(sub, common) -> None:
    """``verify`` and ``diff`` on the ``zerofast`` command's subparsers (``common``: --tag, --follow-symlinks, --debug)."""
    v = sub.add_parser("verify", parents=[common], help="check a checkpoint, or an output against its source",
                       description="Check a checkpoint without converting it, or with --against an export, reshard "
                                   "or universal folder against the checkpoint it came from. One line per finding, "
                                   "then a summary; exit 0 when clean, 1 otherwise.")
    v.add_argument("path", metavar="PATH", help="a checkpoint (root or tag folder), or an output folder")
    v.add_argument("--against", metavar="CKPT", help="the checkpoint PATH was written from")
    v.add_argument("--strict", action="store_true", help="NaN/Inf in masters or moments are failures, not notes")
    v.add_argument("--base-model", metavar="DIR", help="the base model folder of a --merge-adapters export")
    v.add_argument("--base-dtype", choices=("as-stored", "as-trained"), default=None,
                   help="the base a --merge-adapters export was merged onto (its own --base-dtype; default as-stored)")
    v.add_argument("--json", action="store_true", help="print the report as JSON")
    v.set_defaults(run=_verify)
    d = sub.add_parser("diff", parents=[common], help="compare two checkpoints or exports, tensor by tensor",
                       description="List tensors only in A or only in B, dtype and shape changes, and for changed "
                                   "tensors the max abs and relative difference and the fraction of elements "
                                   "changed, largest change first. --tag applies to both sides. Exit 0, or with "
                                   "--exit-code 1 when they differ; 1 on an error either way.")
    d.add_argument("a", metavar="A", help="a checkpoint (root or tag folder) or an export folder")
    d.add_argument("b", metavar="B", help="another one")
    d.add_argument("--optimizer", action="store_true", help="compare the per-element optimizer states too")
    d.add_argument("--json", action="store_true", help="print the result as JSON")
    d.add_argument("--exit-code", action="store_true",
                   help="exit 1 when A and B differ (as git diff --exit-code), 0 when they are identical")
    d.set_defaults(run=_diff)


def _verify(args: argparse.Namespace) -> int:
    from ..checks import verify

    report = verify(args.path, args.against, tag=args.tag, strict=args.strict, base_model=args.base_model,
                    follow_symlinks=args.follow_symlinks, base_dtype=args.base_dtype)
    print(json.dumps(report.to_dict(), indent=2) if args.json else "\n".join(report.lines()))
    return 0 if report.ok else 1


def _diff(args: argparse.Namespace) -> int:
    from ..checks import diff

    result = diff(args.a, args.b, optimizer=args.optimizer, tag_a=args.tag, tag_b=args.tag,
                  follow_symlinks=args.follow_symlinks)
    print(json.dumps(result.to_dict(), indent=2) if args.json else "\n".join(result.lines()))
    return 1 if args.exit_code and not result.identical else 0
