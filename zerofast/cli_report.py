"""Lines of ``zerofast inspect``'s text report that are not about the tensors.

Plain data in, strings out: no torch, so the command line's parser stays light.
"""
from __future__ import annotations


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
