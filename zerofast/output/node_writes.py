"""The team's side of a save spread over the nodes (:mod:`zerofast.load.node_view`, the view
every rank reads): the transfers that fill a writer's stubs before each file, the items the
team's writers run over the view, and the wire they talk over. Internal to the team protocol
(:mod:`.team`): ``share`` hands the items out in place of the plain writes.

- :class:`TeamView`: a view with the team's transfers: what a writer's stubs lack, sent by the
  files' holders, and the writer's service that asks for it file by file.
- :class:`Fed` and :class:`Serving`: node 0 writes every file; the others serve its requests.
- :func:`rounds`: every node writes its own share (``--output-on-every-node``), round by round.
- :class:`OnThisNode`: rank 0's folder then, which commits only the files written on node 0.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from ..base.errors import ExportError
from ..discover import Found
from ..load import node_bytes, node_view
from ..load.node_view import NodeView, Ranges
from .transaction import Folder

STOP = -1  # the request that ends a holder's service


@dataclass
class TeamView(NodeView):
    """This rank's view of a save spread over the nodes, and the transfers that fill its stubs
    for each output file (the view's ``wire``, set once the skeletons are exchanged)."""

    serving: bool = False  # the writer's side of a service is open: the holders wait for requests

    def send(self, needed: Ranges, writer: int) -> None:
        """This rank's part of ``needed``: the pieces of the files it holds, chunk by chunk. A
        piece it cannot read goes as zeros, so that the writer is not left waiting; the error is
        raised once everything is sent (the step then fails, and nothing is committed)."""
        failed: ExportError | None = None
        for chunk in node_bytes.chunks(self._pieces(needed, self.me)):
            buf = torch.zeros(sum(n for _, _, n in chunk), dtype=torch.uint8)
            view, at = memoryview(buf.numpy()), 0
            for name, pieces in node_bytes.by_name(chunk):
                length = sum(n for _, n in pieces)
                if failed is None:
                    try:
                        node_bytes.read_pieces(self.real_tag_dir / name, pieces, view[at:at + length])
                    except (OSError, ExportError) as e:
                        failed = e if isinstance(e, ExportError) else ExportError(
                            f"cannot read it for another node: {e}", self.real_tag_dir / name)
                at += length
            self.wire.send(buf, writer)
        if failed is not None:
            raise failed

    def receive(self, needed: Ranges) -> None:
        """Fill this rank's stubs with ``needed``, from each holder in turn. A failure to write
        still takes every chunk off the wire, so that no holder is left blocked in a send."""
        failed: BaseException | None = None
        for holder in sorted({self.holder[n] for n in needed}):
            for chunk in node_bytes.chunks(self._pieces(needed, holder)):
                buf = torch.empty(sum(n for _, _, n in chunk), dtype=torch.uint8)
                self.wire.recv(buf, holder)
                if failed is None:
                    try:
                        self.fill(chunk, memoryview(buf.numpy()))
                    except OSError as e:
                        failed = e
        if failed is not None:
            raise ExportError(f"cannot write the bytes of another node's files into {self.root}: {failed}",
                              self.real_tag_dir)

    def trade(self, needs: Sequence[tuple[int, Ranges]]) -> Ranges:
        """Every rank at once, writer by writer in the order given: the writer receives its
        ``needed``, the holders send theirs. Returns what this rank received, to punch once it is
        written. A failure is raised after the last writer, so that no rank is left waiting."""
        got: Ranges = {}
        failed: ExportError | None = None
        for writer, needed in needs:
            try:
                if writer == self.me:
                    got = needed
                    self.receive(needed)
                elif any(self.holder[n] == self.me for n in needed):
                    self.send(needed, writer)
            except ExportError as e:
                failed = failed or e
        if failed is not None:
            raise failed
        return got

    def _pieces(self, needed: Ranges, holder: int) -> list[tuple[str, int, int]]:
        return [(n, o, l) for n in sorted(needed) if self.holder[n] == holder for o, l in needed[n]]

    # -- the writer's service ---------------------------------------------------------------

    def request(self, index: int, needed: Ranges) -> None:
        """The writer asks each holder with pieces of ``needed`` for them, as write ``index``."""
        self.serving = True
        for holder in sorted({self.holder[n] for n in needed}):
            self.wire.send(torch.tensor([index], dtype=torch.int64), holder)
        self.receive(needed)

    def stop(self, writer: int) -> None:
        """The writer ends the service: every other rank leaves :meth:`serve`."""
        if self.me == writer and self.serving:
            self.serving = False
            for rank in range(len(self.have)):
                if rank != writer:
                    self.wire.send(torch.tensor([STOP], dtype=torch.int64), rank)

    def serve(self, writer: int, needed_for: Callable[[int], Ranges]) -> None:
        """A holder's side: answer the writer's requests (a write's index) until it stops; a
        failure is raised then, not before, since the writer goes on asking."""
        request = torch.empty(1, dtype=torch.int64)
        failed: ExportError | None = None
        while True:
            self.wire.recv(request, writer)
            index = int(request[0])
            if index == STOP:
                break
            try:
                self.send(needed_for(index), writer)
            except ExportError as e:
                failed = failed or e
        if failed is not None:
            raise failed


def build(found: Found, listings: Sequence[dict], me: int, follow_symlinks: bool | None) -> TeamView:
    """This rank's :class:`TeamView` of the save the ranks' listings spread over the nodes
    (:func:`zerofast.load.node_view.build`)."""
    return node_view.build(found, listings, me, follow_symlinks, kind=TeamView)


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

    def __init__(self, view: TeamView, index: int, write) -> None:
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

    def __init__(self, view: TeamView, writes: list) -> None:
        self.view, self.writes = view, writes

    def write(self, tmp: Path, advance: Callable[[int], None]) -> None:
        self.view.serve(0, lambda i: self.view.needed(self.writes[i].reads(), 0))


def rounds(view: TeamView, by_rank: Sequence[list]) -> list:
    """This rank's items when every rank writes ``by_rank[rank]``: one :class:`Round` per file of
    the rank with the most, so that every rank takes part in every round's transfers."""
    count = max((len(w) for w in by_rank), default=0)
    state: dict[str, BaseException] = {}
    return [Round(view, i, by_rank, state, last=i == count - 1) for i in range(count)]


class Round:
    """Round ``index``: the bytes of each rank's ``index``-th file move to that rank (writer by
    writer, in rank order), then this rank writes its own file and punches its bytes out again.
    A rank whose write failed goes on trading in the later rounds, and raises in the last one."""

    def __init__(self, view: TeamView, index: int, by_rank: Sequence[list], state: dict, last: bool) -> None:
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
