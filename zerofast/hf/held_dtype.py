"""Which base a merged adapter gets (``base_dtype="as-trained"``): the dtype the run held the
frozen base in, read from what the model-states file records."""
from __future__ import annotations

import torch

from ..base import dtypes, keys
from ..base.errors import ExportError, short_repr
from ..prepare import Prepared
from ..plan import TRAINABLE

_MIXED_PRECISION = {"fp16": torch.float16, "bf16": torch.bfloat16}


def training_dtype(prepared: Prepared) -> torch.dtype:
    """The dtype the run held the frozen base in, from what the model-states file records.

    What it relies on: the DeepSpeed config the file records (``ds_config``, as the engine ran it;
    the Trainer has filled in its "auto" values by then). ``fp16.enabled`` -> float16,
    ``bf16.enabled`` (``bfloat16`` where there is no ``bf16`` section, as DeepSpeed reads it) ->
    bfloat16: in those modes DeepSpeed holds the base in that dtype (it casts the module's
    parameters; at ZeRO-3, zero.Init builds them so). Frozen parameters the file still holds
    (a tied name) must agree. Not the trainable ones: at ZeRO-3 a LoRA adapter added after
    zero.Init stays float32 under bf16. With neither mode, DeepSpeed keeps the dtypes the model
    was loaded in, which the file records only through the parameters it holds: float32 when
    they are all float32. Anything else is an ExportError naming the file."""
    meta = prepared.checkpoint.meta
    path = meta.path

    def unknown(why: str) -> ExportError:
        return ExportError(f"base_dtype='as-trained' (--base-dtype as-trained) needs the dtype the run held the base "
                           f"model in, and this file does not settle it: {why}; pass base_dtype='as-stored' "
                           "(--base-dtype as-stored) to merge onto the base as stored", path)

    config = meta.raw.get(keys.DS_CONFIG)
    if not isinstance(config, dict):
        raise unknown("it records no DeepSpeed config (ds_config)")
    sections = {"fp16": config.get("fp16"),
                "bf16": config["bf16"] if config.get("bf16") is not None else config.get("bfloat16")}
    enabled = []
    for label, section in sections.items():
        if section is None:
            continue
        if not isinstance(section, dict):
            raise unknown(f"ds_config's {label} section is {short_repr(section, 40)}, not a dict")
        flag = section.get("enabled", False)
        if not isinstance(flag, bool):
            raise unknown(f"ds_config's {label} 'enabled' is {short_repr(flag, 40)}, not true or false")
        if flag:
            enabled.append(label)
    if len(enabled) > 1:
        raise unknown("ds_config enables both fp16 and bf16")
    buffers = set(meta.buffer_names)
    trainable = {n for n, tp in prepared.plan.tensors.items() if tp.kind == TRAINABLE}
    params = {k: v.dtype for k, v in meta.module.items()
              if k not in buffers and isinstance(v, torch.Tensor) and v.dtype.is_floating_point}
    if enabled:
        dtype = _MIXED_PRECISION[enabled[0]]
        frozen = {d for k, d in params.items() if k not in trainable}
        if frozen - {dtype}:
            raise unknown(f"ds_config trains in {enabled[0]}, but the frozen parameters it holds are "
                          f"{', '.join(sorted(map(dtypes.name, frozen)))}")
        return dtype
    held = set(params.values())
    if held - {torch.float32}:
        raise unknown("ds_config enables neither fp16 nor bf16, so DeepSpeed kept the dtypes the model was loaded "
                      f"in, and the module parameters it holds are {', '.join(sorted(map(dtypes.name, held)))}")
    return torch.float32
