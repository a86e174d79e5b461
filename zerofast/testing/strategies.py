"""Hypothesis strategies for zerofast's property tests (needs ``hypothesis``, a test dependency)."""
from __future__ import annotations

import torch
from hypothesis import strategies as st

from .synthesize import BufferSpec, LayoutSpec, ParamSpec


def layouts(max_world_size: int = 8, max_dim: int = 6):
    """A hypothesis strategy of random, small LayoutSpecs that DeepSpeed 0.19.8 can produce.

    Covers stages 0-3, world sizes 1..max_world_size, 1-3 groups, fp32/bf16/fp16, frozen and
    trainable params (numel 0 and 1 included), buffers of several dtypes, tied names, custom key
    orders and tags, the stage-1 BF16_Optimizer and the stage-0 flat-master variant.

    Left out because DeepSpeed 0.19.8 cannot produce them:
    * 0-dim parameters (shape ()): the engine broadcasts every parameter as
      ``p.data.view(torch.uint8)`` (stages 0-2, ``_broadcast_model``; stage 3, ``zero.Init``'s
      ``_zero_init_param``), which raises for 0-dim tensors of any dtype and world size.
      (0-dim buffers are fine and are generated.)
    * a group whose params all have zero elements: the ZeRO wrappers read the dtype of the
      group's first owned param and fail.
    Zero-element trainable params are generated: DeepSpeed records them as frozen. (At stage 3
    with world_size > 1 a forward pass over such a param fails, but the engine saves them.)
    """
    dtypes = [torch.float32, torch.bfloat16, torch.float16]
    dim = st.integers(0, max_dim)
    any_shape = st.lists(dim, min_size=1, max_size=3).map(tuple)
    owned_shape = st.lists(st.integers(1, max_dim), min_size=1, max_size=3).map(tuple)

    @st.composite
    def build(draw):
        stage = draw(st.integers(0, 3))
        world = draw(st.integers(1, max_world_size))
        dtype = draw(st.sampled_from(dtypes))
        counter = iter(range(10**6))

        def name(kind: str) -> str:
            module = draw(st.integers(-1, 3))
            leaf = f"{kind}{next(counter)}"
            return leaf if module < 0 else f"m{module}.{leaf}"

        groups = []
        for _ in range(draw(st.integers(1, 3))):
            shapes = draw(st.lists(any_shape, max_size=3))
            shapes.insert(draw(st.integers(0, len(shapes))), draw(owned_shape))
            groups.append([ParamSpec(name("w"), s) for s in shapes])
        frozen = [ParamSpec(name("f"), s) for s in draw(st.lists(any_shape, max_size=3))]
        float_buffer = [dtype] if stage == 3 else [torch.float32, dtype]  # zero.Init casts them
        buffers = [
            BufferSpec(name("b"), s, d)
            for s, d in draw(st.lists(st.tuples(st.lists(dim, max_size=2).map(tuple),
                                                st.sampled_from(float_buffer + [torch.int64, torch.bool])),
                                      max_size=3))
        ]
        sources = [p.name for g in groups for p in g] + [p.name for p in frozen]
        tied = {name("t"): src for src in draw(st.lists(st.sampled_from(sources), max_size=2))}
        order = None
        if draw(st.booleans()):
            names = sources + list(tied) + [b.name for b in buffers]
            order = list(draw(st.permutations(names)))
            for alias, src in tied.items():
                if order.index(alias) < order.index(src):
                    order.remove(alias)
                    order.insert(order.index(src) + 1, alias)
        tag = draw(st.sampled_from(["global_step1", "global_step3", "global_step1000", "best_model"]))
        return LayoutSpec(
            stage=stage,
            world_size=world,
            model_dtype=dtype,
            groups=groups,
            frozen=frozen,
            buffers=buffers,
            tied=tied,
            order=order,
            tag=tag,
            write_latest=draw(st.booleans()),
            seed=draw(st.integers(0, 2**31 - 1)),
            bf16_optimizer_wrapper=stage == 1 and dtype == torch.bfloat16 and draw(st.booleans()),
            with_optimizer_states=draw(st.booleans()),
            stage0_flat_masters=stage == 0 and dtype != torch.float32 and draw(st.booleans()),
        )

    return build()
