"""The ``zerofast`` command: ``export`` a checkpoint to Hugging Face-layout files, ``inspect`` one,
``reshard`` it for another world size or write it ``to-universal``, ``verify`` it (or an output
against it) and ``diff`` two of them.

Errors about the input or the output folder (every :class:`~zerofast.base.errors.ZeroFastError`) are
reported as one line on stderr with exit code 1; ``--debug`` adds the traceback.

Parsing the arguments imports no torch (each command imports what it runs), so ``--help`` and
``--version`` answer at once; ``build`` and ``doctor`` see to the native core.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import traceback
import warnings
from typing import Sequence

from .interrupts import ctrl_c_exits, interrupted
from .args import Later, Parser, Version, common_options, dtype_arg, positive, size_arg
from .report import model_dtype, optimizer_lines, parallelism_line, training_dtype
from .dcp import DCP_FORMAT, add_to_dcp, dcp_header_lines
from ..base.errors import ZeroFastError, short_repr, some
from ..base.settings import OVERRIDABLE, overriding
from .native import add_native_commands
from ..output.progress import ProgressBar, is_tty
from .checks import add_verify_commands


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (teams.Stopped): the writers have cleaned up
        return interrupted(e)


def _main(argv: Sequence[str] | None) -> int:
    with ctrl_c_exits(as_program=argv is None):
        parser = _parser()
        argv = sys.argv[1:] if argv is None else list(argv)
        args = parser.parse_args(argv)  # --dtype, --version: torch
        args.argv = argv
        if args.command is None:
            parser.print_help(sys.stderr)
            return 2
        from ..output import team as teams  # torch: only once a command runs

    try:
        with warnings.catch_warnings(), teams.signals_raise(), overriding(**_overrides(args)):
            warnings.showwarning = _show_warning
            return args.run(args)
    except ZeroFastError as e:
        if args.debug:
            traceback.print_exc()
        print(f"zerofast: error: {_rank_prefix()}{' '.join(str(e).split())}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # The reader left (`zerofast inspect ... | head`); point stdout at /dev/null so that
        # Python's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Warnings as one line each, like the errors: the source line means nothing to a CLI user."""
    print(f"zerofast: warning: {_rank_prefix()}{' '.join(str(message).split())}", file=sys.stderr)


def _parser() -> argparse.ArgumentParser:
    common = common_options()
    parser = Parser(prog="zerofast", description="Consolidate DeepSpeed ZeRO checkpoints.")
    parser.add_argument("--version", action=Version, help="show zerofast's, torch's and Python's versions, the "
                        "native core and the thread count, and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    ex = sub.add_parser("export", parents=[common], help="write Hugging Face-layout weight files",
                        description="Write a checkpoint as model.safetensors / pytorch_model.bin (sharded with "
                                    "an index when larger than --max-shard-size).")
    ex.add_argument("ckpt", metavar="CKPT", help="checkpoint root (holding 'latest') or a tag folder")
    ex.add_argument("out", metavar="OUT", help="output folder")
    ex.add_argument("--dtype", type=dtype_arg, default="fp32", metavar="{fp32,bf16,fp16,keep}",
                    help="dtype of floating tensors, in any spelling (bf16, bfloat16, torch.bfloat16, any case); "
                         "'keep' keeps what the checkpoint holds (default: fp32)")
    # A metavar, so that building the parser does not list (import) the choices; the help does.
    ex.add_argument("--format", choices=Later("..hf.formats", "FORMATS"), default="safetensors", metavar="FORMAT",
                    help="%(choices)s (default: safetensors)")
    ex.add_argument("--max-shard-size", type=size_arg, default="5GB", metavar="SIZE",
                    help="per-file limit: bytes, or e.g. 500MB, 5G, 5GB, 4GiB (default: 5GB)")
    ex.add_argument("--exclude-frozen", action="store_true", help="leave out parameters that did not train")
    ex.add_argument("--duplicate-tied", action="store_true",
                    help="store tied weights as real copies instead of recording the aliases")
    ex.add_argument("--overwrite", action="store_true",
                    help="write into a non-empty folder zerofast did not write (replaces only weight files)")
    ex.add_argument("--quiet", action="store_true", help="no progress bar and no summary")
    ex.add_argument("--optimizer-states", action="store_true",
                    help="also write every per-element optimizer state of every param group to optimizer.safetensors "
                         "as <param>.<key>, and their step and hyperparameters to optimizer_state.json")
    ex.add_argument("--device", default="cpu",
                    help="where to gather and cast: cpu, or cuda (each rank its LOCAL_RANK's GPU) / cuda:N")
    ex.add_argument("--workers", type=positive("workers"), default=1, metavar="N",
                    help="share the export among N processes on this machine (under torchrun, the ranks "
                         "share it without this)")
    ex.add_argument("--output-on-every-node", action="store_true",
                    help="under torchrun, with the rank files on the nodes' local disks: each node writes the "
                         "files its ranks produced into OUT on its own disk (node 0 also the index and config "
                         "files), for you to gather; without it node 0 writes them all")
    peft = ex.add_mutually_exclusive_group()
    peft.add_argument("--adapter", action="store_true",
                      help="PEFT checkpoint: write adapter_model.safetensors + adapter_config.json, which "
                           "PeftModel.from_pretrained loads")
    peft.add_argument("--merge-adapters", action="store_true",
                      help="PEFT (LoRA) checkpoint: write the base model with the adapter merged in, as "
                           "merge_and_unload() computes it")
    ex.add_argument("--base-model", metavar="DIR",
                    help="with --merge-adapters: the base model's save_pretrained folder, for checkpoints saved "
                         "without their frozen weights (default: adapter_config.json's base_model_name_or_path)")
    ex.add_argument("--base-dtype", choices=("as-stored", "as-trained"), default=None,
                    help="with --merge-adapters and a --base-model folder: merge onto its weights as stored "
                         "(default), or as trained: each base parameter first rounded to the dtype the run held "
                         "the model in (the checkpoint's bf16/fp16 mode)")
    ex.add_argument("--weights-only", action="store_true",
                    help="write only the weight files: no config, generation config or tokenizer files")
    ex.set_defaults(run=_export)
    _add_zero_to_fp32(sub)
    _add_resume(sub, common)
    add_to_dcp(sub, common)

    ins = sub.add_parser("inspect", parents=[common], help="describe a checkpoint without converting it",
                         description="Describe a checkpoint from its metadata, reading no tensor data: stage, world "
                                     "size, parallelism, training dtype, its tensors by kind, the tied weights, the "
                                     "optimizer's param groups and what an export weighs in each dtype.")
    ins.add_argument("ckpt", metavar="CKPT", help="checkpoint root (holding 'latest') or a tag folder")
    ins.add_argument("--json", action="store_true", help="print the report as JSON")
    ins.set_defaults(run=_inspect)
    add_verify_commands(sub, common)
    add_native_commands(sub)
    return parser


# ---------------------------------------------------------------------------------------------
# export

def _export(args: argparse.Namespace) -> int:
    from ..hf import distributed, export
    from ..native.ops import resolve_device
    from ..output import team as teams
    from ..output import workers

    if args.base_dtype and not args.merge_adapters:
        print("zerofast: error: --base-dtype chooses the base of --merge-adapters; pass that too", file=sys.stderr)
        return 2
    resolve_device(args.device)  # here, so that --workers starts no ranks for a device that is not there
    if args.workers > 1:
        workers.launch_local(args.workers, _as_one_rank(args.argv))
        return 0
    run = functools.partial(distributed.shared_export, output_on_every_node=args.output_on_every_node) \
        if teams.launched() else export
    leader = teams.rank() == 0
    bar = ProgressBar(enabled=leader and not args.quiet and is_tty(sys.stderr), desc="export")
    try:
        result = run(args.ckpt, args.out, dtype=args.dtype, format=args.format,
                     max_shard_size=args.max_shard_size, tag=args.tag, exclude_frozen=args.exclude_frozen,
                     duplicate_tied=args.duplicate_tied, overwrite=args.overwrite,
                     optimizer_states=args.optimizer_states, progress=bar, device=args.device,
                     adapter=args.adapter, merge_adapters=args.merge_adapters, base_model=args.base_model,
                     base_dtype=args.base_dtype, hf_files=not args.weights_only,
                     follow_symlinks=args.follow_symlinks)
    finally:
        bar.close()
    if leader and not args.quiet:
        count = len(result.files) + (1 if result.index else 0) + len(result.optimizer_files) + len(result.other_files)
        tied = f", {len(result.aliases)} tied" if result.aliases else ""
        ranks = f" by {teams.world_size()} ranks" if teams.launched() else ""
        optim = f", {human_bytes(result.optimizer_size)} of optimizer states" if result.optimizer_files else ""
        print(f"wrote {count} file{'s' if count != 1 else ''} ({human_bytes(result.total_size + result.optimizer_size)}"
              f"{optim}, {result.tensors} tensors{tied}) to {result.out_dir}{ranks} in {result.seconds:.2f} s"
              f"{_replaced(result.replaced)}")
        if result.merge_base is not None:
            print(result.merge_base.describe())
    return 0


def _replaced(names) -> str:
    return f"; replaced {some(names, 6)}" if names else ""


def _as_one_rank(argv: Sequence[str]) -> list[str]:
    """The command line each worker runs: the same, with a later ``--workers 1`` overriding the
    count (before any ``--``, after which it would be read as a path)."""
    argv = list(argv)
    end = argv.index("--") if "--" in argv else len(argv)
    return argv[:end] + ["--workers", "1"] + argv[end:]


def _overrides(args) -> dict:
    """The flags that stand for a public keyword (--tp-rules: ``tp_rules=``), as the keywords;
    a flag not given leaves the environment's setting."""
    return {name: getattr(args, name, None) for name in OVERRIDABLE}


def _rank_prefix() -> str:
    from ..output import team as teams

    return f"[rank {teams.rank()} of {teams.world_size()}] " if teams.launched() else ""


# ---------------------------------------------------------------------------------------------
# zero-to-fp32: DeepSpeed's converter script, argument for argument

def _add_zero_to_fp32(sub) -> None:
    z = sub.add_parser("zero-to-fp32", help="what DeepSpeed's zero_to_fp32.py does, with the same arguments",
                       description="Drop-in for DeepSpeed's zero_to_fp32.py: same arguments, same output file names "
                                   "(pytorch_model.bin, or model.safetensors with --safe_serialization; sharded "
                                   "with an index past --max_shard_size).")
    z.add_argument("checkpoint_dir", help="path to the desired checkpoint folder, e.g. path/checkpoint-12")
    z.add_argument("output_dir", help="folder for the fp32 state_dict files, e.g. path/checkpoint-12-output/")
    z.add_argument("--max_shard_size", type=size_arg, default="5GB",
                   help="largest file before sharding: bytes, or e.g. 500MB, 5GB (default: 5GB)")
    z.add_argument("--safe_serialization", action="store_true", help="write safetensors instead of torch pickles")
    z.add_argument("-t", "--tag", default=None, help="checkpoint tag, e.g. global_step1 (default: 'latest')")
    z.add_argument("--exclude_frozen_parameters", action="store_true", help="exclude frozen parameters")
    z.add_argument("--follow-symlinks", action="store_const", const=True, help="(zerofast only) follow links out of it")
    z.add_argument("-d", "--debug", action="store_true", help="show the traceback of an error")
    z.set_defaults(run=_zero_to_fp32)


def _zero_to_fp32(args: argparse.Namespace) -> int:
    from ..compat import export_like_deepspeed

    bar = ProgressBar(enabled=is_tty(sys.stderr), desc="export")
    try:
        options = {k: getattr(args, k) for k in ("max_shard_size", "safe_serialization", "tag",
                                                 "exclude_frozen_parameters", "follow_symlinks")}
        result = export_like_deepspeed(args.checkpoint_dir, args.output_dir, progress=bar, **options)
    finally:
        bar.close()
    print(f"saved {', '.join(result.files)}{' and ' + result.index if result.index else ''} "
          f"({human_bytes(result.total_size)}) to {result.out_dir}")
    return 0


# ---------------------------------------------------------------------------------------------
# reshard / to-universal: resume on another number of GPUs

def _add_resume(sub, common) -> None:
    r = sub.add_parser("reshard", parents=[common], help="rewrite a checkpoint for another data-parallel size",
                       description="Write the checkpoint as DeepSpeed would have saved it at --world-size ranks, so "
                                   "that a plain engine.load_checkpoint(OUT) at that size resumes training.")
    r.add_argument("ckpt", metavar="CKPT", help="checkpoint root (holding 'latest') or a tag folder")
    r.add_argument("out", metavar="OUT", help="the new checkpoint root")
    r.add_argument("--world-size", type=positive("ranks"), required=True, metavar="N",
                   help="the new data-parallel world size")
    r.add_argument("--overwrite", action="store_true", help="write into a folder holding files this command did "
                   "not write (replaces only the names it writes: latest, the tag folder, the recovery scripts)")
    r.add_argument("--keep-nvme", action="store_true", help="write a ZeRO-Infinity save's optimizer state back "
                   "into offloaded_tensors/ swap files (not supported: refused); by default it is written plain")
    r.add_argument("--quiet", action="store_true", help="no progress bar and no summary")
    r.add_argument("--workers", type=positive("workers"), default=1, metavar="N",
                   help="share the files among N processes on this machine (under torchrun, the ranks share them)")
    r.set_defaults(run=_reshard)
    u = sub.add_parser("to-universal", parents=[common], help="write DeepSpeed's universal checkpoint layout",
                       description="Write the checkpoint in the layout of deepspeed.checkpoint.ds_to_universal "
                                   "(frozen params and buffers included), loadable at any world size with "
                                   "{\"checkpoint\": {\"load_universal\": true}}. OUT is the new tag folder; "
                                   "latest_universal is written next to it.")
    u.add_argument("ckpt", metavar="CKPT", help="checkpoint root (holding 'latest') or a tag folder")
    u.add_argument("out", metavar="OUT", help="the universal tag folder, e.g. ckpt_universal/global_step100")
    u.add_argument("--overwrite", action="store_true",
                   help="write into a folder holding files this command did not write (replaces only the names it "
                        "writes: the model-states files and zero/)")
    u.add_argument("--quiet", action="store_true", help="no progress bar and no summary")
    u.add_argument("--workers", type=positive("workers"), default=1, metavar="N",
                   help="share the files among N processes on this machine (under torchrun, the ranks share them)")
    u.set_defaults(run=_to_universal)


def _reshard(args: argparse.Namespace) -> int:
    from ..writers.reshard import write_resharded

    written = _shared(args, "reshard", write_resharded, args.ckpt, args.out, args.world_size, tag=args.tag,
                      overwrite=args.overwrite, keep_nvme=args.keep_nvme, follow_symlinks=args.follow_symlinks)
    if written is not None:
        print(f"wrote {written.path} for {args.world_size} data-parallel ranks ({_summary(written)})")
    return 0


def _to_universal(args: argparse.Namespace) -> int:
    from ..writers.universal import write_universal

    written = _shared(args, "to-universal", write_universal, args.ckpt, args.out, tag=args.tag,
                      overwrite=args.overwrite, follow_symlinks=args.follow_symlinks)
    if written is not None:
        print(f"wrote the universal checkpoint {written.path} (latest_universal in {written.path.parent}; "
              f"{_summary(written)})")
    return 0


def _summary(written) -> str:
    from ..output import team as teams

    ranks = f" by {teams.world_size()} ranks" if teams.launched() else ""
    return (f"{written.files} files, {human_bytes(written.nbytes)} of tensors{ranks} in {written.seconds:.2f} s"
            f"{_replaced(written.replaced)}")


def _shared(args: argparse.Namespace, what: str, write, *positional, **options):
    """Run ``write`` alone, as the ranks of this torchrun job, or as --workers local ranks, with a
    progress bar on the leader's terminal. Returns its result on the process that reports it (the
    leader, unless --quiet), else None."""
    import torch

    from ..output import team as teams
    from ..output import workers

    if args.workers > 1:
        workers.launch_local(args.workers, _as_one_rank(args.argv))
        return None
    bar = ProgressBar(enabled=teams.rank() == 0 and not args.quiet and is_tty(sys.stderr), desc=what)
    try:
        if not teams.launched():
            result = write(*positional, progress=bar, **options)
            return None if args.quiet else result
        with teams.joined(torch.device("cpu")) as team, teams.signals_raise(team):
            result = write(*positional, team=team, progress=bar, **options)
        return result if team.leader and not args.quiet else None
    finally:
        bar.close()


# ---------------------------------------------------------------------------------------------
# inspect

def describe(ckpt_dir, tag: str | None = None, follow_symlinks: bool | None = None) -> dict:
    """What ``inspect`` reports, as plain JSON-ready data. Reads metadata only, no tensor data."""
    from ..base import dtypes, keys
    from ..base.dtypes import out_dtype_for
    from ..prepare import prepare
    from ..plan import BUFFER, FROZEN, TRAINABLE

    # warn_absent: the report says it instead
    prepared = prepare(ckpt_dir, None, tag=tag, warn_absent=False, follow_symlinks=follow_symlinks)
    plan, ckpt = prepared.plan, prepared.checkpoint
    tensors = {k: {"count": 0, "elements": 0, "bytes": 0, "dtypes": set()} for k in (TRAINABLE, FROZEN, BUFFER)}
    for tp in plan.tensors.values():
        row = tensors[tp.kind]
        row["count"] += 1
        row["elements"] += tp.numel
        row["bytes"] += tp.numel * tp.stored_dtype.itemsize
        row["dtypes"].add(dtypes.name(tp.stored_dtype))
    for row in tensors.values():
        row["dtypes"] = sorted(row["dtypes"])
    output = {label: sum(tp.numel * out_dtype_for(tp.stored_dtype, d).itemsize for tp in plan.tensors.values())
              for label, d in dtypes.CLI_NAMES.items()}
    own = ckpt.layout.report(ckpt, plan)  # a save that is not DeepSpeed's says what it is itself
    if own is not None:
        return {**own, "tensors": tensors, "output_bytes": output}
    return {
        "checkpoint": str(ckpt.files.root), "tag": ckpt.files.tag, "stage": plan.stage,
        "layout": ckpt.layout.name, "universal": ckpt.layout.name == "universal",
        "world_size": plan.world_size, "deepspeed_version": _text_or_none(ckpt.ds_version),
        "global_steps": _int_or_none(ckpt.meta.raw.get(keys.GLOBAL_STEPS)),
        "training_dtype": training_dtype(ckpt.meta.raw.get(keys.DS_CONFIG)),
        "model_dtype": model_dtype(ckpt.meta),
        "parallelism": ckpt.parallelism,
        "tensors": tensors, "tied": dict(plan.aliases), "output_bytes": output,
        "frozen_excluded": plan.frozen_excluded, "absent_frozen": list(plan.absent_frozen),
        "optimizer_groups": ckpt.layout.optimizer_groups(ckpt) if plan.stage else [],
    }


# The file decides these values; the report holds them only as JSON types (a tensor, NaN or a
# stand-in object would make ``--json`` fail or print what is not JSON).

def _text_or_none(value) -> str | None:
    return value[:200] if isinstance(value, str) else None if value is None else short_repr(value)


def _int_or_none(value) -> int | None:
    return value if type(value) is int and abs(value) < 2 ** 63 else None


def _inspect(args: argparse.Namespace) -> int:
    report = describe(args.ckpt, tag=args.tag, follow_symlinks=args.follow_symlinks)
    if args.json:
        print(json.dumps(report, indent=2, allow_nan=False))
    else:
        print(format_report(report))
    return 0


def format_report(r: dict) -> str:
    lines = dcp_header_lines(r) if r.get("format") == DCP_FORMAT else [
        f"checkpoint    {r['checkpoint']}",
        f"tag           {r['tag']}" + (f"  (global step {r['global_steps']})" if r["global_steps"] is not None else ""),
        f"stage         ZeRO-{r['stage']}" + ("  (universal checkpoint, from ds_to_universal)" if r.get("universal") else ""),
        f"world size    {r['world_size']}",
        f"parallelism   {parallelism_line(r['parallelism'])}",
        f"deepspeed     {r['deepspeed_version'] or 'unknown'}",
        f"training      {r['training_dtype'] or 'unknown'} (model held in {r['model_dtype'] or 'unknown'})",
        "",
        f"{'tensors':<10}{'count':>8}{'elements':>14}{'stored':>12}   dtypes",
    ]
    total = {"count": 0, "elements": 0, "bytes": 0}
    for kind in r["tensors"]:  # describe's order: trainable, frozen, buffer
        row = r["tensors"][kind]
        lines.append(f"{kind:<10}{row['count']:>8,}{row['elements']:>14,}{human_bytes(row['bytes']):>12}   "
                     f"{', '.join(row['dtypes']) or '-'}")
        total = {k: total[k] + row[k] for k in total}
    lines.append(f"{'total':<10}{total['count']:>8,}{total['elements']:>14,}{human_bytes(total['bytes']):>12}")
    if r.get("frozen_excluded"):
        named = f" (named but absent: {', '.join(r['absent_frozen'])})" if r["absent_frozen"] else ""
        lines += ["", "frozen        absent: saved with exclude_frozen_parameters=True (as the HF Trainer saves PEFT "
                  f"models), so the frozen weights are not in this checkpoint{named}"]
    lines += ["", "tied          " + (", ".join(f"{a} -> {s}" for a, s in r["tied"].items()) or "none"), ""]
    lines += optimizer_lines(r.get("optimizer_groups") or [])
    lines.append(f"{'export as':<10}{'size':>12}")
    for label, nbytes in r["output_bytes"].items():
        lines.append(f"{label:<10}{human_bytes(nbytes):>12}   {nbytes:,} bytes")
    return "\n".join(lines)


def human_bytes(n: int) -> str:
    """Decimal units, the ones ``--max-shard-size 5GB`` uses."""
    if n < 1000:
        return f"{n} B"
    value = n / 1000
    for unit in ("KB", "MB", "GB"):
        if value < 1000:
            return f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} TB"
