"""Train a tiny Megatron-DeepSpeed-style GPT as a DeepSpeed PipelineModule (tensor x pipeline parallel).

No Megatron is installed. The layers are those of Megatron-DeepSpeed's ``GPTModelPipe`` (tied input and
output embeddings): layer 0 ``_to_float16`` (a function), layer 1 ``TiedLayerSpec("embed",
EmbeddingPipe)`` (vocabulary-parallel word embeddings, 21 tokens padded to 24, and replicated position
embeddings), layers 2-5 ``ParallelTransformerLayerPipe`` (train_megatron.py's tensor-parallel layer:
input_layernorm, self_attention.query_key_value / dense, post_attention_layernorm, SwiGLU
mlp.dense_h_to_4h, mlp.dense_4h_to_h), layer 6 the final ``LayerNorm``, layer 7 ``TiedLayerSpec("embed",
EmbeddingPipe, forward_fn=_logits_helper)`` (the output head on the word embeddings) and, in bf16, layer
8 ``float16_to_fp32``. ``PipelineModule(topology=PipeModelDataParallelTopology(num_pp, num_mp, num_dp),
partition_method="type:transformer")``: global rank = (pp * dp + d) * tp + t; the embedding module lives
on the first and the last stage. The tensor-parallel groups for Megatron's autograd functions are made
from the topology's "model" axis before the module is built (as Megatron's own mpu makes them apart
from DeepSpeed's grid); ``deepspeed.initialize`` takes no ``mpu`` with a PipelineModule (it asserts
``mpu is None`` and uses the module's grid). Run under torchrun like train.py:

    DS_ACCELERATOR=cpu python -m torch.distributed.run --nproc_per_node W \
        tests/dsgen/train_megatron_pipe.py '<spec as JSON>' OUTDIR

Spec keys: family ("megatron_pipe"), stage (0 or 1: DeepSpeed refuses ZeRO 2/3 with pipelines),
world_size, dtype ("bf16" | "fp32"), tp, pp, steps (train_batch calls, 2 micro-batches each), tag,
ds_config. The client optimizer is torch's AdamW in Megatron's two groups (weight decay 0.01 for the
weights; none for biases and norms, :func:`no_weight_decay`): two flat groups per (stage, tp rank).

OUTDIR gets what ``engine.save_checkpoint(OUTDIR, tag, client_state={"universal_checkpoint_info":
UC_INFO, "iteration": steps})`` writes, and from rank 0:

* ``ground_truth.pt`` (plain data, ``torch.load(weights_only=True)``), train_megatron.py's keys under
  the PIPELINE names (``tied_modules.embed.word_embeddings.weight``, ``2.input_layernorm.weight``,
  ..., ``6.weight``): every parameter's fp32 master and Adam moments (``safe_get_full_fp32_param`` /
  ``safe_get_full_optimizer_state`` at ZeRO 1; the fp32 parameter and the torch optimizer's state at
  ZeRO 0) put together over its stage's tp group by the model's own partitioning (train_megatron's
  ``gather_full``: replicated copies checked bit-identical over the tp group, SwiGLU's gate halves
  then up halves, the vocabulary trimmed to 21 rows), collected from every stage on rank 0. The tied
  module's parameters are one entry each, the first stage's copy (what ds_to_universal keeps with
  ``pipeline_replicated_parameter_patterns``); the last stage's word-embedding copy (master and
  moments) must be bit-identical to the first's. The last stage's copy of the position embeddings
  gets no gradient (the head uses only the word embeddings), so it may differ: ``pipe_copies`` holds
  the last stage's copies of the tied names, ``pipe_copies_identical`` name -> bool (master and both
  moments). Extra keys: ``tp_partition``, ``shard_shapes`` (name -> the shape each tp rank holds),
  ``param_stages`` (name -> the stages holding it), ``universal_checkpoint_info``,
  ``original_vocab_size``, ``padded_vocab_size``; ``layout`` = {"family": "megatron_pipe", "tp",
  "pp", "dp", "layer_stage": stage of each layer index}.
* ``universal/`` (``latest_universal`` and ``<tag>_universal/``): DeepSpeed's own ``ds_to_universal``
  on the save (train_megatron.py's ``run_ds_to_universal``: in-process, one worker, strict), or
  ``ds_to_universal.error`` with its one-line reason.
"""
import os
import re
import sys
import types
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as tdist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import deepspeed  # noqa: E402
import deepspeed.comm as dist  # noqa: E402
from deepspeed.utils import safe_get_full_fp32_param  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train as base  # noqa: E402
import train_megatron as tm  # noqa: E402  (the TP layers, shard_of, gather_full, run_ds_to_universal)
from gloo_job import process_group  # noqa: E402

VOCAB, PADDED_VOCAB, HIDDEN, MAX_POS, SEQ = tm.VOCAB, tm.PADDED_VOCAB, tm.HIDDEN, tm.MAX_POS, tm.SEQ
LAYERS = 4          # transformer layers: pipeline layer indices 2..5
FIRST_LAYER = 2     # 0: _to_float16, 1: the embedding
FINAL_NORM = FIRST_LAYER + LAYERS   # 6
HEAD = FINAL_NORM + 1               # 7: the tied head (no layer file: a forward_fn layer has no state_dict)
SEED = 4321
EMBED = "tied_modules.embed."
WORD = EMBED + "word_embeddings.weight"
POSITION = EMBED + "position_embeddings.weight"
TIED = (WORD, POSITION)

# One transformer layer's parameters as train_megatron.py's model has them (suffix, shape, kind).
_PREFIX0 = "language_model.encoder.layers.0."
LAYER_PARAMS = [(n[len(_PREFIX0):], shape, kind) for n, (shape, kind) in tm.full_params().items()
                if n.startswith(_PREFIX0)]


# ``frozen``: one parameter of each tensor-parallel kind in the first transformer layer
FROZEN = tuple(f"{FIRST_LAYER}.{suffix}" for suffix in (
    "self_attention.query_key_value.weight", "self_attention.dense.weight", "mlp.dense_h_to_4h.weight",
    "input_layernorm.weight"))


def full_params() -> dict:
    """Pipeline name -> (full shape, tensor-parallel kind), in the order of the consolidated state dict."""
    p = {WORD: ((PADDED_VOCAB, HIDDEN), "vocab"), POSITION: ((MAX_POS, HIDDEN), "replicated")}
    for i in range(FIRST_LAYER, FIRST_LAYER + LAYERS):
        for suffix, shape, kind in LAYER_PARAMS:
            p[f"{i}.{suffix}"] = (shape, kind)
    p[f"{FINAL_NORM}.weight"] = ((HIDDEN,), "replicated")
    p[f"{FINAL_NORM}.bias"] = ((HIDDEN,), "replicated")
    return p


# What Megatron-DeepSpeed's UniversalCheckpointInfo(using_model_pipe=True) writes for this model (tp > 1,
# layernorm, position embeddings, linear biases, SwiGLU, tied embeddings), its patterns verbatim:
# unescaped dots, matched with re.match (a prefix match).
UC_INFO = {
    "universal_checkpoint_version": 0.2,
    "original_vocab_size": VOCAB,
    "padded_vocab_size": PADDED_VOCAB,
    "vocabulary_parameter_patterns": [r"tied_modules.embed.word_embeddings.weight"],
    "pipeline_replicated_parameter_patterns": [r"tied_modules.embed.word_embeddings.weight",
                                               r"tied_modules.embed.position_embeddings.weight"],
    "tp_replicated_parameter_patterns": [
        r"\d+.input_layernorm.weight",
        r"\d+.post_attention_layernorm.weight",
        r"\d+.weight",
        r"\d+.bias",
        r"tied_modules.embed.position_embeddings.weight",
        r"\d+.self_attention.dense.bias",
        r"\d+.mlp.dense_4h_to_h.bias",
        r"\d+.input_layernorm.bias",
        r"\d+.post_attention_layernorm.bias",
    ],
    "parameter_with_row_parallelism_patterns": [r"\d+.mlp.dense_4h_to_h.weight", r"\d+.self_attention.dense.weight"],
    "parameter_with_2_sub_params_cat_dim_0": [r"\d+.mlp.dense_h_to_4h.weight", r"\d+.mlp.dense_h_to_4h.bias"],
    "parameter_to_average_patterns": [],
}


def check_uc_info(info: dict) -> None:
    """UC_INFO says of every name what the model does with it (train_megatron's rule: at most one
    pattern per list, the list of its kind, column-parallel in none), and the pipeline-replicated
    patterns name exactly the tied module's parameters."""
    used = set()
    for name, (_shape, kind) in full_params().items():
        said = []
        for key, k in tm._INFO_KIND.items():
            hits = [pat for pat in info[key] if re.match(pat, name)]
            assert len(hits) <= 1, (name, hits)
            said += [k] * len(hits)
            used.update(hits)
        assert said == ([] if kind == "column" else [kind]), (name, kind, said)
        pipe = [pat for pat in info["pipeline_replicated_parameter_patterns"] if re.match(pat, name)]
        assert len(pipe) == (name in TIED), (name, pipe)
    unused = {pat for key in tm._INFO_KIND for pat in info[key]} - used
    assert not unused, unused


def no_weight_decay(name: str) -> bool:
    """Megatron's second AdamW group: biases and norms (the final LayerNorm's weight is ``6.weight``)."""
    return name.endswith(".bias") or "norm" in name or name == f"{FINAL_NORM}.weight"


def full_values(seed: int = SEED) -> dict:
    """Every full fp32 tensor, drawn from one seeded generator in name order (the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (shape, _kind) in full_params().items():
        noise = torch.randn(shape, generator=g)
        if "layernorm.weight" in name or name == f"{FINAL_NORM}.weight":
            out[name] = 1.0 + 0.1 * noise
        elif name.endswith(".bias"):
            out[name] = 0.1 * noise
        else:
            out[name] = 0.3 * noise
    return out


# -- the pipeline's layers (Megatron-DeepSpeed's names) ----------------------------------------------

class EmbeddingPipe(tm.Embedding):
    """Megatron's Embedding (word_embeddings vocabulary-parallel, position_embeddings replicated) with
    ``word_embeddings_weight``, the attribute GPTModelPipe ties (``tied_weight_attr``)."""

    @property
    def word_embeddings_weight(self):
        return self.word_embeddings.weight


class ParallelTransformerLayerPipe(tm.ParallelTransformerLayer):
    """train_megatron's tensor-parallel layer; the class name is what ``type:transformer`` partitions by."""

    def __init__(self, tp_ctx, layer_number):
        super().__init__(tp_ctx)
        self.layer_number = layer_number


def _to_float16(ids):  # Megatron's first pipeline layer: casts float inputs only; token ids pass
    return ids


def float16_to_fp32(x):  # Megatron's last pipeline layer in bf16/fp16 runs
    return x.float()


def _logits_helper(tp_ctx):
    """GPTModelPipe's head: parallel_lm_logits on the tied word embeddings (this rank's vocabulary
    rows), then every tp rank's logits (the loss below is not vocabulary-parallel)."""

    def logits(embedding, h):
        local = F.linear(tm._CopyToTP.apply(h, tp_ctx.tp_group), embedding.word_embeddings_weight)
        return tm._GatherFromTP.apply(local, tp_ctx.tp_group)

    return logits


def loss_fn(logits, targets):
    return F.cross_entropy(logits.float().reshape(-1, PADDED_VOCAB), targets.reshape(-1))


def layer_specs(tp_ctx, bf16: bool):
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    specs = [_to_float16, TiedLayerSpec("embed", EmbeddingPipe, tp_ctx, tied_weight_attr="word_embeddings_weight")]
    specs += [LayerSpec(ParallelTransformerLayerPipe, tp_ctx, i) for i in range(LAYERS)]
    specs.append(LayerSpec(tm.LayerNorm, HIDDEN))
    specs.append(TiedLayerSpec("embed", EmbeddingPipe, tp_ctx, forward_fn=_logits_helper(tp_ctx),
                               tied_weight_attr="word_embeddings_weight"))
    if bf16:
        specs.append(float16_to_fp32)
    return specs


def tp_context(topo):
    """This rank's tensor-parallel coordinates and group, from the topology's "model" axis (every rank
    makes every group, in the same order), in the shape train_megatron's layers ask an mpu for."""
    rank = tdist.get_rank()
    ctx = types.SimpleNamespace(tp=topo.get_dim("model"), tp_rank=topo.get_coord(rank).model, tp_group=None)
    for ranks in topo.get_axis_comm_lists("model"):
        group = tdist.new_group(ranks)
        if rank in ranks:
            ctx.tp_group, ctx.tp_ranks = group, ranks
    assert ctx.tp_group is not None
    return ctx


# -- run ---------------------------------------------------------------------------------------------

def main():
    spec = base.read_spec(sys.argv[1])
    outdir = Path(sys.argv[2])
    stage = int(spec["stage"])
    steps = int(spec.get("steps", 2))
    tag = spec.get("tag", f"global_step{steps}")
    unknown = set(spec) - {"family", "stage", "world_size", "dtype", "tp", "pp", "steps", "ds_config", "tag", "frozen"}
    assert not unknown, f"unknown spec keys {sorted(unknown)}"
    assert stage in (0, 1), "DeepSpeed refuses ZeRO 2/3 with a PipelineModule"
    # ZeRO off reads the torch optimizer's own state: fp32 only (bf16 would wrap it)
    assert stage == 1 or spec["dtype"] == "fp32", "stage 0 is made in fp32 only"
    check_uc_info(UC_INFO)
    with process_group(lambda: deepspeed.init_distributed(dist_backend="gloo")):  # barrier, then torn down
        rank = dist.get_rank()
        train_and_save(spec, outdir, stage, steps, tag)
    if rank == 0:  # no collectives left: DeepSpeed's converter reads the files alone
        tm.run_ds_to_universal(outdir, tag)


def train_and_save(spec, outdir, stage, steps, tag):
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    world = dist.get_world_size()
    assert world == spec["world_size"], (world, spec["world_size"])
    tp, pp = int(spec["tp"]), int(spec["pp"])
    assert world % (tp * pp) == 0, (world, tp, pp)
    dp = world // (tp * pp)
    bf16 = spec["dtype"] == "bf16"
    cfg = base.deep_merge(base.ds_config_for(spec), {"gradient_accumulation_steps": 2})

    topo = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
    tp_ctx = tp_context(topo)
    model = PipelineModule(layers=layer_specs(tp_ctx, bf16), topology=topo, loss_fn=loss_fn,
                           partition_method="type:transformer")
    params = full_params()
    full = full_values()
    with torch.no_grad():
        for name, p in model.named_parameters():
            value = tm.shard_of(full[name], params[name][1], tp_ctx.tp_rank, tp)
            assert p.shape == value.shape, (name, p.shape, value.shape)
            p.copy_(value)
    frozen = set(FROZEN) if spec.get("frozen") else set()
    assert not (frozen and stage == 0), "frozen: ZeRO 1 (ZeRO off records no frozen names)"
    for name, p in model.named_parameters():
        p.requires_grad_(name not in frozen)
    # Megatron's two groups: weight decay for the weights, none for biases and norms
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    no_wd = [p for n, p in named if no_weight_decay(n)]
    wd = [p for n, p in named if not no_weight_decay(n)]
    optimizer = torch.optim.AdamW([{"params": wd, "weight_decay": 0.01}, {"params": no_wd, "weight_decay": 0.0}],
                                  lr=1e-2, betas=(0.9, 0.99))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)
    grid = engine.grid
    coord = topo.get_coord(dist.get_rank())
    assert (grid.get_stage_id(), grid.get_slice_parallel_rank(), grid.get_data_parallel_rank()) == \
        (coord.pipe, coord.model, coord.data) == (coord.pipe, tp_ctx.tp_rank, coord.data)
    assert engine.checkpoint_mp_rank == coord.pipe * tp + coord.model, engine.checkpoint_mp_rank

    gen = torch.Generator().manual_seed(1000 + coord.data)  # the same on every rank of a pipeline

    def batches():
        while True:
            yield (torch.randint(0, VOCAB, (2, SEQ), generator=gen), torch.randint(0, VOCAB, (2, SEQ), generator=gen))

    data = batches()
    for _ in range(steps):
        engine.train_batch(data_iter=data)

    engine.save_checkpoint(str(outdir), tag=tag, client_state={"universal_checkpoint_info": UC_INFO,
                                                               "iteration": steps})

    truth = local_truth(engine, stage, tp_ctx, params)
    everyone = [None] * world
    dist.all_gather_object(everyone, truth)
    if dist.get_rank() == 0:
        merged = merge(everyone, spec, stage, steps, tag, tp, pp, dp)
        tmp = outdir / "ground_truth.pt.tmp"
        torch.save(merged, tmp)
        torch.load(tmp, weights_only=True)
        os.replace(tmp, outdir / "ground_truth.pt")


def local_truth(engine, stage, tp_ctx, params) -> dict:
    """This rank's parameters, full over its tp group (tp rank 0 keeps them), with its stage."""
    module = engine.module
    base.relink_optimizer_state(engine)
    masters = base.stage0_fp32_masters(engine, stage)
    values, shard_shapes, frozen = {}, {}, {}
    for name, p in module.named_parameters():  # the same order on every rank of a stage: gathers are collectives
        kind = params[name][1]
        if not p.requires_grad:  # as the model holds it (its dtype), its shards put together
            shard_shapes[name] = list(p.shape)
            frozen[name] = tm.gather_full(p.detach(), kind, tp_ctx, f"{name} (frozen)")[0]
            continue
        if stage == 0:
            state = engine.optimizer.state[p]
            per = [masters[id(p)]] + [state[k] for k in base.OPTIMIZER_KEYS]
        else:
            per = [safe_get_full_fp32_param(p)] + [base.full_optimizer_state(p, k, name) for k in base.OPTIMIZER_KEYS]
        per = [v.detach().float().clone().reshape(base.full_shape(p)) for v in per]
        shard_shapes[name] = list(base.full_shape(p))
        full = [tm.gather_full(v, kind, tp_ctx, f"{name} ({what})")[0]
                for v, what in zip(per, ("fp32",) + base.OPTIMIZER_KEYS)]
        values[name] = full
    if stage == 0:
        steps = {int(s["step"]) for s in engine.optimizer.state.values()}
    else:
        steps = {base.inner_optimizer_step(engine, stage)}
    coord = module._topo.get_coord(dist.get_rank())
    return {
        "stage": coord.pipe, "tp_rank": tp_ctx.tp_rank, "dp_rank": coord.data,
        "values": values if tp_ctx.tp_rank == 0 and coord.data == 0 else {},
        "frozen": frozen if tp_ctx.tp_rank == 0 and coord.data == 0 else {},
        "names": list(values), "shard_shapes": {tp_ctx.tp_rank: shard_shapes},
        "layer_stage": {i: coord.pipe for i in range(module._local_start, module._local_stop)},
        "optimizer_step": sorted(float(s) for s in steps),
        "parts": [int(x) for x in module.parts],
    }


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1).view(torch.int32),
                                                                       b.view(-1).view(torch.int32))


def merge(everyone, spec, stage, steps, tag, tp, pp, dp) -> dict:
    params = full_params()
    by_stage = {}
    for r in everyone:
        if r["values"]:
            assert r["stage"] not in by_stage, r["stage"]
            by_stage[r["stage"]] = r["values"]
    assert sorted(by_stage) == list(range(pp)), sorted(by_stage)
    trainable, opt = {}, {k: {} for k in base.OPTIMIZER_KEYS}
    param_stages, pipe_copies, pipe_copies_opt, identical = {}, {}, {k: {} for k in base.OPTIMIZER_KEYS}, {}
    for s in range(pp):
        for name, vals in by_stage[s].items():
            param_stages.setdefault(name, []).append(s)
            if name in trainable:  # a tied name held by a later stage: compare, keep the first stage's
                first = [trainable[name]] + [opt[k][name] for k in base.OPTIMIZER_KEYS]
                same = all(_same(a, b) for a, b in zip(first, vals))
                if name == WORD and not same:
                    raise RuntimeError(f"stage {s}'s copy of the tied {name} differs from stage 0's")
                identical[name] = same
                pipe_copies[name] = vals[0]
                for k, v in zip(base.OPTIMIZER_KEYS, vals[1:]):
                    pipe_copies_opt[k][name] = v
                continue
            trainable[name] = vals[0]
            for k, v in zip(base.OPTIMIZER_KEYS, vals[1:]):
                opt[k][name] = v
    frozen = {n: v for r in everyone for n, v in r["frozen"].items()}
    assert list(trainable) != [] and set(trainable) | set(frozen) == set(params), set(params) ^ set(trainable)
    assert {n: st for n, st in param_stages.items() if len(st) > 1} == {n: [0, pp - 1] for n in TIED}, param_stages
    for name, v in trainable.items():
        shape, kind = params[name]
        want = (VOCAB,) + tuple(shape[1:]) if kind == "vocab" else tuple(shape)
        assert tuple(v.shape) == want, (name, v.shape, want)
    shard_shapes = {}
    for r in everyone:
        for t, shapes in r["shard_shapes"].items():
            for name, shape in shapes.items():
                prev = shard_shapes.setdefault(name, {}).setdefault(t, shape)
                assert prev == shape, (name, t, prev, shape)
    for name, per_tp in shard_shapes.items():  # every tp rank holds a piece of the same shape
        assert sorted(per_tp) == list(range(tp)) and all(s == per_tp[0] for s in per_tp.values()), (name, per_tp)
    layer_stage = {}
    for r in everyone:
        layer_stage.update(r["layer_stage"])
    step_values = {s for r in everyone for s in r["optimizer_step"]}
    assert len(step_values) == 1, step_values
    return {
        "trainable": {n: trainable[n] for n in params if n in trainable}, "frozen": frozen, "buffers": {},
        "optimizer_states": {k: {n: opt[k][n] for n in params if n in trainable} for k in opt},
        "state_dict_keys": list(params), "tied": {},
        "optimizer_step": step_values.pop(),
        "layout": {"family": "megatron_pipe", "tp": tp, "pp": pp, "dp": dp,
                   "layer_stage": [layer_stage[i] for i in sorted(layer_stage)]},
        "parts": everyone[0]["parts"],
        "tp_partition": {n: {"kind": k, "dim": tm.PARTITION_DIM[k]} for n, (_s, k) in params.items()},
        "shard_shapes": {n: shard_shapes[n][0] for n in params},
        "param_stages": param_stages,
        "pipe_copies": pipe_copies, "pipe_copies_optimizer": pipe_copies_opt,
        "pipe_copies_identical": identical,
        "universal_checkpoint_info": UC_INFO,
        "original_vocab_size": VOCAB, "padded_vocab_size": PADDED_VOCAB,
        "model_dtype": "bfloat16" if spec["dtype"] == "bf16" else "float32", "stage": stage,
        "world_size": tp * pp * dp, "tag": tag, "spec": spec, "ds_version": deepspeed.__version__,
    }


if __name__ == "__main__":
    from gloo_job import exit_now

    main()
    exit_now()  # torn down and written: no finalization (tests/dsgen/gloo_job.py)
