"""zerofast's export of a Megatron-DeepSpeed TP 2 x DP 2 save against DeepSpeed's ds_to_universal (issue 47).

    python benchmarks/megatron_tp.py [--rounds N] [--data DIR] [--quiet-load L] [--small]

The save: tests/dsgen/train_megatron.py's Megatron-named GPT (its tensor-parallel layers, its mpu
in Megatron's rank order, its ``universal_checkpoint_info`` patterns), sized up here to about 530M
parameters: hidden 2048, 16 heads, SwiGLU ffn 5632, 9 layers, vocabulary 32001 padded to 32256
(128 x tp), 1024 positions, bf16, ZeRO-1, tp 2 x dp 2 (world 4, torchrun on gloo, OMP_NUM_THREADS=1),
torch's AdamW as the client optimizer, trained one step on a 2 x 8 token batch and saved with
``universal_checkpoint_info`` (the vocabulary sizes of this model) as client state. It is made once
by this file (``_train`` under torchrun; no ground truth) and cached in ``$ZEROFAST_BENCH_DIR`` or
``<repo>/.cache/bench-megatron/`` (``megatron-tp2-dp2-<key>``, the key hashing the spec and the
DeepSpeed version), reused while present.

What one round measures (each tool a fresh child process; the two alternate who goes first; the
save is read once before each, so both start from a warm page cache):

* zerofast: ``python -m zerofast export SAVE OUT --dtype bf16`` (the checkout this file is in, by
  PYTHONPATH): the whole process's wall time, imports included;
* DeepSpeed: ``python -m deepspeed.checkpoint.ds_to_universal --input_folder TAG_DIR
  --output_folder U --num_extract_workers 2 --num_merge_workers 2``, then a second process that
  ``torch.load``s every ``U/zero/<param>/fp32.pt`` into a state dict (what a user must do to get
  the weights): the two processes' wall times added.

Beside the times, for each: the peak memory of the process tree, polled every 0.1 s (the sum over
the tree of RSS, and of PSS, which counts a page shared by several processes once; read from
/proc/PID/smaps_rollup), and ``ru_maxrss`` (the largest single process, from wait4); the disk it
used, polled every 0.1 s: its output folder (ds_to_universal's includes the ``tmp`` slices folder it
writes and removes at the end) plus a TMPDIR of its own, the peak and the final bytes (apparent
sizes); the bytes written. The machine (cores, RAM) is recorded beside the figures, and for each run
the load average and MemAvailable before it and how many cores the rest of the machine kept busy
during it (/proc/stat's busy time less the child tree's CPU time); ``--quiet-load L`` waits before
each run for the 1-minute load average to fall under L. The medians over the rounds, the ratio
DeepSpeed / zerofast, and every sample go to benchmarks/results/megatron-tp-<timestamp>.json.

Last, the outputs of the last round are compared (``_check``, a child): every tensor of zerofast's
bf16 export must equal ds_to_universal's fp32 parameter cast with ``.to(torch.bfloat16)``, bit for
bit, under the same names and shapes, and the two must hold the same names.

This process never imports torch, so that its own size stays out of the children's ru_maxrss.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DSGEN = REPO / "tests" / "dsgen"

# The model. Per layer 4 H^2 + 3 H F (+ biases and norms) = 51.4M; 9 layers, the padded
# vocabulary and the positions: 530,850,816 parameters held, 530,328,576 after the vocabulary's
# 255 padding rows are trimmed.
SPEC = {
    "family": "megatron", "stage": 1, "world_size": 4, "dtype": "bf16", "tp": 2, "steps": 1,
    "hidden": 2048, "heads": 16, "ffn": 5632, "layers": 9, "vocab": 32001, "vocab_divisible_by": 128,
    "max_pos": 1024, "seq": 8, "micro_batch": 2, "seed": 1234, "lr": 1e-3,
    # ZeRO's buckets at 5e7 elements, not the default 5e8 (a 1 GB bf16 buffer per rank).
    "ds_config": {"zero_optimization": {"stage": 1, "reduce_bucket_size": 50_000_000,
                                        "allgather_bucket_size": 50_000_000}},
}
# --small: the same layout at a few thousand parameters, to try this script in seconds.
SMALL = {**SPEC, "hidden": 64, "heads": 4, "ffn": 96, "layers": 2, "vocab": 301, "vocab_divisible_by": 8,
         "max_pos": 16}
POLL_S = 0.1
GIB = 2**30


# -- the machine and the process tree -----------------------------------------------------------------

def meminfo() -> dict:
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            out[key] = int(value.split()[0]) * 1024
    return out


def machine() -> dict:
    cpu = ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpus": os.cpu_count(), "cpu_model": cpu, "ram_bytes": meminfo()["MemTotal"],
            "platform": platform.platform(), "python": platform.python_version()}


def load_now() -> dict:
    return {"loadavg": list(os.getloadavg()), "mem_available_bytes": meminfo()["MemAvailable"]}


def busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy (not idle, not waiting on I/O) since boot."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rfind(")") + 2:].split()[1])
        kids.setdefault(ppid, []).append(int(entry.name))
    return kids


def tree_memory(root: int) -> tuple[int, int, int]:
    """(RSS summed, PSS summed, processes) over ``root`` and its descendants."""
    kids, todo, rss, pss, n = _children(), [root], 0, 0, 0
    while todo:
        pid = todo.pop()
        todo.extend(kids.get(pid, []))
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Rss:"):
                        rss += int(line.split()[1]) * 1024
                    elif line.startswith("Pss:"):
                        pss += int(line.split()[1]) * 1024
            n += 1
        except OSError:
            pass
    return rss, pss, n


def folder_bytes(path: Path) -> tuple[int, int]:
    """(apparent bytes, files) under ``path``; files that vanish while it looks are skipped."""
    total = files = 0
    stack = [str(path)]
    while stack:
        try:
            it = os.scandir(stack.pop())
        except OSError:
            continue
        with it:
            for e in it:
                try:
                    if e.is_dir(follow_symlinks=False):
                        stack.append(e.path)
                    elif e.is_file(follow_symlinks=False):
                        total += e.stat(follow_symlinks=False).st_size
                        files += 1
                except OSError:
                    pass
    return total, files


def run_watched(cmd: list[str], env: dict, watch: list[Path], log: Path, guard_bytes: int = GIB) -> dict:
    """Run ``cmd`` (its output to ``log``); poll its tree's memory and the size of the folders in
    ``watch``. Killed (and an error raised) when the machine's MemAvailable drops under ``guard_bytes``."""
    with open(log, "w") as out:
        busy0 = busy_seconds()
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
        peak_rss = peak_pss = peak_disk = peak_files = max_procs = 0
        low_mem = meminfo()["MemAvailable"]
        while True:
            pid, status, rusage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            rss, pss, n = tree_memory(proc.pid)
            peak_rss, peak_pss, max_procs = max(peak_rss, rss), max(peak_pss, pss), max(max_procs, n)
            disk = [folder_bytes(w) for w in watch]
            peak_disk = max(peak_disk, sum(d[0] for d in disk))
            peak_files = max(peak_files, sum(d[1] for d in disk))
            avail = meminfo()["MemAvailable"]
            low_mem = min(low_mem, avail)
            if avail < guard_bytes:
                os.killpg(proc.pid, 9)
                os.wait4(proc.pid, 0)
                raise RuntimeError(f"{cmd[:4]}: killed, the machine's MemAvailable fell to {avail / GIB:.2f} GiB")
            time.sleep(POLL_S)
        wall = time.perf_counter() - t0
        busy = busy_seconds() - busy0
    proc.returncode = code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} exited {code}:\n{log.read_text()[-4000:]}")
    final = [folder_bytes(w) for w in watch]
    cpu = rusage.ru_utime + rusage.ru_stime  # the child and its waited-for descendants
    return {"seconds": wall, "cpu_seconds": cpu,
            # what the rest of the machine kept busy meanwhile, in cores (this poller included)
            "others_cores_busy": max(0.0, busy - cpu) / wall, "peak_tree_rss": peak_rss, "peak_tree_pss": peak_pss, "max_processes": max_procs,
            "ru_maxrss": rusage.ru_maxrss * 1024, "peak_disk_bytes": max(peak_disk, sum(d[0] for d in final)),
            "peak_disk_files": max(peak_files, sum(d[1] for d in final)), "final_disk_bytes": sum(d[0] for d in final),
            "final_files": sum(d[1] for d in final), "min_mem_available": low_mem}


def child_env(tmpdir: Path | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1")
    if tmpdir is not None:
        env.update(TMPDIR=str(tmpdir), TMP=str(tmpdir), TEMP=str(tmpdir))
    return env


# -- the save --------------------------------------------------------------------------------------

def cache_root(arg: Path | None) -> Path:
    if arg is not None:
        return arg
    env = os.environ.get("ZEROFAST_BENCH_DIR")
    return Path(env) if env else REPO / ".cache" / "bench-megatron"


def save_key(spec: dict) -> str:
    import importlib.metadata

    blob = json.dumps(spec, sort_keys=True) + importlib.metadata.version("deepspeed")
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_save(root: Path, spec: dict) -> Path:
    final = root / f"megatron-tp2-dp2-{save_key(spec)}"
    if (final / "meta.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    tmp.mkdir()
    print(f"generating the save in {tmp} (torchrun, world 4) ...", flush=True)
    env = child_env()
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(spec["world_size"]),
           "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), str(Path(__file__).resolve()),
           "_train", json.dumps(spec), str(tmp)]
    before = load_now()
    try:
        got = run_watched(cmd, env, [tmp], root / "generate.log")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    meta = json.loads((tmp / "meta.json").read_text())
    meta["generation"] = {**got, "before": before}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    print(f"  {got['seconds']:.0f} s, peak tree PSS {got['peak_tree_pss'] / GIB:.1f} GiB, "
          f"{got['final_disk_bytes'] / 1e9:.2f} GB", flush=True)
    return final


def _train(spec_json: str, outdir: str) -> None:
    """Under torchrun: build the sized-up Megatron GPT, train one step, save (rank 0 also meta.json)."""
    spec = json.loads(spec_json)
    outdir = Path(outdir)
    sys.path.insert(0, str(DSGEN))
    import copy

    import torch
    import deepspeed
    import deepspeed.comm as dist

    import train as base  # tests/dsgen: ds_config_for
    import train_megatron as tm
    from gloo_job import exit_now, process_group

    tp = spec["tp"]
    multiple = spec["vocab_divisible_by"] * tp
    padded = -(-spec["vocab"] // multiple) * multiple
    # train_megatron's classes read these module globals when built and run.
    tm.VOCAB, tm.PADDED_VOCAB, tm.HIDDEN, tm.HEADS = spec["vocab"], padded, spec["hidden"], spec["heads"]
    tm.FFN, tm.MAX_POS, tm.LAYERS, tm.SEQ = spec["ffn"], spec["max_pos"], spec["layers"], spec["seq"]
    info = copy.deepcopy(tm.UC_INFO)
    info.update(original_vocab_size=spec["vocab"], padded_vocab_size=padded)
    tm.check_uc_info(info)

    t0 = time.perf_counter()
    with process_group(lambda: deepspeed.init_distributed(dist_backend="gloo")):
        rank = dist.get_rank()
        mpu = tm.MegatronMPU(tp)
        torch.set_default_dtype(torch.bfloat16)  # built in bf16: no fp32 copy of the model per rank
        model = tm.GPTModel(mpu)
        torch.set_default_dtype(torch.float32)
        full = tm.full_params()
        assert [n for n, _ in model.named_parameters()] == list(full)
        with torch.no_grad():
            for i, (name, p) in enumerate(model.named_parameters()):
                kind = full[name][1]
                # a replicated parameter is the same on every tp rank; a sharded one its own piece
                g = torch.Generator().manual_seed(spec["seed"] * 1000 + i * 16 + (0 if kind == "replicated" else 1 + mpu.tp_rank))
                if "layernorm.weight" in name:
                    p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
                elif name.endswith(".bias"):
                    p.copy_(0.02 * torch.randn(p.shape, generator=g))
                else:
                    p.normal_(0.0, 0.02, generator=g)
        optimizer = torch.optim.AdamW(model.parameters(), lr=spec["lr"], betas=(0.9, 0.99))
        cfg = base.ds_config_for(spec)
        cfg["train_micro_batch_size_per_gpu"] = spec["micro_batch"]
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg, mpu=mpu)
        built = time.perf_counter() - t0
        gen = torch.Generator().manual_seed(1000 + mpu.dp_rank)
        for _ in range(spec["steps"]):
            ids = torch.randint(0, spec["vocab"], (spec["micro_batch"], spec["seq"]), generator=gen)
            targets = torch.randint(0, spec["vocab"], (spec["micro_batch"], spec["seq"]), generator=gen)
            loss = engine(ids, targets)
            engine.backward(loss)
            engine.step()
        trained = time.perf_counter() - t0
        tag = f"global_step{spec['steps']}"
        engine.save_checkpoint(str(outdir), tag=tag,
                               client_state={"universal_checkpoint_info": info, "iteration": spec["steps"]})
        saved = time.perf_counter() - t0
        if rank == 0:
            held = {n: list(s) for n, (s, _k) in full.items()}
            exported = {n: ([spec["vocab"]] + s[1:] if full[n][1] == "vocab" else s) for n, s in held.items()}
            numel = lambda shapes: sum(int(torch.Size(s).numel()) for s in shapes.values())  # noqa: E731
            meta = {"spec": spec, "tag": tag, "padded_vocab": padded, "params_held": numel(held),
                    "params_exported": numel(exported), "tensors": len(full), "shapes": exported,
                    "loss": float(loss.detach()), "deepspeed": deepspeed.__version__, "torch": torch.__version__,
                    "optimizer": type(engine.optimizer).__name__,
                    "rank0_seconds": {"build": built, "train": trained - built, "save": saved - trained}}
    if rank == 0:
        (outdir / "meta.json").write_text(json.dumps(meta, indent=2))
    exit_now()


# -- the measured children -------------------------------------------------------------------------

def _read_universal(folder: str) -> None:
    """DeepSpeed's side, after ds_to_universal: every parameter's fp32.pt into one state dict."""
    import torch

    zero = Path(folder) / "zero"
    sd = {}
    for d in sorted(zero.iterdir()):
        f = d / "fp32.pt"
        if f.is_file():
            obj = torch.load(f, map_location="cpu", weights_only=True)
            sd[d.name] = obj["param"] if isinstance(obj, dict) else obj
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    print(json.dumps({"tensors": len(sd), "bytes": nbytes}))


def _check(zf_out: str, universal: str, report: str) -> None:
    """zerofast's bf16 tensors against ds_to_universal's fp32 params cast to bf16, bit for bit."""
    import torch
    from safetensors import safe_open

    zero = Path(universal) / "zero"
    ds_names = sorted(d.name for d in zero.iterdir() if (d / "fp32.pt").is_file())
    files = sorted(Path(zf_out).glob("*.safetensors"))
    where = {}
    for f in files:
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                where[k] = f
    mismatches, checked, elements = [], 0, 0
    for name in ds_names:
        if name not in where:
            mismatches.append({"name": name, "why": "not in zerofast's export"})
            continue
        obj = torch.load(zero / name / "fp32.pt", map_location="cpu", weights_only=True)
        ds = obj["param"] if isinstance(obj, dict) else obj
        with safe_open(str(where[name]), "pt") as h:
            zf = h.get_tensor(name)
        want = ds.to(torch.bfloat16)
        if zf.dtype != torch.bfloat16 or ds.dtype != torch.float32 or zf.shape != want.shape:
            mismatches.append({"name": name, "why": f"zerofast {zf.dtype} {list(zf.shape)}, "
                                                   f"ds_to_universal {ds.dtype} {list(ds.shape)}"})
        elif not torch.equal(zf.view(torch.int16), want.view(torch.int16)):
            n = int((zf.view(torch.int16) != want.view(torch.int16)).sum())
            mismatches.append({"name": name, "why": f"{n} of {zf.numel()} elements differ"})
        checked += 1
        elements += zf.numel()
    extra = sorted(set(where) - set(ds_names))
    result = {"equal": not mismatches and not extra, "tensors_compared": checked, "elements_compared": elements,
              "ds_to_universal_tensors": len(ds_names), "zerofast_tensors": len(where),
              "zerofast_only": extra, "mismatches": mismatches[:50], "mismatch_count": len(mismatches)}
    Path(report).write_text(json.dumps(result, indent=2))


# -- the rounds ------------------------------------------------------------------------------------

def warm(save: Path) -> None:
    for p in sorted(save.rglob("*.pt")):
        with open(p, "rb") as f:
            while f.read(1 << 24):
                pass


def measure_zerofast(save: Path, scratch: Path) -> dict:
    out, tmpdir = scratch / "zf_out", scratch / "zf_tmp"
    for d in (out, tmpdir):
        shutil.rmtree(d, ignore_errors=True)
    tmpdir.mkdir(parents=True)
    before = load_now()
    got = run_watched([sys.executable, "-m", "zerofast", "export", str(save), str(out), "--dtype", "bf16", "--quiet"],
                      child_env(tmpdir), [out, tmpdir], scratch / "zerofast.log")
    got.update(before=before, bytes_written=folder_bytes(out)[0], tmpdir_left=folder_bytes(tmpdir)[1])
    return got


def measure_deepspeed(save: Path, tag: str, scratch: Path) -> dict:
    out, tmpdir = scratch / "ds_universal", scratch / "ds_tmp"
    for d in (out, tmpdir):
        shutil.rmtree(d, ignore_errors=True)
    tmpdir.mkdir(parents=True)
    before = load_now()
    convert = run_watched([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                          str(save / tag), "--output_folder", str(out), "--num_extract_workers", "2",
                          "--num_merge_workers", "2"], child_env(tmpdir), [out, tmpdir],
                          scratch / "ds_to_universal.log")
    read = run_watched([sys.executable, str(Path(__file__).resolve()), "_read_universal", str(out)],
                       child_env(tmpdir), [tmpdir], scratch / "read_universal.log")
    read.update(json.loads((scratch / "read_universal.log").read_text().strip().splitlines()[-1]))
    both = [convert, read]
    return {"seconds": convert["seconds"] + read["seconds"], "convert_seconds": convert["seconds"],
            "cpu_seconds": convert["cpu_seconds"] + read["cpu_seconds"],
            "others_cores_busy": (convert["others_cores_busy"] * convert["seconds"] + read["others_cores_busy"]
                                  * read["seconds"]) / (convert["seconds"] + read["seconds"]),
            "read_seconds": read["seconds"],
            **{k: max(c[k] for c in both) for k in ("peak_tree_rss", "peak_tree_pss", "ru_maxrss", "max_processes")},
            "peak_disk_bytes": convert["peak_disk_bytes"], "peak_disk_files": convert["peak_disk_files"],
            "final_disk_bytes": convert["final_disk_bytes"], "final_files": convert["final_files"],
            "bytes_written_final": folder_bytes(out)[0], "tmp_folder_left": (out / "tmp").exists(),
            "min_mem_available": min(c["min_mem_available"] or 0 for c in both),
            "convert": convert, "read": read, "before": before}


def wait_for_quiet(limit: float, most_s: float = 600) -> float | None:
    """Wait until the 1-minute load average is under ``limit``; None, or the load when it gave up."""
    t0 = time.monotonic()
    while os.getloadavg()[0] >= limit:
        if time.monotonic() - t0 > most_s:
            return os.getloadavg()[0]
        time.sleep(5)
    return None


def median(samples: list[dict], key: str) -> float:
    return statistics.median(s[key] for s in samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--data", type=Path, default=None,
                    help="where the save is cached and the outputs are written (default: $ZEROFAST_BENCH_DIR, "
                         "else <repo>/.cache/bench-megatron)")
    ap.add_argument("--max-round-s", type=float, default=300,
                    help="stop after the round in which the pair took longer than this (the rounds are fewer)")
    ap.add_argument("--quiet-load", type=float, default=None, metavar="L",
                    help="before each measurement, wait (up to 10 min) for the 1-minute load average to fall under L")
    ap.add_argument("--small", action="store_true", help="a tiny model of the same layout, to try the script")
    ap.add_argument("--no-check", action="store_true", help="skip the bit-for-bit comparison of the outputs")
    args = ap.parse_args()

    root = cache_root(args.data)
    save = ensure_save(root, SMALL if args.small else SPEC)
    meta = json.loads((save / "meta.json").read_text())
    tag = meta["tag"]
    save_bytes, save_files = folder_bytes(save / tag)
    print(f"save {save}: {meta['params_held']:,} parameters held ({meta['params_exported']:,} after the "
          f"vocabulary's padding), {save_bytes / 1e9:.2f} GB in {save_files} files", flush=True)
    scratch = root / f"scratch-{os.getpid()}"
    scratch.mkdir(parents=True)
    samples: dict[str, list[dict]] = {"zerofast": [], "deepspeed": []}
    notes = []
    check = None
    try:
        for r in range(args.rounds):
            order = ["zerofast", "deepspeed"] if r % 2 == 0 else ["deepspeed", "zerofast"]
            round_s = 0.0
            for tool in order:
                warm(save)
                if args.quiet_load is not None:
                    waited = wait_for_quiet(args.quiet_load)
                    if waited is not None:
                        notes.append(f"round {r + 1} {tool}: the load stayed over {args.quiet_load} ({waited:.2f})")
                last = r == args.rounds - 1
                s = (measure_zerofast(save, scratch) if tool == "zerofast" else
                     measure_deepspeed(save, tag, scratch))
                s["round"] = r + 1
                samples[tool].append(s)
                round_s += s["seconds"]
                print(f"  round {r + 1} {tool:9s} {s['seconds']:7.2f} s  tree PSS {s['peak_tree_pss'] / GIB:5.2f} GiB "
                      f"(RSS {s['peak_tree_rss'] / GIB:5.2f}, max 1 proc {s['ru_maxrss'] / GIB:5.2f})  disk peak "
                      f"{s['peak_disk_bytes'] / 1e9:6.2f} GB  load {s['before']['loadavg'][0]:.2f}, others busy "
                      f"{s['others_cores_busy']:.2f} cores", flush=True)
                if tool == "zerofast" and not last:
                    shutil.rmtree(scratch / "zf_out", ignore_errors=True)
                if tool == "deepspeed" and not last:
                    shutil.rmtree(scratch / "ds_universal", ignore_errors=True)
            if round_s > args.max_round_s and r < args.rounds - 1:
                notes.append(f"stopped after round {r + 1} of {args.rounds}: it took {round_s:.0f} s "
                             f"(over --max-round-s {args.max_round_s:.0f})")
                print(notes[-1], flush=True)
                break
        if not args.no_check:
            report = scratch / "check.json"
            subprocess.run([sys.executable, str(Path(__file__).resolve()), "_check", str(scratch / "zf_out"),
                            str(scratch / "ds_universal"), str(report)], env=child_env(), check=True, cwd=REPO)
            check = json.loads(report.read_text())
            print(f"check: {'EQUAL' if check['equal'] else 'MISMATCH'}: {check['tensors_compared']} tensors, "
                  f"{check['elements_compared']:,} elements; {check['mismatch_count']} mismatches, "
                  f"zerofast-only names {check['zerofast_only']}", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    zf, ds = samples["zerofast"], samples["deepspeed"]
    keys = ("seconds", "cpu_seconds", "others_cores_busy", "peak_tree_pss", "peak_tree_rss", "ru_maxrss", "peak_disk_bytes", "final_disk_bytes")
    summary = {tool: {k: median(s, k) for k in keys} for tool, s in samples.items()}
    for k in ("convert_seconds", "read_seconds"):
        summary["deepspeed"][k] = median(ds, k)
    summary["ratio_seconds_deepspeed_over_zerofast"] = summary["deepspeed"]["seconds"] / summary["zerofast"]["seconds"]
    summary["ratio_peak_pss_deepspeed_over_zerofast"] = (summary["deepspeed"]["peak_tree_pss"]
                                                        / summary["zerofast"]["peak_tree_pss"])
    git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--", "zerofast"], cwd=REPO, capture_output=True,
                                text=True).stdout.strip())
    report = {
        "benchmark": "megatron_tp", "what": "zerofast export --dtype bf16 vs ds_to_universal + torch.load of every "
                                            "fp32.pt, TP 2 x DP 2 Megatron-DeepSpeed save",
        "machine": machine(), "git": {"head": git, "zerofast_dirty": dirty},
        "save": {"path": str(save), "bytes": save_bytes, "files": save_files,
                 **{k: meta[k] for k in ("params_held", "params_exported", "tensors", "padded_vocab", "deepspeed",
                                         "torch", "optimizer", "spec")},
                 "generation": meta.get("generation")},
        "commands": {
            "zerofast": "python -m zerofast export SAVE OUT --dtype bf16 --quiet",
            "deepspeed": "python -m deepspeed.checkpoint.ds_to_universal --input_folder SAVE/TAG --output_folder U "
                         "--num_extract_workers 2 --num_merge_workers 2; then python benchmarks/megatron_tp.py "
                         "_read_universal U (torch.load of every U/zero/*/fp32.pt)"},
        "method": {"rounds": len(zf), "rounds_asked": args.rounds, "poll_s": POLL_S, "cache": "warm",
                   "quiet_load": args.quiet_load,
                   "load": "before: loadavg and MemAvailable before the child starts; others_cores_busy: the "
                           "machine's busy CPU time during the run (/proc/stat) less the child tree's (wait4), over "
                           "the wall time (the poller's own share included)",
                   "memory": "peak_tree_pss / peak_tree_rss: sums over the process tree, polled; ru_maxrss: the "
                             "largest single process (wait4)",
                   "disk": "apparent bytes of the output folder (with ds_to_universal's tmp slices) and of the "
                           "child's TMPDIR, polled; peak and final"},
        "notes": notes, "summary": summary, "check": check, "samples": samples,
    }
    out = HERE / "results" / time.strftime(f"megatron-tp{'-small' if args.small else ''}-%Y%m%d-%H%M%S.json")
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    z, d = summary["zerofast"], summary["deepspeed"]
    print(f"\n| tool | s (median of {len(zf)}) | peak tree PSS GiB | peak tree RSS GiB | max 1 proc GiB | "
          f"peak disk GB | final disk GB |\n|---|---|---|---|---|---|---|")
    for name, m in (("zerofast export --dtype bf16", z), ("ds_to_universal + torch.load", d)):
        print(f"| {name} | {m['seconds']:.2f} | {m['peak_tree_pss'] / GIB:.2f} | {m['peak_tree_rss'] / GIB:.2f} | "
              f"{m['ru_maxrss'] / GIB:.2f} | {m['peak_disk_bytes'] / 1e9:.2f} | {m['final_disk_bytes'] / 1e9:.2f} |")
    print(f"DeepSpeed / zerofast: {summary['ratio_seconds_deepspeed_over_zerofast']:.1f}x the time "
          f"(ds_to_universal {d['convert_seconds']:.1f} s + read {d['read_seconds']:.1f} s)")
    print(f"wrote {out}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_train":
        _train(sys.argv[2], sys.argv[3])
    elif len(sys.argv) > 1 and sys.argv[1] == "_read_universal":
        _read_universal(sys.argv[2])
    elif len(sys.argv) > 1 and sys.argv[1] == "_check":
        _check(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        main()
