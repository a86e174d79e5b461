"""How long the DCP chunk-coverage check takes for 1k to 1M chunks per tensor.

``python benchmarks/dcp_chunks.py [--chunks 1024,4096,65536,1048576] [--repeats 5]``: for each
count, the median of ``--repeats`` calls of ``zerofast.load.dcp_cover.check_cover`` (what
``read_dcp`` runs once per tensor of a ``.metadata``) on three layouts of that many chunks:

rows       one-row shards of a (n, 4) tensor, as FSDP over n ranks or one-row ShardedTensors save
           them: the grid path, one split dimension
grid       a (n/2, 8) tensor in one-row shards of half its columns (FSDP x TP 2): the grid path,
           two split dimensions
irregular  a (n/2, 6) tensor whose even rows are split at column 3 and odd rows at column 2: not
           a grid, so the corner path

The chunk lists are built before the clock starts; the times are the check alone (turning the
boxes into arrays included): wall-clock seconds, and the process's CPU seconds beside them, since
on a shared machine the wall clock also counts waiting for a core. Prints a table, the machine
and its load average.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path


def rows(n: int) -> tuple[tuple, list, list]:
    return (n, 4), [(i, 0) for i in range(n)], [(1, 4)] * n


def grid(n: int) -> tuple[tuple, list, list]:
    half = n // 2
    return (half, 8), [(i, c) for i in range(half) for c in (0, 4)], [(1, 4)] * n


def irregular(n: int) -> tuple[tuple, list, list]:
    half = n // 2
    offsets, sizes = [], []
    for i in range(half):
        cut = 3 if i % 2 == 0 else 2
        offsets += [(i, 0), (i, cut)]
        sizes += [(1, cut), (1, 6 - cut)]
    return (half, 6), offsets, sizes


LAYOUTS = {"rows": rows, "grid": grid, "irregular": irregular}


def median_seconds(layout, n: int, repeats: int) -> tuple[float, float]:
    """(wall, CPU) seconds of one check, each the median of ``repeats``."""
    from zerofast.load.dcp_cover import check_cover

    size, offsets, sizes = layout(n)
    wall, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        check_cover("w", size, offsets, sizes, Path("bench/.metadata"))
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall), statistics.median(cpu)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    import numpy

    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    return (f"{platform.system()} {platform.release()}, {cpu}, {os.cpu_count()} CPUs, load average {load}; "
            f"Python {platform.python_version()}, numpy {numpy.__version__}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", default="1024,4096,65536,1048576", help="comma-separated chunk counts")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    counts = [int(c) for c in args.chunks.split(",")]
    print(f"machine: {machine()}")
    print(f"check_cover, median of {args.repeats}: wall seconds (CPU seconds)")
    print(f"{'chunks':>9} " + " ".join(f"{name:>19}" for name in LAYOUTS))
    for n in counts:
        cells = [median_seconds(layout, n, args.repeats) for layout in LAYOUTS.values()]
        print(f"{n:>9} " + " ".join(f"{wall:>10.4f} ({cpu:.4f})" for wall, cpu in cells), flush=True)
    print(f"machine after: load average {', '.join(f'{v:.1f}' for v in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
