"""The command line's argument types and actions. They import nothing heavy, so that building the
parser, ``--help`` and ``--version`` never import torch: a value is checked, or a command's own
``--help`` lists its choices, only when that command runs."""
from __future__ import annotations

import argparse
import importlib
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


def common_options() -> argparse.ArgumentParser:
    """The options of every command that reads a checkpoint (a parent parser)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--tag", help="which save to read when the root holds several (default: 'latest')")
    common.add_argument("--follow-symlinks", action="store_const", const=True, default=None,
                        help="follow symbolic links that lead out of the checkpoint folder (refused by default; "
                             "as ZEROFAST_FOLLOW_SYMLINKS=1)")
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
