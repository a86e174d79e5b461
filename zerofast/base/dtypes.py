"""The one dtype table: every name zerofast accepts or writes for a dtype, and what it may cast.

The CLI's ``--dtype`` words, the names DeepSpeed's converter accepts, the safetensors codes and
the set the native op converts between all live here, so that no two modules can disagree.
"""
from __future__ import annotations

import torch

# Requested output dtypes: None keeps what the checkpoint holds.
OUTPUT_DTYPES: tuple[torch.dtype | None, ...] = (None, torch.float32, torch.bfloat16, torch.float16)

# The CLI's words for OUTPUT_DTYPES ("keep" is None).
CLI_NAMES: dict[str, torch.dtype | None] = {
    "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "keep": None}

# Every spelling accepted from Python (DeepSpeed's converter takes these, with or without "torch.").
_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}

# DeepSpeed config sections that switch mixed precision on, and the CLI's word for what each trains in.
CONFIG_SECTIONS: dict[str, str] = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16"}

# The dtypes the native op converts between; any other pair must match exactly.
CASTABLE: frozenset[torch.dtype] = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16})

# safetensors' codes.
SAFETENSORS_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


def name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def resolve(dtype) -> torch.dtype | None:
    """A requested output dtype from a torch dtype, one of its names (``"bf16"``,
    ``"torch.float16"``, ...) or None; anything else is a ValueError that lists the choices."""
    if dtype is None:
        return None
    found = _NAMES.get(dtype.lower().removeprefix("torch.")) if isinstance(dtype, str) else dtype
    if found not in _NAMES.values():
        raise ValueError(f"Unsupported output dtype {dtype!r}. Choose one of: {', '.join(sorted(_NAMES))}")
    return found


def output_dtype(dtype) -> torch.dtype | None:
    """The requested output dtype from any spelling the API, the CLI and compat share: a torch
    dtype, None, or a name in any case (``"bf16"``, ``"BFloat16"``, ``"torch.bfloat16"``; ``"keep"``
    is None)."""
    if isinstance(dtype, str) and dtype.strip().lower() in ("keep", "none"):
        return None
    found = resolve(dtype.strip() if isinstance(dtype, str) else dtype)
    check(found)
    return found


def check(dtype: torch.dtype | None) -> None:
    """Refuse a requested dtype the policy has no meaning for."""
    if dtype not in OUTPUT_DTYPES:
        raise ValueError(f"dtype must be one of torch.float32, torch.bfloat16, torch.float16 or None, got {dtype!r}")


def castable(src: torch.dtype, dst: torch.dtype) -> bool:
    return src == dst or (src in CASTABLE and dst in CASTABLE)


def out_dtype_for(stored: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype policy: floating tensors take ``dtype``; ``None`` and non-floating keep their own."""
    if dtype is None or not stored.is_floating_point:
        return stored
    return dtype
