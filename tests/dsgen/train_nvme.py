"""Train the suite's model under ZeRO-Infinity (NVMe offload of the optimizer and the params).

Run under torchrun like train.py (same spec keys, same ground truth file):

    DS_ACCELERATOR=cpu python -m torch.distributed.run --nproc_per_node W \
        tests/dsgen/train_nvme.py '<spec as JSON>' OUTDIR

The spec's ``ds_config`` names ``"nvme_path": "@SWAP@"`` for ``offload_optimizer`` and
``offload_param``; this script points them at a fresh folder next to OUTDIR (the swap folder is
DeepSpeed's working space, not part of the save: ``save_checkpoint`` copies the optimizer's swap
files into ``OUTDIR/<tag>/offloaded_tensors/``) and removes it once every rank is done. Then it runs
train.py's ``main``: the ground truth comes from the live engine the same way, through
``safe_get_full_fp32_param`` and ``safe_get_full_optimizer_state``, which swap each sub-group in
from the swap files to read it.

Needs DeepSpeed's ``async_io`` op (libaio); see tests/dsgen/README.md.
"""
import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train as base  # noqa: E402

PLACEHOLDER = "@SWAP@"


def main():
    spec_text = sys.argv[1] if sys.argv[1].lstrip().startswith("{") else Path(sys.argv[1]).read_text()
    outdir = Path(sys.argv[2])
    swap = Path(str(outdir) + ".swap")
    sys.argv[1] = spec_text.replace(PLACEHOLDER, str(swap))
    try:
        base.main()
    finally:
        if int(os.environ.get("RANK", "0")) == 0:
            shutil.rmtree(swap, ignore_errors=True)


if __name__ == "__main__":
    from gloo_job import exit_now

    main()
    exit_now()  # torn down and written: no finalization (tests/dsgen/gloo_job.py)
