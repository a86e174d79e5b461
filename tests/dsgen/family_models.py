"""Tiny models for the mixture-of-experts and pipeline-parallel checkpoint generators.

Both need DeepSpeed to build (``deepspeed.moe.layer.MoE``, ``deepspeed.pipe``), which is a test
dependency; zerofast itself never imports this module.

* ``build_moe(ep_size)``: an embedding (tied to the output head), persistent buffers, a frozen
  LayerNorm, and two MoE layers (4 and 2 experts, top-1 gate). ``ep_size=1`` is the
  single-process model whose ``state_dict()`` names every expert by its global id: the names a
  consolidated MoE checkpoint must come back under.
* ``build_llama()``: a tiny transformers Llama (2 layers, grouped-query attention, untied head)
  for AutoTP; transformers is a test dependency only.
* ``pipe_layers()``: the layer specs of a 6-layer pipeline (a tied embedding / head pair, two
  MLP blocks, a frozen block with int64 and float buffers, a LayerNorm). ``build_sequential()``
  builds the same layers as one ``nn.Sequential`` (the tied pair sharing one Parameter): the
  names ``zerofast.pipeline_to_sequential`` maps PipelineModule names to.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

VOCAB = 37
DIM = 12
HIDDEN = 20
MOE_EXPERTS = (4, 2)  # experts per MoE layer


class Expert(nn.Module):
    def __init__(self, dim: int = DIM, hidden: int = HIDDEN):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class MoEModel(nn.Module):
    def __init__(self, ep_size: int):
        super().__init__()
        from deepspeed.moe.layer import MoE

        self.embed = nn.Embedding(VOCAB, DIM)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, DIM))
        self.register_buffer("step_count", torch.arange(3, dtype=torch.int64))
        self.frozen_norm = nn.LayerNorm(DIM)
        for p in self.frozen_norm.parameters():
            p.requires_grad_(False)
        self.moe1 = MoE(hidden_size=DIM, expert=Expert(), num_experts=MOE_EXPERTS[0], ep_size=ep_size, k=1,
                        min_capacity=4)
        self.mid = nn.Linear(DIM, DIM)
        self.moe2 = MoE(hidden_size=DIM, expert=Expert(), num_experts=MOE_EXPERTS[1], ep_size=ep_size, k=1,
                        min_capacity=4)
        self.final_norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, ids, targets):
        x = self.frozen_norm(self.embed(ids) * self.scale.to(self.embed.weight.dtype))
        if self.training:
            with torch.no_grad():
                self.step_count += 1
        h, aux1, _ = self.moe1(x)
        x = x + h
        x = x + self.mid(x)
        h, aux2, _ = self.moe2(x)
        x = x + h
        logits = self.lm_head(self.final_norm(x))
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))
        return loss + 0.01 * (aux1 + aux2).float()


def build_moe(ep_size: int, seed: int = 1234) -> MoEModel:
    torch.manual_seed(seed)
    return MoEModel(ep_size)


class Embed(nn.Embedding):
    pass


class PipeBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class FrozenBlock(nn.Module):
    """A frozen projection with buffers: their values live only in the pipeline's layer files."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)
        for p in self.proj.parameters():
            p.requires_grad_(False)
        self.adapter = nn.Linear(DIM, 3, bias=False)
        self.adapter_out = nn.Linear(3, DIM, bias=False)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, DIM))
        self.register_buffer("calls", torch.zeros(2, dtype=torch.int64))

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.calls += 1
        return x + self.proj(x) * self.scale.to(x.dtype) + self.adapter_out(self.adapter(x))


def head_forward(module, x):
    return F.linear(x, module.weight)


def pipe_layers():
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    return [
        TiedLayerSpec("embed", Embed, VOCAB, DIM),
        LayerSpec(PipeBlock),
        LayerSpec(FrozenBlock),
        LayerSpec(PipeBlock),
        LayerSpec(nn.LayerNorm, DIM),
        TiedLayerSpec("embed", Embed, VOCAB, DIM, forward_fn=head_forward),
    ]


def pipe_loss(logits, targets):
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def build_sequential(seed: int = 1234) -> nn.Sequential:
    """The pipeline's layers as one module: layer i under ``"i"``, the tied head sharing layer 0's weight."""
    torch.manual_seed(seed)
    embed = Embed(VOCAB, DIM)
    head = Embed(VOCAB, DIM)
    head.weight = embed.weight
    return nn.Sequential(embed, PipeBlock(), FrozenBlock(), PipeBlock(), nn.LayerNorm(DIM), head)


def build_llama(seed: int = 1234):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB + 3, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config)
