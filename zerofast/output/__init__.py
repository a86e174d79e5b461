"""What every writer of files shares, below the Hugging Face export (:mod:`zerofast.hf`) and the
checkpoint writers (:mod:`zerofast.writers`):

- :mod:`.transaction`: the one output-folder transaction (ownership, never over the input, lock,
  temporary folder, commit, what was replaced);
- :mod:`.team`: the team protocol: the processes sharing one output, and how signals stop them;
- :mod:`.workers`: ``--workers N``, the ranks of one command started on this machine;
- :mod:`.nodes` (with :mod:`.node_bytes`, its files' bytes, and :mod:`.node_writes`, the writes run
  over it): a save whose rank files lie on different nodes' disks, read where it lies and fed to
  the writer over the process group;
- :mod:`.progress`: the progress bar a command shows on a terminal;
- :mod:`.windows`: tensors written into a file through bounded, reserved memory-mapped windows.
"""
