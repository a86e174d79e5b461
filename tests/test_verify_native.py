"""verify and diff give the same reports whether their checks run in the native op
(zerofast.checks.ranges) or in Python (the path for dtypes the op does not know), on real
DeepSpeed checkpoints with faults planted: a changed master, NaN and infinities in masters and
moments, a changed export element, a diff of two saves and of a checkpoint against a bf16 export."""
from __future__ import annotations

import shutil
import struct

import pytest
import torch

import zerofast
from tests.conftest import HAVE_DEEPSPEED
from tests.dsgen.catalog import ensure_checkpoint
from tests.test_verify import _overwrite, _segments
from zerofast.checks import checkpoint, tensors
from zerofast.prepare import prepare

pytestmark = pytest.mark.skipif(not HAVE_DEEPSPEED, reason="DeepSpeed 0.19.8 is needed to make real checkpoints")


def _both(monkeypatch, run) -> tuple[dict, dict]:
    """``run()``'s report as a dict (without its timing), natively and in Python."""
    def untimed():
        result = run()
        result.seconds = 0.0
        return result.to_dict()

    native = untimed()
    with monkeypatch.context() as m:
        for module in (tensors, checkpoint):
            m.setattr(module, "NATIVE_DTYPES", frozenset())
        python = untimed()
    return native, python


def _trainables(ckpt, n: int) -> list[str]:
    """``n`` trainable tensors whose first stored range holds at least three elements."""
    plan = prepare(ckpt, None, warn_absent=False).plan
    names = [name for name, tp in plan.tensors.items() if tp.kind == "trainable" and tp.segments
             and tp.segments[0][3] >= 3]
    return names[:n]


def test_a_planted_checkpoint_reports_alike(monkeypatch, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(ensure_checkpoint("s2_bf16_w2_frozen_tied"), ckpt)
    first, second = _trainables(ckpt, 2)
    file, offset, _, _ = _segments(ckpt, first)[0]
    _overwrite(file, offset, struct.pack("<ff", 1e30, float("nan")))  # a master off its weight, and a NaN
    file, offset, _, _ = _segments(ckpt, second)[0]
    _overwrite(file, offset, struct.pack("<ff", float("inf"), -0.0))
    file, offset, _, _ = _segments(ckpt, second, "exp_avg_sq")[0]
    _overwrite(file, offset, struct.pack("<fff", float("nan"), float("-inf"), 0.0))
    for strict in (False, True):
        native, python = _both(monkeypatch, lambda: zerofast.verify(ckpt, strict=strict))
        assert native == python
        checks = {(f["check"], f["name"]) for f in native["findings"]}
        assert {("master-weight", first), ("nonfinite", first), ("nonfinite", second),
                ("nonfinite", f"{second}.exp_avg_sq")} <= checks, native["findings"]


def test_an_export_with_a_changed_element_reports_alike(monkeypatch, tmp_path):
    ckpt = ensure_checkpoint("s2_bf16_w2_frozen_tied")
    out = tmp_path / "hf"
    zerofast.export(ckpt, out, max_shard_size="4KB", dtype=torch.bfloat16)
    shard = sorted(out.glob("model-0000*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    data[8 + n + 3] ^= 0x40  # one bit of the first tensor's second element
    shard.write_bytes(bytes(data))
    native, python = _both(monkeypatch, lambda: zerofast.verify(out, against=ckpt))
    assert native == python and [f["check"] for f in native["findings"]] == ["values"], native["findings"]


def test_diffs_report_alike(monkeypatch, tmp_path):
    from tests.dsgen.two_saves import ensure_two_saves

    root = ensure_two_saves()
    native, python = _both(monkeypatch, lambda: zerofast.diff(root / "global_step2", root / "global_step3",
                                                               optimizer=True))
    assert native == python and native["changed"]
    ckpt = ensure_checkpoint("s2_bf16_w2_frozen_tied")
    zerofast.export(ckpt, tmp_path / "bf16", dtype=torch.bfloat16)
    native, python = _both(monkeypatch, lambda: zerofast.diff(ckpt, tmp_path / "bf16"))
    assert native == python and any(c["dtype_a"] != c["dtype_b"] for c in native["changed"])


def test_a_torch_export_holding_a_strided_tensor_reports_alike(monkeypatch, tmp_path):
    # torch.save keeps a view's strides: the native checks read such a tensor like any other.
    ckpt = ensure_checkpoint("s2_bf16_w2_frozen_tied")
    out = tmp_path / "hf"
    zerofast.export(ckpt, out, format="torch")
    file = sorted(out.glob("*.bin"))[0]
    saved = torch.load(file, weights_only=True)
    name = next(n for n, t in saved.items() if t.dim() == 2)
    wide = torch.zeros(2 * saved[name].numel(), dtype=saved[name].dtype)
    wide[::2] = saved[name].reshape(-1)
    saved[name] = wide[::2].reshape(saved[name].shape)
    torch.save(saved, file)
    assert not torch.load(file, weights_only=True)[name].is_contiguous()
    native, python = _both(monkeypatch, lambda: zerofast.verify(out, against=ckpt))
    assert native == python and native["findings"] == [], native["findings"]
