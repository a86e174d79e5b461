"""Megatron-DeepSpeed's rules for putting tensor-parallel slices together (internal).

Megatron-DeepSpeed saves (and DeepSpeed's ``ds_to_universal``, which reads them) say how each
parameter was cut across the tp ranks in ``universal_checkpoint_info``, a dict of regular
expressions matched as prefixes (``re.match``) against the parameter names. One parameter takes
the first rule that matches, in this order (that of ``ds_to_universal``):

1. ``tp_replicated_parameter_patterns``: every rank holds the whole tensor; the copies must be
   equal, and one is kept;
2. ``parameter_to_average_patterns``: the mean of the copies, ``(0 + s0 + s1 + ...) / T`` in the
   stored dtype (fp32 masters), as ``sum(slices) / len(slices)`` computes it;
3. ``parameter_with_2_sub_params_cat_dim_0`` (SwiGLU's ``dense_h_to_4h``): each slice is two
   halves on dim 0; the first halves are joined, then the second halves;
4. ``parameter_with_sub_params``: ``{patterns, shape, partition_dim}``, the sub-parameters' sizes
   at ``partition_dim`` (a tuple, or from version 0.4 the rank widths in
   ``sub_param_shard_widths``); a legacy count of equal sub-parameters is split evenly;
5. otherwise the slices are joined on dim 1 for ``parameter_with_row_parallelism_patterns``,
   else on dim 0;
6. then, whatever the join, ``vocabulary_parameter_patterns`` keep the first
   ``original_vocab_size`` rows.

Every join is a list of blocks: a run of ``width`` indices along the join dim, at ``shard_at``
in rank ``t``'s slice and ``full_at`` in the full tensor. The blocks become pieces in AutoTP's
``affine_map`` vocabulary, so the layout gathers them in its one pass.

The patterns come with the checkpoint. Python's ``re`` has no timeout, so a pattern is refused
(not run) when it is longer than :data:`MAX_PATTERN` characters, uses a back-reference or a
look-around, or repeats a group that itself repeats or alternates (the shapes of catastrophic
backtracking).
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..base.errors import CorruptCheckpointError, UnsupportedCheckpointError, short_repr

MAX_PATTERN = 512  # characters; Megatron-DeepSpeed's longest is under 100
MAX_PATTERNS = 4096  # per list

REPLICATED = "tp_replicated_parameter_patterns"
AVERAGE = "parameter_to_average_patterns"
TWO_SUB_PARAMS = "parameter_with_2_sub_params_cat_dim_0"
SUB_PARAMS = "parameter_with_sub_params"
SUB_WIDTHS = "sub_param_shard_widths"
SUB_PARAM_SHAPE = "sub_param_shape"  # the field ds_to_universal writes beside such a parameter
ROW_PARALLEL = "parameter_with_row_parallelism_patterns"
VOCABULARY = "vocabulary_parameter_patterns"
ORIGINAL_VOCAB = "original_vocab_size"
VERSION = "universal_checkpoint_version"
CATEGORY_LISTS = (REPLICATED, AVERAGE, TWO_SUB_PARAMS, ROW_PARALLEL, VOCABULARY)


@dataclass(frozen=True)
class Block:
    rank: int
    shard_at: int
    full_at: int
    width: int


@dataclass(frozen=True)
class Merge:
    """How one parameter's slices go together: ``kind`` is "replicated", "average" or "join"."""

    kind: str
    rule: str  # the rule's name, for inspect and messages
    dim: int = 0
    blocks: tuple[Block, ...] = ()
    vocab: int | None = None  # rows kept (vocabulary parameters)
    # parameter_with_sub_params: the entry's fields as ds_to_universal records them beside the
    # tensor (``sub_param_shape``: patterns, shape, partition_dim; a legacy count made sizes)
    sub_shape: dict | None = None

    @property
    def label(self) -> str:
        """What ``inspect`` shows for the parameter."""
        base = {REPLICATED: "replicated", AVERAGE: "averaged", TWO_SUB_PARAMS: "two sub-params joined on dim 0",
                SUB_PARAMS: f"sub-params joined on dim {self.dim}"}.get(self.rule, f"joined on dim {self.dim}")
        return base + (f" (first {self.vocab} rows: vocabulary)" if self.vocab is not None else "")


@dataclass
class Rules:
    lists: dict[str, list[re.Pattern]]
    sub_params: list[tuple[list[re.Pattern], list, int, dict]]  # (patterns, shape, partition_dim, the entry)
    sub_widths: dict[str, list[list[int]]]
    original_vocab: int | None
    version: float
    path: Path
    used: set[str] = field(default_factory=set)

    def merge(self, name: str, shapes: list[tuple[int, ...]]) -> Merge:
        """The merge of ``name``, whose slice on tp rank t has shape ``shapes[t]``."""
        vocab = self._vocab(name)
        for key, kind in ((REPLICATED, "replicated"), (AVERAGE, "average")):
            if self._match(key, name):
                if vocab is not None:
                    raise UnsupportedCheckpointError(f"{name!r} is both a vocabulary parameter and matched by {key}: "
                                                     "trimming a whole copy is not supported", self.path)
                return Merge(kind, key)
        if self._match(TWO_SUB_PARAMS, name):
            return self._sub_join(name, shapes, 0, [[s[0] // 2 for s in shapes]] * 2, TWO_SUB_PARAMS, vocab,
                                  halves=True)
        sub = self._sub_params(name)
        if sub is not None:
            widths = self._widths(name, shapes, sub)
            merge = self._sub_join(name, shapes, sub[2], widths, SUB_PARAMS, vocab)
            return dataclasses.replace(merge, sub_shape=self._sub_shape(sub, widths))
        dim = 1 if self._match(ROW_PARALLEL, name) else 0
        widths = [[self._dim(name, s, dim) for s in shapes]]
        return self._sub_join(name, shapes, dim, widths, ROW_PARALLEL if dim else "join on dim 0", vocab)

    # -- matching ---------------------------------------------------------------------------------

    def _match(self, key: str, name: str) -> bool:
        hits = [p for p in self.lists.get(key, ()) if p.match(name)]
        if len(hits) > 1:
            raise UnsupportedCheckpointError(
                f"expected at most one pattern of {key} to match {name!r}, found {short_repr([p.pattern for p in hits])}",
                self.path)
        self.used.update(p.pattern for p in hits)
        return bool(hits)

    def _vocab(self, name: str) -> int | None:
        if not self._match(VOCABULARY, name):
            return None
        if self.original_vocab is None:
            raise CorruptCheckpointError(f"expected {ORIGINAL_VOCAB} in universal_checkpoint_info for the "
                                         f"vocabulary parameter {name!r}, found none", self.path)
        return self.original_vocab

    def _sub_params(self, name: str):
        for patterns, shape, dim, entry in self.sub_params:
            for p in patterns:
                if p.match(name):
                    self.used.add(p.pattern)
                    return p.pattern, shape, dim, entry
        return None

    def _sub_shape(self, sub, widths: list[list[int]]) -> dict:
        """The entry as ds_to_universal writes it: as the save gives it, except that a legacy
        count of equal sub-parameters at ``partition_dim`` becomes their sizes (a tuple)."""
        _, shape, dim, entry = sub
        fields = {"patterns": entry["patterns"], "shape": entry["shape"], "partition_dim": dim}
        if self.version < 0.4 and not isinstance(shape[dim], (list, tuple)):
            normalized = list(shape)
            normalized[dim] = tuple(sum(w) for w in widths)
            fields["shape"] = tuple(normalized)
        return fields

    # -- joins ------------------------------------------------------------------------------------

    def _dim(self, name: str, shape: tuple[int, ...], dim: int) -> int:
        if len(shape) <= dim:
            raise UnsupportedCheckpointError(f"{name!r} has {len(shape)} dims (shape {list(shape)}), but its rule "
                                             f"joins its slices on dim {dim}", self.path)
        return shape[dim]

    def _widths(self, name, shapes, sub) -> list[list[int]]:
        """Per sub-parameter, its width on each tp rank."""
        pattern, shape, dim, _ = sub
        T = len(shapes)
        sizes = shape[dim] if dim < len(shape) else None
        if self.version >= 0.4:
            widths = self.sub_widths.get(pattern)
            if not isinstance(widths, list) or any(not isinstance(w, list) or len(w) != T for w in widths):
                raise CorruptCheckpointError(f"expected {SUB_WIDTHS}[{pattern!r}]: one width per tp rank for each "
                                             f"sub-parameter of {name!r}, found {short_repr(widths)}", self.path)
            return [[int(x) for x in w] for w in widths]
        full = sum(self._dim(name, s, dim) for s in shapes)
        if isinstance(sizes, (list, tuple)):
            counts = [int(x) for x in sizes]
        elif isinstance(sizes, int) and sizes > 0 and full % sizes == 0:
            counts = [full // sizes] * sizes
        else:
            raise CorruptCheckpointError(f"expected the sub-parameter sizes of {name!r} at dim {dim} of "
                                         f"{short_repr(shape)}, found {short_repr(sizes)}", self.path)
        if sum(counts) != full or any(c % T for c in counts):
            raise UnsupportedCheckpointError(
                f"the sub-parameters {counts} of {name!r} do not split evenly over {T} tp ranks (or do not add up "
                f"to its {full} rows), and universal_checkpoint_version {self.version} records no shard widths",
                self.path)
        return [[c // T] * T for c in counts]

    def _sub_join(self, name, shapes, dim, widths, rule, vocab, halves=False) -> Merge:
        """Sub-parameter j of rank t: ``widths[j][t]`` indices along ``dim``; each rank holds its
        pieces of every sub-parameter in order, the full tensor all ranks' pieces of sub-parameter
        0, then of 1, ..."""
        T = len(shapes)
        for t, s in enumerate(shapes):
            held = self._dim(name, s, dim)
            if halves and held % 2:
                raise UnsupportedCheckpointError(f"{name!r} is two sub-parameters joined on dim 0, but tp rank {t}'s "
                                                 f"slice has an odd {held} rows", self.path)
            if sum(w[t] for w in widths) != held:
                raise CorruptCheckpointError(f"tp rank {t}'s slice of {name!r} has {held} indices on dim {dim}, its "
                                             f"rule gives {sum(w[t] for w in widths)}", self.path)
            if s[:dim] + s[dim + 1:] != shapes[0][:dim] + shapes[0][dim + 1:]:
                raise CorruptCheckpointError(f"the tp ranks' slices of {name!r} differ beyond dim {dim}: "
                                             f"{[list(x) for x in shapes]}", self.path)
        rows = sum(w[t] for w in widths for t in range(T)) if dim == 0 else shapes[0][0] if shapes[0] else 0
        if vocab is not None and vocab > rows:
            raise UnsupportedCheckpointError(f"{ORIGINAL_VOCAB} {vocab} is larger than the {rows} rows of {name!r} "
                                             "joined", self.path)
        blocks, full_at, shard_at = [], 0, [0] * T
        for w in widths:
            for t in range(T):
                blocks.append(Block(t, shard_at[t], full_at, w[t]))
                shard_at[t] += w[t]
                full_at += w[t]
        return Merge("join", rule, dim, tuple(blocks), vocab)


def universal_fields(merge: Merge, path: Path | None) -> dict:
    """What ``ds_to_universal`` writes beside a parameter's full ``param``, in its order: a join's
    ``cat_dim`` (with ``param_n_sub_params`` for two sub-parameters), then ``vocab_tensor``; nothing
    for a replicated or averaged one."""
    if merge.kind != "join":
        return {}
    if merge.rule == SUB_PARAMS:  # a plain dict here: the writer pickles it as DeepSpeed's SubparamShape
        out = {SUB_PARAM_SHAPE: merge.sub_shape}
        if merge.vocab is not None:
            out["vocab_tensor"] = True
        return out
    out = {"cat_dim": merge.dim}
    if merge.rule == TWO_SUB_PARAMS:
        out["param_n_sub_params"] = 2
    if merge.vocab is not None:
        out["vocab_tensor"] = True
    return out


def full_shape(merge: Merge, shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    if merge.kind != "join":
        return shapes[0]
    out = list(shapes[0])
    out[merge.dim] = sum(b.width for b in merge.blocks)
    if merge.vocab is not None:
        if merge.vocab > out[0]:
            raise UnsupportedCheckpointError(f"{ORIGINAL_VOCAB} {merge.vocab} is larger than the joined "
                                             f"vocabulary's {out[0]} rows", None)
        out[0] = merge.vocab
    return tuple(out)


def affine_entry(merge: Merge, shapes: list[tuple[int, ...]]) -> dict:
    """The join as an ``affine_map`` entry: ``{"logical_shape", "ranks": {t: {"pieces": [...]}}}``,
    each piece ``full.as_strided(shape, *source) = shard.as_strided(shape, *dest)``."""
    full = full_shape(merge, shapes)
    full_strides = _strides(full)
    ranks = {t: {"pieces": []} for t in range(len(shapes))}
    for b in merge.blocks:
        shard = shapes[b.rank]
        shape = list(shard)
        shape[merge.dim] = b.width
        start = [0] * len(shard)
        start[merge.dim] = b.full_at
        if merge.vocab is not None:  # clip the rows past the original vocabulary
            rows = min(start[0] + shape[0], merge.vocab) - start[0]
            if rows <= 0:
                continue
            shape[0] = rows
        if math.prod(shape) == 0:
            continue
        ranks[b.rank]["pieces"].append({
            "shape": shape,
            "source": [sum(i * s for i, s in zip(start, full_strides)), full_strides],
            "dest": [b.shard_at * _strides(shard)[merge.dim], _strides(shard)],
            "locations": [b.rank],
        })
    return {"logical_shape": list(full), "ranks": ranks}


def _strides(shape) -> list[int]:
    out, step = [], 1
    for d in reversed(shape):
        out.append(step)
        step *= d
    return out[::-1]


# -- reading the metadata ---------------------------------------------------------------------------

def has_rules(info) -> bool:
    return isinstance(info, dict) and any(k in info for k in CATEGORY_LISTS + (SUB_PARAMS,))


def read_rules(info: dict, path: Path) -> Rules:
    """Checks ``universal_checkpoint_info`` rule by rule and compiles its patterns."""
    lists = {k: _patterns(info.get(k), k, path) for k in CATEGORY_LISTS}
    subs = []
    raw_subs = info.get(SUB_PARAMS) or []
    if not isinstance(raw_subs, list) or len(raw_subs) > MAX_PATTERNS:
        raise CorruptCheckpointError(f"expected {SUB_PARAMS} to be a list, found {short_repr(raw_subs)}", path)
    for s in raw_subs:
        dim = s.get("partition_dim") if isinstance(s, dict) else None
        shape = s.get("shape") if isinstance(s, dict) else None
        if type(dim) is not int or not isinstance(shape, (list, tuple)) or not 0 <= dim < len(shape) or len(shape) > 8:
            raise CorruptCheckpointError(f"expected {SUB_PARAMS} entries with patterns, shape and partition_dim, "
                                         f"found {short_repr(s)}", path)
        subs.append((_patterns(s.get("patterns"), SUB_PARAMS, path), list(shape), dim, s))
    widths = info.get(SUB_WIDTHS) or {}
    if not isinstance(widths, dict):
        raise CorruptCheckpointError(f"expected {SUB_WIDTHS} to be a dict, found {short_repr(widths)}", path)
    vocab = info.get(ORIGINAL_VOCAB)
    if vocab is not None and (type(vocab) is not int or vocab < 0):
        raise CorruptCheckpointError(f"expected {ORIGINAL_VOCAB} to be a count, found {short_repr(vocab)}", path)
    version = info.get(VERSION, 0.0)
    if type(version) not in (int, float):
        raise CorruptCheckpointError(f"expected {VERSION} to be a number, found {short_repr(version)}", path)
    return Rules(lists, subs, widths, vocab, float(version), path)


def _patterns(raw, key: str, path: Path) -> list[re.Pattern]:
    if raw is None:
        return []
    if isinstance(raw, str):
        raw = [raw]
    if not isinstance(raw, (list, tuple)) or len(raw) > MAX_PATTERNS:
        raise CorruptCheckpointError(f"expected {key} to be a list of at most {MAX_PATTERNS} patterns, found "
                                     f"{short_repr(raw)}", path)
    return [safe_pattern(p, key, path) for p in raw]


_REPEAT = re.compile(r"[*+?]|\{\d*,?\d*\}")


def safe_pattern(pattern, key: str, path: Path | None) -> re.Pattern:
    """``pattern`` compiled, or refused when running it could take unbounded time."""
    def refuse(why: str):
        return UnsupportedCheckpointError(f"expected a {key} pattern that can be matched in bounded time, found "
                                          f"{short_repr(pattern)}: {why}", path)

    if not isinstance(pattern, str):
        raise CorruptCheckpointError(f"expected {key} patterns to be strings, found {short_repr(pattern)}", path)
    if len(pattern) > MAX_PATTERN:
        raise refuse(f"longer than {MAX_PATTERN} characters")
    if re.search(r"\\[1-9]|\(\?P=|\(\?<?[=!]", pattern):
        raise refuse("back-references and look-arounds are not allowed")
    if _nested_repeat(pattern):
        raise refuse("a repeated group that itself repeats")
    try:
        return re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as e:
        raise CorruptCheckpointError(f"expected a valid {key} regular expression, found {short_repr(pattern)}: {e}",
                                     path) from None


def _nested_repeat(pattern: str) -> bool:
    """Whether a quantifier applies to a group that holds a quantifier or an alternation, as in
    ``(a+)+`` or ``(a|aa)*``: the shapes whose backtracking grows exponentially."""
    stack = [False]  # per open group: whether it holds a quantifier
    i, n = 0, len(pattern)
    in_class = False
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            if pattern[i + 1:i + 2] == "]":
                i += 1
        elif c == "(":
            stack.append(False)
            if pattern.startswith("?", i + 1):  # (?:...), (?P<name>...), (?i): no quantifier
                end = pattern.find(">", i) if pattern.startswith("?P<", i + 1) else i + 1
                while end + 1 < n and pattern[end + 1] not in ":)" and not pattern.startswith("?P<", i + 1):
                    end += 1
                i = max(end, i + 1) + 1
                continue
        elif c == ")" and len(stack) > 1:
            inner = stack.pop()
            m = _REPEAT.match(pattern, i + 1)
            if m and inner:
                return True
            if m or inner:
                stack[-1] = True
        elif c == "|" or _REPEAT.match(pattern, i):  # (a|aa)* backtracks as (a+)+ does
            stack[-1] = True
        i += 1
    return False
