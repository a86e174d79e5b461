"""Plain torch models that the DeepSpeed checkpoint factory trains.

Nothing here imports DeepSpeed: a test can call ``build_model(spec["model"])`` and then
``model.load_state_dict(consolidated, strict=True)`` to check that a consolidated state
dict has exactly the keys and shapes the module expects.

Features (all switchable through keyword arguments, see ``build_model``):

* ``embed.weight`` tied to ``lm_head.weight`` (the source name is ``embed.weight``
  because it is registered first);
* persistent buffers: int64 ``step_count`` (changed by every training forward), bool
  ``token_mask`` and float ``scale``; plus a non-persistent float buffer ``scratch``
  that must NOT show up in any state dict;
* LayerNorms (float weight + bias) in every block;
* odd numels: ``odd.up`` is Linear(7, 13) (weight 91, bias 13), ``odd.down`` is
  Linear(13, 7), a 1-element parameter ``gate`` of shape (1,), and optionally
  (``empty_param``) a trainable zero-element parameter ``odd.empty`` of shape (0, 4);
* frozen parameters: a LoRA-like ``lora`` block whose ``base`` Linear (and ``base_norm``)
  has ``requires_grad=False`` while the small ``lora_a``/``lora_b`` adapters train.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

DEFAULTS = {
    "vocab": 53,
    "dim": 16,
    "hidden": 40,
    "n_blocks": 2,
    "tied": True,
    "buffers": True,
    "frozen": True,
    "lora_rank": 2,
    "odd": True,
    "empty_param": False,
    "seed": 1234,
}


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class LoraBlock(nn.Module):
    """A frozen base projection plus a trainable low-rank adapter."""

    def __init__(self, dim: int, rank: int):
        super().__init__()
        self.base_norm = nn.LayerNorm(dim)
        self.base = nn.Linear(dim, dim)
        self.lora_a = nn.Linear(dim, rank, bias=False)
        self.lora_b = nn.Linear(rank, dim, bias=False)
        for p in list(self.base.parameters()) + list(self.base_norm.parameters()):
            p.requires_grad_(False)

    def forward(self, x):
        h = self.base_norm(x)
        return x + self.base(h) + self.lora_b(self.lora_a(h))


class OddBlock(nn.Module):
    """Parameters whose numels divide badly by any world size."""

    def __init__(self, dim: int, empty_param: bool):
        super().__init__()
        self.proj_in = nn.Linear(dim, 7)
        self.up = nn.Linear(7, 13)
        self.down = nn.Linear(13, 7)
        self.proj_out = nn.Linear(7, dim, bias=False)
        self.gate = nn.Parameter(torch.full((1,), 0.5))
        # No 0-dim parameter here: DeepSpeed 0.19.8 refuses one at every stage and world size
        # (engine._broadcast_model and zero.Init call param.data.view(torch.uint8), which
        # torch rejects for 0-dim tensors).
        # Optional trainable parameter with zero elements: DeepSpeed keeps it out of the
        # optimizer groups and checkpoints it with the frozen parameters.
        self.empty = nn.Parameter(torch.zeros(0, 4)) if empty_param else None

    def forward(self, x):
        h = self.proj_in(x)
        h = self.down(torch.tanh(self.up(h)))
        if self.empty is not None:
            h = h + self.empty.sum()
        return x + self.gate * self.proj_out(h)


class ZfModel(nn.Module):
    def __init__(self, vocab, dim, hidden, n_blocks, tied, buffers, frozen, lora_rank, odd, empty_param):
        super().__init__()
        self.vocab = vocab
        self.has_buffers = buffers
        self.embed = nn.Embedding(vocab, dim)
        if buffers:
            self.register_buffer("scale", torch.linspace(0.5, 1.5, dim))
            self.register_buffer("step_count", torch.arange(3, dtype=torch.int64))
            self.register_buffer("token_mask", torch.arange(vocab) % 3 != 0)
            self.register_buffer("scratch", torch.zeros(dim), persistent=False)
        self.blocks = nn.ModuleList([Block(dim, hidden) for _ in range(n_blocks)])
        self.lora = LoraBlock(dim, lora_rank) if frozen else None
        self.odd = OddBlock(dim, empty_param) if odd else None
        self.final_norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.embed.weight

    def forward(self, ids, targets=None):
        x = self.embed(ids)
        if self.has_buffers:
            x = x * self.scale.to(x.dtype)  # stage 3 bf16 leaves float buffers fp32
            if self.training:
                with torch.no_grad():
                    self.step_count += 1
        for block in self.blocks:
            x = block(x)
        if self.lora is not None:
            x = self.lora(x)
        if self.odd is not None:
            x = self.odd(x)
        logits = self.lm_head(self.final_norm(x))
        if targets is None:
            return logits
        if self.has_buffers:
            targets = torch.where(self.token_mask[targets], targets, torch.full_like(targets, -100))
        return F.cross_entropy(logits.float().reshape(-1, self.vocab), targets.reshape(-1), ignore_index=-100)


def model_kwargs(model_spec: dict | None) -> dict:
    kw = dict(DEFAULTS)
    kw.update(model_spec or {})
    unknown = set(kw) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown model options: {sorted(unknown)}")
    return kw


def build_model(model_spec: dict | None = None) -> ZfModel:
    """Build the model deterministically (same seed -> same initial values)."""
    kw = model_kwargs(model_spec)
    seed = kw.pop("seed")
    torch.manual_seed(seed)
    return ZfModel(**kw)


def param_groups(model: nn.Module, n_groups: int, weight_decay: float = 0.01):
    """Optimizer param groups.

    1 group: every parameter. 2 groups: group 0 = matrices (ndim >= 2, with weight decay),
    group 1 = biases, norms and scalars (ndim < 2, no decay). 3 groups: like 2, but the
    LayerNorm parameters get a third group. Frozen parameters stay in the groups (DeepSpeed
    filters them out itself). Tied parameters appear once (named_parameters dedups).
    """
    # Under deepspeed.zero.Init the tensors are empty placeholders: use the recorded shape.
    named = [(n, p, len(getattr(p, "ds_shape", p.shape))) for n, p in model.named_parameters()]
    if n_groups == 1:
        return [{"params": [p for _, p, _ in named]}]
    mats = [p for n, p, ndim in named if ndim >= 2]
    if n_groups == 2:
        rest = [p for n, p, ndim in named if ndim < 2]
        return [{"params": mats, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]
    if n_groups == 3:
        norms = [p for n, p, ndim in named if ndim < 2 and "norm" in n]
        rest = [p for n, p, ndim in named if ndim < 2 and "norm" not in n]
        return [
            {"params": mats, "weight_decay": weight_decay},
            {"params": rest, "weight_decay": 0.0},
            {"params": norms, "weight_decay": 0.0, "lr": 5e-3},
        ]
    raise ValueError(f"n_groups must be 1, 2 or 3, not {n_groups}")
