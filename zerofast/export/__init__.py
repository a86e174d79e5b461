"""Step 5: hand the plan's tensors out: in memory or as files.

- :mod:`.materialize`: the eager state dict and the lazy mapping;
- :mod:`.run`: ``export()``, the Hugging Face folder of weight files;
- :mod:`.shards`: how tensors are split into files (pure);
- :mod:`.formats`: the registry of output formats, one module each;
- :mod:`.outdir`: the output folder's transaction (lock, temporary folder, commit);
- :mod:`.distributed`: the same export shared by the ranks of a torch.distributed job;
- :mod:`.read`: ``load_exported``, reading a folder back.
"""
from .materialize import LazyStateDict, TensorMeta, eager_state_dict
from .read import load_exported
from .run import ExportResult, Progress, export

__all__ = ["LazyStateDict", "TensorMeta", "eager_state_dict", "load_exported", "ExportResult", "Progress", "export"]
