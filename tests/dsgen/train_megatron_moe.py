"""Train a tiny Megatron-DeepSpeed-style MoE GPT (tensor parallel x expert parallel) with DeepSpeed on the CPU.

The GPT of train_megatron.py (its mpu, tensor-parallel layers and names), with the MLP of its
second layer replaced by a native ``deepspeed.moe.layer.MoE`` as Megatron-DeepSpeed's
``ParallelTransformerLayer`` does with ``--num-experts``: the layer's ``mlp`` IS the MoE, so the
names are ``language_model.encoder.layers.1.mlp.deepspeed_moe.gate.wg.weight`` and
``....mlp.deepspeed_moe.experts.deepspeed_experts.{local id}.dense_h_to_4h.weight`` (SwiGLU, as the
dense MLP). Run under torchrun like train.py:

    DS_ACCELERATOR=cpu python -m torch.distributed.run --nproc_per_node W \
        tests/dsgen/train_megatron_moe.py '<spec as JSON>' OUTDIR

Spec keys: family ("megatron_moe"), stage (1 | 2), world_size, dtype, tp, ep, steps, ds_config,
``expert_tp`` (bool): the MoE's ``enable_expert_tensor_parallelism``, and ``frozen`` (bool): the
parameters of :data:`FROZEN` (a row-parallel dense weight, and SwiGLU's ``dense_h_to_4h.weight`` of
every expert) have ``requires_grad=False`` and are left out of the optimizer.

* ``expert_tp`` false (Megatron-DeepSpeed's default): each expert is a whole MLP. DeepSpeed then makes
  its expert groups without the mpu (``groups._create_expert_and_data_parallel``): expert-parallel
  groups of consecutive GLOBAL ranks, expert-data-parallel groups strided by ep, across the tp ranks;
* ``expert_tp`` true: each expert is Megatron's tensor-parallel MLP (column-parallel
  ``dense_h_to_4h``, row-parallel ``dense_4h_to_h``) over the mpu's tp group, and DeepSpeed makes its
  groups from the mpu (``_create_expert_data_and_model_parallel``): inside each tp rank's
  data-parallel group, expert-parallel groups of ``ep`` consecutive dp ranks.

OUTDIR gets what ``engine.save_checkpoint`` writes with ``client_state = {"iteration": steps}`` and the
module's attribute ``universal_checkpoint_info = UC_INFO``, which DeepSpeed's MoE save writes into the
model states (it refuses the key in the client state: "client_state contains reserved checkpoint keys:
['universal_checkpoint_info']") (UC_INFO: train_megatron.py's patterns plus the MoE layer's: the gate
and the experts' row-parallel biases replicated, ``dense_4h_to_h.weight`` row-parallel, SwiGLU's
``dense_h_to_4h`` two sub-parameters), and from rank 0 ``ground_truth.pt``: train_megatron.py's keys
under the names of the same model on one process (expert ``l`` of expert-parallel rank ``e`` is
``e * num_local + l``), every full tensor put together by the model's own partitioning (the dense
part as train_megatron.py does; a tensor-parallel expert's shards all-gathered over the tp group by
its kind, a whole expert as it is), the experts' moments from the base optimizer's state
(train_families.expert_optimizer_state), frozen tensors in the model dtype, put together the same way.
Extra keys: ``tp_partition``, ``expert_parallel`` (``{"expert_tp", "ep_rank_of_rank",
"edp_group_of_rank"}``: what DeepSpeed's groups were, read from them).

One thing of DeepSpeed's is replaced so that it runs on gloo at all: :func:`patch_gather_tokens`.
"""
import os
import re
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
import deepspeed  # noqa: E402
import deepspeed.comm as dist  # noqa: E402
from deepspeed.moe.layer import MoE  # noqa: E402
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer  # noqa: E402
from deepspeed.utils import groups, safe_get_full_fp32_param  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train as base  # noqa: E402
import train_families as families  # noqa: E402  (merge_truth, expert_optimizer_state)
import train_megatron as meg  # noqa: E402  (the GPT, its mpu and its tensor-parallel layers)
from gloo_job import process_group  # noqa: E402

MOE_LAYER = 1       # the layer whose MLP is the MoE
NUM_EXPERTS = 4
_MOE = f"language_model.encoder.layers.{MOE_LAYER}.mlp."
EXPERT = _MOE + "deepspeed_moe.experts.deepspeed_experts."
_EXPERT_NAME = re.compile(r"^(.*\.deepspeed_experts\.)(\d+)(\..*)$")
_X = meg._L + r"mlp\.deepspeed_moe\.experts\.deepspeed_experts\.\d+\."
UC_INFO = {
    **meg.UC_INFO,
    "tp_replicated_parameter_patterns": meg.UC_INFO["tp_replicated_parameter_patterns"] + [
        meg._L + r"mlp\.deepspeed_moe\.gate\.wg\.weight", _X + r"dense_4h_to_h\.bias"],
    "parameter_with_row_parallelism_patterns": meg.UC_INFO["parameter_with_row_parallelism_patterns"] + [
        _X + r"dense_4h_to_h\.weight"],
    "parameter_with_2_sub_params_cat_dim_0": meg.UC_INFO["parameter_with_2_sub_params_cat_dim_0"] + [
        _X + r"dense_h_to_4h\.weight", _X + r"dense_h_to_4h\.bias"],
}
FROZEN = ("language_model.encoder.layers.0.self_attention.dense.weight", "dense_h_to_4h.weight")
_KIND = {"dense_h_to_4h.weight": "swiglu", "dense_h_to_4h.bias": "swiglu", "dense_4h_to_h.weight": "row",
         "dense_4h_to_h.bias": "replicated"}


def full_params() -> dict:
    """name -> (full shape, tensor-parallel kind) of the model on one process, in its order."""
    out = {}
    for name, value in meg.full_params().items():
        if name.startswith(_MOE):
            if name == _MOE + "dense_h_to_4h.weight":  # the MoE takes the dense MLP's place
                out[_MOE + "deepspeed_moe.gate.wg.weight"] = ((NUM_EXPERTS, meg.HIDDEN), "replicated")
                for e in range(NUM_EXPERTS):
                    for rest, (shape, _k) in _expert_params().items():
                        out[f"{EXPERT}{e}.{rest}"] = (shape, _KIND[rest])
            continue
        out[name] = value
    return out


def _expert_params() -> dict:
    return {rest: meg.full_params()[_MOE + rest] for rest in _KIND}


def full_values() -> dict:
    g = torch.Generator().manual_seed(meg.SEED + 1)
    out = {}
    for name, (shape, _kind) in full_params().items():
        noise = torch.randn(shape, generator=g)
        out[name] = 1.0 + 0.1 * noise if "layernorm.weight" in name else (
            0.1 * noise if name.endswith(".bias") else 0.3 * noise)
    return out


class MoEMPU(meg.MegatronMPU):
    """The mpu, shared (not copied) by the experts DeepSpeed's ``Experts`` deep-copies."""

    def __deepcopy__(self, memo):
        return self


class WholeExpert(nn.Module):
    """A whole SwiGLU MLP (Megatron-DeepSpeed's ParallelMLP with moe=True and no expert tensor
    parallelism: its linear layers at tensor-parallel size 1)."""

    def __init__(self):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(meg.HIDDEN, 2 * meg.FFN)
        self.dense_4h_to_h = nn.Linear(meg.FFN, meg.HIDDEN)

    def forward(self, x):
        gate, up = self.dense_h_to_4h(x).chunk(2, dim=-1)
        return self.dense_4h_to_h(F.silu(gate) * up)


class MegatronMoE(MoE):
    """The MoE as a layer's ``mlp``: returns the output, keeps the auxiliary loss for the model."""

    def forward(self, hidden_states, used_token=None):
        out, l_aux, _counts = super().forward(hidden_states, used_token)
        self.last_aux = l_aux
        return out


def build_model(mpu, spec) -> meg.GPTModel:
    ep, expert_tp = int(spec["ep"]), bool(spec["expert_tp"])
    model = meg.GPTModel(mpu)
    expert = meg.ParallelMLP(mpu) if expert_tp else WholeExpert()
    model.language_model.encoder.layers[MOE_LAYER].mlp = MegatronMoE(
        meg.HIDDEN, expert, num_experts=NUM_EXPERTS, ep_size=ep, k=1, min_capacity=4, use_rts=False,
        enable_expert_tensor_parallelism=expert_tp)
    e = ep_rank(mpu, ep, expert_tp)
    local = NUM_EXPERTS // ep
    spec_, full = full_params(), full_values()
    with torch.no_grad():
        for name, p in model.named_parameters():
            m = _EXPERT_NAME.match(name)
            gname = f"{m.group(1)}{e * local + int(m.group(2))}{m.group(3)}" if m else name
            kind = spec_[gname][1]
            value = meg.shard_of(full[gname], kind, mpu.tp_rank, mpu.tp) if (expert_tp or not m) else full[gname]
            assert p.shape == value.shape, (name, p.shape, value.shape)
            p.copy_(value)
    return model


def patch_gather_tokens() -> None:
    """DeepSpeed 0.19.8's ``moe.mappings._gather_tokens`` (every MoE forward with tp > 1 runs it) hands
    ``all_gather_into_tensor`` a flat output buffer, which gloo refuses: "ProcessGroupGloo::allgather:
    invalid tensor size at index 0 (expected (4, 2, 8), got (64))". Replaced by the same gather over
    the tp group, a list of tensors concatenated on ``dim`` (what it computes with NCCL)."""
    import deepspeed.moe.mappings as mappings
    import torch.distributed as tdist

    def gather_tokens(input_, dim=0):
        mpu = groups.mpu
        size = mpu.get_tensor_model_parallel_world_size()
        if size == 1:
            return input_
        parts = [torch.empty_like(input_) for _ in range(size)]
        tdist.all_gather(parts, input_.contiguous(), group=mpu.get_tensor_model_parallel_group())
        return torch.cat(parts, dim=dim).contiguous()

    mappings._gather_tokens = gather_tokens


def frozen(name: str) -> bool:
    """Whether ``frozen`` freezes ``name`` (a dense name, or an expert's by what follows its id)."""
    m = _EXPERT_NAME.match(name)
    return (m.group(3)[1:] if m else name) in FROZEN


def ep_rank(mpu, ep: int, expert_tp: bool) -> int:
    """The expert-parallel rank DeepSpeed 0.19.8 gives this rank (utils/groups.py): with the mpu,
    the place in ``ep`` consecutive ranks of this tp rank's data-parallel group; without it,
    the global rank modulo ep."""
    return mpu.dp_rank % ep if expert_tp else dist.get_rank() % ep


def main():
    spec = base.read_spec(sys.argv[1])
    outdir = Path(sys.argv[2])
    steps = int(spec.get("steps", 2))
    tag = spec.get("tag", f"global_step{steps}")
    unknown = set(spec) - {"family", "stage", "world_size", "dtype", "tp", "ep", "expert_tp", "frozen", "steps",
                           "ds_config", "tag"}
    assert not unknown, f"unknown spec keys {sorted(unknown)}"
    with process_group(lambda: deepspeed.init_distributed(dist_backend="gloo")):
        train_and_save(spec, outdir, int(spec["stage"]), steps, tag)


def train_and_save(spec, outdir, stage, steps, tag):
    world = dist.get_world_size()
    assert world == spec["world_size"], (world, spec["world_size"])
    tp, ep, expert_tp = int(spec["tp"]), int(spec["ep"]), bool(spec["expert_tp"])
    mpu = MoEMPU(tp)
    patch_gather_tokens()
    model = build_model(mpu, spec)
    for name, p in model.named_parameters():
        p.requires_grad_(not (spec.get("frozen") and frozen(name)))
    # Megatron's two groups (weight decay for the weights, none for biases and norms), each split by
    # DeepSpeed into its dense part and its experts: four flat groups, both expert ones "ep_size_<ep>"
    trained = [p for p in model.parameters() if p.requires_grad]
    groups_ = split_params_into_different_moe_groups_for_optimizer(
        [{"params": [p for p in trained if p.dim() > 1], "name": "weight_decay", "weight_decay": 0.01},
         {"params": [p for p in trained if p.dim() <= 1], "name": "no_weight_decay", "weight_decay": 0.0}])
    assert [g["name"] for g in groups_] == ["weight_decay", "no_weight_decay", f"ep_size_{ep}", f"ep_size_{ep}"]
    optimizer = torch.optim.AdamW(groups_, lr=1e-2, betas=(0.9, 0.99))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=base.ds_config_for(spec), mpu=mpu)
    moe = engine.module.language_model.encoder.layers[MOE_LAYER].mlp
    assert groups._get_expert_parallel_rank(moe.expert_group_name) == ep_rank(mpu, ep, expert_tp)

    gen = torch.Generator().manual_seed(1000 + mpu.dp_rank)  # the same within a tp group
    for _ in range(steps):
        ids = torch.randint(0, meg.VOCAB, (2, meg.SEQ), generator=gen)
        targets = torch.randint(0, meg.VOCAB, (2, meg.SEQ), generator=gen)
        loss = engine(ids, targets)
        engine.backward(loss + 0.01 * moe.last_aux.float())
        engine.step()
    # DeepSpeed's MoE save refuses universal_checkpoint_info in the client state (a reserved key); it
    # writes the module's attribute of that name instead, as it does for AutoTP
    engine.module.universal_checkpoint_info = UC_INFO
    engine.save_checkpoint(str(outdir), tag=tag, client_state={"iteration": steps})

    base.relink_optimizer_state(engine)
    params = full_params()
    e, local = ep_rank(mpu, ep, expert_tp), NUM_EXPERTS // ep
    trainable, frozen_truth, opt = {}, {}, {k: {} for k in base.OPTIMIZER_KEYS}
    for name, p in engine.module.named_parameters():  # the same order on every rank: gathers are collectives
        m = _EXPERT_NAME.match(name)
        gname = f"{m.group(1)}{e * local + int(m.group(2))}{m.group(3)}" if m else name
        if not p.requires_grad:  # as the model holds it (its dtype), the shards put together
            value = p.detach().clone()
            frozen_truth[gname] = meg.gather_full(value, params[gname][1], mpu, f"{gname} (frozen)")[0] \
                if (expert_tp or not m) else value
            continue
        optimizer_state = ((lambda key: families.expert_optimizer_state(engine, p, key)) if m
                           else (lambda key: base.full_optimizer_state(p, key, name)))
        values = [safe_get_full_fp32_param(p)] + [optimizer_state(k) for k in opt]
        values = [v.detach().float().clone().reshape(p.shape) for v in values]
        if expert_tp or not m:
            values = [meg.gather_full(v, params[gname][1], mpu, f"{gname} ({what})")[0]
                      for v, what in zip(values, ("fp32",) + base.OPTIMIZER_KEYS)]
        want = (meg.VOCAB,) + params[gname][0][1:] if params[gname][1] == "vocab" else params[gname][0]
        assert tuple(values[0].shape) == tuple(want), (gname, values[0].shape, want)
        trainable[gname] = values[0]
        for k, v in zip(opt, values[1:]):
            opt[k][gname] = v
    assert list(engine.module.state_dict()) == [n for n, _ in engine.module.named_parameters()]  # no buffers
    ep_of_rank, edp_of_rank = [None] * world, [None] * world
    dist.all_gather_object(ep_of_rank, groups._get_expert_parallel_rank(moe.expert_group_name))
    dist.all_gather_object(edp_of_rank, list(groups._get_expert_data_parallel_group_ranks(moe.expert_group_name)))
    truth = {
        "trainable": trainable, "frozen": frozen_truth, "buffers": {}, "optimizer_states": opt,
        "state_dict_keys": list(params), "tied": {},
        "optimizer_step": base.inner_optimizer_step(engine, stage),
        "layout": {"family": "megatron_moe", "dp": mpu.dp, "tp": tp, "ep": ep, "expert_tp": expert_tp,
                   "experts": {_MOE[:-1]: NUM_EXPERTS}},
    }
    merged = families.merge_truth(truth)
    if dist.get_rank() == 0:
        merged.update(model_dtype="bfloat16" if spec["dtype"] == "bf16" else "float32", stage=stage,
                      world_size=world, tag=tag, spec=spec, ds_version=deepspeed.__version__,
                      tp_partition={n: {"kind": k, "dim": meg.PARTITION_DIM[k]} for n, (_s, k) in params.items()},
                      universal_checkpoint_info=UC_INFO, original_vocab_size=meg.VOCAB,
                      padded_vocab_size=meg.PADDED_VOCAB,
                      expert_parallel={"expert_tp": expert_tp, "ep_rank_of_rank": ep_of_rank,
                                       "edp_group_of_rank": edp_of_rank})
        tmp = outdir / "ground_truth.pt.tmp"
        torch.save(merged, tmp)
        torch.load(tmp, weights_only=True)
        os.replace(tmp, outdir / "ground_truth.pt")


if __name__ == "__main__":
    from gloo_job import exit_now

    main()
    exit_now()  # torn down and written: no finalization (tests/dsgen/gloo_job.py)
