"""Test support that ships with zerofast, as ``torch.testing`` does: nothing here is imported by
``import zerofast``.

- :mod:`.synthesize`: DeepSpeed 0.19.8's on-disk format written without DeepSpeed (fp16 included),
  with the ground truth, for what DeepSpeed cannot write on a CPU;
- :mod:`.strategies`: hypothesis strategies of random layouts (needs ``hypothesis``);
- :mod:`.fake_device`: a CPU-backed device (the upload ring's streams as worker threads) that a
  test registers itself in ``zerofast.devices.DEVICES``.
"""
