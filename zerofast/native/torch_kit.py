"""The running torch's objects that the core's readers (csrc/load/, csrc/load/torch_kit.h) are
handed once, at import (:func:`.loader.import_core`).

That half of the core includes no torch header, so that its compiled code depends on the CPython
ABI alone and one build loads beside every torch: it makes and inspects tensors only through these
objects, as the Python reference (:mod:`zerofast.load.unpickle`) does.
"""
from __future__ import annotations


def objects() -> dict | None:
    """The running torch's objects the readers of csrc/load/ work with. That half of the core
    includes no torch header, so that its code depends on the CPython ABI alone and loads beside
    any torch: it makes and inspects tensors through these, as the Python reference does. None
    where a torch lacks one of the two private names (then the Python reference reads every file)."""
    import torch

    if not hasattr(torch._C, "_from_dlpack") or not hasattr(torch._C, "StorageBase"):
        return None
    return {"tensor_type": torch.Tensor, "parameter_type": torch.nn.Parameter, "dtype_type": torch.dtype,
            "size_type": torch.Size, "strided": torch.strided,
            "empty_of": lambda dtype: torch.empty(0, dtype=dtype),  # a prototype per storage dtype
            "tensor_new": torch.Tensor.new, "tensor_set": torch.Tensor.set_,
            "empty_bytes": lambda n: torch.empty(n, dtype=torch.uint8),
            "empty_longs": lambda n: torch.empty(n, dtype=torch.int64),
            # this core's own op (loaded with it): the readers make a file's tensors that share
            # a storage in one call of it (csrc/load/unpickle.cpp)
            "restrided": torch.ops.zerofast.restrided.default,
            "from_dlpack": torch._C._from_dlpack,  # csrc/load/dlpack_tensor.h
            "dlpack_probe": lambda dtype: torch.empty(1, dtype=dtype).__dlpack__(),  # the DLPack code of a dtype
            "storage_base": torch._C.StorageBase}  # its C subscript, under UntypedStorage's Python one
