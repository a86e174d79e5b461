"""zerofast's native core: built against the running torch on first use, cached, loaded.
The variables that steer it are read with every other setting, in :mod:`zerofast.base.settings`.

- :mod:`.cache`: where a core lives and what it is built from, found without importing torch;
- :mod:`.loader`: find, build (under a lock, in a child process) and load it, or say why not;
- :mod:`.build`: the child process that runs torch's extension builder;
- :mod:`.proof`: what proves a new core sound before it is cached (its linkage, its errors whole);
- :mod:`.toolchain`: the C++ compilers tried in turn, what names each, what a core links;
- :mod:`.cudaplan`: whether the CUDA kernels are built, for which GPUs, with which nvcc (no CUDA);
- :mod:`.report`: what ``zerofast --version`` and ``zerofast doctor`` print.

Nothing is compiled at ``pip install`` time, so no build-time torch is ever involved: the wheel
and the sdist carry ``csrc/`` as package data (``zerofast/csrc``), a checkout uses its own.
"""
