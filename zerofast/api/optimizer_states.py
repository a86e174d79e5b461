"""``zerofast.optimizer_state``: the wrapped optimizer's per-element state, consolidated per parameter.

The plan comes from :mod:`zerofast.plan.optimizer`, which lays these tensors out with the same
builders as the fp32 masters; it runs through the same executor.
"""
from __future__ import annotations

import functools
import os

import torch

from ..base.settings import overriding
from ..results import state_dict_of
from ..prepare import prepare


def optimizer_state(ckpt_dir: str | os.PathLike, key: str, *, dtype: torch.dtype | None = torch.float32,
                    tag: str | None = None, lazy: bool = False, follow_symlinks: bool | None = None,
                    tp_rules: str | os.PathLike | dict | None = None, tp_replicated: str | None = None,
                    unstack_layers: bool | None = None):
    """The full value of one per-element optimizer state for every trainable parameter.

    Args:
        ckpt_dir: the checkpoint root (holding ``latest``) or a tag folder, ZeRO stage 1, 2 or 3.
        key: the state's name in the wrapped optimizer, e.g. ``"exp_avg"`` or ``"exp_avg_sq"``.
        dtype: ``torch.float32`` (default), ``torch.bfloat16``/``torch.float16``, or ``None`` to
            keep what the checkpoint holds.
        tag: which save to read when the root holds several.
        lazy: return a read-only mapping that builds each tensor when it is looked up.
        follow_symlinks: follow symbolic links that lead out of the checkpoint folder (refused by
            default: a checkpoint from elsewhere could point zerofast at any file). None takes
            ``ZEROFAST_FOLLOW_SYMLINKS``.
        tp_rules, tp_replicated, unstack_layers: as for :func:`zerofast.reconstruct`.

    Returns:
        ``{param_name: tensor}`` shaped like the parameters, in the model's order (an
        ``OrderedDict``, or a :class:`~zerofast.LazyStateDict` when ``lazy`` is set). Frozen and
        tied-alias names are absent: the optimizer keeps no state for them.
    """
    with overriding(tp_rules=tp_rules, tp_replicated=tp_replicated, unstack_layers=unstack_layers):
        return state_dict_of(functools.partial(prepare, ckpt_dir, dtype, tag=tag, optimizer_keys=[key],
                                               follow_symlinks=follow_symlinks), lazy)
