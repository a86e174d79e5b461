"""What every writer of files shares, below the Hugging Face export (:mod:`zerofast.hf`) and the
checkpoint writers (:mod:`zerofast.writers`):

- :mod:`.transaction`: the one output-folder transaction (ownership, never over the input, lock,
  temporary folder, commit, what was replaced);
- :mod:`.team`: the team protocol: the processes sharing one output, and how signals stop them;
- :mod:`.windows`: tensors written into a file through bounded, reserved memory-mapped windows.
"""
