"""Build for zerofast's native core.

`pip install --no-build-isolation -e .` compiles the op schema (csrc/*.cpp) and, for each device
directory under csrc/ that can be built here, its kernels: csrc/cpu always; csrc/cuda when torch
was built with CUDA and nvcc is found, or when FORCE_CUDA=1 (TORCH_CUDA_ARCH_LIST is respected by
torch's builder). Each device's kernels register themselves with the dispatcher, so nothing else
needs to know which were built: `zerofast._C.built_devices()` asks the dispatcher.
"""
import glob
import os

import torch
from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

ROOT = os.path.dirname(os.path.abspath(__file__))


def want_cuda() -> bool:
    if os.environ.get("FORCE_CUDA", "0") == "1":
        return True
    return torch.version.cuda is not None and CUDA_HOME is not None


# device directory under csrc/ -> whether its kernels can be built here
DEVICES = {"cpu": lambda: True, "cuda": want_cuda}


def cxx_standard() -> str:
    # torch 2.14's headers need C++20; older ones are built and tested here as C++17.
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    return "c++20" if (major, minor) >= (2, 14) else "c++17"


def _sources(pattern: str) -> list:
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def extension():
    sources = _sources("csrc/*.cpp") + _sources("csrc/load/*.cpp")  # host code: the native pickle reader
    for device, wanted in DEVICES.items():
        if wanted():
            sources += _sources(f"csrc/{device}/*.cpp") + _sources(f"csrc/{device}/*.cu")
    macros = [("ZEROFAST_TORCH_VERSION", f'"{torch.__version__}"')]
    cxx = ["-O3", f"-std={cxx_standard()}", "-fopenmp"]
    if any(s.endswith(".cu") for s in sources):
        return CUDAExtension("zerofast._C", sources, define_macros=macros,
                             extra_compile_args={"cxx": cxx, "nvcc": ["-O3"]}, extra_link_args=["-fopenmp"])
    return CppExtension("zerofast._C", sources, define_macros=macros, extra_compile_args={"cxx": cxx},
                        extra_link_args=["-fopenmp"])


setup(
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
