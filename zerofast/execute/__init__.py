"""Step 4: the executor runs plans through the native ops (``zerofast.native.ops``).

- :mod:`.executor`: a plan's tensors into fresh or given memory, by the one path its device's
  :mod:`zerofast.devices` entry gives it (the batched reader, the upload ring, or the mapped gather);
- :mod:`.read_batch`: whole passes as one native call that preads the checkpoint files;
- :mod:`.ring`: passes onto a device through pinned slots, cut from the plan's columns;
- :mod:`.download`: results made on a device back into host memory, on the same device protocol.
"""
from .executor import Executor, view_ranges

__all__ = ["Executor", "view_ranges"]
