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
from tests.conftest import needs_deepspeed, needs_nvme
from tests.dsgen.catalog import ensure_checkpoint
from tests.dsgen.dcp import ensure_dcp
from zerofast.base import errors
from zerofast.base.errors import MappingLimitError, mapping_refused
from zerofast.load import archive, unpickle

pytestmark = needs_deepspeed
S2 = "s2_bf16_w2_frozen_tied"
REFUSED = "unable to mmap 4081 bytes from file </x.pt>: Cannot allocate memory (12)"


def test_what_counts_as_the_kernel_refusing_a_mapping():
    assert mapping_refused(OSError(errno.ENOMEM, "Cannot allocate memory"))
    assert mapping_refused(RuntimeError(REFUSED))
    assert not mapping_refused(OSError(errno.EACCES, "Permission denied"))
    assert not mapping_refused(RuntimeError("unable to mmap 4081 bytes from file </x.pt>: No such device (19)"))
    assert not mapping_refused(RuntimeError("unable to mmap 4081 bytes from file </run (12)/x.pt>: No such device (19)"))
    assert not mapping_refused(ValueError("Cannot allocate memory (12)"))


def test_the_message_blames_the_limit_only_at_the_limit(monkeypatch):
    monkeypatch.setattr(errors, "_read_int", lambda path: 1000)
    monkeypatch.setattr(errors, "_count_lines", lambda path: 999)
    at_limit = errors.mapping_limit_error("/x.pt")
    assert "holds 999 mappings and the system allows 1000" in str(at_limit) and "sysctl" in str(at_limit)
    assert at_limit.errno == errno.ENOMEM and at_limit.filename == "/x.pt" and str(at_limit).startswith("/x.pt: ")
    monkeypatch.setattr(errors, "_count_lines", lambda path: 40)
    elsewhere = errors.mapping_limit_error("/x.pt")
    assert "holds 40 of the 1000 mappings" in str(elsewhere) and "ulimit -v" in str(elsewhere)


@pytest.mark.parametrize("native", ["1", "0"])
def test_a_refused_mapping_of_a_rank_file_names_the_limit(monkeypatch, native):
    monkeypatch.setenv("ZEROFAST_NATIVE", native)
    root = ensure_checkpoint(S2)

    def refuse(*args, **kwargs):
        raise RuntimeError(REFUSED)

    monkeypatch.setattr(torch.UntypedStorage, "from_file", refuse)
    with pytest.raises(MappingLimitError, match=r"cannot map the file: .*vm.max_map_count") as e:
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


@pytest.mark.parametrize("where", [pytest.param("nvme", marks=needs_nvme), "dcp"])
def test_the_other_readers_that_map_name_the_limit(monkeypatch, where):
    """NVMe swap files and DCP data files map through map_file too."""
    root = ensure_checkpoint("s3_bf16_w2_nvme") if where == "nvme" else ensure_dcp(2)
    real = torch.UntypedStorage.from_file
    refused = []

    def refuse(path, *args, **kwargs):
        if (where == "nvme" and str(path).endswith(".tensor.swp")) or (where == "dcp" and str(path).endswith(".distcp")):
            refused.append(path)
            raise RuntimeError(REFUSED)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(torch.UntypedStorage, "from_file", refuse)
    with pytest.raises(MappingLimitError) as e:
        zerofast.reconstruct(root)
    assert refused and e.value.path == str(refused[0])
