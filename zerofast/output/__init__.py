"""What every writer of files shares, below the Hugging Face export (:mod:`zerofast.hf`) and the
checkpoint writers (:mod:`zerofast.writers`):

- :mod:`.transaction`: the one output-folder transaction (ownership, never over the input, lock,
  temporary folder, commit, what was replaced);
- :mod:`.team`: the team protocol: the processes sharing one output, and how signals stop them;
- :mod:`.workers`: ``--workers N``, the ranks of one command started on this machine;
- :mod:`.node_writes`: a save whose rank files lie on different nodes' disks (each rank's view of
  it is :mod:`zerofast.load.node_view`'s), read where it lies and fed to the writer over the
  process group, file by file;
- :mod:`.progress`: the progress bar a command shows on a terminal;
- :mod:`.windows`: tensors written into a file through bounded, reserved memory-mapped windows.
"""
