"""``zerofast.reconstruct``: discover, load safely, plan, execute, and hand back a state dict."""
from __future__ import annotations

import functools
import os

import torch

from ..base.settings import overriding
from ..native import ops
from ..results import state_dict_of
from ..prepare import prepare


def reconstruct(ckpt_dir: str | os.PathLike, dtype: torch.dtype | None = torch.float32, *, tag: str | None = None,
                lazy: bool = False, exclude_frozen: bool = False, device: str | torch.device = "cpu",
                follow_symlinks: bool | None = None, tp_rules: str | os.PathLike | dict | None = None, tp_replicated: str | None = None,
                unstack_layers: bool | None = None):
    """Consolidate a DeepSpeed ZeRO checkpoint into one state dict.

    Args:
        ckpt_dir: the checkpoint root (holding ``latest``) or a tag folder.
        dtype: ``torch.float32`` (default) returns every floating tensor as fp32, frozen weights
            included; ``torch.bfloat16``/``torch.float16`` cast every floating tensor once;
            ``None`` keeps what the checkpoint holds (fp32 masters, frozen weights in the model
            dtype, buffers as stored). Integer and bool buffers always keep their dtype.
        tag: which save to read when the root holds several.
        lazy: return a read-only mapping that builds each tensor when it is looked up.
        exclude_frozen: leave out parameters with ``requires_grad=False`` (e.g. a LoRA base).
        device: where the tensors are built and returned: ``"cpu"``, or ``"cuda"``/``"cuda:N"``
            (gathered and cast on the GPU; needs the extension built with CUDA).
        follow_symlinks: follow symbolic links that lead out of the checkpoint folder (refused by
            default: a checkpoint from elsewhere could point zerofast at any file). None takes
            ``ZEROFAST_FOLLOW_SYMLINKS``.
        tp_rules: how a tensor-parallel save's slices go together where the save does not record
            it, or instead of what it records: a preset (``"megatron-gpt:mlp=swiglu,vocab=50257"``),
            the path of a JSON rules file, or the rules as a dict (docs/formats.md). None takes
            ``ZEROFAST_TP_RULES``.
        tp_replicated: ``"equal"`` refuses a tensor-parallel replicated parameter whose copies
            differ between the tp ranks, ``"mean"`` averages them as ``ds_to_universal`` does.
            None takes ``ZEROFAST_TP_REPLICATED`` (default ``"equal"``).
        unstack_layers: a Megatron-Core save's stacked layers come out per layer
            (``decoder.layers.<i>.*``), weights and optimizer state. None takes
            ``ZEROFAST_UNSTACK_LAYERS`` (default: kept as stored).

    Returns:
        An ``OrderedDict`` in the model's own ``state_dict()`` order (tied parameters share
        storage), or a :class:`~zerofast.LazyStateDict` when ``lazy`` is set.
    """
    device = ops.resolve_device(device)
    with overriding(tp_rules=tp_rules, tp_replicated=tp_replicated, unstack_layers=unstack_layers):
        return state_dict_of(functools.partial(prepare, ckpt_dir, dtype, tag=tag, exclude_frozen=exclude_frozen,
                                               follow_symlinks=follow_symlinks), lazy, device)
