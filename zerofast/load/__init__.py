"""Step 2: read checkpoint files without running code and without importing DeepSpeed.

- :mod:`.archive`: the zip directory of a ``torch.save`` file, checked;
- :mod:`.pickle_bounds`, :mod:`.unpickle`: the restricted C unpickler (allowlisted globals,
  bounded opcodes and storages);
- :mod:`.stand_ins`: inert stand-ins for the DeepSpeed classes the pickles name;
- :mod:`.reader`: which unpickler reads a rank file, the native one (csrc/load/) or :mod:`.unpickle`;
- :mod:`.parallel`: many rank files read at once, on a small pool of threads;
- :mod:`.rank_states`: ZeRO-3's per-rank model-states files, each repeated pickle read once;
- :mod:`.records`: typed views of the model-states and optimizer files, and the checks every
  layout shares (stage, world size, flat groups); :mod:`.bulk_checks`: the same checks over a
  whole collection at once;
- :mod:`.checkpoint`: the loaded checkpoint records a layout returns;
- :mod:`.residency`: how much of a batch's sources the page cache holds (the batched reader's
  thread count follows it);
- :mod:`.dcp`, :mod:`.dcp_stand_ins`: a PyTorch Distributed Checkpoint folder (``.metadata``
  and its chunk files), read as safely as a rank file;
- :mod:`.node_view` (with :mod:`.node_bytes`, its files' bytes): a save whose rank files lie on
  different nodes' disks, seen by each rank as one folder of links to its own files and sparse
  stubs of the others' (what the team moves into the stubs is :mod:`zerofast.output`'s).

Which files a DeepSpeed save has and how they fit together is each layout's business
(:mod:`zerofast.layouts`): the DeepSpeed readers here know files, not kinds of save. DCP is
the exception: its own format rather than a kind of ZeRO save, it is read whole by :mod:`.dcp`,
which :mod:`zerofast.layouts.dcp` wraps.
"""
from .checkpoint import LoadedCheckpoint, PartitionedCheckpoint, Partition, Stored
from .reader import load_files
from .records import ModelStates, OptimStates, load_file

__all__ = ["LoadedCheckpoint", "PartitionedCheckpoint", "Partition", "Stored", "ModelStates", "OptimStates",
           "load_file", "load_files"]
