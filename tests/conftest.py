import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

from tests.dsgen.catalog import LAYOUTS, ensure_checkpoint

HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
needs_deepspeed = pytest.mark.skipif(
    not HAVE_DEEPSPEED, reason="DeepSpeed 0.19.8 is needed to make real checkpoints (pip install deepspeed==0.19.8)")

NVME_ENV = "ZEROFAST_TEST_NVME"  # 1: run the NVMe (ZeRO-Infinity) tests even if async_io must be built first
# Random layouts tests/test_gather_plan.py checks under the sanitizers (2000 for a longer run).
GATHER_CASES = int(os.environ.get("ZEROFAST_TEST_GATHER_CASES", "150"))


def async_io_built() -> bool:
    """DeepSpeed's async_io op is there to load without a build: installed prebuilt
    (DS_BUILD_AIO=1) or already JIT-built in torch's extension folder. Checked by file, because
    asking DeepSpeed to load it starts a build (about 20 minutes on 2 cores, needs libaio-dev)."""
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.submodule_search_locations:
        return False
    prebuilt = Path(list(spec.submodule_search_locations)[0]) / "ops" / "aio"
    if any(prebuilt.glob("async_io_op*.so")):
        return True
    from torch.utils.cpp_extension import get_default_build_root
    flavor = "cpu" if torch.version.cuda is None else f"cu{torch.version.cuda.replace('.', '')}"
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()  # as torch picks it
    folder = Path(root) / f"py{sys.version_info.major}{sys.version_info.minor}_{flavor}" / "async_io"
    return any(folder.glob("async_io*.so"))


needs_nvme = pytest.mark.skipif(
    not HAVE_DEEPSPEED or not (os.environ.get(NVME_ENV) == "1" or async_io_built()),
    reason=f"NVMe offload saves need DeepSpeed's async_io op, not built here; install libaio-dev and set {NVME_ENV}=1 "
           "(the first run builds the op, about 20 minutes), or install DeepSpeed with DS_BUILD_AIO=1")


@pytest.fixture(scope="session", params=sorted(LAYOUTS))
def real_ckpt(request):
    """(name, root, ground truth) of each real DeepSpeed checkpoint; made once and cached."""
    if not HAVE_DEEPSPEED:
        pytest.skip("DeepSpeed 0.19.8 is needed to make real checkpoints")
    root = ensure_checkpoint(request.param)
    truth = torch.load(root / "ground_truth.pt", weights_only=True)
    return request.param, root, truth
