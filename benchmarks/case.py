"""One benchmark measurement, run in a fresh process: ``python benchmarks/case.py CASE CKPT OUT``.

Prints one JSON line: seconds after imports, bytes produced, peak RSS. The parent process adds
the whole-process time. Peak RSS is this process's own high-water mark (``VmHWM`` in
/proc/self/status), not ``ru_maxrss``: Linux carries ``ru_maxrss`` across fork and exec, so it
would report run.py's own peak whenever that is larger. A case that launches workers
(zf_export_2workers) also counts their ``ru_maxrss`` (each at least this process's size when it
forked). Cases that need DeepSpeed import it here, so zerofast's own cases never
pay for it.
"""
from __future__ import annotations

import json
import os
import resource
import shutil
import sys
import time
from collections import OrderedDict
from pathlib import Path


def _nbytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def zf_eager(ckpt, out):
    import zerofast

    zerofast.reconstruct  # noqa: B018 -- a lazy import; seconds are counted after imports
    t0 = time.perf_counter()
    sd = zerofast.reconstruct(ckpt)
    return time.perf_counter() - t0, _nbytes(sd.values())


class _FirstByte(Exception):
    pass


def zf_prepare(ckpt, out):
    """Everything zf_eager does before the first byte is copied: ``reconstruct`` up to its
    executor's first read (discover, read the files, plan, make the executor), timed where that
    read would begin and stopped there."""
    import zerofast
    from zerofast.execute import Executor

    planned = []

    def first_read(self, tps):
        at = time.perf_counter()
        planned.append((at, sum(tp.nbytes for tp in (tps.values() if hasattr(tps, "values") else tps))))
        raise _FirstByte

    Executor.run_all = first_read  # where a checkout still has it (before the plan's columns went end to end)
    Executor.run_plan = first_read
    zerofast.reconstruct  # noqa: B018 -- a lazy import; seconds are counted after imports
    t0 = time.perf_counter()
    try:
        zerofast.reconstruct(ckpt)
    except _FirstByte:
        pass
    at, nbytes = planned[0]
    return at - t0, nbytes


def zf_lazy(ckpt, out):
    """Every tensor of the lazy mapping looked up once, in its order, and dropped."""
    import zerofast

    zerofast.reconstruct  # noqa: B018
    t0 = time.perf_counter()
    sd = zerofast.reconstruct(ckpt, lazy=True)
    total = 0
    for name in sd:
        t = sd[name]  # built (read ahead with its neighbours when small), then dropped
        total += t.numel() * t.element_size()
    return time.perf_counter() - t0, total


def _empty_model(ckpt):
    """A module with an uninitialized fp32 tensor for each of the checkpoint's (fp32 dict's) names."""
    import zerofast

    return model_like(zerofast.reconstruct(ckpt, lazy=True), "cpu")


def model_like(sd, device: str, dtype=None):
    """A module with an uninitialized tensor (on ``device``) for each name of the lazy dict ``sd``;
    floating ones in ``dtype`` when given."""
    import torch

    root = torch.nn.Module()
    for name in sd:
        meta = sd.meta(name)
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        want = dtype if dtype is not None and meta.dtype.is_floating_point else meta.dtype
        module.register_parameter(leaf, torch.nn.Parameter(torch.empty(meta.shape, dtype=want, device=device),
                                                           requires_grad=False))
    return root


def zf_load_into(ckpt, out):
    """zerofast.load_into into a model of empty fp32 tensors (made before the clock starts)."""
    import zerofast

    model = _empty_model(ckpt)
    t0 = time.perf_counter()
    zerofast.load_into(model, ckpt)
    return time.perf_counter() - t0, _nbytes(model.state_dict().values())


def ds_eager(ckpt, out):
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    t0 = time.perf_counter()
    sd = get_fp32_state_dict_from_zero_checkpoint(str(ckpt))
    # DeepSpeed leaves frozen weights in bf16; the same fp32 contract costs it this cast.
    sd = {k: v.float() if v.is_floating_point() and v.dtype != torch.float32 else v for k, v in sd.items()}
    return time.perf_counter() - t0, _nbytes(sd.values())


def _export(ckpt, out, dtype):
    import zerofast as zexport

    zexport.export  # noqa: B018
    t0 = time.perf_counter()
    zexport.export(ckpt, out, dtype=dtype, max_shard_size="1GB")
    return time.perf_counter() - t0, _dir_bytes(out)


def zf_export(ckpt, out):
    import torch

    return _export(ckpt, out, torch.float32)


def zf_export_bf16(ckpt, out):
    import torch

    return _export(ckpt, out, torch.bfloat16)


def zf_export_2workers(ckpt, out):
    """zf_export shared by two ranks on this machine (``--workers 2``): the 1-vs-2 worker figure."""
    import re
    import subprocess

    cmd = [sys.executable, "-m", "zerofast", "export", str(ckpt), str(out), "--max-shard-size", "1GB", "--workers", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    # Rank 0 times its export call up to the commit, the wait for the other rank included, but
    # not the ranks' start and imports, as zf_export's time leaves out this process's imports.
    seconds = float(re.search(r" in ([\d.]+) s$", proc.stdout.strip()).group(1))
    return seconds, _dir_bytes(out)


def ds_export(ckpt, out):
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    t0 = time.perf_counter()
    convert_zero_checkpoint_to_fp32_state_dict(str(ckpt), str(out), safe_serialization=True, max_shard_size="1GB")
    return time.perf_counter() - t0, _dir_bytes(out)


def floor(ckpt, out):
    """One plain copy of every byte the consolidation must read, into fresh buffers."""
    import torch

    from zerofast.prepare import prepare

    prepared = prepare(ckpt)  # metadata only: the sources stay memory-mapped
    t0 = time.perf_counter()
    copies = [torch.empty_like(src).copy_(src) for src in prepared.sources]
    return time.perf_counter() - t0, _nbytes(copies)


def dict_floor(ckpt, out):
    """The memory floor of any eager dict of this save: a fresh process that imports zerofast,
    loads its native core and makes the same fp32 outputs (names, shapes) as separate filled
    tensors in a dict, and no more. Its peak RSS is the interpreter, torch and the dict alone;
    the names and shapes come from a file this process writes, so no plan is ever in the child."""
    import subprocess

    from zerofast.prepare import prepare

    tensors = prepare(ckpt).plan.tensors
    spec = {"names": list(tensors), "shapes": [list(tp.shape) for tp in tensors.values()],
            "dtypes": [str(tp.out_dtype).removeprefix("torch.") for tp in tensors.values()]}
    del tensors
    (out / "spec.json").write_text(json.dumps(spec))
    del spec
    proc = subprocess.run([sys.executable, __file__, "_dict_floor_child", str(ckpt), str(out)],
                          capture_output=True, text=True, check=True)
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    return got["seconds"], got["bytes"], got["peak_rss"]


def _dict_floor_child(ckpt, out):
    import torch

    from zerofast.native import ops

    ops.load_native()  # as zf_eager has it: the core's code and libraries are part of the floor
    spec = json.loads((out / "spec.json").read_text())
    names, shapes, dtypes = spec["names"], spec["shapes"], [getattr(torch, d) for d in spec["dtypes"]]
    del spec
    with open("/proc/self/clear_refs", "w") as f:  # the peak restarts here: the file's text is gone
        f.write("5")
    t0 = time.perf_counter()
    sd = OrderedDict()  # as reconstruct returns
    for i, name in enumerate(names):
        sd[name] = torch.ones(shapes[i], dtype=dtypes[i])  # ones: every page touched
        shapes[i] = None  # the shapes are not part of the dict
    return time.perf_counter() - t0, _nbytes(sd.values())


def cat_files(ckpt, out):
    """The floor of a save of thousands of files: ``cat`` of every file the layout reads > /dev/null."""
    import subprocess

    from zerofast.layouts import discover

    files = [str(p) for p in discover(ckpt).paths()]
    t0 = time.perf_counter()
    subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t0, sum(os.path.getsize(f) for f in files)


def disk_write(ckpt, out):
    """The disk's own write speed for zf_export's bytes: dd from /dev/zero, 16 MiB blocks, in 1GB
    files like the shards, no sync (the export does not sync either)."""
    import subprocess

    from zerofast.prepare import prepare

    total = sum(tp.nbytes for tp in prepare(ckpt).plan.tensors.values())
    t0 = time.perf_counter()
    left, i = total, 0
    while left > 0:
        n = min(left, 10**9)
        subprocess.run(["dd", "if=/dev/zero", f"of={out / f'shard{i}'}", "bs=16M", f"count={n}", "iflag=count_bytes",
                        "status=none"], check=True)
        left -= n
        i += 1
    return time.perf_counter() - t0, _dir_bytes(out)


def zf_reshard(ckpt, out):
    """Rewrite the checkpoint for half its data-parallel world size."""
    import zerofast
    from zerofast.layouts import discover

    world = len(discover(ckpt).optim_files)
    zerofast.reshard  # noqa: B018 -- a lazy import; seconds are counted after imports
    t0 = time.perf_counter()
    zerofast.reshard(ckpt, out, max(1, world // 2))
    return time.perf_counter() - t0, _dir_bytes(out)


def copy_files(ckpt, out):
    """The floor of reshard: one plain copy of every file of the save (as many bytes as it writes)."""
    from zerofast.layouts import discover

    files = discover(ckpt)
    t0 = time.perf_counter()
    for path in (*files.model_files, *files.optim_files):
        shutil.copyfile(path, out / path.name)
    return time.perf_counter() - t0, _dir_bytes(out)


def zf_to_universal(ckpt, out):
    import zerofast

    zerofast.to_universal  # noqa: B018
    t0 = time.perf_counter()
    zerofast.to_universal(ckpt, out / "universal" / "step")
    return time.perf_counter() - t0, _dir_bytes(out)


def ds_to_universal(ckpt, out):
    """DeepSpeed's own converter, as its docs run it (--inject_missing_state for ZeRO-1/2 saves)."""
    import subprocess

    from zerofast.layouts import discover

    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
           str(discover(ckpt).tag_dir), "--output_folder", str(out / "universal" / "step"), "--inject_missing_state"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return seconds, _dir_bytes(out)


def zf_to_dcp(ckpt, out):
    """A ZeRO save written as a PyTorch DCP folder: fp32 weights and Adam's moments and steps."""
    import torch.distributed.checkpoint  # noqa: F401 -- imports are not timed (torch's DCP takes seconds)

    import zerofast

    zerofast.to_dcp  # noqa: B018
    t0 = time.perf_counter()
    zerofast.to_dcp(ckpt, out / "dcp")
    return time.perf_counter() - t0, _dir_bytes(out)


def zf_export_dcp(ckpt, out):
    """A DCP folder (``ckpt``) exported as safetensors, kept in its dtype as torch's converter does."""
    import zerofast

    zerofast.export  # noqa: B018
    t0 = time.perf_counter()
    zerofast.export(ckpt, out, dtype=None, max_shard_size="1GB")
    return time.perf_counter() - t0, _dir_bytes(out)


def torch_dcp_to_torch_save(ckpt, out):
    """torch's own converter of a DCP folder: the whole state dict in memory, then one torch.save."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    t0 = time.perf_counter()
    dcp_to_torch_save(ckpt, out / "model.pt")
    return time.perf_counter() - t0, _dir_bytes(out)


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


CASES = {f.__name__: f for f in (zf_eager, zf_prepare, zf_lazy, zf_load_into, cat_files, ds_eager, dict_floor,
                                  _dict_floor_child, zf_export, zf_export_bf16,
                                  zf_export_2workers, ds_export, floor, disk_write, zf_reshard, copy_files,
                                  zf_to_universal, ds_to_universal, zf_to_dcp, zf_export_dcp, torch_dcp_to_torch_save)}


def _peak_rss(workers: bool) -> int:
    """This process's peak resident bytes; with ``workers``, the largest of it and its workers."""
    with open("/proc/self/status") as f:
        own = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    if not workers:
        return own
    return max(own, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)


def main() -> None:
    case, ckpt, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    owns_out = case != "_dict_floor_child"  # the child reads its parent's folder
    if owns_out:
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
    try:
        seconds, nbytes, *measured = CASES[case](ckpt, out)  # a case that measures elsewhere gives its RSS
        rss = measured[0] if measured else _peak_rss(workers=case == "zf_export_2workers")
        print(json.dumps({"case": case, "seconds": seconds, "bytes": nbytes, "peak_rss": rss}), flush=True)
    finally:
        if owns_out:
            shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
