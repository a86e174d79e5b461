"""Step 3: the plan, a plain-data description of every output tensor, and its builders.

- :mod:`.model`: ``Plan``, ``TensorPlan``, ``SourceTable``, ``VirtualBuffer``;
- :mod:`.build`: the state dict's plan: shared classification of the module and the dtype policy;
- :mod:`.layouts`: one builder per checkpoint layout;
- :mod:`.optimizer`: the optimizer states' plan, by the same layout builders;
- :mod:`.keys`: the names DeepSpeed gives its checkpoint entries.
"""
from .build import build_plan, out_dtype_for
from .model import BUFFER, FROZEN, TRAINABLE, Plan, SourceTable, TensorPlan, VirtualBuffer
from .optimizer import build_optimizer_plan

__all__ = ["build_plan", "build_optimizer_plan", "out_dtype_for", "Plan", "TensorPlan", "SourceTable",
           "VirtualBuffer", "TRAINABLE", "FROZEN", "BUFFER"]
