"""The child of tests/test_fuzz.py: runs many seeded mutation cases in one process.

Usage: python -m tests.fuzz_child <pristine root> <work dir> <seed> <cases> <report.json>

Each case replaces one value, or one dict key, somewhere in one rank file's object tree with a
value of another type or size, writes the file back (tests.planting), and runs one of zerofast's
entry points on it. Only a ZeroFastError (or success) is acceptable. Before each case the child
prints its number, so that a crash or a hang is pinned to the case the parent sees last.
"""
from __future__ import annotations

import contextlib
import io
import json
import random
import shutil
import sys
import traceback
from pathlib import Path

import torch

import zerofast
from zerofast import cli
from tests.planting import load, save
from zerofast.load.stand_ins import DeepSpeedRecord


def _shared_nest(levels: int, width: int):
    value = [0]
    for _ in range(levels):
        value = [value] * width
    return value


def _deep(levels: int):
    value: object = 0
    for _ in range(levels):
        value = [value]
    return value


# Values of every type and size a pickle can carry into the places the loader reads.
VALUES = [
    lambda: None, lambda: True, lambda: 0, lambda: -1, lambda: 3, lambda: 2 ** 31, lambda: 2 ** 63, lambda: 2 ** 64 + 1,
    lambda: -(2 ** 63) - 1, lambda: 10 ** 40, lambda: 1.5, lambda: float("nan"), lambda: float("inf"),
    lambda: "", lambda: "x", lambda: "module", lambda: "y" * 5000,
    lambda: [], lambda: [1, 2], lambda: ["a", "b"], lambda: {}, lambda: {"a": 1}, lambda: {1: "a"}, lambda: (),
    lambda: (1,), lambda: (2, 3), lambda: list(range(10000)),
    lambda: torch.zeros(()), lambda: torch.zeros(3), lambda: torch.ones(2, 2, dtype=torch.int64),
    lambda: torch.zeros(0, 5), lambda: torch.ones(4, dtype=torch.bfloat16), lambda: torch.tensor(True),
    lambda: torch.zeros(3, dtype=torch.float64), lambda: torch.zeros(2, dtype=torch.complex64),
    lambda: torch.Size([2 ** 40]), lambda: torch.Size([3, 0]), lambda: torch.float16, lambda: torch.int64,
    lambda: _deep(60), lambda: _shared_nest(6, 30),
]
KEYS = [lambda: 0, lambda: -1, lambda: None, lambda: (1, 2), lambda: "", lambda: "__metadata__", lambda: "z" * 300,
        lambda: 1.5, lambda: True, lambda: "module", lambda: "../x"]


def _children(obj) -> list:
    if isinstance(obj, dict):
        return list(obj)
    if isinstance(obj, list):
        return list(range(len(obj)))
    return []


def _pick_slot(rng: random.Random, root):
    """A random walk down the tree, stopping at each level with probability 1/3: the metadata
    near the top is hit about as often as the long lists below it."""
    container, key = None, None
    node = root
    while True:
        if isinstance(node, DeepSpeedRecord):
            node = vars(node)
        keys = _children(node)
        if not keys or (container is not None and rng.random() < 1 / 3):
            return container, key
        container, key = node, rng.choice(keys)
        node = container[key]


OPERATIONS = ("reconstruct", "lazy", "export", "optimizer_state", "inspect_json", "inspect")


def _run(op: str, root: Path, out: Path) -> None:
    if op == "reconstruct":
        zerofast.reconstruct(root)
    elif op == "lazy":
        sd = zerofast.reconstruct(root, lazy=True, dtype=None)
        for name in sd:
            sd[name]
    elif op == "export":
        shutil.rmtree(out, ignore_errors=True)
        zerofast.export(root, out)
        zerofast.load_exported(out)
    elif op == "optimizer_state":
        zerofast.optimizer_state(root, "exp_avg")
    else:
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = cli.main(["inspect", str(root)] + (["--json"] if op == "inspect_json" else []))
        if code == 0 and op == "inspect_json":
            json.loads(stdout.getvalue())  # must be real JSON
        if code not in (0, 1) or "Traceback" in stderr.getvalue():
            raise AssertionError(f"inspect exited {code}: {stderr.getvalue()[-2000:]}")


def main(pristine: str, work: str, seed: int, cases: int, report: str) -> None:
    pristine, work = Path(pristine), Path(work)
    root = work / "ckpt"
    shutil.copytree(pristine, root)
    tag_dir = root / (root / "latest").read_text().strip()
    files = sorted(p.name for p in tag_dir.glob("*.pt"))
    rng = random.Random(seed)
    failures = []
    for case in range(cases):
        name = rng.choice(files)
        victim = tag_dir / name
        obj = load(pristine / tag_dir.name / name)
        container, key = _pick_slot(rng, obj)
        if isinstance(container, dict) and rng.random() < 0.25:
            new = rng.choice(KEYS)()
            container[new] = container.pop(key)
            what = f"key {key!r} -> {new!r:.60}"
        else:
            new = rng.choice(VALUES)()
            container[key] = new
            what = f"[{key!r}] = {type(new).__name__} {zerofast.base.errors.short_repr(new, 60)}"
        op = rng.choice(OPERATIONS)
        label = f"case {case}: {name} {what}, {op}"
        print(label, flush=True)
        try:
            save(obj, victim)
            _run(op, root, work / "out")
            print("  ok", flush=True)
        except zerofast.ZeroFastError as e:
            print(f"  {type(e).__name__}: {str(e)[:300]}", flush=True)
        except Exception:
            failures.append({"case": label, "traceback": traceback.format_exc()[-3000:]})
        shutil.copyfile(pristine / tag_dir.name / name, victim)
    Path(report).write_text(json.dumps(failures))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
