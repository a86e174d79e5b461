"""Factory for real DeepSpeed ZeRO checkpoints used by the test suite.

``models`` holds plain torch model builders (no DeepSpeed import), ``train`` is the
script run under torchrun to train and save, and ``catalog`` lists the layouts and
generates/caches them on demand (``ensure_checkpoint(name)``).
"""
