"""Step 4: the executor runs plans through the native ops (``zerofast.native.ops``).

- :mod:`.executor`: one tensor plan into fresh or given memory, on the CPU or a GPU (whose
  results come back through its :mod:`zerofast.devices` entry);
- :mod:`.read_batch`: whole passes as one native call that preads the checkpoint files.
"""
from .executor import Executor, view_ranges

__all__ = ["Executor", "view_ranges"]
