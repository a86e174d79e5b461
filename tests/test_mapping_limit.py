"""The kernel refusing one more file mapping (ENOMEM: the process holds ``vm.max_map_count``
mappings, a save of tens of thousands of files) is a MappingLimitError naming the file and the
limit, not a corrupt file. The suite cannot lower the system's limit, so the refusal is planted
where each reader maps: torch's ``from_file`` (the native reader, the Python reference, NVMe
swap files and DCP data files all map through ``map_file``) and ``mmap`` (archive.py's
reading of the local headers)."""
from __future__ import annotations

import errno
import mmap

import pytest
import torch

import zerofast
from tests.conftest import needs_deepspeed
from tests.dsgen.catalog import ensure_checkpoint
from zerofast.errors import MappingLimitError, mapping_refused
from zerofast.load import archive, unpickle

pytestmark = needs_deepspeed
S2 = "s2_bf16_w2_frozen_tied"
REFUSED = "unable to mmap 4081 bytes from file </x.pt>: Cannot allocate memory (12)"


def test_what_counts_as_the_kernel_refusing_a_mapping():
    assert mapping_refused(OSError(errno.ENOMEM, "Cannot allocate memory"))
    assert mapping_refused(RuntimeError(REFUSED))
    assert not mapping_refused(OSError(errno.EACCES, "Permission denied"))
    assert not mapping_refused(RuntimeError("unable to mmap 4081 bytes from file </x.pt>: No such device (19)"))
    assert not mapping_refused(ValueError("Cannot allocate memory (12)"))


@pytest.mark.parametrize("native", ["1", "0"])
def test_a_refused_mapping_of_a_rank_file_names_the_limit(monkeypatch, native):
    monkeypatch.setenv("ZEROFAST_NATIVE", native)
    root = ensure_checkpoint(S2)

    def refuse(*args, **kwargs):
        raise RuntimeError(REFUSED)

    monkeypatch.setattr(torch.UntypedStorage, "from_file", refuse)
    with pytest.raises(MappingLimitError, match=r"cannot map the file: .* vm.max_map_count") as e:
        zerofast.reconstruct(root)
    assert e.value.path.startswith(str(root)) and e.value.path.endswith(".pt")
    assert isinstance(e.value, OSError)


def test_a_refused_mapping_of_a_zip_directory_names_the_limit(monkeypatch):
    monkeypatch.setenv("ZEROFAST_NATIVE", "0")  # archive.py maps the file for its local headers
    path = next(ensure_checkpoint(S2).rglob("*model_states.pt"))

    def refuse(*args, **kwargs):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(mmap, "mmap", refuse)
    with pytest.raises(MappingLimitError) as e:
        archive.index_archive(path)
    assert e.value.path == str(path)


def test_other_mapping_failures_stay_what_they_are(monkeypatch, tmp_path):
    path = tmp_path / "x.pt"
    torch.save({"w": torch.ones(3)}, path)

    def refuse(*args, **kwargs):
        raise RuntimeError("unable to mmap 100 bytes from file </x.pt>: No such device (19)")

    monkeypatch.setattr(torch.UntypedStorage, "from_file", refuse)
    with pytest.raises(RuntimeError, match="No such device"):
        unpickle.map_file(path)
