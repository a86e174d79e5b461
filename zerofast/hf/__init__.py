"""Hugging Face weight folders: what ``zerofast.export`` writes and ``zerofast.load_exported`` reads.

- :mod:`.run`: ``export()``, the folder of weight files (and the optimizer states next to them);
- :mod:`.shards`: how tensors are split into files (pure);
- :mod:`.formats`: the registry of weight formats, one module each;
- :mod:`.trainer`: a Trainer checkpoint's config and tokenizer files, PEFT adapters and merges;
- :mod:`.held_dtype`: the dtype a run held the frozen base in, for ``base_dtype="as-trained"`` merges;
- :mod:`.distributed`: ``shared_export()``, the same export shared by the ranks of a
  torch.distributed job;
- :mod:`.read`: ``load_exported``, reading a folder back.

The folder is written through the output-folder transaction every writer shares
(:mod:`zerofast.output.transaction`), led by the team protocol (:mod:`zerofast.output.team`).
"""
from .read import load_exported
from .run import ExportResult, Progress, export

__all__ = ["load_exported", "ExportResult", "Progress", "export"]
