"""Train a tiny Megatron-DeepSpeed-style GPT (tensor parallel x data parallel) with DeepSpeed on the CPU.

No Megatron is installed: this file holds a tiny GPT whose state-dict names are those of
Megatron-DeepSpeed's ``GPTModel`` with ``--no-pipeline-parallel``, its tensor-parallel layers
(column-, row- and vocabulary-parallel, Megatron's autograd functions over the tp group), an
``mpu`` object in Megatron's rank order (global rank = dp * TP + tp) passed to
``deepspeed.initialize(mpu=...)``, and the ``universal_checkpoint_info`` that Megatron-DeepSpeed's
``UniversalCheckpointInfo`` would write for these names. Run under torchrun like train.py:

    DS_ACCELERATOR=cpu python -m torch.distributed.run --nproc_per_node W \
        tests/dsgen/train_megatron.py '<spec as JSON>' OUTDIR

Spec keys: family ("megatron"), stage, world_size, dtype ("bf16" | "fp32"), tp, steps, ds_config, and
the variants (all off by default):

* ``drift``: on the last step, tp rank t's copies of the replicated layer norms and row-parallel
  biases (:data:`DRIFTING`, not the position embeddings) get ``DRIFT_DELTA * t`` added to their
  gradient, as if each tp rank saw a different loss contribution for them and nothing all-reduced
  their gradients over the tp group (BLOOM's drifted layer norms). Their copies (masters and
  moments) then differ between the tp ranks, and nothing else does (no forward pass follows);
  ``universal_checkpoint_info`` still lists them under ``tp_replicated_parameter_patterns``;
* ``average`` (with ``drift``): the same save, but ``universal_checkpoint_info`` lists those
  parameters under ``parameter_to_average_patterns`` instead;
* ``universal_checkpoint_info: false``: the client state holds no ``universal_checkpoint_info``;
* ``sub_params``: ``universal_checkpoint_info`` version 0.4 declares SwiGLU's ``dense_h_to_4h``
  under ``parameter_with_sub_params`` (two sub-parameters of FFN rows, ``sub_param_shard_widths``
  FFN / tp each) instead of ``parameter_with_2_sub_params_cat_dim_0``: the same layout, the
  other rule;
* ``frozen`` (stages 1-2): the parameters of :data:`FROZEN` (one of each tensor-parallel kind:
  vocabulary, column, row, SwiGLU, replicated) have ``requires_grad=False`` and are left out of
  the optimizer, so each tp rank's model states hold its shard of them in the model dtype; the
  truth's ``frozen`` holds each put together over the tp group (the vocabulary without padding);
* ``megatron_save``: saved the way Megatron-DeepSpeed's ``save_checkpoint`` saves with
  ``--no-pipeline-parallel``: the module's ``state_dict`` replaced by its
  ``state_dict_for_save_checkpoint`` (a NESTED dict ``{"language_model": {"embedding":
  {"word_embeddings": {"weight"}, "position_embeddings": {"weight"}}, "encoder": {"layers.0....",
  "final_layernorm...."}}}``) for the save, and the client state of ``generate_state_dict``:
  ``args`` (an ``argparse.Namespace``), ``checkpoint_version`` 3.0, ``iteration``, ``tokens``,
  ``universal_checkpoint_info`` and ``rng_state`` (a list of one dict holding ``random``'s,
  numpy's and torch's states, ``cuda_rng_state`` None, ``rng_tracker_states`` {}): the model
  states need ``torch.load(weights_only=False)`` (argparse and numpy globals).

OUTDIR gets what ``engine.save_checkpoint`` writes (``latest``, the tag folder with
``mp_rank_{tp}_model_states.pt`` at stages 1-2 or ``zero_pp_rank_{dp}_mp_rank_{tp}_model_states.pt``
at stage 3, and ``[bf16_]zero_pp_rank_{dp}_mp_rank_{tp}_optim_states.pt``), with
``client_state={"universal_checkpoint_info": uc_info(spec), "iteration": steps}`` (see the variants),
and from rank 0:

* ``ground_truth.pt`` (plain data, ``torch.load(weights_only=True)``), the keys of
  train_families.py's truth under the FULL Megatron names and shapes: every tensor-parallel
  shard (``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state`` first, over the dp
  group) put together over the tp group by the model's own partitioning (``gather_full``):
  all-gather along the partition dim; SwiGLU's ``dense_h_to_4h``: the gate halves, then the up
  halves; the vocabulary: all 24 padded rows, then the original 21. A replicated parameter is
  tp rank 0's copy, after checking that every tp rank holds the same bits (master and moments).
  A drifted parameter (``drift``) is the mean of the tp ranks' copies, ``sum(copies) / T`` in
  fp32 (``(0 + s0 + s1) / 2``, as ds_to_universal averages), after checking that every tp rank's
  copy differs from rank 0's (master and moments) and that no other parameter drifted.
  Extra keys: ``tp_partition`` (name -> {"kind", "dim"}), ``shard_shapes`` (name -> shape held
  by each tp rank), ``universal_checkpoint_info`` (None where the save has none),
  ``original_vocab_size``, ``padded_vocab_size``; with ``drift`` also ``tp_copies`` (name -> [tp
  rank 0's fp32 master, tp rank 1's, ...]) and ``tp_copies_optimizer`` (key -> name -> the
  copies of that moment).
* ``universal/`` (``latest_universal`` and ``<tag>_universal/``): what DeepSpeed's own
  ``ds_to_universal`` writes from the save (run in-process, one worker, no
  ``--inject_missing_state``), a second reference; or, where it raises, ``ds_to_universal.error``
  holding its one-line reason.
"""
import argparse
import copy
import os
import random
import re
import shutil
import sys
import traceback
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import numpy  # noqa: E402
import torch  # noqa: E402
import torch.distributed as tdist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
import deepspeed  # noqa: E402
import deepspeed.comm as dist  # noqa: E402
from deepspeed.utils import safe_get_full_fp32_param  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train as base  # noqa: E402
import train_families as families  # noqa: E402  (merge_truth)
from gloo_job import process_group  # noqa: E402

VOCAB = 21          # original vocabulary
PADDED_VOCAB = 24   # Megatron pads the vocabulary to a multiple of tp (and of make_vocab_size_divisible_by)
HIDDEN = 8
HEADS = 2
FFN = 12            # SwiGLU: dense_h_to_4h holds gate (FFN rows) and up (FFN rows)
MAX_POS = 8
LAYERS = 2
SEQ = 6
SEED = 1234

# -- the full model: name -> (full shape, tensor-parallel kind) ------------------------------------
# kinds: "vocab" (rows split, padded vocabulary), "column" (dim 0), "row" (dim 1),
# "swiglu" (two sub-params stacked on dim 0, each split on dim 0), "replicated".
PARTITION_DIM = {"vocab": 0, "column": 0, "row": 1, "swiglu": 0, "replicated": None}


def full_params() -> dict:
    p = {"language_model.embedding.word_embeddings.weight": ((PADDED_VOCAB, HIDDEN), "vocab"),
         "language_model.embedding.position_embeddings.weight": ((MAX_POS, HIDDEN), "replicated")}
    for i in range(LAYERS):
        layer = f"language_model.encoder.layers.{i}."
        p.update({
            layer + "input_layernorm.weight": ((HIDDEN,), "replicated"),
            layer + "input_layernorm.bias": ((HIDDEN,), "replicated"),
            layer + "self_attention.query_key_value.weight": ((3 * HIDDEN, HIDDEN), "column"),
            layer + "self_attention.query_key_value.bias": ((3 * HIDDEN,), "column"),
            layer + "self_attention.dense.weight": ((HIDDEN, HIDDEN), "row"),
            layer + "self_attention.dense.bias": ((HIDDEN,), "replicated"),
            layer + "post_attention_layernorm.weight": ((HIDDEN,), "replicated"),
            layer + "post_attention_layernorm.bias": ((HIDDEN,), "replicated"),
            layer + "mlp.dense_h_to_4h.weight": ((2 * FFN, HIDDEN), "swiglu"),
            layer + "mlp.dense_h_to_4h.bias": ((2 * FFN,), "swiglu"),
            layer + "mlp.dense_4h_to_h.weight": ((HIDDEN, FFN), "row"),
            layer + "mlp.dense_4h_to_h.bias": ((HIDDEN,), "replicated"),
        })
    p["language_model.encoder.final_layernorm.weight"] = ((HIDDEN,), "replicated")
    p["language_model.encoder.final_layernorm.bias"] = ((HIDDEN,), "replicated")
    return p


# What Megatron-DeepSpeed's UniversalCheckpointInfo would write for these names: regexes that
# ds_to_universal applies with re.match (a prefix match), at most one per list for each name.
_L = r"language_model\.encoder\.layers\.\d+\."
# The replicated parameters that ``drift`` makes differ between the tp ranks: the layer norms and
# the row-parallel biases (the position embeddings stay equal).
DRIFTING = [
    _L + r"input_layernorm\.weight",
    _L + r"input_layernorm\.bias",
    _L + r"self_attention\.dense\.bias",
    _L + r"post_attention_layernorm\.weight",
    _L + r"post_attention_layernorm\.bias",
    _L + r"mlp\.dense_4h_to_h\.bias",
    r"language_model\.encoder\.final_layernorm\.weight",
    r"language_model\.encoder\.final_layernorm\.bias",
]
DRIFT_DELTA = 1e-2  # added to tp rank t's gradient of a drifting parameter, times t, on the last step
UC_INFO = {
    "universal_checkpoint_version": 0.2,
    "original_vocab_size": VOCAB,
    "padded_vocab_size": PADDED_VOCAB,
    "tp_replicated_parameter_patterns": [r"language_model\.embedding\.position_embeddings\.weight"] + DRIFTING,
    "vocabulary_parameter_patterns": [r"language_model\.embedding\.word_embeddings\.weight"],
    "parameter_with_row_parallelism_patterns": [
        _L + r"self_attention\.dense\.weight",
        _L + r"mlp\.dense_4h_to_h\.weight",
    ],
    "parameter_with_2_sub_params_cat_dim_0": [
        _L + r"mlp\.dense_h_to_4h\.weight",
        _L + r"mlp\.dense_h_to_4h\.bias",
    ],
    "parameter_to_average_patterns": [],
}
_INFO_KIND = {"tp_replicated_parameter_patterns": "replicated", "parameter_to_average_patterns": "replicated",
              "vocabulary_parameter_patterns": "vocab", "parameter_with_row_parallelism_patterns": "row",
              "parameter_with_2_sub_params_cat_dim_0": "swiglu"}
VARIANT_KEYS = ("drift", "average", "universal_checkpoint_info", "megatron_save", "frozen", "sub_params")
# ``frozen``: one parameter of each tensor-parallel kind
FROZEN = ("language_model.embedding.word_embeddings.weight",
          "language_model.encoder.layers.0.self_attention.query_key_value.weight",
          "language_model.encoder.layers.0.self_attention.dense.weight",
          "language_model.encoder.layers.0.mlp.dense_h_to_4h.weight",
          "language_model.encoder.layers.0.input_layernorm.weight")


def uc_info(spec: dict) -> dict | None:
    """The ``universal_checkpoint_info`` this layout saves: UC_INFO; with ``average`` the drifting
    parameters under ``parameter_to_average_patterns``; None for ``universal_checkpoint_info: false``."""
    if spec.get("average") and not spec.get("drift"):
        raise ValueError("spec: 'average' averages the drifted copies: it needs 'drift'")
    if not spec.get("universal_checkpoint_info", True):
        return None
    info = copy.deepcopy(UC_INFO)
    if spec.get("average"):
        info["tp_replicated_parameter_patterns"] = [p for p in info["tp_replicated_parameter_patterns"]
                                                    if p not in DRIFTING]
        info["parameter_to_average_patterns"] = list(DRIFTING)
    if spec.get("sub_params"):
        tp = int(spec["tp"])
        weight, bias = info.pop("parameter_with_2_sub_params_cat_dim_0")
        info["parameter_with_2_sub_params_cat_dim_0"] = []
        # ds_to_universal sums tuples only: the sub-parameters' sizes are a tuple at partition_dim
        info["parameter_with_sub_params"] = [{"patterns": [weight], "shape": ((FFN, FFN), HIDDEN), "partition_dim": 0},
                                             {"patterns": [bias], "shape": ((FFN, FFN),), "partition_dim": 0}]
        info["sub_param_shard_widths"] = {p: [[FFN // tp] * tp, [FFN // tp] * tp] for p in (weight, bias)}
        info["universal_checkpoint_version"] = 0.4
    return info


def check_uc_info(info: dict | None) -> None:
    """``info`` says of every name what the model does with it (column-parallel: no list)."""
    if info is None:
        return
    used = set()
    lists = {key: info[key] for key in _INFO_KIND}
    lists["sub_params"] = [p for entry in info.get("parameter_with_sub_params", []) for p in entry["patterns"]]
    for name, (_shape, kind) in full_params().items():
        said = []
        for key, k in {**_INFO_KIND, "sub_params": "swiglu"}.items():
            hits = [pat for pat in lists[key] if re.match(pat, name)]
            assert len(hits) <= 1, (name, hits)
            said += [k] * len(hits)
            used.update(hits)
        assert said == ([] if kind == "column" else [kind]), (name, kind, said)
    unused = {pat for pats in lists.values() for pat in pats} - used
    assert not unused, unused


def drifting(name: str) -> bool:
    return any(re.match(p, name) for p in DRIFTING)


def full_values(seed: int = SEED) -> dict:
    """Every full fp32 tensor, drawn from one seeded generator in name order (the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (shape, _kind) in full_params().items():
        noise = torch.randn(shape, generator=g)
        if "layernorm.weight" in name:
            out[name] = 1.0 + 0.1 * noise
        elif name.endswith(".bias"):
            out[name] = 0.1 * noise
        else:
            out[name] = 0.3 * noise
    return out


def shard_of(full: torch.Tensor, kind: str, tp_rank: int, tp: int) -> torch.Tensor:
    """This tp rank's piece of ``full``, as Megatron lays it out."""
    if kind == "replicated":
        return full.clone()
    if kind == "swiglu":
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[tp_rank], up.chunk(tp, dim=0)[tp_rank]], dim=0).clone()
    return full.chunk(tp, dim=PARTITION_DIM[kind])[tp_rank].clone()


def join_shards(shards: list, kind: str) -> torch.Tensor:
    """The full tensor from the tp ranks' pieces (inverse of shard_of; the vocabulary still padded)."""
    if kind == "replicated":
        return shards[0]
    if kind == "swiglu":
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=PARTITION_DIM[kind])


# -- Megatron's mpu, rank order tp fastest ----------------------------------------------------------

class MegatronMPU:
    """The parallel state DeepSpeed asks a Megatron ``mpu`` for (no pipeline parallelism)."""

    def __init__(self, tp: int):
        world, rank = tdist.get_world_size(), tdist.get_rank()
        assert world % tp == 0, (world, tp)
        dp = world // tp
        self.tp, self.dp = tp, dp
        self.tp_rank, self.dp_rank = rank % tp, rank // tp
        for d in range(dp):  # every rank makes every group, in the same order
            ranks = [d * tp + t for t in range(tp)]
            group = tdist.new_group(ranks)
            if rank in ranks:
                self.tp_group, self.tp_ranks = group, ranks
        for t in range(tp):
            ranks = [d * tp + t for d in range(dp)]
            group = tdist.new_group(ranks)
            if rank in ranks:
                self.dp_group, self.dp_ranks = group, ranks

    # tensor (model) parallel
    def get_model_parallel_rank(self):
        return self.tp_rank

    def get_model_parallel_world_size(self):
        return self.tp

    def get_model_parallel_group(self):
        return self.tp_group

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_tensor_model_parallel_src_rank(self):
        return self.tp_ranks[0]

    # data parallel
    def get_data_parallel_rank(self):
        return self.dp_rank

    def get_data_parallel_world_size(self):
        return self.dp

    def get_data_parallel_group(self):
        return self.dp_group

    def get_data_parallel_group_ranks(self):
        return list(self.dp_ranks)

    # no pipeline parallelism
    def get_pipeline_model_parallel_rank(self):
        return 0

    def get_pipeline_model_parallel_world_size(self):
        return 1


# -- Megatron's tensor-parallel autograd functions --------------------------------------------------

class _CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient over the tp group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        tdist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce over the tp group forward; identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.contiguous().clone()
        tdist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    """All-gather along the last dim forward; this rank's slice of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(tdist.get_world_size(group))]
        tdist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        size, rank = tdist.get_world_size(ctx.group), tdist.get_rank(ctx.group)
        return grad.chunk(size, dim=-1)[rank].contiguous(), None


# The ``drift`` variant: the delta this tp rank adds to the gradients of the DRIFTING parameters
# (set by the training loop for the last step; 0 otherwise, where nothing changes).
_DRIFT = {"delta": 0.0}


class _TPDrift(torch.autograd.Function):
    """Identity forward; backward adds ``delta`` to the gradient: this tp rank's loss has
    ``delta * p.sum()`` more, and nothing all-reduces the gradient over the tp group."""

    @staticmethod
    def forward(ctx, p, delta):
        ctx.delta = delta
        return p.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad + ctx.delta, None


def _drifted(p: nn.Parameter) -> torch.Tensor:
    delta = _DRIFT["delta"]
    return _TPDrift.apply(p, delta) if delta else p


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm (same names, same values), through _TPDrift for the ``drift`` variant."""

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, _drifted(self.weight), _drifted(self.bias), self.eps)


def _mark_parallel(param: nn.Parameter, dim: int) -> nn.Parameter:
    # Megatron's set_tensor_model_parallel_attributes (DeepSpeed's norm reads tensor_model_parallel).
    param.tensor_model_parallel = True
    param.partition_dim = dim
    param.partition_stride = 1
    return param


# -- the model (each module holds this tp rank's shards only) ---------------------------------------

class VocabParallelEmbedding(nn.Module):
    def __init__(self, mpu):
        super().__init__()
        self.mpu = mpu
        self.per_rank = PADDED_VOCAB // mpu.tp
        self.start = mpu.tp_rank * self.per_rank
        self.weight = _mark_parallel(nn.Parameter(torch.empty(self.per_rank, HIDDEN)), 0)

    def forward(self, ids):
        outside = (ids < self.start) | (ids >= self.start + self.per_rank)
        local = (ids - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return _ReduceFromTP.apply(out, self.mpu.tp_group)


class Embedding(nn.Module):
    def __init__(self, mpu):
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(mpu)
        self.position_embeddings = nn.Embedding(MAX_POS, HIDDEN)

    def forward(self, ids):
        positions = torch.arange(ids.shape[1]).unsqueeze(0)
        return self.word_embeddings(ids) + self.position_embeddings(positions)


class ColumnParallelLinear(nn.Module):
    def __init__(self, mpu, in_features, out_local):
        super().__init__()
        self.mpu = mpu
        self.weight = _mark_parallel(nn.Parameter(torch.empty(out_local, in_features)), 0)
        self.bias = _mark_parallel(nn.Parameter(torch.empty(out_local)), 0)

    def forward(self, x):
        return F.linear(_CopyToTP.apply(x, self.mpu.tp_group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    def __init__(self, mpu, in_local, out_features):
        super().__init__()
        self.mpu = mpu
        self.weight = _mark_parallel(nn.Parameter(torch.empty(out_features, in_local)), 1)
        self.bias = nn.Parameter(torch.empty(out_features))  # replicated, added after the reduce

    def forward(self, x):
        return _ReduceFromTP.apply(F.linear(x, self.weight), self.mpu.tp_group) + _drifted(self.bias)


class ParallelAttention(nn.Module):
    def __init__(self, mpu):
        super().__init__()
        self.heads = HEADS // mpu.tp
        self.head_dim = HIDDEN // HEADS
        self.query_key_value = ColumnParallelLinear(mpu, HIDDEN, 3 * self.heads * self.head_dim)
        self.dense = RowParallelLinear(mpu, self.heads * self.head_dim, HIDDEN)

    def forward(self, x):
        b, s, _ = x.shape
        qkv = self.query_key_value(x).view(b, s, self.heads, 3, self.head_dim)
        q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))  # [b, heads, s, head_dim]
        ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.dense(ctx.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class ParallelMLP(nn.Module):
    """SwiGLU: dense_h_to_4h holds [this rank's gate rows; this rank's up rows]."""

    def __init__(self, mpu):
        super().__init__()
        ffn_local = FFN // mpu.tp
        self.dense_h_to_4h = ColumnParallelLinear(mpu, HIDDEN, 2 * ffn_local)
        self.dense_4h_to_h = RowParallelLinear(mpu, ffn_local, HIDDEN)

    def forward(self, x):
        gate, up = self.dense_h_to_4h(x).chunk(2, dim=-1)
        return self.dense_4h_to_h(F.silu(gate) * up)


class ParallelTransformerLayer(nn.Module):
    def __init__(self, mpu):
        super().__init__()
        self.input_layernorm = LayerNorm(HIDDEN)
        self.self_attention = ParallelAttention(mpu)
        self.post_attention_layernorm = LayerNorm(HIDDEN)
        self.mlp = ParallelMLP(mpu)

    def forward(self, h):
        h = h + self.self_attention(self.input_layernorm(h))
        return h + self.mlp(self.post_attention_layernorm(h))


class ParallelTransformer(nn.Module):
    def __init__(self, mpu):
        super().__init__()
        self.layers = nn.ModuleList(ParallelTransformerLayer(mpu) for _ in range(LAYERS))
        self.final_layernorm = LayerNorm(HIDDEN)

    def forward(self, h):
        for layer in self.layers:
            h = layer(h)
        return self.final_layernorm(h)


class TransformerLanguageModel(nn.Module):
    def __init__(self, mpu):
        super().__init__()
        self.embedding = Embedding(mpu)
        self.encoder = ParallelTransformer(mpu)

    def forward(self, ids):
        return self.encoder(self.embedding(ids))


class GPTModel(nn.Module):
    """Output head tied to the word embeddings (Megatron's parallel_lm_logits): no head parameter."""

    def __init__(self, mpu):
        super().__init__()
        self.mpu = mpu
        self.language_model = TransformerLanguageModel(mpu)

    def forward(self, ids, targets):
        h = _CopyToTP.apply(self.language_model(ids), self.mpu.tp_group)
        logits = F.linear(h, self.language_model.embedding.word_embeddings.weight)  # this rank's vocab rows
        logits = _GatherFromTP.apply(logits, self.mpu.tp_group)  # all 24 columns, the same on every tp rank
        return F.cross_entropy(logits.float().reshape(-1, PADDED_VOCAB), targets.reshape(-1))

    def state_dict_for_save_checkpoint(self, prefix="", keep_vars=False):
        """Megatron-DeepSpeed's nested state dict (GPTModel -> TransformerLanguageModel ->
        Embedding / ParallelTransformer): its keys joined with "." are the flat names."""
        lm = self.language_model
        return {"language_model": {
            "embedding": {
                "word_embeddings": lm.embedding.word_embeddings.state_dict(prefix=prefix, keep_vars=keep_vars),
                "position_embeddings": lm.embedding.position_embeddings.state_dict(prefix=prefix,
                                                                                   keep_vars=keep_vars),
            },
            "encoder": lm.encoder.state_dict(prefix=prefix, keep_vars=keep_vars),
        }}


def build_model(mpu) -> GPTModel:
    model = GPTModel(mpu)
    spec, full = full_params(), full_values()
    names = [n for n, _ in model.named_parameters()]
    assert names == list(spec), names
    assert list(model.state_dict()) == names  # no buffers
    with torch.no_grad():
        for name, p in model.named_parameters():
            value = shard_of(full[name], spec[name][1], mpu.tp_rank, mpu.tp)
            assert p.shape == value.shape, (name, p.shape, value.shape)
            p.copy_(value)
    return model


# -- run ---------------------------------------------------------------------------------------------

def main():
    spec = base.read_spec(sys.argv[1])
    outdir = Path(sys.argv[2])
    stage = int(spec["stage"])
    steps = int(spec.get("steps", 2))
    tag = spec.get("tag", f"global_step{steps}")
    unknown = set(spec) - {"family", "stage", "world_size", "dtype", "tp", "steps", "ds_config", "tag", *VARIANT_KEYS}
    assert not unknown, f"unknown spec keys {sorted(unknown)}"
    check_uc_info(uc_info(spec))
    with process_group(lambda: deepspeed.init_distributed(dist_backend="gloo")):  # barrier, then torn down
        rank = dist.get_rank()
        train_and_save(spec, outdir, stage, steps, tag)
    if rank == 0:  # no collectives left: DeepSpeed's converter reads the files alone
        run_ds_to_universal(outdir, tag)


def train_and_save(spec, outdir, stage, steps, tag):
    world = dist.get_world_size()
    assert world == spec["world_size"], (world, spec["world_size"])
    tp = int(spec["tp"])
    mpu = MegatronMPU(tp)
    cfg = base.ds_config_for(spec)
    model = build_model(mpu)  # ZeRO-3: the engine partitions it over mpu's dp group
    frozen = set(FROZEN) if spec.get("frozen") else set()
    assert not (frozen and stage == 3), "frozen: stages 1-2 (ZeRO-3 partitions the frozen shards too)"
    for name, p in model.named_parameters():
        p.requires_grad_(name not in frozen)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, betas=(0.9, 0.99))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg, mpu=mpu)
    assert engine.checkpoint_mp_rank == mpu.tp_rank, (engine.checkpoint_mp_rank, mpu.tp_rank)

    gen = torch.Generator().manual_seed(1000 + mpu.dp_rank)  # the same within a tp group
    drift = bool(spec.get("drift"))
    for step in range(steps):
        # drift: only the last step, so that no forward pass runs on the differing copies and
        # nothing but the DRIFTING parameters (and their moments) differs between the tp ranks
        _DRIFT["delta"] = DRIFT_DELTA * mpu.tp_rank if drift and step == steps - 1 else 0.0
        ids = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
        targets = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
        loss = engine(ids, targets)
        engine.backward(loss)
        engine.step()
    _DRIFT["delta"] = 0.0

    info = uc_info(spec)
    client_state = {"iteration": steps} if info is None else {"universal_checkpoint_info": info, "iteration": steps}
    if spec.get("megatron_save"):
        save_like_megatron(engine, outdir, tag, megatron_client_state(spec, cfg, mpu, steps, info))
    else:
        engine.save_checkpoint(str(outdir), tag=tag, client_state=client_state)

    module = engine.module
    base.relink_optimizer_state(engine)
    params = full_params()
    trainable, opt, shard_shapes = {}, {k: {} for k in base.OPTIMIZER_KEYS}, {}
    copies, copies_opt = {}, {k: {} for k in base.OPTIMIZER_KEYS}
    frozen_truth = {}
    for name, p in module.named_parameters():  # the same order on every rank: the gathers are collectives
        kind = params[name][1]
        if not p.requires_grad:  # its shard as the model holds it (the model dtype), put together
            shard_shapes[name] = list(p.shape)
            frozen_truth[name] = gather_full(p.detach(), kind, mpu, f"{name} (frozen)")[0]
            continue
        values = [safe_get_full_fp32_param(p)] + [base.full_optimizer_state(p, k, name) for k in opt]
        values = [v.detach().float().clone().reshape(base.full_shape(p)) for v in values]
        shard_shapes[name] = list(base.full_shape(p))
        drifted = drift and drifting(name)
        gathered = [gather_full(v, kind, mpu, f"{name} ({what})", drifted)
                    for v, what in zip(values, ("fp32",) + base.OPTIMIZER_KEYS)]
        values = [full for full, _ in gathered]
        for v in values:
            assert tuple(v.shape) == trimmed_shape(name), (name, v.shape)
        trainable[name] = values[0]
        for k, v in zip(opt, values[1:]):
            opt[k][name] = v
        if drifted:
            copies[name] = gathered[0][1]
            for k, (_, c) in zip(opt, gathered[1:]):
                copies_opt[k][name] = c
    truth = {
        "trainable": trainable, "frozen": frozen_truth, "buffers": {}, "optimizer_states": opt,
        "state_dict_keys": list(params), "tied": {},
        "optimizer_step": base.inner_optimizer_step(engine, stage),
        "layout": {"family": "megatron", "dp": mpu.dp, "tp": tp, "pp": 1},
        "tp_partition": {n: {"kind": k, "dim": PARTITION_DIM[k]} for n, (_s, k) in params.items()},
        "shard_shapes": shard_shapes,
        "universal_checkpoint_info": info,
        "original_vocab_size": VOCAB, "padded_vocab_size": PADDED_VOCAB,
    }
    if drift:
        truth.update(tp_copies=copies, tp_copies_optimizer=copies_opt)
    merged = families.merge_truth(truth)  # every rank holds every full tensor: all must agree bit for bit
    for key in ("tp_partition", "universal_checkpoint_info", "original_vocab_size", "padded_vocab_size",
                "tp_copies", "tp_copies_optimizer"):
        if key in truth:
            merged[key] = truth[key]
    if dist.get_rank() == 0:
        merged.update(model_dtype="bfloat16" if spec["dtype"] == "bf16" else "float32", stage=stage,
                      world_size=world, tag=tag, spec=spec, ds_version=deepspeed.__version__)
        tmp = outdir / "ground_truth.pt.tmp"
        torch.save(merged, tmp)
        torch.load(tmp, weights_only=True)
        os.replace(tmp, outdir / "ground_truth.pt")


def trimmed_shape(name):
    shape, kind = full_params()[name]
    return (VOCAB,) + tuple(shape[1:]) if kind == "vocab" else tuple(shape)


def gather_full(shard: torch.Tensor, kind: str, mpu: MegatronMPU, what: str, drifted: bool = False):
    """``(full tensor, None)`` of this tp rank's ``shard`` (an all-gather over the tp group); a
    replicated tensor must be bit-identical on every tp rank; the vocabulary loses its padding
    rows. ``drifted``: a replicated tensor whose every tp rank's copy must differ from rank 0's:
    ``(sum(copies) / T, copies)``, the mean as ds_to_universal computes it."""
    shards = [torch.empty_like(shard) for _ in range(mpu.tp)]
    tdist.all_gather(shards, shard.contiguous(), group=mpu.tp_group)
    if kind == "replicated":
        for t, other in enumerate(shards[1:], 1):
            same = torch.equal(other.view(-1).view(torch.int32), shards[0].view(-1).view(torch.int32))
            if same == drifted:
                raise RuntimeError(f"replicated {what}: tp rank {t} "
                                   + ("holds the same bits as tp rank 0, expected it to drift" if drifted
                                      else "differs from tp rank 0"))
        if drifted:
            return sum(shards) / len(shards), [s.clone() for s in shards]
    assert not drifted, what
    full = join_shards(shards, kind)
    return (full[:VOCAB].clone() if kind == "vocab" else full.clone()), None


# -- Megatron-DeepSpeed's save_checkpoint (--no-pipeline-parallel) ------------------------------------

def megatron_args(spec: dict, cfg: dict, mpu: MegatronMPU, steps: int) -> argparse.Namespace:
    """Some of Megatron-DeepSpeed's training arguments (``get_args()``), as its saves pickle them."""
    bf16 = spec["dtype"] == "bf16"
    return argparse.Namespace(
        num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=HEADS, seq_length=SEQ,
        max_position_embeddings=MAX_POS, padded_vocab_size=PADDED_VOCAB, make_vocab_size_divisible_by=6,
        swiglu=True, untie_embeddings_and_output_weights=False,
        tensor_model_parallel_size=mpu.tp, pipeline_model_parallel_size=1, no_pipeline_parallel=True,
        data_parallel_size=mpu.dp, world_size=mpu.tp * mpu.dp, rank=0,
        deepspeed=True, zero_stage=int(spec["stage"]), bf16=bf16, fp16=False,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        micro_batch_size=2, global_batch_size=2 * mpu.dp, train_iters=steps, iteration=steps,
        consumed_train_samples=2 * mpu.dp * steps, consumed_train_tokens=2 * mpu.dp * steps * SEQ,
        lr=1e-2, adam_beta1=0.9, adam_beta2=0.99, weight_decay=0.01, seed=SEED,
        data_path=["1.0", "/data/tiny_text_document"], split="98,2,0",  # nested values
        deepspeed_config_dict=copy.deepcopy(cfg),
        save="/checkpoints/tiny-gpt", load=None, universal_checkpoint=False, no_save_rng=False,
    )


def megatron_client_state(spec, cfg, mpu, steps, info) -> dict:
    """Megatron-DeepSpeed's ``generate_state_dict`` with ``args.deepspeed`` (DeepSpeed saves the
    model and optimizer), in its key order; the RNG states of this rank."""
    state = {"args": megatron_args(spec, cfg, mpu, steps), "checkpoint_version": 3.0, "iteration": steps,
             "tokens": 2 * mpu.dp * steps * SEQ}
    if info is not None:
        state["universal_checkpoint_info"] = info
    state["rng_state"] = [{
        "random_rng_state": random.getstate(),
        "np_rng_state": numpy.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": None,
        "rng_tracker_states": {},
    }]
    return state


def save_like_megatron(engine, outdir: Path, tag: str, client_state: dict) -> None:
    """Megatron-DeepSpeed's save_checkpoint with --no-pipeline-parallel: the module's state_dict is
    its state_dict_for_save_checkpoint (nested) while DeepSpeed saves, then the original again."""
    module = engine.module
    original_state_dict = module.state_dict

    def state_dict_for_save_checkpoint_deepspeed(destination=None, prefix="", keep_vars=False):
        return module.state_dict_for_save_checkpoint(prefix=prefix, keep_vars=keep_vars)

    module.state_dict = state_dict_for_save_checkpoint_deepspeed
    try:
        engine.save_checkpoint(str(outdir), tag=tag, client_state=client_state)
    finally:
        module.state_dict = original_state_dict


def run_ds_to_universal(outdir: Path, tag: str) -> None:
    """DeepSpeed's own converter on the save, in this process (its import is paid already), into
    ``outdir/universal``; where it raises, ``outdir/ds_to_universal.error`` says why instead."""
    from deepspeed.checkpoint import ds_to_universal

    folder = outdir / "universal"
    args = argparse.Namespace(input_folder=str(outdir / tag), output_folder=str(folder / f"{tag}_universal"),
                              num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                              inject_missing_state=False)
    try:
        ds_to_universal.main(args)
    except Exception as e:  # noqa: BLE001 - any failure of the converter is the finding
        shutil.rmtree(folder, ignore_errors=True)
        where = traceback.extract_tb(e.__traceback__)[-1]
        reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
        line = f"{type(e).__name__}: {reason} (at {Path(where.filename).name}:{where.lineno} in {where.name})"
        (outdir / "ds_to_universal.error").write_text(line[:2000] + "\n")


if __name__ == "__main__":
    from gloo_job import exit_now

    main()
    exit_now()  # torn down and written: no finalization (tests/dsgen/gloo_job.py)
