"""Trainer and PEFT folders: what turns an export into a folder Hugging Face libraries load as it is.

A Trainer checkpoint (``output_dir/checkpoint-N/``) keeps ``config.json``, the tokenizer files and,
for PEFT models, ``adapter_config.json`` next to DeepSpeed's ``global_stepN/``. This module finds
that folder, picks the files to copy (with the config's dtype set to the exported one), and
rewrites a plan for PEFT checkpoints: the adapter under the names ``PeftModel.from_pretrained``
expects, or the base model with the LoRA deltas merged the way peft's ``merge_and_unload`` does.
Nothing here imports transformers or peft.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import warnings
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Callable

import torch

from ..base import dtypes, keys
from ..base.errors import ExportError, PeftExportWarning, UnsupportedCheckpointError, short_repr
from ..execute import Executor
from ..prepare import Prepared
from ..base.dtypes import out_dtype_for
from ..plan import FROZEN, TRAINABLE, Plan, TensorPlan
from .formats import read_index, safetensors_files
from .held_dtype import training_dtype

CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "spiece.model",
                   "chat_template.jinja", "chat_template.json", "preprocessor_config.json", "processor_config.json")
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_FILES = {"safetensors": "adapter_model.safetensors", "torch": "adapter_model.bin"}  # peft's names
PEFT_PREFIX = "base_model.model."
_LORA = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>A|B)\.(?P<adapter>[^.]+)\.weight$")


def trainer_folder(prepared: Prepared) -> Path:
    """The folder that holds ``config.json`` and friends: the root above the tag folder."""
    return prepared.checkpoint.files.root


def is_peft(plan: Plan, folder: Path) -> bool:
    return (folder / ADAPTER_CONFIG).is_file() or any(n.startswith(PEFT_PREFIX) for n in plan.order)


def warn_peft_as_is(plan: Plan, folder: Path) -> None:
    warnings.warn(PeftExportWarning(
        f"{folder}: a PEFT checkpoint exported as it is keeps PEFT's names ({PEFT_PREFIX}..., .lora_A.default...), "
        "which transformers' from_pretrained does not load (those weights stay random): pass adapter=True "
        "(--adapter) for an adapter PeftModel.from_pretrained loads, or merge_adapters=True (--merge-adapters) "
        "for the base model with the adapter merged in"), stacklevel=3)


def read_adapter_config(folder: Path) -> dict:
    path = folder / ADAPTER_CONFIG
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise ExportError(f"expected {ADAPTER_CONFIG} next to the DeepSpeed checkpoint (a PEFT run's Trainer writes "
                          "it), found none", folder) from None
    except ValueError as e:
        raise ExportError(f"expected JSON, could not read it ({e})", path) from None
    if not isinstance(config, dict):
        raise ExportError("expected a JSON object", path)
    return config


# ---------------------------------------------------------------------------------------------
# The files next to the weights

def extra_files(folders: list[Path], plan: Plan, dtype: torch.dtype | None, adapter: bool) -> dict[str, bytes]:
    """name -> content of the config and tokenizer files to write next to the weights, each from the
    first folder that has it. The config's dtype is set to the dtype the weights are written in."""
    names = (ADAPTER_CONFIG, *TOKENIZER_FILES) if adapter else (*CONFIG_FILES, *TOKENIZER_FILES)
    out: dict[str, bytes] = {}
    for name in names:
        for folder in folders:
            path = folder / name
            if path.is_file():
                out[name] = path.read_bytes()
                break
    if "config.json" in out:
        out["config.json"] = _with_dtype(out["config.json"], folders, _weights_dtype(plan, dtype))
    return out


def _weights_dtype(plan: Plan, dtype: torch.dtype | None) -> torch.dtype | None:
    """The dtype of most floating bytes in the export (the one dtype, unless ``dtype`` is None)."""
    counts: Counter = Counter()
    for tp in plan.tensors.values():
        if tp.out_dtype.is_floating_point:
            counts[tp.out_dtype] += tp.nbytes
    return counts.most_common(1)[0][0] if counts else dtype


def _with_dtype(raw: bytes, folders: list[Path], dtype: torch.dtype | None) -> bytes:
    if dtype is None or dtype not in dtypes.OUTPUT_DTYPES:
        return raw
    try:
        config = json.loads(raw)
    except ValueError as e:
        raise ExportError(f"expected JSON, could not read it ({e})", folders[0] / "config.json") from None
    if not isinstance(config, dict):
        return raw
    # transformers 4.56+ writes "dtype", older versions "torch_dtype"; either one decides how
    # from_pretrained(dtype="auto") loads, so set the ones present (or the current name).
    keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["dtype", "torch_dtype"]
    for key in keys:
        config[key] = dtypes.name(dtype)
    return (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()


# ---------------------------------------------------------------------------------------------
# Adapter export: PEFT's own file names

def adapter_name_of(key: str, adapter: str = "default") -> str:
    """``key`` as peft's ``get_peft_model_state_dict`` saves it: without the adapter name."""
    key = key.replace(f".modules_to_save.{adapter}.", ".")
    if key.endswith(f".{adapter}"):
        return key[: -len(adapter) - 1]
    head, _, suffix = key.rpartition(".")
    return f"{head.removesuffix('.' + adapter)}.{suffix}"


def adapter_plan(plan: Plan, folder: Path) -> Plan:
    """The trainable tensors only, under the names peft writes to ``adapter_model.safetensors``."""
    tensors, order = {}, []
    for name in plan.order:
        tp = plan.tensors.get(name)
        if tp is None or tp.kind != TRAINABLE:
            continue
        new = adapter_name_of(name)
        tensors[new] = dataclasses.replace(tp, name=new)
        order.append(new)
    if not tensors:
        raise ExportError("expected trainable adapter weights in this PEFT checkpoint, found none", folder)
    return dataclasses.replace(plan, tensors=tensors, aliases={}, order=tuple(order))


# ---------------------------------------------------------------------------------------------
# Merged export: the base model with every LoRA delta added, as merge_and_unload computes it

AS_STORED, AS_TRAINED = "as-stored", "as-trained"
BASE_DTYPES = (AS_STORED, AS_TRAINED)  # what base_dtype= (--base-dtype) takes; AS_STORED is the default


@dataclasses.dataclass(frozen=True)
class MergeBase:
    """The base weights a merged export was built on, as the summary states it.

    ``choice`` is ``"as-stored"`` (the base folder's values as saved) or ``"as-trained"`` (each
    parameter rounded to the dtype the training held the module in, then merged in fp32);
    ``dtype`` is the dtype of those base values; ``source`` is the base folder, or None when the
    checkpoint kept its frozen weights (then they are the trained model's own, as trained)."""

    choice: str
    dtype: torch.dtype
    source: Path | None

    def describe(self) -> str:
        if self.source is None:
            return f"merged onto the checkpoint's own frozen base weights (as trained, {dtypes.name(self.dtype)})"
        if self.choice == AS_STORED:
            return f"merged onto the base as stored ({dtypes.name(self.dtype)}) from {self.source}"
        return (f"merged onto the base as trained (rounded to {dtypes.name(self.dtype)}, the dtype the run held it "
                f"in) from {self.source}")


def merged_plan(prepared: Prepared, dtype: torch.dtype | None, base_model: str | os.PathLike | None,
                folder: Path, base_dtype: str = AS_STORED) -> tuple[Prepared, list[Path]]:
    """:func:`merged_view` without the description of the base."""
    return merged_view(prepared, dtype, base_model, folder, base_dtype)[:2]


def merged_view(prepared: Prepared, dtype: torch.dtype | None, base_model: str | os.PathLike | None,
                folder: Path, base_dtype: str = AS_STORED) -> tuple[Prepared, list[Path], MergeBase]:
    """A Prepared whose plan writes the base model's tensors under the base model's names, the
    LoRA-targeted weights replaced by ``W + transpose(B @ A, fan_in_fan_out) * scaling`` computed in
    fp32 (the fp32 masters of A and B; W upcast), the folders to take config files from, and which
    base that was. Each merged weight is computed when the writer reaches it, so one is in memory
    at a time.

    ``base_dtype`` matters when the base comes from a folder (a save without its frozen weights):
    ``"as-stored"`` takes its values as saved; ``"as-trained"`` first rounds each of its
    parameters to the dtype the run held the module in (:func:`training_dtype`), as the trained
    model's base was, and upcasts that to fp32 for the merge. Buffers keep their stored values."""
    if base_dtype not in BASE_DTYPES:
        raise ValueError(f"base_dtype must be one of {', '.join(map(repr, BASE_DTYPES))}, got {base_dtype!r}")
    config = read_adapter_config(folder)
    _check_lora(config, folder)
    plan = prepared.plan
    sources, mapped = list(prepared.sources), list(prepared.mapped)
    base, base_order, config_folders = _base_tensors(prepared, base_model, config, folder, sources, mapped)
    lora = _lora_pairs(plan, folder)
    merged = _MergedSources(sources)
    held = None
    if plan.frozen_excluded:
        held = training_dtype(prepared) if base_dtype == AS_TRAINED else None
        buffers = _buffer_names(prepared, base, held)
        about = MergeBase(base_dtype, held or _most_bytes(base.values()), config_folders[0])
    else:  # the checkpoint's own frozen weights, held (and saved) in the training dtype: nothing to round
        buffers = set()
        about = MergeBase(AS_TRAINED, _most_bytes(tp for tp in base.values() if tp.kind == FROZEN), None)
    tensors: dict[str, TensorPlan] = {}
    for name in base_order:
        tp = base[name]
        rounding = held if held is not None and tp.stored_dtype.is_floating_point and name not in buffers else None
        pair = lora.pop(name.removesuffix(".weight"), None)
        if pair is not None:
            make = _merge_recipe(sources, tp, pair, config, name, folder, rounding)
            mapped.append(False)
            tp = TensorPlan(name, tp.shape, FROZEN, torch.float32, torch.float32,
                            ((merged.add(make), 0, 0, tp.numel),))
        elif rounding is not None and rounding != tp.stored_dtype:
            # The value as the run held it, which the training dtype stores exactly.
            mapped.append(False)
            tp = TensorPlan(name, tp.shape, FROZEN, rounding, rounding,
                            ((merged.add(_rounded_recipe(sources, tp, rounding)), 0, 0, tp.numel),))
        tensors[name] = dataclasses.replace(tp, name=name, out_dtype=out_dtype_for(tp.stored_dtype, dtype))
    if lora:
        raise ExportError(f"the adapter targets {sorted(lora)[:3]}, which the base model has no weight for", folder)
    aliases = {a: s for a, s in _base_aliases(plan).items() if s in tensors and a not in tensors}
    order = tuple(n for n in base_order if n in tensors) + tuple(a for a in aliases if a not in base_order)
    new_plan = dataclasses.replace(plan, tensors=tensors, aliases=aliases, order=order)
    return Prepared(prepared.checkpoint, new_plan, merged, mapped), [folder, *config_folders], about


class _MergedSources(Sequence):
    """The sources of a merged export: the checkpoint's and the base folder's tensors, then one
    merged weight per LoRA pair, computed on first use and kept until another one is asked for
    (the writer reads a tensor's windows one after another)."""

    def __init__(self, sources: list[torch.Tensor]):
        self._sources = sources
        self._recipes: list[Callable[[], torch.Tensor]] = []
        self._last: tuple[int, torch.Tensor] | None = None

    def add(self, make: Callable[[], torch.Tensor]) -> int:
        self._recipes.append(make)
        return len(self) - 1

    def __len__(self) -> int:
        return len(self._sources) + len(self._recipes)

    def __getitem__(self, i: int) -> torch.Tensor:
        if i < len(self._sources):
            return self._sources[i]
        if self._last is None or self._last[0] != i:
            self._last = None  # drop the previous merged weight before building the next
            self._last = (i, self._recipes[i - len(self._sources)]().reshape(-1))
        return self._last[1]


def _merge_recipe(sources: list, weight: TensorPlan, pair: tuple[TensorPlan, TensorPlan], config: dict, name: str,
                  folder: Path, rounding: torch.dtype | None = None) -> Callable[[], torch.Tensor]:
    a, b = pair
    fan_in_fan_out = bool(config.get("fan_in_fan_out"))
    delta_shape = (a.shape[-1], b.shape[0]) if fan_in_fan_out else (b.shape[0], a.shape[-1])
    if len(a.shape) != 2 or len(b.shape) != 2 or delta_shape != weight.shape:
        raise ExportError(f"the LoRA delta of {name!r} is {delta_shape} (lora_B {b.shape} @ lora_A {a.shape}), "
                          f"the weight {weight.shape}", folder)
    scaling = _scaling(config, name.removesuffix(".weight"), b.shape[1], folder)
    return lambda: _merge(_materialize(sources, weight, rounding), _materialize(sources, a), _materialize(sources, b),
                          scaling, fan_in_fan_out, name, folder)


def _rounded_recipe(sources: list, tp: TensorPlan, rounding: torch.dtype) -> Callable[[], torch.Tensor]:
    return lambda: _materialize(sources, tp).to(rounding)


def _check_lora(config: dict, folder: Path) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise UnsupportedCheckpointError(f"merging a {config.get('peft_type')} adapter is not supported; only LoRA",
                                         folder / ADAPTER_CONFIG)
    if config.get("use_dora"):
        raise UnsupportedCheckpointError("merging a DoRA adapter (use_dora) is not supported", folder / ADAPTER_CONFIG)
    number = (int, float)
    if isinstance(config.get("r"), int) and config["r"] < 1:
        raise ExportError(f"expected a positive 'r', found {config['r']!r}", folder / ADAPTER_CONFIG)
    checks = [("r", int), ("lora_alpha", number), ("fan_in_fan_out", bool), ("use_rslora", bool),
              ("rank_pattern", dict), ("alpha_pattern", dict)]
    for key, kind in checks:
        value = config.get(key)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool) and kind is not bool):
            raise ExportError(f"expected {key!r} to be {getattr(kind, '__name__', 'a number')}, found {value!r}",
                              folder / ADAPTER_CONFIG)
    for key in ("rank_pattern", "alpha_pattern"):
        for pattern, value in (config.get(key) or {}).items():
            if not isinstance(value, number) or isinstance(value, bool) or not value > 0:
                raise ExportError(f"expected {key}[{pattern!r}] to be a positive number, found {value!r}",
                                  folder / ADAPTER_CONFIG)


def _base_name(key: str) -> str:
    return key.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def _lora_pairs(plan: Plan, folder: Path) -> dict[str, tuple[TensorPlan, TensorPlan]]:
    """Base module name -> (lora_A, lora_B) plans of the trainable LoRA weights."""
    found: dict[str, dict[str, TensorPlan]] = {}
    for name, tp in plan.tensors.items():
        m = _LORA.match(name)
        if m and tp.kind == TRAINABLE:
            found.setdefault(_base_name(m["module"]), {})[m["ab"]] = tp
        elif ".lora_" in name or ".modules_to_save." in name:
            # Embedding/conv LoRA, DoRA magnitudes, modules_to_save: left out, the merge would be wrong.
            raise UnsupportedCheckpointError(f"merging {name!r} is not supported: only the lora_A/lora_B weights of "
                                             "linear layers are", folder)
    pairs = {}
    for module, ab in found.items():
        if set(ab) != {"A", "B"}:
            raise ExportError(f"LoRA weights of {module!r} come without their lora_{'B' if 'A' in ab else 'A'}",
                              folder)
        pairs[module] = (ab["A"], ab["B"])
    return pairs


def _base_aliases(plan: Plan) -> dict[str, str]:
    return {_base_name(a): _base_name(s) for a, s in plan.aliases.items()}


def _base_tensors(prepared: Prepared, base_model, config: dict, folder: Path, sources: list, mapped: list):
    """The base model's weights: from the checkpoint when the save kept them, else from a
    ``save_pretrained`` folder (``base_model``, or the adapter config's base_model_name_or_path),
    whose config files are copied in either case."""
    plan = prepared.plan
    where = base_model or config.get("base_model_name_or_path")
    config_folders = [Path(where)] if where and Path(where).is_dir() else []
    if not plan.frozen_excluded:  # the weights the run trained with win over the folder's
        base = {_base_name(n): tp for n, tp in plan.tensors.items() if not _LORA.match(n)}
        order = [_base_name(n) for n in plan.order if n in plan.tensors and not _LORA.match(n)]
        return base, order, config_folders
    if not config_folders:
        raise ExportError("this PEFT checkpoint was saved without its frozen base weights "
                          "(exclude_frozen_parameters=True), so merging needs the base model: pass base_model= "
                          f"(--base-model) a folder saved with save_pretrained (adapter_config.json names "
                          f"{config.get('base_model_name_or_path')!r})", folder)
    base, order = {}, []
    for name, tensor in read_safetensors_folder(Path(where)).items():
        sources.append(tensor.reshape(-1))
        mapped.append(False)
        base[name] = TensorPlan(name, tuple(tensor.shape), FROZEN, tensor.dtype, tensor.dtype,
                                ((len(sources) - 1, 0, 0, tensor.numel()),))
        order.append(name)
    return base, order, config_folders


# ---------------------------------------------------------------------------------------------
def _buffer_names(prepared: Prepared, base: dict[str, TensorPlan], held: torch.dtype | None) -> set[str]:
    """The base tensors that are the module's buffers, which DeepSpeed does not cast (unless the
    config sets ``data_types.buffer_dtype``, which as-trained does not follow: refused)."""
    meta = prepared.checkpoint.meta
    names = {_base_name(n) for n in meta.buffer_names} & set(base)
    config = meta.raw.get(keys.DS_CONFIG)
    types = config.get("data_types") if isinstance(config, dict) else None
    if held is not None and names and isinstance(types, dict) and types.get("buffer_dtype") is not None:
        cast = short_repr(types["buffer_dtype"], 20)
        raise UnsupportedCheckpointError(
            f"base_dtype='as-trained' with ds_config's data_types.buffer_dtype ({cast}) is not supported: the base "
            f"holds buffers ({sorted(names)[0]!r}, ...); pass base_dtype='as-stored'", meta.path)
    return names


def _most_bytes(plans) -> torch.dtype:
    """The floating dtype that holds most of these tensors' bytes (float32 for none)."""
    counts: Counter = Counter()
    for tp in plans:
        if tp.stored_dtype.is_floating_point:
            counts[tp.stored_dtype] += tp.numel * tp.stored_dtype.itemsize
    return counts.most_common(1)[0][0] if counts else torch.float32


def _materialize(sources: list, tp: TensorPlan, rounding: torch.dtype | None = None) -> torch.Tensor:
    """One tensor of the plan in fp32, as peft holds it in an fp32 model; rounded to ``rounding``
    first (exactly what ``.to(rounding).float()`` gives) when that is set."""
    full = dataclasses.replace(tp, out_dtype=torch.float32 if tp.stored_dtype.is_floating_point else tp.stored_dtype)
    value = Executor(sources).run(full)
    return value if rounding is None else value.to(rounding).float()


def _scaling(config: dict, module: str, rank: int, folder: Path | None = None) -> float:
    alpha = _pattern_value(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", 8))
    r = _pattern_value(config.get("rank_pattern") or {}, module, config.get("r", rank))
    if r != rank:
        raise ExportError(f"gives {module!r} rank {r}, but its lora_A has {rank} rows",
                          None if folder is None else folder / ADAPTER_CONFIG)
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def _pattern_value(patterns: dict, module: str, default):
    """peft's rank_pattern/alpha_pattern lookup: the first key matching the end of the module name."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _merge(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float, fan_in_fan_out: bool,
           name: str, folder: Path | None = None) -> torch.Tensor:
    delta = b @ a
    if fan_in_fan_out:
        delta = delta.T
    delta = delta * scaling
    if delta.shape != weight.shape:
        raise ExportError(f"the LoRA delta of {name!r} is {tuple(delta.shape)}, the weight {tuple(weight.shape)}",
                          folder)
    return weight + delta


# ---------------------------------------------------------------------------------------------
# Reading a save_pretrained folder's safetensors files, memory-mapped, with the package's one reader

def read_safetensors_folder(folder: Path) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = list(dict.fromkeys(read_index(index)[0].values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ExportError("expected model.safetensors or model.safetensors.index.json (a save_pretrained folder) "
                          "for the base model, found neither", folder)
    out: dict[str, torch.Tensor] = {}
    for name in files:
        if "/" in name or name in ("", ".", ".."):
            raise ExportError(f"the index names {name!r}, not a file in this folder"[:300], index)
        out.update(safetensors_files.read(folder / name)[0])
    return out
