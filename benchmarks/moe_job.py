"""The many-expert MoE save of ``benchmarks/generate.py``: tests/dsgen/train_families.py's MoE run
(one DeepSpeed training step on the CPU, under torchrun), with a wider model.

Run like train_families.py; the spec's ``moe_layers`` lists the experts of each MoE layer:

    DS_ACCELERATOR=cpu python -m torch.distributed.run --nproc_per_node W \
        benchmarks/moe_job.py '<spec as JSON>' OUTDIR

The model is family_models.MoEModel (tiny experts) with its two MoE layers sized by the spec and
more MoE layers after them, so DeepSpeed writes one ``layer_L_expert_E_mp_rank_00_model_states.pt``
per expert. The test generators' own files are left as they are (their contents key the test
checkpoint cache): this module swaps in the wider model for one run only.
"""
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

DSGEN = Path(__file__).resolve().parent.parent / "tests" / "dsgen"
sys.path.insert(0, str(DSGEN))

import torch  # noqa: E402

import family_models as fm  # noqa: E402
import train_families  # noqa: E402


class WideMoE(fm.MoEModel):
    """MoEModel whose MoE layers hold ``experts[i]`` experts each (at least two layers)."""

    def __init__(self, ep_size: int, experts: list[int]):
        fm.MOE_EXPERTS = tuple(experts[:2])  # the base class reads its two layers' sizes here
        super().__init__(ep_size)
        from deepspeed.moe.layer import MoE

        self.extra = torch.nn.ModuleList(
            MoE(hidden_size=fm.DIM, expert=fm.Expert(), num_experts=n, ep_size=ep_size, k=1, min_capacity=4)
            for n in experts[2:])

    def forward(self, ids, targets):
        x = self.frozen_norm(self.embed(ids) * self.scale.to(self.embed.weight.dtype))
        aux = 0.0
        for layer in (self.moe1, self.moe2, *self.extra):
            h, a, _ = layer(x)
            x = x + h
            aux = aux + a
        logits = self.lm_head(self.final_norm(x + self.mid(x)))
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, fm.VOCAB), targets.reshape(-1))
        return loss + 0.01 * aux.float()


def main() -> None:
    experts = json.loads(sys.argv[1])["moe_layers"]

    def build(ep_size: int, seed: int = 1234) -> WideMoE:
        torch.manual_seed(seed)
        return WideMoE(ep_size, experts)

    fm.build_moe = build  # train_families builds the trained model and the names' model through it
    train_families.main()


if __name__ == "__main__":
    from gloo_job import exit_now

    main()
    exit_now()  # torn down and written: no finalization (tests/dsgen/gloo_job.py)
