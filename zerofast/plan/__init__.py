"""Step 3: the plan, a plain-data description of every output tensor, and its builders.

- :mod:`.model`: ``Plan``, ``TensorPlan``, ``SourceTable``, ``VirtualBuffer``;
- :mod:`.build`: the state dict's plan: shared classification of the module and the dtype policy;
- :mod:`.layouts`: one builder per checkpoint layout;
- :mod:`.optimizer`: the optimizer states' plan, by the same layout builders;
- :mod:`.keys`: the names DeepSpeed gives its checkpoint entries.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .model import BUFFER, FROZEN, TRAINABLE, Plan, SourceTable, TensorPlan, VirtualBuffer

if TYPE_CHECKING:
    from .build import build_plan, out_dtype_for
    from .optimizer import build_optimizer_plan

# The builders import the loader, whose modules import ``plan.keys``: loading them on first use
# lets ``zerofast.load`` and ``zerofast.plan`` be imported in either order (the package's own
# ``__init__`` no longer imports everything up front in one order that happened to work).
_LAZY = {"build_plan": ".build", "out_dtype_for": ".build", "build_optimizer_plan": ".optimizer"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name], __name__), name)


__all__ = ["build_plan", "build_optimizer_plan", "out_dtype_for", "Plan", "TensorPlan", "SourceTable",
           "VirtualBuffer", "TRAINABLE", "FROZEN", "BUFFER"]
