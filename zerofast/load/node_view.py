"""Rank files on the nodes' local disks: a view of a checkpoint that no one node holds.

DeepSpeed's ``use_node_local_storage``, and any cluster without a shared filesystem, leaves each
node with only its own ranks' files. The ranks of a job list their folders (:func:`listing`) and
compare the lists; where they differ, each rank builds a *view* of the save (:func:`build`): a
temporary tag folder holding a link to each file it has, and for each file only other nodes have,
a sparse *stub* of the same size. A stub holds that file's zip directory, pickle and small
storages, sent once by the file's *holder* (the lowest rank that has it, :meth:`NodeView.exchange`),
and holes where its large storages are (:mod:`.node_bytes`: the stubs' bytes and ranges). Every
rank then reads and plans its view as it would a folder on one machine: the same offsets, the same
plan. :meth:`NodeView.needed` says which bytes of the holes a read needs, :meth:`NodeView.fill`
writes them in and :meth:`NodeView.punch` takes them out again.

Reading only: which rank writes which output file, and the transfers that fill a writer's stubs
before each file (so that the stubs never hold more than one output file's sources), are the team
protocol's (:mod:`zerofast.output.node_writes`, :mod:`zerofast.output.team`).

What crosses the network: each file's skeleton, once to every rank that lacks the file; then, for
each output file, the stored bytes of its pieces that lie in files the writer's node lacks (for an
export, the fp32 masters and nothing of the moments: about 4 bytes per parameter not on node 0).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import socket
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

import torch

from ..base.errors import ExportError, IncompleteCheckpointError, ZeroFastError, few
from ..discover import OPTIM, ZERO3_MODEL, Found, check_all_inside
from . import node_bytes

Ranges = dict[str, list[tuple[int, int]]]  # file name -> sorted, disjoint (byte offset, length)


class Wire(Protocol):
    """The process group's byte transfers (torch.distributed's, or a test's)."""

    def broadcast(self, tensor: torch.Tensor, src: int) -> None: ...

    def send(self, tensor: torch.Tensor, dst: int) -> None: ...

    def recv(self, tensor: torch.Tensor, src: int) -> None: ...


def node_name() -> str:
    """How errors name this rank's node: torchrun's node rank, else the host name."""
    group = os.environ.get("GROUP_RANK")
    return f"node {group}" if group is not None else socket.gethostname()


def listing(found: Found) -> dict:
    """What this rank's folder holds of the save: the tag, and each regular file's size."""
    files = {}
    for name in found.names:
        with contextlib.suppress(OSError):
            st = os.stat(found.tag_dir / name)
            if stat.S_ISREG(st.st_mode):
                files[name] = st.st_size
    return {"node": node_name(), "tag": found.tag, "files": files}


def same_files(listings: Sequence[dict]) -> bool:
    """Whether every rank sees the same save (a shared filesystem, or full copies)."""
    return all((l["tag"], l["files"]) == (listings[0]["tag"], listings[0]["files"]) for l in listings)


# ---------------------------------------------------------------------------------------------
# The view

@dataclass
class NodeView:
    """This rank's view of a save spread over the nodes.

    ``have[r]``: the names rank ``r`` holds; ``holder[name]``: the rank that sends ``name``'s
    bytes; ``holes[name]``: the byte ranges a stub of ``name`` leaves out (every rank knows them,
    so holder and writer cut the same pieces without asking each other)."""

    root: Path  # the temporary folder: the save's root as this rank sees it
    tag: str
    real_tag_dir: Path
    me: int
    have: list[frozenset[str]]
    nodes: list[str]
    holder: dict[str, int]
    holes: dict[str, list[tuple[int, int]]]
    wire: Wire | None = None
    outgoing: bytes = b""  # the skeletons this rank sends (build), until exchange sends them

    @property
    def tag_dir(self) -> Path:
        return self.root / self.tag

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def lacked(self) -> list[str]:
        """The files some rank does not have."""
        return sorted(n for n in self.holder if any(n not in names for names in self.have))

    def exchange(self, wire: Wire) -> None:
        """Every rank at once: each holder broadcasts its skeletons; the ranks lacking a file write
        its stub. A stub that cannot be written still takes the rest off the wire."""
        self.wire = wire
        failed: OSError | None = None
        for rank in sorted({self.holder[n] for n in self.lacked()}):
            data = _broadcast_bytes(wire, self.outgoing if rank == self.me else None, rank)
            for name, size, file_holes, kept, body in node_bytes.parse_skeletons(data):
                self.holes[name] = file_holes
                if name not in self.have[self.me] and failed is None:
                    try:
                        node_bytes.write_stub(self.tag_dir / name, size, kept, body)
                    except OSError as e:
                        failed = e
        self.outgoing = b""
        if failed is not None:
            raise ExportError(f"cannot write the view of another node's files in {self.root}: {failed}",
                              self.real_tag_dir)

    # -- which bytes of the holes a read needs ----------------------------------------------

    def needed(self, reads: dict[str, list[tuple[int, int]]], writer: int) -> Ranges:
        """The bytes of ``reads`` (file path -> ranges, as this rank's view names them) that lie in
        the holes of ``writer``'s stubs, by file name."""
        out: Ranges = {}
        for path, ranges in reads.items():
            name = node_bytes.name_in(self.tag_dir, path)
            if name is None or name in self.have[writer] or not self.holes.get(name):
                continue
            cut = node_bytes.intersect(node_bytes.merged(ranges), self.holes[name])
            if cut:
                out[name] = cut
        return out

    def all_holes(self, writer: int) -> Ranges:
        """Every hole of ``writer``'s stubs: what a writer that cannot say what it reads needs."""
        return {n: list(h) for n, h in self.holes.items() if h and n not in self.have[writer]}

    # -- filling and emptying the stubs' holes -------------------------------------------

    def fill(self, chunk: Sequence[tuple[str, int, int]], data: memoryview) -> None:
        """Write ``data``, the bytes of ``chunk``'s ``(name, offset, length)`` pieces back to back,
        into the holes of this rank's stubs."""
        at = 0
        for name, group in node_bytes.by_name(chunk):
            path = self.tag_dir / name
            with node_bytes.keeping_identity(path), open(path, "r+b") as f:
                for offset, length in group:
                    os.pwrite(f.fileno(), data[at:at + length], offset)
                    at += length

    def punch(self, needed: Ranges) -> None:
        """Give the bytes of ``needed`` back: the stubs hold one output file's sources at most."""
        for name, ranges in needed.items():
            path = self.tag_dir / name
            with node_bytes.keeping_identity(path), open(path, "r+b") as f:
                for offset, length in ranges:
                    node_bytes.punch_hole(f.fileno(), offset, length)

    # -- errors -------------------------------------------------------------------------------

    def who_holds(self) -> str:
        """Which ranks' files each node holds, for an error about a missing one."""
        by_node: dict[str, set[int]] = {}
        for node, names in zip(self.nodes, self.have):
            by_node.setdefault(node, set()).update(_ranks_named(names))
        return "; ".join(f"{node} holds {_rank_list(ranks)}" for node, ranks in by_node.items())

    def explain(self, e: ZeroFastError) -> ZeroFastError:
        """``e`` in the user's terms: the real folder for the view's, and, for a missing file,
        which ranks' files each node was found to hold."""
        text = str(e).replace(str(self.tag_dir), str(self.real_tag_dir))
        text = text.replace(str(self.root), str(self.real_tag_dir.parent))
        if isinstance(e, IncompleteCheckpointError):
            text += f" (no node holds it: {self.who_holds()})"
        try:
            return type(e)(text)
        except TypeError:  # a class with arguments of its own keeps its words
            return e


def build(found: Found, listings: Sequence[dict], me: int, follow_symlinks: bool | None,
          kind: type[NodeView] = NodeView) -> NodeView:
    """This rank's view of a save whose files the ranks' listings spread over the nodes, before
    the skeletons arrive (:meth:`NodeView.exchange`): the checks, the links to its own files,
    and the skeletons it is to send. Reads only this node's files. ``kind``: the class made, a
    :class:`NodeView` or one that adds to it (the team's, with the transfers of its writes)."""
    tags = sorted({l["tag"] for l in listings})
    if len(tags) > 1:
        raise ExportError(f"the nodes' folders name different tags ({few(tags)}): every node must hold the same "
                          "save ('latest' moved while the job started?)", found.root)
    have = [frozenset(l["files"]) for l in listings]
    holder = {n: min(r for r, names in enumerate(have) if n in names) for n in set().union(*have)}
    _check_sizes(listings, found.tag_dir)
    check_all_inside(found.root, [found.tag_dir / n for n in sorted(have[me])], follow_symlinks)
    root = Path(tempfile.mkdtemp(prefix="zerofast-nodes-"))
    try:
        view = kind(root, found.tag, Path(os.path.abspath(found.tag_dir)), me, have,
                         [l["node"] for l in listings], holder, {})
        _link_root_files(Path(os.path.abspath(found.root)), root, found.tag)
        view.tag_dir.mkdir(parents=True)
        for name in sorted(have[me]):
            os.symlink(view.real_tag_dir / name, view.tag_dir / name)
        view.outgoing = node_bytes.skeletons(view.real_tag_dir, [n for n in view.lacked() if holder[n] == me])
        return view
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise


def _check_sizes(listings: Sequence[dict], where: Path) -> None:
    seen: dict[str, tuple[int, str]] = {}
    for l in listings:
        for name, size in l["files"].items():
            first = seen.setdefault(name, (size, l["node"]))
            if first[0] != size:
                raise ExportError(f"{name} is {first[0]} bytes on {first[1]} but {size} on {l['node']}: the nodes "
                                  "hold different saves under one name", where)


def _link_root_files(real_root: Path, root: Path, tag: str) -> None:
    """The files beside the tag folder (``latest``, a Trainer's config and tokenizer files)."""
    with contextlib.suppress(OSError), os.scandir(real_root) as entries:
        for e in entries:
            if e.name != tag.split("/")[0] and e.is_file():
                os.symlink(real_root / e.name, root / e.name)


def _broadcast_bytes(wire: Wire, payload: bytes | None, src: int) -> bytes:
    size = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64)
    wire.broadcast(size, src)
    buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload \
        else torch.empty(int(size[0]), dtype=torch.uint8)
    if len(buf):
        wire.broadcast(buf, src)
    return buf.numpy().tobytes()


def _ranks_named(names) -> set[int]:
    ranks = set()
    for name in names:
        m = OPTIM.match(name) or ZERO3_MODEL.match(name)
        if m:
            ranks.add(int(m.groups()[-1]))
    return ranks


def _rank_list(ranks: set[int]) -> str:
    if not ranks:
        return "no rank files"
    spans, ordered = [], sorted(ranks)
    start = prev = ordered[0]
    for r in ordered[1:] + [None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        spans.append(f"{start}" if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(spans)}"

