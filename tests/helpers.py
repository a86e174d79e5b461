"""Comparisons shared by the tests. Everything is bit for bit: zerofast only copies and casts."""
from __future__ import annotations

import torch

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of ``t`` as integers, so NaNs and signed zeros compare exactly."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    return t.view(_INT_VIEW[t.element_size()])


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, name: str = "") -> None:
    assert actual.dtype == expected.dtype, f"{name}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.equal(bits(actual), bits(expected)), f"{name}: values differ"


def expected_value(value: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """What the dtype policy promises for a stored tensor."""
    if dtype is None or not value.is_floating_point():
        return value
    return value.to(dtype)
