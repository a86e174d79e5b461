"""The command line's argument types and actions. They import nothing heavy, so that building the
parser, ``--help`` and ``--version`` never import torch: a value is checked, or a command's own
``--help`` lists its choices, only when that command runs."""
from __future__ import annotations

import argparse
import difflib
import importlib
import sys
from collections.abc import Iterator, Sequence


class Later(Sequence):
    """argparse choices: the keys of ``module.name``, imported on first use."""

    def __init__(self, module: str, name: str):
        self._where, self._items = (module, name), None

    def _all(self) -> list:
        if self._items is None:
            module, name = self._where
            self._items = list(getattr(importlib.import_module(module, __package__), name))
        return self._items

    def __getitem__(self, i):
        return self._all()[i]

    def __len__(self) -> int:
        return len(self._all())

    def __iter__(self) -> Iterator:
        return iter(self._all())

    def __contains__(self, value) -> bool:
        return value in self._all()


class Parser(argparse.ArgumentParser):
    """argparse, with a mistyped flag reported by the command it was given to, with the nearest
    flag it has (``--dtpye`` -> ``did you mean --dtype?``), as git and pip do. Plain argparse hands
    a command's unknown flags up to the top-level parser, whose usage and error name neither."""

    def parse_known_args(self, args=None, namespace=None):
        self._given = list(sys.argv[1:] if args is None else args)
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:  # a command's own parser (a subparser) gets here before the top level's does
            self._unrecognized(extras)
        return namespace, extras

    def error(self, message):
        # A mistyped required flag (--world_size) is reported as missing; the typo is the cause.
        if message.startswith("the following arguments are required"):
            typos = [a for a in _before_dashes(getattr(self, "_given", [])) if _flag(a) and not self._knows(a)]
            if typos:
                self._unrecognized(typos)
        super().error(message)

    def _unrecognized(self, extras: list[str]):
        shown = [a for a in extras if _flag(a)] or extras  # values shifted by the typo are no news
        options = [o for o in self._option_string_actions if o.startswith("--")]
        words = []
        for arg in shown:
            near = difflib.get_close_matches(arg.split("=", 1)[0], options, n=1) if _flag(arg) else []
            words.append(f"{arg} (did you mean {near[0]}?)" if near else arg)
        super().error(f"unrecognized arguments: {' '.join(words)}")

    def _knows(self, arg: str) -> bool:
        flag = arg.split("=", 1)[0]
        if not flag.startswith("--"):
            return flag[:2] in self._option_string_actions  # -t, -tVALUE
        return any(o == flag or (self.allow_abbrev and o.startswith(flag)) for o in self._option_string_actions)


def _flag(arg: str) -> bool:
    return len(arg) > 1 and arg[0] == "-" and not arg[1].isdigit() and arg[1] != "."  # not -1, -.5


def _before_dashes(args: list[str]) -> list[str]:
    return args[:args.index("--")] if "--" in args else args


def common_options() -> argparse.ArgumentParser:
    """The options of every command that reads a checkpoint (a parent parser)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--tag", help="which save to read when the root holds several (default: 'latest')")
    common.add_argument("--follow-symlinks", action="store_const", const=True, default=None,
                        help="follow symbolic links that lead out of the checkpoint folder (refused by default; "
                             "as ZEROFAST_FOLLOW_SYMLINKS=1)")
    common.add_argument("--tp-replicated", choices=("equal", "mean"), default=None,
                        help="a Megatron-DeepSpeed save's tensor-parallel replicated parameters whose copies differ: "
                             "refused (equal, the default) or averaged as BLOOM's converters do (mean); as "
                             "ZEROFAST_TP_REPLICATED")
    common.add_argument("--tp-rules", default=None, metavar="FILE|PRESET",
                        help="how a tensor-parallel save's slices go together where it does not say: a JSON file of "
                             "universal_checkpoint_info's pattern lists, or megatron-gpt:mlp=swiglu|gelu,vocab=N; as "
                             "ZEROFAST_TP_RULES")
    common.add_argument("--unstack-layers", action="store_const", const=True, default=None,
                        help="a Megatron-Core save's stacked layers (decoder.layers.<module>..., a leading layer "
                             "dimension) come out per layer (decoder.layers.<i>.<module>...); as "
                             "ZEROFAST_UNSTACK_LAYERS=1")
    common.add_argument("--debug", action="store_true", help="show the traceback of an error")
    return common


class Version(argparse.Action):
    """``--version``: zerofast's, torch's and Python's versions, the native core, the threads."""

    def __init__(self, option_strings, dest, help=None):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from .. import __version__
        from ..native.report import version_lines

        print("\n".join(version_lines(__version__)))
        parser.exit()


def positive(what: str):
    """An argparse type: a positive int, or an error that says what the number counts."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(f"expected a positive number of {what}, got {text!r}")
        return value

    return parse


def dtype_arg(text: str):
    """An argparse type: the one dtype vocabulary (:func:`zerofast.base.dtypes.output_dtype`)."""
    from ..base import dtypes

    try:
        return dtypes.output_dtype(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected fp32, bf16, fp16 or keep (or bfloat16, float16, float32, "
                                         f"torch.bfloat16, ..., in any case), got {text!r}") from None


def size_arg(text: str) -> int:
    """An argparse type: bytes, or e.g. 500MB, 5G, 5GB, 4GiB."""
    from ..hf.shards import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
