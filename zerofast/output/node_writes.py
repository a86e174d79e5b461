"""The items a team's writers run over a save spread over the nodes (:mod:`.nodes`), and the
wire they talk over. Internal to the team protocol (:mod:`.team`): ``share`` hands them out in
place of the plain writes.

- :class:`Fed` and :class:`Serving`: node 0 writes every file; the others serve its requests.
- :func:`rounds`: every node writes its own share (``--output-on-every-node``), round by round.
- :class:`OnThisNode`: rank 0's folder then, which commits only the files written on node 0.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

import torch

from .nodes import NodeFiles, Ranges
from .transaction import Folder


class DistWire:
    """torch.distributed's transfers of host bytes: over the default group where it is gloo, else
    over a gloo group made for them (NCCL moves only GPU tensors). Made on every rank at once."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self._dist = dist
        self._group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self._dist.broadcast(tensor, src, group=self._group)

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self._dist.send(tensor, dst, group=self._group)

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        self._dist.recv(tensor, src, group=self._group)


class Fed:
    """The leader's write of a file whose bytes partly lie on other nodes: they are asked for
    them first, and they are given back (punched out of the stubs) once the file is written."""

    def __init__(self, view: NodeFiles, index: int, write) -> None:
        self.view, self.index, self.inner = view, index, write
        self.file, self.nbytes = write.file, write.nbytes

    def write(self, tmp: Path, advance: Callable[[int], None]) -> None:
        needed = self.view.needed(self.inner.reads(), 0)
        try:
            if needed:
                self.view.request(self.index, needed)
            self.inner.write(tmp, advance)
        finally:
            self.view.punch(needed)


class Serving:
    """Another rank's share: send the leader the bytes of each file it asks for, until it stops."""

    nbytes = 0

    def __init__(self, view: NodeFiles, writes: list) -> None:
        self.view, self.writes = view, writes

    def write(self, tmp: Path, advance: Callable[[int], None]) -> None:
        self.view.serve(0, lambda i: self.view.needed(self.writes[i].reads(), 0))


def rounds(view: NodeFiles, by_rank: Sequence[list]) -> list:
    """This rank's items when every rank writes ``by_rank[rank]``: one :class:`Round` per file of
    the rank with the most, so that every rank takes part in every round's transfers."""
    count = max((len(w) for w in by_rank), default=0)
    state: dict[str, BaseException] = {}
    return [Round(view, i, by_rank, state, last=i == count - 1) for i in range(count)]


class Round:
    """Round ``index``: the bytes of each rank's ``index``-th file move to that rank (writer by
    writer, in rank order), then this rank writes its own file and punches its bytes out again.
    A rank whose write failed goes on trading in the later rounds, and raises in the last one."""

    def __init__(self, view: NodeFiles, index: int, by_rank: Sequence[list], state: dict, last: bool) -> None:
        self.view, self.index, self.by_rank, self.state, self.last = view, index, by_rank, state, last
        mine = by_rank[view.me]
        self.inner = mine[index] if index < len(mine) else None
        self.nbytes = self.inner.nbytes if self.inner is not None else 0

    def write(self, tmp: Path, advance: Callable[[int], None]) -> None:
        needs = [(r, self.view.needed(files[self.index].reads(), r))
                 for r, files in enumerate(self.by_rank) if self.index < len(files)]
        got: Ranges = {}
        try:
            got = self.view.trade(needs)
            if self.inner is not None and not self.state:
                self.inner.write(tmp, advance)
        except Exception as e:  # raised in the last round, once no other rank waits on this one
            self.state.setdefault("failed", e)
        finally:
            self.view.punch(got)
        if self.last and self.state:
            raise self.state["failed"]


class OnThisNode:
    """Rank 0's output folder when every node writes its own files: the writer's commit names
    every file, of which this node's folder holds only those written here."""

    def __init__(self, folder: Folder, elsewhere: Callable[[], set[str]]) -> None:
        self.folder, self.elsewhere = folder, elsewhere

    def __getattr__(self, name: str):
        return getattr(self.folder, name)

    def commit(self, names: Sequence[str], **options) -> None:
        away = self.elsewhere()
        self.folder.commit([n for n in names if n not in away], **options)
