"""The child of tests/test_op_fuzz.py: calls the native ops' kernels with generated arguments.

Usage: python -m tests.op_fuzz_child <device> <seed> <first case> <cases> <work dir> <report.json>

Case k draws everything from ``random.Random(f"{seed}:{k}")``, so one case runs again alone with
``<first case> = k`` and ``<cases> = 1``. A case is a valid call of one op (sources in memory and in
a file, tables of rows that do not overlap, empty tables and huge ones) with at most one argument
damaged: moved to another device (meta stands in for one on a CPU machine), made non-contiguous or
of another dtype or shape, given negative or overflowing offsets, indexes past the end, bad file
descriptors, and so on. The kernel of ``device`` is called through the dispatcher's
``redispatch``, as a caller on a machine of several devices can reach it, so a damaged argument
meets the kernel's own checks rather than the dispatcher's choice of kernel.

What each case must give:
- a valid call: the result of the pure-torch reference (zerofast/native/reference.py), bit for bit;
- a damaged one: a RuntimeError whose message names the damaged argument.

Anything else is a failure, written to the report; a crash ends the child, and the case it died
in is the last line it printed.
"""
from __future__ import annotations

import json
import os
import random
import resource
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from zerofast.native import ops, reference

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int64, torch.int32]
I64MAX = 2 ** 63 - 1
I64MIN = -(2 ** 63)
HUGE_ROWS = 60_000  # rows in a huge segment table; about 1 case in 40 has one
OPS = ["gather_cast", "read_cast", "read_cast_new", "read_cast_to_file", "check_ranges"]
SCHEMA = {
    "gather_cast": ["sources", "segments", "out", "stream_sources"],
    "read_cast": ["sources", "source_fds", "source_offsets", "segments", "outs", "readers", "hugepages"],
    "read_cast_new": ["sources", "source_fds", "source_offsets", "segments", "dims", "ranks", "dtype", "readers",
                      "hugepages"],
    "read_cast_to_file": ["sources", "source_fds", "source_offsets", "segments", "out_fd", "out_offsets",
                          "out_numels", "out_dtype", "readers", "copy_file_range"],
    "check_ranges": ["sources", "source_fds", "source_offsets", "segments", "numels", "dtype", "compare", "chunk",
                     "readers"],
}
WIDTH = {"gather_cast": 4, "read_cast": 5, "read_cast_new": 5, "read_cast_to_file": 5, "check_ranges": 6}


@dataclass
class Case:
    op: str
    args: dict
    work: Path
    rng: random.Random
    home: str  # the device the kernel under test runs on
    fds: list[int] = field(default_factory=list)  # to close after the case
    label: str = "valid"
    expect: tuple[str, ...] | None = None  # names one of which the error must contain; None: valid
    out_files: tuple[Path, Path] | None = None  # read_cast_to_file: the native and the reference output
    small_segments: torch.Tensor | None = None  # the table without a huge table's filler rows

    def open(self, path: Path, flags: int) -> int:
        fd = os.open(path, flags)
        self.fds.append(fd)
        return fd


# ---------------------------------------------------------------------------------------------
# Valid calls

def _values(rng: random.Random, n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(rng.randrange(2 ** 32))
    if dtype.is_floating_point:
        return (torch.randn(n, generator=g, dtype=torch.float64) * 100).to(dtype)
    return torch.randint(-1000, 1000, (n,), generator=g, dtype=torch.int64).to(dtype)


def _sources(case: Case, family: list[torch.dtype], files: bool, least: int = 0, mixed: bool = False) -> None:
    """Sources of dtypes from ``family`` (one of them unless ``mixed``), each in memory or read from
    one file that holds their bytes after random padding."""
    rng = case.rng
    count = rng.choice([0, 1, 1, 2, 3, 4]) if least == 0 else rng.randint(1, 4)
    same = rng.choice(family)
    sources = [_values(rng, rng.randint(least, 48), rng.choice(family) if mixed else same) for _ in range(count)]
    case.args["sources"] = sources
    if not files:
        return
    path = case.work / "sources.bin"
    blob, fds, offsets = bytearray(), [], []
    for s in sources:
        blob += os.urandom(rng.randint(0, 9))
        offsets.append(len(blob))
        blob += s.view(torch.uint8).numpy().tobytes()
    path.write_bytes(bytes(blob) + os.urandom(rng.randint(0, 9)))
    fd = case.open(path, os.O_RDONLY)
    for i in range(count):
        if rng.random() < 0.5:
            fds.append(fd)
        else:  # copied from the tensor: the offset is not read
            fds.append(rng.choice([-1, -7]))
            offsets[i] = rng.choice([0, -3, I64MAX, offsets[i]])
    case.args["source_fds"] = fds
    case.args["source_offsets"] = torch.tensor(offsets, dtype=torch.int64)


def _rows(rng: random.Random, numels: list[int], m: int, full: bool) -> list[list[int]]:
    """(source, source offset, destination offset, length) rows writing [0, m) without overlaps;
    ``full``: every element of it."""
    rows, dst = [], 0
    usable = [i for i, n in enumerate(numels) if n > 0]
    while dst < m and usable:
        if not full and rng.random() < 0.3:
            dst += rng.randint(1, 3)
            continue
        s = rng.choice(usable)
        length = rng.randint(1, min(m - dst, numels[s]))
        rows.append([s, rng.randint(0, numels[s] - length), dst, length])
        dst += length
        if not full and rng.random() < 0.15:
            break
    if numels and rng.random() < 0.3:  # an empty row is valid anywhere inside
        rows.append([rng.randrange(len(numels)), 0, rng.randint(0, m), 0])
    rng.shuffle(rows)
    return rows


def _table(rows: list[list[int]], width: int) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, width)


def build(case: Case) -> None:
    rng, op, args = case.rng, case.op, case.args
    family = FLOATS if rng.random() < 0.8 else [rng.choice(INTS)]
    if op == "gather_cast":
        _sources(case, family, files=False, mixed=family is FLOATS)
        numels = [s.numel() for s in args["sources"]]
        out_dtype = rng.choice(family) if family is FLOATS else family[0]
        m = rng.randint(0, 40)
        args["segments"] = _table(_rows(rng, numels, m, full=False), 4)
        args["out"] = _values(rng, m, out_dtype)
        args["stream_sources"] = False  # True promises private file mappings, which these are not
        if case.home != "cpu":
            args["sources"] = [s.to(case.home) if rng.random() < 0.5 else s for s in args["sources"]]
            args["out"] = args["out"].to(case.home)
    elif op in ("read_cast", "read_cast_new", "read_cast_to_file"):
        _sources(case, family, files=True, least=1 if op == "read_cast_new" else 0, mixed=family is FLOATS)
        numels = [s.numel() for s in args["sources"]]
        sizes = [rng.randint(0, 30) for _ in range(rng.choice([0, 1, 2, 3]) if numels else 0)]
        rows = []
        for o, m in enumerate(sizes):
            rows += [[o] + r for r in _rows(rng, numels, m, full=op == "read_cast_new")]
        rng.shuffle(rows)
        args["segments"] = _table(rows, 5)
        dtypes = [rng.choice(family) if family is FLOATS else family[0] for _ in sizes]
        if op == "read_cast":
            args["outs"] = [_values(rng, m, d) for m, d in zip(sizes, dtypes)]
        elif op == "read_cast_new":
            dims, ranks = [], []
            for m in sizes:
                shape = rng.choice([[m], [1, m], [m, 1]] + ([[2, m // 2]] if m % 2 == 0 else []) + ([[]] if m == 1 else []))
                dims += shape
                ranks.append(len(shape))
            args["dims"], args["ranks"] = dims, ranks
            args["dtype"] = rng.choice(family) if family is FLOATS else family[0]
        else:
            dtype = rng.choice(family) if family is FLOATS else family[0]
            offsets, at = [], rng.randint(0, 7)
            for m in sizes:
                offsets.append(at)
                at += m * dtype.itemsize + rng.randint(0, 5)
            blob = os.urandom(at + rng.randint(0, 16))
            native, ref = case.work / "out_native.bin", case.work / "out_reference.bin"
            native.write_bytes(blob)
            ref.write_bytes(blob)
            case.out_files = (native, ref)
            args["out_fd"] = case.open(native, os.O_RDWR)
            args["out_offsets"] = torch.tensor(offsets, dtype=torch.int64)
            args["out_numels"] = torch.tensor(sizes, dtype=torch.int64)
            args["out_dtype"] = dtype
            args["copy_file_range"] = rng.random() < 0.5
        args["readers"] = rng.choice([0, 1, 2, 3])
        if op != "read_cast_to_file":
            args["hugepages"] = rng.random() < 0.5
    else:  # check_ranges
        _sources(case, FLOATS + INTS + [torch.int16, torch.int8, torch.uint8, torch.bool], files=True,
                 mixed=rng.random() < 0.5)
        numels = [s.numel() for s in args["sources"]]
        compare = rng.random() < 0.7
        sizes = [rng.randint(0, 40) for _ in range(rng.choice([0, 1, 2, 3]))]
        rows = []
        for t, m in enumerate(sizes):
            for side in (0, 1) if compare else (0,):
                rows += [[t, side] + r for r in _rows(rng, numels, m, full=False)]
        rng.shuffle(rows)
        args["segments"] = _table(rows, 6)
        args["numels"] = torch.tensor(sizes, dtype=torch.int64)
        args["dtype"] = rng.choice(FLOATS + [torch.int64])
        args["compare"] = compare
        args["chunk"] = rng.choice([1, 3, 7, 16, 1 << 20])
        args["readers"] = rng.choice([0, 1, 2])
    if rng.random() < 1 / 40:
        _huge_table(case)


def _huge_table(case: Case) -> None:
    """Many empty rows around the real ones: still a valid call, whose answer is the reference's
    for the table without them (the reference takes seconds over so many rows)."""
    rng, seg = case.rng, case.args["segments"]
    if not case.args["sources"] or not _out_count(case):
        return  # an empty row still names a source and an output
    filler = torch.zeros(HUGE_ROWS, seg.size(1), dtype=torch.int64)
    at = rng.randint(0, HUGE_ROWS)
    case.small_segments = seg
    case.args["segments"] = torch.cat([filler[:at], seg, filler[at:]])
    case.label = f"{HUGE_ROWS} empty rows around the table"


def _out_count(case: Case) -> int:
    if case.op == "read_cast":
        return len(case.args["outs"])
    if case.op == "read_cast_new":
        return len(case.args["ranks"])
    if case.op == "read_cast_to_file":
        return case.args["out_numels"].numel()
    if case.op == "check_ranges":
        return case.args["numels"].numel()
    return 1


# ---------------------------------------------------------------------------------------------
# Damage: each returns (label, names the error may give) or None where it does not apply.

def _non_contiguous(t: torch.Tensor) -> torch.Tensor | None:
    if t.dim() == 1:
        if t.numel() < 2:
            return None
        wide = torch.empty(t.numel() * 2, dtype=t.dtype, device=t.device)
        wide[::2] = t
        view = wide[::2]
    elif t.dim() == 2:
        if t.size(0) < 2 or t.size(1) < 2:
            return None
        view = torch.cat([t, t], 1)[:, :t.size(1)]
    else:
        return None
    return None if view.is_contiguous() else view


def _damage_tensor(case: Case, name: str, t: torch.Tensor, shapes: bool = True):
    """Table ``t`` (argument ``name``) moved to another device, made strided, retyped or reshaped."""
    rng = case.rng
    ref = f"`{name}`"
    how = rng.choice(["device", "strided", "dtype"] + (["shape"] if shapes else []))
    if how == "device":
        return f"{ref} on meta", t.to("meta")
    if how == "strided":
        v = _non_contiguous(t)
        return (f"{ref} non-contiguous", v) if v is not None else None
    if how == "dtype":
        if t.dtype != torch.int64:
            return None  # a data tensor's dtype is damaged by the cast mutations
        d = rng.choice([torch.int32, torch.float64, torch.float32, torch.uint8])
        return f"{ref} as {d}", t.to(d)
    if t.dtype != torch.int64:
        return None
    if t.dim() == 2:
        w = t.size(1)
        shapes = [(t.size(0), w - 1), (t.size(0), w + 1), (t.numel(),), (1, t.size(0), w)]
        shape = rng.choice(shapes)
        grown = torch.zeros(int(torch.tensor(shape).prod()), dtype=torch.int64)
        grown[:min(t.numel(), grown.numel())] = t.reshape(-1)[:grown.numel()]
        return f"{ref} reshaped to {list(shape)}", grown.reshape(shape)
    extra = rng.choice([-1, 1]) if t.numel() else 1
    n = t.numel() + extra
    return f"{ref} of {n} entries", torch.cat([t, t.new_zeros(max(extra, 0))])[:n].clone()


def damage(case: Case):
    """One argument of ``case`` made invalid; returns (label, names) or None."""
    rng, op, args = case.rng, case.op, case.args
    kinds = ["table", "row"] + (["sources"] if args["sources"] else [])
    if op == "gather_cast":
        kinds += ["out"]
    if op in ("read_cast", "read_cast_new", "read_cast_to_file", "check_ranges"):
        kinds += ["fds", "offsets"] if args["sources"] else ["fds_len"]
    if op == "read_cast":
        kinds += ["outs"] if args["outs"] else []
    if op == "read_cast_new":
        kinds += ["dims"]
    if op == "read_cast_to_file":
        kinds += ["out_fd", "out_table"]
    if op == "check_ranges":
        kinds += ["numels", "chunk", "side"]
    kind = rng.choice(kinds)
    w = WIDTH[op]

    if kind == "table":
        got = _damage_tensor(case, "segments", args["segments"])
        if got is None:
            return None
        args["segments"] = got[1]
        return got[0], ("`segments`",)

    if kind == "row":
        seg = args["segments"].clone()
        if seg.size(0) == 0:
            return None
        k = rng.randrange(seg.size(0))
        col = rng.randrange(w)
        index_cols = {"gather_cast": {0: "source"}, "check_ranges": {0: "tensor", 2: "source"}}.get(
            op, {0: "output", 1: "source"})
        if op == "check_ranges" and col == 1:
            return None  # the side column: see "side"
        if col in index_cols:  # past the end, or negative
            limit = {"source": len(args["sources"]), "output": _out_count(case), "tensor": _out_count(case)}
            value = rng.choice([-1, I64MIN, I64MAX, limit[index_cols[col]]])
        else:  # an offset or length: negative, or past any source and output of these sizes
            value = rng.choice([-1, -(2 ** 40), I64MIN, I64MAX, 2 ** 62, 2 ** 31])
        seg[k, col] = value
        args["segments"] = seg
        return f"segments[{k}][{col}] = {value}", (f"`segments[{k}]`",)

    if kind == "sources":
        i = rng.randrange(len(args["sources"]))
        s = args["sources"][i]
        fds = args.get("source_fds")
        how = rng.choice(["device", "strided", "cast"])
        if how == "device":
            args["sources"] = _replace(args["sources"], i, s.to("meta"))
            return f"sources[{i}] on meta", (f"`sources[{i}]`",)
        if how == "strided":
            if op == "check_ranges" and fds[i] >= 0:
                return None  # a source read from its file may be strided
            v = _non_contiguous(s)
            if v is None:
                return None
            args["sources"] = _replace(args["sources"], i, v)
            return f"sources[{i}] non-contiguous", (f"`sources[{i}]`",)
        # A dtype nothing casts to or from.
        if op == "gather_cast":
            if s.dtype not in FLOATS and args["out"].dtype not in FLOATS:
                bad = torch.float32 if args["out"].dtype != torch.float32 else torch.int16
            else:
                bad = rng.choice([torch.int64, torch.int8, torch.complex64])
            args["sources"] = _replace(args["sources"], i, s.to(bad) if bad != torch.complex64 else s.to(torch.float32).to(bad))
            return f"sources[{i}] as {bad}", (f"`sources[{i}]`",)
        if op == "check_ranges":
            bad = rng.choice([torch.complex64, torch.float8_e4m3fn, torch.uint16])
            args["sources"] = _replace(args["sources"], i, torch.zeros(s.numel(), dtype=bad))
            return f"sources[{i}] as {bad}", (f"`sources[{i}]`",)
        used = [r for r in args["segments"].tolist() if r[1] == i]
        if not used or (op == "read_cast" and not args["outs"]):
            return None
        target = {"read_cast": lambda r: args["outs"][r[0]].dtype, "read_cast_new": lambda r: args["dtype"],
                  "read_cast_to_file": lambda r: args["out_dtype"]}[op](used[0])
        bad = torch.int16 if target in FLOATS else torch.float32
        args["sources"] = _replace(args["sources"], i, torch.zeros(s.numel(), dtype=bad))
        if fds[i] >= 0:  # the file's bytes must still cover the source
            args["source_fds"] = _replace(fds, i, -1)
        return f"sources[{i}] as {bad}", (f"`sources[{i}]`",)

    if kind == "out":
        out = args["out"]
        how = rng.choice(["device", "strided", "cast"])
        if how == "device":
            # On cuda, a host `out` is refused as `out`, or as the GPU source that cannot go there.
            args["out"] = out.to("meta") if case.home == "cpu" or rng.random() < 0.5 else out.cpu()
            return f"out on {args['out'].device}", ("`out`", "`sources[")
        if how == "strided":
            v = _non_contiguous(out)
            if v is None:
                return None
            args["out"] = v
            return "out non-contiguous", ("`out`",)
        if not args["sources"]:
            return None
        bad = torch.int32 if out.dtype in FLOATS else torch.float16
        args["out"] = torch.zeros(out.numel(), dtype=bad, device=out.device)
        return f"out as {bad}", ("`out`",)

    if kind == "fds_len":
        fds = list(args["source_fds"])
        args["source_fds"] = fds + [-1]
        return "one source fd too many", ("`source_fds`",)

    if kind == "fds":
        fds = list(args["source_fds"])
        i = rng.randrange(len(fds))
        how = rng.choice(["len", "closed", "high", "int", "dir", "write_only", "short"])
        if how == "len":
            args["source_fds"] = fds[:-1] if rng.random() < 0.5 else fds + [fds[0]]
            return f"{len(args['source_fds'])} source fds", ("`source_fds`",)
        if how == "short":  # the file ends before the source does
            if fds[i] < 0 or args["sources"][i].numel() == 0:
                return None
            size = os.fstat(fds[i]).st_size
            nbytes = args["sources"][i].numel() * args["sources"][i].element_size()
            offsets = args["source_offsets"].clone()
            offsets[i] = size - nbytes + rng.randint(1, nbytes)
            args["source_offsets"] = offsets
            return f"source_offsets[{i}] = {int(offsets[i])} reads past the file's end", (f"`sources[{i}]`",)
        if how == "closed":
            fd = os.open(case.work / "sources.bin", os.O_RDONLY)
            os.close(fd)
            value = fd
        elif how == "high":
            value = rng.choice([1 << 20, 2 ** 31 - 1])
        elif how == "int":
            value = rng.choice([2 ** 31, I64MAX])
        elif how == "dir":
            value = case.open(case.work, os.O_RDONLY)
        else:
            value = case.open(case.work / "sources.bin", os.O_WRONLY)
        fds[i] = value
        args["source_fds"] = fds
        offsets = args["source_offsets"].clone()
        offsets[i] = 0  # a memory source's offset may be anything: not the damage under test
        args["source_offsets"] = offsets
        return f"source_fds[{i}] = {value} ({how})", (f"`source_fds[{i}]`",)

    if kind == "offsets":
        fds = args["source_fds"]
        if rng.random() < 0.4:
            got = _damage_tensor(case, "source_offsets", args["source_offsets"])
            if got is None:
                return None
            args["source_offsets"] = got[1]
            return got[0], ("`source_offsets`",)
        files = [i for i, fd in enumerate(fds) if fd >= 0]
        if not files:
            return None
        i = rng.choice(files)
        offsets = args["source_offsets"].clone()
        offsets[i] = rng.choice([-1, I64MIN, I64MAX, I64MAX - 3, 2 ** 62])
        args["source_offsets"] = offsets
        names = (f"`source_offsets[{i}]`",)
        if int(offsets[i]) >= 0:  # an empty source at a far offset is refused as past the file's end
            names += (f"`sources[{i}]`",)
        return f"source_offsets[{i}] = {int(offsets[i])}", names

    if kind == "outs":
        outs = list(args["outs"])
        i = rng.randrange(len(outs))
        how = rng.choice(["device", "strided"])
        if how == "device":
            outs[i] = outs[i].to("meta")
        else:
            v = _non_contiguous(outs[i])
            if v is None:
                return None
            outs[i] = v
        args["outs"] = outs
        return f"outs[{i}] {how}", (f"`outs[{i}]`",)

    if kind == "dims":
        dims, ranks = list(args["dims"]), list(args["ranks"])
        how = rng.choice(["negative", "overflow", "rank", "extra"])
        if how == "negative" and dims:
            k = rng.randrange(len(dims))
            dims[k] = rng.choice([-1, I64MIN])
            name = "`dims["
        elif how == "overflow":
            dims += [2 ** 40, 2 ** 40]
            ranks.append(2)
            name = "`dims["
        elif how == "rank" and ranks:
            k = rng.randrange(len(ranks))
            ranks[k] = rng.choice([-1, len(dims) + 1, I64MAX])
            name = f"`ranks[{k}]`"
        else:
            dims.append(rng.randint(0, 3))
            name = "`dims`"
        args["dims"], args["ranks"] = dims, ranks
        return f"dims {dims} ranks {ranks} ({how})", (name,)

    if kind == "out_fd":
        how = rng.choice(["negative", "int", "closed", "dir", "read_only"])
        if how == "negative":
            value = rng.choice([-1, I64MIN])
        elif how == "int":
            value = rng.choice([2 ** 31, I64MAX])
        elif how == "closed":
            value = os.open(case.work / "sources.bin", os.O_RDONLY)
            os.close(value)
        elif how == "dir":
            value = case.open(case.work, os.O_RDONLY)
        else:
            value = case.open(case.out_files[0], os.O_RDONLY)
        args["out_fd"] = value
        return f"out_fd = {value} ({how})", ("`out_fd`",)

    if kind == "out_table":
        name = rng.choice(["out_offsets", "out_numels"])
        t = args[name]
        if rng.random() < 0.5:
            got = _damage_tensor(case, name, t)
            if got is None:
                return None
            args[name] = got[1]
            return got[0], ("`out_offsets`",)
        if t.numel() == 0:
            return None
        t = t.clone()
        k = rng.randrange(t.numel())
        if name == "out_offsets":
            if int(args["out_numels"][k]) == 0:
                t[k] = rng.choice([-1, I64MIN])
            else:
                t[k] = rng.choice([-1, I64MIN, I64MAX, I64MAX - 1])
        else:
            t[k] = rng.choice([-1, I64MIN])
        args[name] = t
        return f"{name}[{k}] = {int(t[k])}", (f"`{name}[{k}]`",)

    if kind == "numels":
        numels = args["numels"]
        how = rng.choice(["tensor", "negative", "huge"])
        if how == "tensor":  # not reshaped: one tensor more or fewer may be a valid call
            got = _damage_tensor(case, "numels", numels, shapes=False)
            if got is None:
                return None
            args["numels"] = got[1]
            return got[0], ("`numels`",)
        if how == "huge":
            args["numels"] = torch.cat([numels, torch.tensor([rng.choice([2 ** 62, I64MAX])])])
            args["chunk"] = rng.choice([1, 3])
            return f"numels {args['numels'].tolist()}", ("`numels",)
        if numels.numel() == 0:
            return None
        numels = numels.clone()
        k = rng.randrange(numels.numel())
        numels[k] = rng.choice([-1, I64MIN])
        args["numels"] = numels
        return f"numels[{k}] = {int(numels[k])}", (f"`numels[{k}]`",)

    if kind == "chunk":
        args["chunk"] = rng.choice([0, -1, I64MIN])
        return f"chunk = {args['chunk']}", ("`chunk`",)

    if kind == "side":
        seg = args["segments"].clone()
        if seg.size(0) == 0:
            return None
        k = rng.randrange(seg.size(0))
        seg[k, 1] = rng.choice([-1, 2, I64MAX] + ([] if args["compare"] else [1]))
        args["segments"] = seg
        return f"segments[{k}] side {int(seg[k, 1])}", (f"`segments[{k}]`",)
    return None


def _replace(items: list, i: int, value) -> list:
    items = list(items)
    items[i] = value
    return items


def cosmetic(case: Case) -> str | None:
    """A change that keeps the call valid: reader counts far past the cores."""
    if "readers" not in case.args or case.rng.random() > 0.1:
        return None
    case.args["readers"] = case.rng.choice([-5, 1000, 10 ** 6])
    return f"readers = {case.args['readers']}"


# ---------------------------------------------------------------------------------------------
# Calling and judging

def _kernel_key(case: Case) -> torch._C.DispatchKeySet:
    key = torch._C.DispatchKey.CUDA if case.op == "gather_cast" and case.home == "cuda" else torch._C.DispatchKey.CPU
    return torch._C.DispatchKeySet(key)


def call(case: Case):
    op = getattr(torch.ops.zerofast, case.op).default
    return op.redispatch(_kernel_key(case), *[case.args[name] for name in SCHEMA[case.op]])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.cpu(), b.cpu()
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)))


def expected(case: Case):
    """The reference's answer to a valid call, computed before the kernel runs."""
    a = dict(case.args)
    if case.small_segments is not None:
        a["segments"] = case.small_segments
    if case.op == "gather_cast":
        out = a["out"].clone()
        reference.gather_cast(a["sources"], a["segments"], out)
        return out
    if case.op == "read_cast":
        outs = [o.clone() for o in a["outs"]]
        reference.read_cast(a["sources"], a["source_fds"], a["source_offsets"], a["segments"], outs)
        return outs
    if case.op == "read_cast_new":
        return reference.read_cast_new(a["sources"], a["source_fds"], a["source_offsets"], a["segments"], a["dims"],
                                       a["ranks"], a["dtype"])
    if case.op == "read_cast_to_file":
        fd = os.open(case.out_files[1], os.O_RDWR)
        try:
            reference.read_cast_to_file(a["sources"], a["source_fds"], a["source_offsets"], a["segments"], fd,
                                        a["out_offsets"], a["out_numels"], a["out_dtype"])
        finally:
            os.close(fd)
        return case.out_files[1].read_bytes()
    return reference.check_ranges(a["sources"], a["source_fds"], a["source_offsets"], a["segments"], a["numels"],
                                  a["dtype"], a["compare"], a["chunk"])


def got(case: Case, result):
    if case.op == "gather_cast":
        return case.args["out"]
    if case.op == "read_cast":
        return case.args["outs"]
    if case.op == "read_cast_to_file":
        return case.out_files[0].read_bytes()
    return result


def matches(want, have) -> bool:
    if isinstance(want, bytes):
        return want == have
    if isinstance(want, torch.Tensor):
        return _same(want, have)
    return len(want) == len(have) and all(_same(w, h) for w, h in zip(want, have))


def make(seed: int, k: int, device: str, work: Path) -> Case:
    rng = random.Random(f"{seed}:{k}")
    op = rng.choice(OPS) if device == "cpu" else rng.choice(["gather_cast"] * 3 + OPS)
    case = Case(op, {}, work, rng, device)
    build(case)
    if rng.random() < 0.15:
        case.label = cosmetic(case) or case.label
        return case
    for _ in range(8):  # a damage that does not apply is drawn again
        snapshot = dict(case.args)
        hit = damage(case)
        if hit is not None:
            case.label, case.expect = hit[0] if case.label == "valid" else f"{case.label}; {hit[0]}", hit[1]
            return case
        case.args = snapshot
    return case


def run_case(seed: int, k: int, device: str, work: Path) -> dict | None:
    """None when case ``k`` does what it must, else what went wrong."""
    case = make(seed, k, device, work)
    print(f"case {k}: {case.op} {case.label}", flush=True)
    try:
        want = expected(case) if case.expect is None else None
        try:
            result = call(case)
        except Exception as e:  # judged below: only a RuntimeError naming the argument passes
            if case.expect is None:
                return {"case": k, "op": case.op, "label": case.label, "problem": f"valid call raised {e!r:.500}"}
            text = str(e)
            if not isinstance(e, RuntimeError) or not any(name in text for name in case.expect):
                return {"case": k, "op": case.op, "label": case.label,
                        "problem": f"{type(e).__name__} not naming {case.expect}: {text[:500]}"}
            return None
        if case.expect is not None:
            return {"case": k, "op": case.op, "label": case.label, "problem": "damaged call raised nothing"}
        if not matches(want, got(case, result)):
            return {"case": k, "op": case.op, "label": case.label, "problem": "result differs from the reference"}
        return None
    finally:
        for fd in case.fds:
            try:
                os.close(fd)
            except OSError:
                pass


def main(device: str, seed: int, first: int, count: int, work: str, report: str) -> None:
    ops.load_native()
    work_dir = Path(work)
    work_dir.mkdir(parents=True, exist_ok=True)
    failures = []
    for k in range(first, first + count):
        try:
            problem = run_case(seed, k, device, work_dir)
        except Exception:  # the harness itself: still reported with its case
            problem = {"case": k, "problem": traceback.format_exc()[-2000:]}
        if problem is not None:
            failures.append(problem)
    Path(report).write_text(json.dumps(failures))
    print("done", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "cpu":  # CUDA reserves far more address space than it uses
        limit = 8 << 30  # a memory bomb fails as an allocation error instead of taking the machine
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6])
