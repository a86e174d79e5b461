"""The tensor-parallel rules a user gives (internal): ``--tp-rules``, ``ZEROFAST_TP_RULES`` and
``tp_rules=`` name a JSON file in ``universal_checkpoint_info``'s vocabulary (:mod:`.tp_rules`),
a preset, or (the keyword only) the dict itself, for saves that do not record their rules."""
from __future__ import annotations

import json
from pathlib import Path

from ..base.errors import SettingsError
from .tp_rules import CATEGORY_LISTS, ORIGINAL_VOCAB, REPLICATED, ROW_PARALLEL, TWO_SUB_PARAMS, VERSION, VOCABULARY

MAX_RULES_FILE = 1 << 20  # bytes
PRESETS = ("megatron-gpt",)


def from_setting(value: str | dict) -> dict:
    """The ``universal_checkpoint_info``-like dict that ``--tp-rules`` / ZEROFAST_TP_RULES /
    ``tp_rules=`` names: a preset (``megatron-gpt:mlp=swiglu,vocab=50257``), a JSON file in the
    same vocabulary, or (the keyword only) that dict itself; :func:`read_rules` checks it."""
    if isinstance(value, dict):
        return value
    name, _, options = value.partition(":")
    if name in PRESETS:
        return megatron_gpt(_options(value, options))
    path = Path(value)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_RULES_FILE + 1)
    except OSError as e:
        raise SettingsError(f"--tp-rules {value!r}: expected a preset ({', '.join(PRESETS)}) or a readable JSON "
                            f"file, could not read it: {e.strerror}") from None
    if len(data) > MAX_RULES_FILE:
        raise SettingsError(f"--tp-rules {value!r}: expected a rules file of at most {MAX_RULES_FILE} bytes")
    try:
        info = json.loads(data)
    except (ValueError, RecursionError):
        raise SettingsError(f"--tp-rules {value!r}: expected JSON, found something else") from None
    if not isinstance(info, dict):
        raise SettingsError(f"--tp-rules {value!r}: expected a JSON object of pattern lists "
                            f"({', '.join(CATEGORY_LISTS)}, {ORIGINAL_VOCAB}, ...)")
    return info


def _options(value: str, text: str) -> dict[str, str]:
    out = {}
    for item in filter(None, text.split(",")):
        key, eq, v = item.partition("=")
        if not eq or key not in ("mlp", "vocab"):
            raise SettingsError(f"--tp-rules {value!r}: expected options mlp=swiglu|gelu and vocab=N, found {item!r}")
        out[key] = v
    return out


def megatron_gpt(options: dict[str, str]) -> dict:
    """Megatron-DeepSpeed's GPT patterns (its ``megatron/model/gpt_model.py``,
    ``UniversalCheckpointInfo``) for both of its namings: the pipeline one (``3.input_layernorm``,
    ``tied_modules.embed.*``) and ``--no-pipeline-parallel``'s (``language_model.encoder.layers.3.*``).
    Two things the shapes cannot tell are asked for, not guessed: whether the MLP is SwiGLU
    (``dense_h_to_4h`` holds two sub-parameters) and the vocabulary's size before padding."""
    missing = [k for k in ("mlp", "vocab") if k not in options]
    if missing or options["mlp"] not in ("swiglu", "gelu") or not options["vocab"].isdigit():
        raise SettingsError("--tp-rules megatron-gpt needs mlp=swiglu or mlp=gelu (whether dense_h_to_4h holds two "
                            "sub-parameters) and vocab=N (the tokenizer's vocabulary before padding), as in "
                            "megatron-gpt:mlp=swiglu,vocab=50257; the shapes cannot tell them")
    layers = (r"\d+\.", r"language_model\.encoder\.layers\.\d+\.")
    per_layer = lambda *names: [prefix + n for prefix in layers for n in names]  # noqa: E731
    info = {
        VERSION: 0.2,
        ORIGINAL_VOCAB: int(options["vocab"]),
        VOCABULARY: [r"tied_modules\.embed\.word_embeddings\.weight", r"\d+\.word_embeddings\.weight",
                     r"\d+\.lm_head\.weight", r"language_model\.embedding\.word_embeddings\.weight",
                     r"language_model\.output_layer\.weight"],
        REPLICATED: per_layer(r"input_layernorm\.weight", r"input_layernorm\.bias", r"post_attention_layernorm\.weight",
                              r"post_attention_layernorm\.bias", r"self_attention\.dense\.bias",
                              r"mlp\.dense_4h_to_h\.bias")
        + [r"\d+\.weight$", r"\d+\.bias$", r"language_model\.encoder\.final_layernorm\.weight",
           r"language_model\.encoder\.final_layernorm\.bias", r"tied_modules\.embed\.position_embeddings\.weight",
           r"language_model\.embedding\.position_embeddings\.weight"],
        ROW_PARALLEL: per_layer(r"mlp\.dense_4h_to_h\.weight", r"self_attention\.dense\.weight"),
    }
    if options["mlp"] == "swiglu":
        info[TWO_SUB_PARAMS] = per_layer(r"mlp\.dense_h_to_4h\.weight", r"mlp\.dense_h_to_4h\.bias")
    return info


def looks_megatron(names) -> bool:
    """Whether parameter names look like Megatron-DeepSpeed's GPT (for the refusal's hint)."""
    return any(n.startswith("language_model.encoder.layers.") or ".self_attention.query_key_value." in n
               for n in names)
