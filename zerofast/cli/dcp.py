"""The ``zerofast to-dcp`` command: a ZeRO checkpoint as a PyTorch Distributed Checkpoint folder.

Kept apart from :mod:`zerofast.cli`, which only registers it (``add_to_dcp``)."""
from __future__ import annotations

import argparse
import time

from .args import dtype_arg

# What inspect's report calls the format; zerofast.layouts.dcp.FORMAT, spelled here too so that
# building the parser imports no torch (tests/test_dcp_in.py checks that they agree).
DCP_FORMAT = "PyTorch DCP"


def add_to_dcp(sub, common) -> None:
    d = sub.add_parser("to-dcp", parents=[common], help="write a PyTorch Distributed Checkpoint (DCP) folder",
                       description="Write the checkpoint as a torch.distributed.checkpoint folder holding "
                                   "{'model': state dict, 'optim': optimizer state} in the layout of "
                                   "get_state_dict(model, optim), so that dcp.load plus set_state_dict resumes "
                                   "an FSDP2 job at any world size.")
    d.add_argument("ckpt", metavar="CKPT", help="checkpoint root (holding 'latest') or a tag folder")
    d.add_argument("out", metavar="OUT", help="the DCP folder")
    d.add_argument("--dtype", type=dtype_arg, default="fp32", metavar="{fp32,bf16,fp16,keep}",
                   help="dtype of floating weights; 'keep' keeps what the checkpoint holds (default: fp32); "
                        "optimizer states stay as stored")
    d.add_argument("--optimizer", action=argparse.BooleanOptionalAction, default=True,
                   help="also write the optimizer state (default: on; stage 0 needs --no-optimizer)")
    d.add_argument("--overwrite", action="store_true", help="write into a non-empty folder zerofast did not write")
    d.set_defaults(run=_to_dcp)


def _to_dcp(args: argparse.Namespace) -> int:
    from ..writers.dcp import to_dcp

    start = time.perf_counter()
    result = to_dcp(args.ckpt, args.out, dtype=args.dtype, optimizer=args.optimizer, tag=args.tag,
                    overwrite=args.overwrite, follow_symlinks=args.follow_symlinks)
    print(f"wrote {len(result.files)} files ({result.nbytes:,} bytes of tensors, {result.tensors} tensors) to "
          f"{result.out_dir} in {time.perf_counter() - start:.2f} s")
    return 0


# ---------------------------------------------------------------------------------------------
# inspect of a DCP folder: the header of the report (the tensor table is the same as for ZeRO)

def dcp_header_lines(r: dict) -> list[str]:
    others = f"{r['other_tensors']} more tensors (optimizer state, ...) and {r['other_items']} other items, not read"
    return [
        f"checkpoint    {r['checkpoint']}",
        f"format        {DCP_FORMAT}, {r['ranks']} ranks, {r['sharding']}",
        f"dcp version   {r['dcp_version'] or 'unknown'}",
        f"also saved    {others}",
        *([f"backend       {r['backend']}", f"layers        {r['layers']}",
           f"optimizer     {r['optimizer_state']}"] if r.get("backend") else []),
        "",
        f"{'tensors':<10}{'count':>8}{'elements':>14}{'stored':>12}   dtypes",
    ]
