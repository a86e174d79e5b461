"""Drop-in replacements for ``deepspeed.utils.zero_to_fp32``: same names, signatures and defaults.

Moving a project over is one changed import::

    from zerofast.compat import get_fp32_state_dict_from_zero_checkpoint

Everything runs on zerofast's plan and native executor, so the differences are zerofast's:
no DeepSpeed import, no code run from the pickles, frozen parameters upcast to fp32 like the
rest (DeepSpeed leaves them in the model dtype), stage-3 tied weights present, and a
keyword-only ``dtype`` (``None`` keeps what the checkpoint holds).
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from .base import dtypes
from .hf import ExportResult, Progress, export
from .results import LazyStateDict
from .api.load_into import load_into
from .api.reconstruct import reconstruct

_NO_LIMIT = 1 << 62  # max_shard_size=None: one file, as DeepSpeed writes then


class LazyTensor:
    """A value of the lazy state dict: ``contiguous()`` builds the tensor (in the requested dtype);
    ``shape`` and ``dtype`` are known without reading data. DeepSpeed's lazy values offer these
    three, so code written for them runs unchanged."""

    __slots__ = ("_source", "_name", "shape", "dtype")

    def __init__(self, source: LazyStateDict, name: str):
        meta = source.meta(name)
        self._source, self._name = source, name
        self.shape, self.dtype = meta.shape, meta.dtype

    def contiguous(self) -> torch.Tensor:
        return self._source[self._name]

    def __repr__(self) -> str:
        return f"LazyTensor({self._name!r}, shape={tuple(self.shape)}, dtype={self.dtype})"


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=None, exclude_frozen_parameters=False,
                                             lazy_mode=False, *, dtype=torch.float32, follow_symlinks=None):
    """The consolidated state dict of a ZeRO checkpoint, every floating tensor in fp32.

    ``lazy_mode=True`` returns a dict of :class:`LazyTensor` whose ``contiguous()`` builds one
    tensor at a time; tied names map to the same object. ``dtype`` (zerofast only):
    ``torch.bfloat16``/``torch.float16`` cast every floating tensor, ``None`` keeps the stored
    dtypes (fp32 masters, frozen weights in the model dtype), as DeepSpeed's engine does.
    ``follow_symlinks`` (zerofast only): as for :func:`zerofast.reconstruct`.
    """
    options = dict(tag=tag, exclude_frozen=exclude_frozen_parameters, follow_symlinks=follow_symlinks)
    if not lazy_mode:
        return reconstruct(checkpoint_dir, dtype, **options)
    source = reconstruct(checkpoint_dir, dtype, lazy=True, **options)
    values = {name: LazyTensor(source, name) for name in source.plan.tensors}
    return OrderedDict((name, values[source.plan.aliases.get(name, name)]) for name in source)


def convert_zero_checkpoint_to_state_dict(checkpoint_dir, output_dir, dtype=torch.float32, max_shard_size="5GB",
                                          safe_serialization=False, tag=None, exclude_frozen_parameters=False, *,
                                          follow_symlinks=None):
    """Write the consolidated weights with DeepSpeed's file names: ``pytorch_model.bin`` (or
    ``model.safetensors`` with ``safe_serialization``), sharded with an index past
    ``max_shard_size`` (``None``: never). ``dtype`` takes a torch dtype or a name such as
    ``"bf16"``; ``None`` (zerofast only) keeps the stored dtypes.

    Like DeepSpeed, it writes into a folder that holds other files, replacing only weight files.
    Tied weights: the torch format keeps them shared; safetensors stores one copy and records the
    alias in its metadata (see ``zerofast.load_exported``), where DeepSpeed's safetensors path
    fails on shared tensors. ``follow_symlinks`` (zerofast only): as for :func:`zerofast.reconstruct`.
    """
    return export_like_deepspeed(checkpoint_dir, output_dir, dtype=dtype, max_shard_size=max_shard_size,
                                 safe_serialization=safe_serialization, tag=tag,
                                 exclude_frozen_parameters=exclude_frozen_parameters, follow_symlinks=follow_symlinks)


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_dir, max_shard_size="5GB",
                                               safe_serialization=False, tag=None, exclude_frozen_parameters=False,
                                               *, follow_symlinks=None):
    """:func:`convert_zero_checkpoint_to_state_dict` in fp32."""
    return convert_zero_checkpoint_to_state_dict(checkpoint_dir, output_dir, dtype=torch.float32,
                                                 max_shard_size=max_shard_size,
                                                 safe_serialization=safe_serialization, tag=tag,
                                                 exclude_frozen_parameters=exclude_frozen_parameters,
                                                 follow_symlinks=follow_symlinks)


def load_state_dict_from_zero_checkpoint(model, checkpoint_dir, tag=None, *, follow_symlinks=None):
    """Move ``model`` to the CPU, load the checkpoint into it (non-strict, like DeepSpeed) and
    return it. Tensors are written in place, one at a time; no state dict is built."""
    model = model.cpu()
    # Casting each value straight to its parameter's dtype gives the same bits as DeepSpeed's
    # detour through fp32: every stored dtype converts to fp32 exactly.
    load_into(model, checkpoint_dir, strict=False, tag=tag, dtype=None, follow_symlinks=follow_symlinks)
    return model


def export_like_deepspeed(checkpoint_dir, output_dir, *, dtype=torch.float32, max_shard_size="5GB",
                          safe_serialization=False, tag=None, exclude_frozen_parameters=False,
                          progress: Progress | None = None, follow_symlinks: bool | None = None) -> ExportResult:
    """The conversion behind the compat functions and ``zerofast zero-to-fp32``."""
    return export(checkpoint_dir, output_dir, dtype=dtypes.resolve(dtype),
                  format="safetensors" if safe_serialization else "torch",
                  max_shard_size=_NO_LIMIT if max_shard_size is None else max_shard_size, tag=tag,
                  exclude_frozen=exclude_frozen_parameters, overwrite=True, progress=progress, hf_files=False,
                  follow_symlinks=follow_symlinks)

