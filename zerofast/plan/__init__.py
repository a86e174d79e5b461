"""Step 3: the plan, a plain-data description of every output tensor, and its builders.

- :mod:`.tensor`: ``TensorPlan`` (one output tensor) and the segment tables;
- :mod:`.model`: ``Plan``, ``SourceTable``, ``VirtualBuffer``;
- :mod:`.columns`: the one form of a plan's tensors (``PlanTensors``) and of a builder's
  entries (``EntryTable``), column by column;
- :mod:`.builders`: the partition arithmetic (stage 0 matching, stages 1-2, stage 3, frozen);
- :mod:`.build`: the state dict's plan: the module's classification and the dtype policy applied;
- :mod:`.partitioned`: the same for saves split into partitions (MoE, pipeline, AutoTP);
- :mod:`.optimizer`: the optimizer states' plan, placed like the masters; :mod:`.whole_params`:
  states laid out over whole parameters (Muon's momentum at stages 1-2);
- :mod:`.dcp`: the plan of a PyTorch DCP folder, each tensor put back together from its chunks.

Which builders a save needs is its layout's call (:mod:`zerofast.layouts`).
"""
from __future__ import annotations

from .build import build_plan
from .model import BUFFER, FROZEN, TRAINABLE, Plan, SourceTable, TensorPlan, VirtualBuffer
from .optimizer import build_optimizer_plan

__all__ = ["build_plan", "build_optimizer_plan", "Plan", "TensorPlan", "SourceTable", "VirtualBuffer", "TRAINABLE",
           "FROZEN", "BUFFER"]
