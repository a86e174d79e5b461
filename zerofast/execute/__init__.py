"""Step 4: the executor runs plans through the native ops (``zerofast.ops``).

- :mod:`.executor`: one tensor plan into fresh or given memory, on the CPU or a GPU;
- :mod:`.pinned_copy`: GPU results copied back to host memory through pinned buffers.
"""
from .executor import Executor

__all__ = ["Executor"]
