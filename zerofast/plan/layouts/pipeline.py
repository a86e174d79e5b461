"""Pipeline-parallel saves: ZeRO off, and the names of the sequential model.

With ZeRO 1 each stage is an ordinary set of partitions (:mod:`zerofast.load.families.pipeline`
lists them; :mod:`.family` plans them).
"""
from __future__ import annotations

from ...errors import UnsupportedCheckpointError
from ...load.families import FamilyCheckpoint
from ...load.families.pipeline import TIED
from .. import keys
from ..model import Entry, SourceTable


def stage0_masters(ckpt: FamilyCheckpoint, table: SourceTable) -> dict[str, Entry]:
    """ZeRO off: without mixed precision the layer files hold the trained values themselves."""
    for ms in ckpt.model_states:
        opt = ms.raw.get(keys.STAGE0_OPTIMIZER)
        if isinstance(opt, dict) and ({keys.STAGE0_FP32_GROUPS, keys.STAGE0_FP32_FLAT} & set(opt)):
            raise UnsupportedCheckpointError(
                "pipeline stage 0 with mixed-precision masters is not supported: the masters are unnamed and the "
                "stage's layers are not recorded", ms.path)
    return {n: table.whole(str(s.path), s.key, s.tensor)
            for n, s in ckpt.stored.items() if n not in ckpt.buffers and s.tensor.is_floating_point()}


def sequential_names(names, tied_layers: dict[str, int]) -> dict[str, str]:
    """PipelineModule name -> the name of the same tensor in ``nn.Sequential(*layers)``:
    ``tied_modules.<key>.<p>`` becomes ``<first layer>.<p>``, every other name stays."""
    out = {}
    for n in names:
        m = TIED.match(n)
        out[n] = f"{tied_layers[m.group(1)]}.{m.group(2)}" if m and m.group(1) in tied_layers else n
    return out
