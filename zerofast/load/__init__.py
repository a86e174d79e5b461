"""Step 2: read checkpoint files without running code and without importing DeepSpeed.

- :mod:`.archive`: the zip directory of a ``torch.save`` file, checked;
- :mod:`.unpickle`: the restricted C unpickler (allowlisted globals, bounded storages);
- :mod:`.stand_ins`: inert stand-ins for the DeepSpeed classes the pickles name;
- :mod:`.checkpoint`: typed views of the model-states and optimizer files, stage and world size.
"""
from .checkpoint import LoadedCheckpoint, ModelStates, OptimStates, UniversalState, load_checkpoint, load_file

__all__ = ["LoadedCheckpoint", "ModelStates", "OptimStates", "UniversalState", "load_checkpoint", "load_file"]
