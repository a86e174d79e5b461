""":func:`shared_export`: :func:`zerofast.export` written by several processes, the ranks of a
torch.distributed job or local workers (``--workers``).

Every rank reads the checkpoint's metadata and computes the same layout (a pure function of the
checkpoint and the options), so the ranks need not send each other any plan. Rank 0 opens the
output folder as a plain export does; each rank writes the data files a deterministic
byte-balanced assignment gives it into that temporary folder; rank 0 then writes the indexes and
commits. The steps and their agreements are the team protocol's (:mod:`zerofast.output.team`).

The output folder must be one folder that every rank sees (a shared filesystem across nodes).
"""
from __future__ import annotations

import os

import torch

from ..devices import device_of
from ..base.errors import ExportError
from ..native.ops import resolve_device
from ..output.team import joined, signals_raise
from . import run
from .run import ExportResult


def _local_device(device: str | torch.device) -> torch.device:
    """``cuda`` without an index means this rank's own GPU, as torchrun numbers them."""
    entry = device_of(device)
    device = torch.device(device)
    if entry.host or device.index is not None:
        return device
    local = int(os.environ.get("LOCAL_RANK", "0"))
    visible = entry.count()
    if 0 < visible <= local:  # with none at all, resolve_device says so
        # NCCL refuses two ranks on one GPU, so a rank without a GPU of its own cannot share one.
        raise ExportError(f"device={device.type!r}: this rank (LOCAL_RANK {local}) has no GPU of its own, {visible} "
                          "visible; start at most one rank per GPU on each node")
    return torch.device(device.type, local)


def shared_export(ckpt_dir, out_dir, *, device: str | torch.device = "cpu", output_on_every_node: bool = False,
                  **options) -> ExportResult:
    """:func:`zerofast.export` shared among the ranks of a torch.distributed job; call it on every rank.

    Takes the same arguments and returns the same :class:`~zerofast.ExportResult` on every rank. It
    joins the job from torchrun's environment unless the default process group already exists.
    ``device="cuda"`` gives each rank the GPU of its ``LOCAL_RANK``. ``output_on_every_node``: where
    the rank files lie on the nodes' local disks, each node writes the files its ranks produced
    into ``out_dir`` on its own disk (node 0 also the index and the other files), instead of
    node 0 writing them all; elsewhere it changes nothing.
    """
    device = resolve_device(_local_device(device))  # before NCCL needs the GPU
    with joined(device, output_on_every_node) as team, signals_raise(team):
        return run.export(ckpt_dir, out_dir, device=device, team=team, **options)
