"""ZeRO stages 1 and 2: each param group's flat buffer is the ranks' partitions end to end.

Parameters follow each other in ``param_shapes`` order; after parameter i come
``param_alignment_paddings[g][i]`` unused elements, and the buffer's end is padding.
"""
from __future__ import annotations

import math

import numpy as np

from ...base.errors import InconsistentCheckpointError
from ...load import LoadedCheckpoint
from ..columns import EntryTable
from ..model import Entry, FlatGroups, SegmentTable, SourceTable, VirtualBuffer

INT64_MAX = 2 ** 63 - 1


def trainable(ckpt: LoadedCheckpoint, table: SourceTable, shapes, flats: FlatGroups) -> EntryTable:
    parts: list[EntryTable] = []  # per group
    for g, group in enumerate(shapes):
        buf_parts = [groups[g][1] for groups in flats]
        buf = VirtualBuffer([table.add(str(o.path), groups[g][0], groups[g][1])
                             for o, groups in zip(ckpt.optim_states, flats)], [p.numel() for p in buf_parts])
        pads = _alignment_paddings(ckpt, g, len(group))
        fast = _columns(group, pads, buf, buf_parts[0].dtype)
        if fast is not None:
            parts.append(fast)
            continue
        out: dict[str, Entry] = {}
        offset = 0
        for i, (name, shape) in enumerate(group.items()):
            n = math.prod(shape)
            if offset + n > buf.numel:
                raise InconsistentCheckpointError(
                    f"'param_shapes' places {name!r} at elements [{offset}, {offset + n}) of group {g}, but the "
                    f"{ckpt.world_size} ranks' partitions hold only {buf.numel}", ckpt.optim_states[0].path)
            out[name] = (shape, buf_parts[0].dtype, buf.pieces(offset, n, 0))
            offset += n + pads[i]
        parts.append(EntryTable.of_entries(out))
    # one table, in group order (a later group's entry of a name replacing an earlier one's)
    return EntryTable.join(parts)


def _alignment_paddings(ckpt: LoadedCheckpoint, group: int, count: int) -> list[int]:
    o = ckpt.optim_states[0]
    pads = o.param_alignment_paddings
    if pads is None:
        return [0] * count
    if group >= len(pads) or len(pads[group]) != count:
        raise InconsistentCheckpointError(
            f"expected {count} 'param_alignment_paddings' for group {group}, found "
            f"{len(pads[group]) if group < len(pads) else 'none'}", o.path)
    return [int(p) for p in pads[group]]


def _columns(group: dict, pads: list[int], buf: VirtualBuffer, dtype) -> EntryTable | None:
    """The loop's entries for one group by array arithmetic (tens of thousands of parameters), or
    None where the loop would raise or the sums could leave int64. A parameter that crosses from
    one rank's partition into the next gets its segments from :meth:`VirtualBuffer.pieces`."""
    if not group or not buf.sources:
        return None
    sizes = list(map(math.prod, group.values()))
    if (max(sizes) + max(pads)) * len(sizes) > INT64_MAX:
        return None
    n = np.array(sizes, dtype=np.int64)
    step = n + np.array(pads, dtype=np.int64)
    offsets = np.cumsum(step) - step
    if bool((offsets + n > buf.numel).any()):
        return None  # the loop names the parameter
    rows = np.zeros((len(sizes), 1, 4), dtype=np.int64)
    rows[:, 0, 0], rows[:, 0, 1], odd = buf.single_pieces(offsets, n)
    rows[:, 0, 3] = n
    cut = [buf.pieces(int(offsets[i]), sizes[i], 0) for i in np.flatnonzero(odd).tolist()]
    return EntryTable.of(list(group), list(group.values()), dtype, SegmentTable.regular(rows, odd, cut))
