"""Build for zerofast's native core.

`pip install --no-build-isolation -e .` compiles the CPU kernels against the torch that is
already installed. CUDA kernels (csrc/cuda/*.cu) are added when torch was built with CUDA and
nvcc is found, or when FORCE_CUDA=1; TORCH_CUDA_ARCH_LIST is respected by torch's builder.
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


def cxx_standard() -> str:
    # torch 2.14's headers need C++20; older ones are built and tested here as C++17.
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    return "c++20" if (major, minor) >= (2, 14) else "c++17"


def extension():
    rel = lambda pattern: sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))
    sources = rel("csrc/*.cpp") + rel("csrc/cpu/*.cpp")
    macros = [("ZEROFAST_TORCH_VERSION", f'"{torch.__version__}"')]
    cxx = ["-O3", f"-std={cxx_standard()}", "-fopenmp"]
    cuda_sources = rel("csrc/cuda/*.cu") + rel("csrc/cuda/*.cpp")
    if want_cuda() and cuda_sources:
        macros.append(("ZEROFAST_WITH_CUDA", None))
        return CUDAExtension(
            "zerofast._C",
            sources + cuda_sources,
            define_macros=macros,
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3"]},
            extra_link_args=["-fopenmp"],
        )
    return CppExtension(
        "zerofast._C", sources, define_macros=macros, extra_compile_args={"cxx": cxx}, extra_link_args=["-fopenmp"]
    )


setup(
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
