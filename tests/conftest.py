import importlib.util

import pytest
import torch

from tests.dsgen.catalog import LAYOUTS, ensure_checkpoint

HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
needs_deepspeed = pytest.mark.skipif(
    not HAVE_DEEPSPEED, reason="DeepSpeed 0.19.8 is needed to make real checkpoints (pip install deepspeed==0.19.8)")


@pytest.fixture(scope="session", params=sorted(LAYOUTS))
def real_ckpt(request):
    """(name, root, ground truth) of each real DeepSpeed checkpoint; made once and cached."""
    if not HAVE_DEEPSPEED:
        pytest.skip("DeepSpeed 0.19.8 is needed to make real checkpoints")
    root = ensure_checkpoint(request.param)
    truth = torch.load(root / "ground_truth.pt", weights_only=True)
    return request.param, root, truth
