"""The typed results of ``zerofast.verify`` and ``zerofast.diff``: plain dataclasses that tests
and scripts assert on, with the CLI's one-line-per-finding text and JSON forms."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Finding:
    """One thing found wrong (or, with ``fatal=False``, worth knowing).

    ``check`` names the check that found it (``"master-weight"``, ``"steps"``, ``"nonfinite"``,
    ``"moments-zero"``, ``"files"``, ``"missing"``, ``"values"``, ``"dtype"``, ...); ``name`` the
    tensor or file it is about; ``detail`` the numbers (counts, max differences)."""

    check: str
    name: str
    message: str
    fatal: bool = True
    detail: dict = field(default_factory=dict)

    def line(self) -> str:
        level = "FAIL" if self.fatal else "note"
        return f"{level} {self.check}: {self.name}: {self.message}"


@dataclass
class Report:
    """What ``zerofast.verify`` found. ``ok`` is true when no finding is fatal; ``checks`` says
    what was checked (one short sentence each), so a clean report shows its coverage."""

    path: str
    against: str | None
    kind: str  # what ``path`` is: "zero checkpoint", "universal checkpoint", "safetensors export", ...
    findings: list[Finding] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)
    tensors: int = 0  # tensors whose data was read
    bytes_read: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not any(f.fatal for f in self.findings)

    @property
    def failures(self) -> list[Finding]:
        return [f for f in self.findings if f.fatal]

    def by_check(self, check: str) -> list[Finding]:
        return [f for f in self.findings if f.check == check]

    def add(self, check: str, name: str, message: str, fatal: bool = True, **detail) -> None:
        self.findings.append(Finding(check, name, message, fatal, detail))

    def summary(self) -> str:
        fails, notes = len(self.failures), len(self.findings) - len(self.failures)
        what = f"{self.path} against {self.against}" if self.against else self.path
        verdict = "clean" if self.ok else f"{fails} problem{'s' * (fails != 1)}"
        extra = f", {notes} note{'s' * (notes != 1)}" if notes else ""
        return (f"{'OK' if self.ok else 'FAILED'}: {what} ({self.kind}): {verdict}{extra}; {self.tensors} tensors, "
                f"{self.bytes_read / 1e6:.1f} MB read in {self.seconds:.2f} s")

    def lines(self) -> list[str]:
        return [f"check {c}" for c in self.checks] + [f.line() for f in self.findings] + [self.summary()]

    def to_dict(self) -> dict:
        out = asdict(self)
        out["ok"] = self.ok
        out["summary"] = self.summary()
        return _json_safe(out)


@dataclass(frozen=True)
class TensorChange:
    """One tensor present on both sides whose dtype, shape or values differ. ``changed`` counts
    the elements that differ (after casting both sides to float64 when the dtypes differ);
    ``max_rel`` is ``max |a - b| / max(|a|, tiny)``."""

    name: str
    dtype_a: str
    dtype_b: str
    shape_a: tuple[int, ...]
    shape_b: tuple[int, ...]
    numel: int
    changed: int = 0
    max_abs: float = 0.0
    max_rel: float = 0.0

    @property
    def fraction(self) -> float:
        return self.changed / self.numel if self.numel else 0.0

    @property
    def retyped(self) -> bool:
        return self.dtype_a != self.dtype_b or self.shape_a != self.shape_b

    def line(self) -> str:
        if self.shape_a != self.shape_b:
            return f"shape {self.name}: {list(self.shape_a)} -> {list(self.shape_b)}"
        head = f"dtype {self.name}: {self.dtype_a} -> {self.dtype_b}; " if self.dtype_a != self.dtype_b else \
            f"changed {self.name}: "
        return (f"{head}{self.changed:,} of {self.numel:,} elements differ ({self.fraction:.1%}), max abs "
                f"{self.max_abs:.3g}, max rel {self.max_rel:.3g}")


@dataclass
class Diff:
    """What ``zerofast.diff(a, b)`` found. ``changed`` is sorted by size of change (largest
    relative change first); ``equal`` lists tensors identical bit for bit (same dtype and shape)."""

    a: str
    b: str
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    changed: list[TensorChange] = field(default_factory=list)
    equal: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def identical(self) -> bool:
        return not (self.only_a or self.only_b or self.changed)

    def change(self, name: str) -> TensorChange | None:
        return next((c for c in self.changed if c.name == name), None)

    def summary(self) -> str:
        return (f"{self.a} vs {self.b}: {len(self.only_a)} only in A, {len(self.only_b)} only in B, "
                f"{len(self.changed)} changed, {len(self.equal)} equal ({self.seconds:.2f} s)")

    def lines(self) -> list[str]:
        out = [f"only in A: {n}" for n in self.only_a] + [f"only in B: {n}" for n in self.only_b]
        return out + [c.line() for c in self.changed] + [self.summary()]

    def to_dict(self) -> dict:
        out = asdict(self)
        for c, d in zip(self.changed, out["changed"]):
            d["fraction"] = c.fraction
        out["identical"] = self.identical
        out["summary"] = self.summary()
        return _json_safe(out)


def _json_safe(value):
    """NaN and infinities are not JSON: they become strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value
