"""The team protocol: the processes that write one output together, and how signals stop them.

Every writer of files (:func:`zerofast.export`, :func:`zerofast.reshard`,
:func:`zerofast.to_universal`) is led by a team: :data:`ALONE`, one process that writes every
file, or a :class:`Team`, the ranks of a torch.distributed job (torchrun, or ``--workers``) that
share the files out. A writer calls it in this order:

0. ``ckpt_dir, tag, follow = team.checkpoint(ckpt_dir, tag, follow_symlinks, out)``: the save as
   this rank reads it: itself, or where the ranks' folders hold different files (rank files on
   the nodes' local disks), a view of it (:mod:`zerofast.load.node_view`) whose missing bytes the
   team moves (:mod:`.node_writes`).
1. ``with team.step("reading the checkpoint", out):`` each rank reads the checkpoint and plans
   every file for itself (metadata only), so no plan is sent between ranks. (Every writer opens
   with steps 0 and 1 through :func:`opening`.)
2. ``with team.output_dir(out, overwrite, ...) as folder:`` the leader opens the output folder's
   transaction (:func:`zerofast.output.transaction.output_dir`: ownership, never over the input,
   lock, temporary folder); the others get the same temporary folder, which they must see.
3. ``mine = team.share(writes, tag, out)``: the ranks compare a fingerprint of their plans (and
   the tag they resolved) and refuse to go on if they differ; each gets a byte-balanced share of
   ``writes`` (items with ``nbytes`` and ``file.name`` / ``file.keys``).
4. ``with team.step("writing the files", out):`` each rank writes its share into the temporary
   folder.
5. ``with team.step("committing", out): if team.leader: ...`` the leader writes what depends on
   every file (indexes, ``latest``) and commits the transaction.
6. ``team.close()`` (:func:`joined` does it): the view of step 0 is removed.

With the save spread over the nodes, the leader writes every file, and ``share`` gives the
others one item whose ``write`` serves the leader's requests for their files' bytes instead. With
``every_node`` (``--output-on-every-node``), each node's first rank opens a transaction of its
own in step 2 and commits its node's files after step 5; ``share`` gives every rank the same
number of rounds, each of which moves the bytes of that round's files before writing them.

Each step ends with an agreement (an all_gather of every rank's outcome): if any rank failed,
every rank raises, so nothing is committed unless every file was written, and the leader's
transaction removes the temporary folder as the error unwinds. An interrupt leaves at once.

:func:`signals_raise` turns SIGTERM into an exception for the duration of a command, so that a
writer stopped by ``kill`` (or by torchrun, once another rank failed) unwinds and removes its
temporary folder the way Ctrl-C does: alone, it raises :class:`Stopped` (a KeyboardInterrupt, exit
code 143 on the command line); in a team it raises an ExportError saying the launcher stopped it.
"""
from __future__ import annotations

import contextlib
import datetime
import hashlib
import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch

from ..base.errors import ExportError, ZeroFastError
from ..discover import locate
from ..load import node_view
from . import node_writes
from .transaction import Folder, local_folder, output_dir
from ..devices import device_of
from ..base.settings import DIST_TIMEOUT_ENV, settings


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def launched() -> bool:
    """Whether a launcher (torchrun, ``--workers``) started this process as one of several ranks."""
    return world_size() > 1


def timeout_s() -> float:
    return settings().dist_timeout_s()


def share(sizes: Sequence[int], ranks: int) -> list[int]:
    """The rank that writes each item: largest first, each to the rank with the fewest bytes so
    far (ties to the lower rank). Every rank computes it alone and gets the same answer; no rank
    ends up more than one item's size above another."""
    loads = [0] * ranks
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        owner = min(range(ranks), key=lambda r: (loads[r], r))
        owners[i] = owner
        loads[owner] += sizes[i]
    return owners


class Alone:
    """The one process of a plain run: it writes every file, and steps need no agreement."""

    leader = True
    failing = False

    def step(self, what: str, where: Path) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def output_dir(self, out: Path, overwrite: bool, **transaction) -> contextlib.AbstractContextManager[Folder]:
        return output_dir(out, overwrite, **transaction)

    def checkpoint(self, ckpt_dir, tag: str | None, follow_symlinks: bool | None, where: Path):
        return ckpt_dir, tag, follow_symlinks

    def share(self, writes: list, tag: str, where: Path) -> list:
        return writes

    def close(self) -> None:
        pass


ALONE = Alone()


@dataclass(frozen=True)
class Opening:
    """What a writer's steps 0 and 1 settle: its team, its local output folder, the save as this
    rank reads it, and when the command started (for the time it reports)."""

    team: Team | Alone
    out: Path
    ckpt_dir: str | os.PathLike
    tag: str | None
    follow_symlinks: bool | None
    started: float


@contextlib.contextmanager
def opening(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, tag: str | None,
            follow_symlinks: bool | None, team: Team | Alone | None) -> Iterator[Opening]:
    """Steps 0 and 1 as every writer opens them (``team`` None: :data:`ALONE`): a remote
    ``out_dir`` refused, the save found for this rank, the body run as "reading the checkpoint"."""
    started = time.monotonic()
    team = team or ALONE
    out = local_folder(out_dir)
    ckpt_dir, tag, follow_symlinks = team.checkpoint(ckpt_dir, tag, follow_symlinks, out)
    with team.step("reading the checkpoint", out):
        yield Opening(team, out, ckpt_dir, tag, follow_symlinks, started)


def _fingerprint(writes: Sequence, tag: str) -> str:
    h = hashlib.sha256(tag.encode())
    for w in writes:
        h.update(repr((w.file.name, w.nbytes, w.file.keys)).encode())
    return h.hexdigest()


def _describe(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text if isinstance(e, ZeroFastError) else f"{type(e).__name__}: {text}"


def _backend_reason(e: BaseException) -> str:
    """What a gloo/NCCL error says, without its source location and its advice to read the logs."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", " ".join(str(e).split()))
    return text.split(". ")[0].rstrip(".")


class Team:
    """The ranks writing one output; what the writers' ``team=`` takes.

    ``gather(obj)`` returns every rank's ``obj`` in rank order (``all_gather_object``), and raises
    RuntimeError when a rank is lost or the timeout passes.
    """

    def __init__(self, rank: int, size: int, gather: Callable[[object], list],
                 wire: Callable[[], node_view.Wire] | None = None, every_node: bool = False):
        self.rank = rank
        self.size = size
        self._gather_objects = gather
        self._wire = wire  # makes the byte transfers between ranks, for a save spread over the nodes
        self.nodes: node_writes.TeamView | None = None  # that save's view, once step 0 found one
        # With such a save: each node writes the files its ranks produced into its own output
        # folder (--output-on-every-node), and which node wrote which file, once shared out.
        self.every_node = every_node
        self._written_on: dict[str, str] = {}
        self.failing = False  # this rank is already on its way out: a SIGTERM must not cut the cleanup

    def checkpoint(self, ckpt_dir, tag: str | None, follow_symlinks: bool | None, where: Path):
        """Step 0: ``(ckpt_dir, tag, follow_symlinks)`` to read: as given where every rank lists the
        same files, else this rank's view of the save the nodes hold between them."""
        with self.step("listing the checkpoint", where):
            found = locate(ckpt_dir, tag, follow_symlinks)
            mine = node_view.listing(found)
        listings = self._gather(mine, "listing the checkpoint", where)
        if node_view.same_files(listings):
            return ckpt_dir, tag, follow_symlinks
        with self.step("comparing the nodes' files", where):
            if self._wire is None:
                raise ExportError("the ranks see different files, and this team cannot move bytes between them", where)
            self.nodes = node_writes.build(found, listings, self.rank, follow_symlinks)
        with self.step("reading the checkpoint from the nodes", where):
            try:
                self.nodes.exchange(self._wire())
            except RuntimeError as e:
                raise self._lost(e, "reading the checkpoint from the nodes", where) from None
        # the view's links lead to this node's own files, checked against the setting above
        return self.nodes.root, self.nodes.tag, True

    def close(self) -> None:
        if self.nodes is not None:
            self.nodes.close()
            self.nodes = None

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def share(self, writes: list, tag: str, where: Path) -> list:
        """This rank's part of ``writes``, once every rank is found to have planned the same output.

        Every rank reads the checkpoint for itself; one that resolved another tag (``latest``
        moved while the job started) or saw other files would write files of another output.
        """
        plans = self._gather(_fingerprint(writes, tag), "comparing the ranks' plans", where)
        odd = [r for r, p in enumerate(plans) if p != plans[0]]
        if odd:
            raise ExportError(f"rank {odd[0]} of {self.size} planned another export than rank 0 (another tag, or "
                              "other files): every rank must see the same checkpoint", where)
        if self.nodes is not None and not self.every_node:
            return self._share_from_nodes(writes, where)
        owners = share([w.nbytes for w in writes], self.size)
        if self.nodes is not None:
            return self._share_on_every_node(writes, owners, where)
        return [w for w, owner in zip(writes, owners) if owner == self.rank]

    def _share_from_nodes(self, writes: list, where: Path) -> list:
        """The leader writes every file, fed by the others: per file where each says what it reads
        (``reads()``), else every byte its stubs lack, moved before any file is written."""
        view = self.nodes
        if all(hasattr(w, "reads") for w in writes):
            if self.leader:
                return [node_writes.Fed(view, i, w) for i, w in enumerate(writes)]
            return [node_writes.Serving(view, writes)]
        with self.step("moving the bytes of the other nodes' files", where):
            needed = view.all_holes(0)
            view.receive(needed) if self.leader else view.send(needed, 0)
        return writes if self.leader else []

    def _share_on_every_node(self, writes: list, owners: list[int], where: Path) -> list:
        """Each rank writes its own share, on its own node: fed round by round where the writes
        say what they read, else after every byte its stubs lack has been moved."""
        view = self.nodes
        self._written_on = {w.file.name: view.nodes[owner] for w, owner in zip(writes, owners)}
        if all(hasattr(w, "reads") for w in writes):
            return node_writes.rounds(view, [[w for w, o in zip(writes, owners) if o == r] for r in range(self.size)])
        with self.step("moving the bytes of the other nodes' files", where):
            view.trade([(r, view.all_holes(r)) for r in range(self.size)])
        return [w for w, owner in zip(writes, owners) if owner == self.rank]

    @contextlib.contextmanager
    def step(self, what: str, where: Path) -> Iterator[None]:
        """Run the body on every rank, then agree: if any rank failed, every rank raises."""
        try:
            yield
            self._end_service(what, where)
        except Exception as e:
            self.failing = True
            with contextlib.suppress(ExportError, RuntimeError):
                self._end_service(what, where)
            if self.nodes is not None and isinstance(e, ZeroFastError):
                e = self.nodes.explain(e)
            with contextlib.suppress(ExportError):  # our own error says more than a lost peer
                self._gather(_describe(e), what, where)
            raise e
        except BaseException:
            # Interrupted or stopped: leave at once; the others see the connection close.
            self.failing = True
            raise
        failed = [(r, m) for r, m in enumerate(self._gather(None, what, where)) if m is not None]
        if failed:
            self.failing = True
            r, message = failed[0]
            more = f" (and {len(failed) - 1} other ranks)" if len(failed) > 1 else ""
            raise ExportError(f"rank {r} of {self.size}{more} failed while {what}: {message}", where)

    def _end_service(self, what: str, where: Path) -> None:
        """The leader lets the others out of their service before a step's agreement."""
        if self.nodes is not None and self.nodes.serving:
            try:
                self.nodes.stop(0)
            except RuntimeError as e:
                raise self._lost(e, what, where) from None

    def _gather(self, mine: object, what: str, where: Path) -> list:
        """Every rank's ``mine``, in rank order."""
        try:
            return self._gather_objects(mine)
        except RuntimeError as e:  # gloo/NCCL errors, timeouts included, derive from it
            raise self._lost(e, what, where) from None

    def _lost(self, e: RuntimeError, what: str, where: Path) -> ExportError:
        self.failing = True
        return ExportError(f"lost contact with the other ranks while {what} (one crashed, was killed, or outlasted "
                           f"the timeout, {DIST_TIMEOUT_ENV}; see its output): {_backend_reason(e)}", where)

    @contextlib.contextmanager
    def output_dir(self, out: Path, overwrite: bool, **transaction) -> Iterator[Folder]:
        """Rank 0's transaction (see :func:`.transaction.output_dir`); the others get its
        temporary folder and take no part in the commit."""
        if self.nodes is not None and self.every_node:
            with self._output_dir_on_every_node(out, overwrite, **transaction) as folder:
                yield folder
            return
        with contextlib.ExitStack() as stack:
            folder = None
            if self.nodes is not None:  # never write over the real save either
                transaction["inputs"] = [*transaction.get("inputs", ()), self.nodes.real_tag_dir]
            with self.step("opening the output folder", out):
                if self.leader:
                    folder = stack.enter_context(output_dir(out, overwrite, **transaction))
            tmp = Path(self._gather(str(folder.tmp) if self.leader else None, "opening the output folder", out)[0])
            with self.step("opening the output folder", out):
                if self.nodes is None and not tmp.is_dir():  # spread over the nodes, the leader writes alone
                    raise ExportError(f"cannot see rank 0's temporary folder {tmp.name} here: every rank must "
                                      "write to the same folder, on a filesystem all the nodes share", out)
            yield folder if folder is not None else Folder.follower(out, tmp)


    @contextlib.contextmanager
    def _output_dir_on_every_node(self, out: Path, overwrite: bool, **transaction) -> Iterator[Folder]:
        """A transaction on each node, opened by its first rank: rank 0's commits the files
        written on node 0 (the writer's commit, less the other nodes' files); the others commit
        their node's files once rank 0 has committed."""
        transaction["inputs"] = [*transaction.get("inputs", ()), self.nodes.real_tag_dir]
        here = self.nodes.nodes[self.rank]
        first = self.nodes.nodes.index(here)
        with contextlib.ExitStack() as stack:
            folder = None
            with self.step("opening the output folder on every node", out):
                if self.rank == first:
                    folder = stack.enter_context(output_dir(out, overwrite, **transaction))
            tmp = Path(self._gather(str(folder.tmp) if folder else None, "opening the output folder", out)[first])
            with self.step("opening the output folder on every node", out):
                if not tmp.is_dir():
                    raise ExportError(f"cannot see the temporary folder {tmp.name} that rank {first} made on this node "
                                      f"({here}): the ranks of a node must see the same output folder", out)
            if folder is None:
                yield Folder.follower(out, tmp)
            else:
                yield node_writes.OnThisNode(folder, lambda: self._written_on_node(here, False))
            with self.step("committing on every node", out):
                if folder is not None and not self.leader:
                    folder.commit(sorted(self._written_on_node(here, True)))

    def _written_on_node(self, node: str, on: bool) -> set[str]:
        """The files written on ``node`` (``on``), or on every other node."""
        return {n for n, where in self._written_on.items() if (where == node) == on}


@contextlib.contextmanager
def joined(device: torch.device, every_node: bool = False) -> Iterator[Team]:
    """A Team of this process's job: the default group if the caller set one up, else one joined
    from the launcher's environment (gloo, or NCCL for a GPU run) and left at the end: where the
    work finished, after a barrier (no rank tears its connections down while a peer is still in a
    collective with it, which has aborted a gloo rank at exit: "terminate called without an active
    exception"); where it raised, at once (a peer may be gone). ``every_node``: see :class:`Team`."""
    import torch.distributed as dist

    if dist.is_initialized():
        with _closing(_team_of_default_group(every_node)) as team:
            yield team
        return
    entry = device_of(device)
    entry.select(device)
    dist.init_process_group(entry.backend, timeout=datetime.timedelta(seconds=timeout_s()))
    finished = False
    try:
        with _closing(_team_of_default_group(every_node)) as team:
            yield team
        finished = True
    finally:
        try:
            if finished:
                _last_barrier(dist)
        finally:
            dist.destroy_process_group()


def _last_barrier(dist) -> None:
    try:
        dist.barrier()
    except RuntimeError as e:
        raise ExportError("this rank finished, but lost contact with the other ranks at the end (one crashed, was "
                          f"killed, or outlasted the timeout, {DIST_TIMEOUT_ENV}; see its output): "
                          f"{_backend_reason(e)}") from None


@contextlib.contextmanager
def _closing(team: Team) -> Iterator[Team]:
    try:
        yield team
    finally:
        team.close()


def _team_of_default_group(every_node: bool) -> Team:
    import torch.distributed as dist

    def gather(obj: object) -> list:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, obj)
        return gathered

    return Team(dist.get_rank(), dist.get_world_size(), gather, node_writes.DistWire, every_node)


# ---------------------------------------------------------------------------------------------
# Signals

class Stopped(KeyboardInterrupt):
    """A signal other than SIGINT stopped the run; unwinding removes the temporary folder as for
    Ctrl-C. ``signum`` says which (the command line exits with 128 + signum)."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


@contextlib.contextmanager
def signals_raise(team: "Team | Alone" = ALONE) -> Iterator[None]:
    """SIGTERM raises instead of killing the process, so the writers unwind and clean up. A team's
    rank raises an ExportError (torchrun stops every rank with SIGTERM once one fails); a rank
    already failing ignores it and finishes its cleanup."""
    def stop(signum, frame):
        if team.failing:
            return
        if isinstance(team, Team):
            team.failing = True
            raise ExportError("stopped by SIGTERM: the launcher stops every rank once one of them fails")
        raise Stopped(signum)

    try:
        previous = signal.signal(signal.SIGTERM, stop)
    except ValueError:  # not the main thread: signals stay as they are
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
