"""Lines of ``zerofast inspect``'s text report that are not about the tensors.

Plain data in, strings out: no torch, so the command line's parser stays light.
"""
from __future__ import annotations

import collections

from collections import Counter


def offloaded_suffix(parallelism: dict) -> str:
    """The end of the ``parallelism`` line of a ZeRO-Infinity save (:mod:`zerofast.layouts.nvme`)."""
    swapped = parallelism.get("offloaded")
    if not swapped:
        return ""
    return (f"; optimizer state of sub-groups {swapped['sub_groups']} in offloaded_tensors/ "
            f"({swapped['files']} swap files)")


def optimizer_lines(groups: list[dict]) -> list[str]:
    """One line per optimizer param group (``describe()["optimizer_groups"]``): its name, how
    many parameters, and the per-element states it keeps; then a blank line."""
    lines = []
    for i, g in enumerate(groups):
        label = f"group {i}" + (f" ({g['name']})" if g.get("name") else "")
        count = f"{g['params']} params: " if g.get("params") is not None else ""
        lines.append(f"{'optimizer' if i == 0 else '':<14}{label}: {count}{', '.join(g['keys']) or '-'}")
    return lines + ([""] if lines else [])


def parallelism_line(p: dict) -> str:
    """``data-parallel: dp 4`` / ``mixture-of-experts: dp 4, ep 2; experts per layer ...`` / ..."""
    degrees = ", ".join(f"{k} {p[k]}" for k in ("pp", "dp", "ep", "tp") if k in p)
    line = f"{p.get('family', 'data-parallel')}: {degrees}"
    if p.get("experts_per_layer"):
        line += "; experts per layer: " + ", ".join(f"{k} {n}" for k, n in p["experts_per_layer"].items())
    if p.get("stages"):
        line += "; stages: " + ", ".join(f"{s}: layers {ranges(layers)}" for s, layers in enumerate(p["stages"]))
    if p.get("tied_layers"):
        line += "; tied: " + ", ".join(f"{k} (layer {i})" for k, i in p["tied_layers"].items())
    if p.get("tp_rules"):
        counts = collections.Counter(p["tp_rules"].values())
        line += "; tensors: " + ", ".join(f"{n} {label}" for label, n in counts.most_common())
    return line + offloaded_suffix(p)



def ranges(indices: list[int]) -> str:
    if not indices:
        return "-"
    if indices == list(range(indices[0], indices[-1] + 1)):
        return f"{indices[0]}-{indices[-1]}" if len(indices) > 1 else str(indices[0])
    return ",".join(map(str, indices))



def training_dtype(config) -> str | None:
    """What the DeepSpeed config trained in: its bf16/fp16 sections, else fp32."""
    from ..base import dtypes

    if not isinstance(config, dict):
        return None
    for key, label in dtypes.CONFIG_SECTIONS.items():
        section = config.get(key)
        if isinstance(section, dict) and section.get("enabled") is True:
            return label
    return "fp32"



def model_dtype(meta) -> str | None:
    """The dtype the module's parameters were held in (stage 3 placeholders carry it too)."""
    import torch

    from ..base import dtypes

    buffers = set(meta.buffer_names)
    counts = Counter(dtypes.name(v.dtype) for k, v in meta.module.items()
                     if k not in buffers and isinstance(v, torch.Tensor) and v.dtype.is_floating_point)
    return counts.most_common(1)[0][0] if counts else None
