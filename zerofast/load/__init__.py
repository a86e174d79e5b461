"""Step 2: read checkpoint files without running code and without importing DeepSpeed.

- :mod:`.archive`: the zip directory of a ``torch.save`` file, checked;
- :mod:`.pickle_bounds`, :mod:`.unpickle`: the restricted C unpickler (allowlisted globals,
  bounded opcodes and storages);
- :mod:`.stand_ins`: inert stand-ins for the DeepSpeed classes the pickles name;
- :mod:`.records`: typed views of the model-states and optimizer files, and the checks every
  layout shares (stage, world size, flat groups);
- :mod:`.checkpoint`: the loaded checkpoint records a layout returns.

Which files a save has and how they fit together is each layout's business
(:mod:`zerofast.layouts`); nothing here knows the kinds of save.
"""
from .checkpoint import LoadedCheckpoint, PartitionedCheckpoint, Partition, Stored
from .reader import load_files
from .records import ModelStates, OptimStates, load_file

__all__ = ["LoadedCheckpoint", "PartitionedCheckpoint", "Partition", "Stored", "ModelStates", "OptimStates",
           "load_file", "load_files"]
