"""The native zip-directory reader (csrc/load/zip_directory.cpp) against archive.py's.

On every real rank file of a few suite checkpoints the two must build the same index (entries,
prefix, data.pkl bytes, storage offsets); on damaged copies (byte edits of the end records, the
central directory and the local headers) the native one either builds exactly the reference's
index or declines, and ``index_archive`` then raises the reference's error, naming the file.
ZEROFAST_DIFF_CASES scales the number of damaged copies (a tenth of it, at least 30).
"""
from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import pytest

from tests.conftest import needs_deepspeed
from tests.dsgen.catalog import ensure_checkpoint
from tests.planting import member, patch_central_directory
from tests.test_native_reader import same_tree
from zerofast.native import ops
from zerofast.base.errors import CorruptCheckpointError, ZeroFastError
from zerofast.load import archive
from zerofast.load.archive import index_archive, index_archives
from zerofast.load.reader import load_file, load_files, native_core

pytestmark = needs_deepspeed

LAYOUTS = ("s2_bf16_w2_frozen_tied", "s3_bf16_w2_frozen_tied", "s3_fp32_w3_3groups_subgroups")
CASES = max(int(os.environ.get("ZEROFAST_DIFF_CASES", "300")) // 10, 30)
SEED = int(os.environ.get("ZEROFAST_DIFF_SEED", "0"))
needs_core = pytest.mark.skipif(native_core() is None, reason="no native core to test: it could not be built "
                                                              "here (`zerofast doctor` says why) or ZEROFAST_NATIVE=0")


def _rank_files(layout: str) -> list[Path]:
    root = ensure_checkpoint(layout)
    return sorted((root / (root / "latest").read_text().strip()).glob("*.pt"))


def _reference(path: Path, monkeypatch):
    with monkeypatch.context() as patch:
        patch.setenv("ZEROFAST_NATIVE", "0")
        return index_archive(path)


def _native(path: Path) -> tuple:
    return ops.load_native().zip_directory(os.fsencode(path), 0, path.stat().st_size)


def _same_index(native, reference) -> None:
    assert native.directory is not None and reference.directory is None
    assert (native.path, native.file_size, native.prefix) == (reference.path, reference.file_size, reference.prefix)
    assert native.pickle_bytes == reference.pickle_bytes
    assert dict(native.entries) == dict(reference.entries)


@needs_core
@pytest.mark.parametrize("layout", LAYOUTS)
def test_real_files_get_the_reference_index(layout, monkeypatch):
    for path in _rank_files(layout):
        native, reference = index_archive(path), _reference(path, monkeypatch)
        _same_index(native, reference)
        for name, entry in reference.entries.items():
            if "/data/" in name:
                key = entry.name.rsplit("/", 1)[1]
                assert native.directory.storage_offset(key, entry.size) == reference.storage_offset(key, entry.size)
                assert native.directory.storage_offset(key, entry.size + 1) == -1


@needs_core
@pytest.mark.parametrize("whole", [0, archive.READ_WHOLE_BYTES, 1 << 40], ids=["mapped", "small-whole", "all-whole"])
def test_a_batch_of_real_files_gets_the_reference_index(whole, monkeypatch):
    """index_archives: each file's index as index_archive builds it; the files it reads whole
    (at most READ_WHOLE_BYTES) come with their bytes, and read back the same trees as mapped."""
    monkeypatch.setattr(archive, "READ_WHOLE_BYTES", whole)
    paths = [p for layout in LAYOUTS for p in _rank_files(layout)]
    for path, index in zip(paths, index_archives(paths)):
        _same_index(index, _reference(path, monkeypatch))
        if path.stat().st_size <= whole:
            assert bytes(index.whole.numpy()) == path.read_bytes()
        else:
            assert index.whole is None
    for path, tree in zip(paths, load_files(paths)):
        same_tree(tree, load_file(path))


def test_a_batch_without_the_core_leaves_every_file_to_archive_py(monkeypatch):
    monkeypatch.setenv("ZEROFAST_NATIVE", "0")
    paths = _rank_files(LAYOUTS[0])
    assert index_archives(paths) == [None] * len(paths)


@needs_core
def test_a_batch_leaves_what_is_not_a_regular_file_to_archive_py(tmp_path):
    real = _rank_files(LAYOUTS[0])[0]
    folder, missing, empty = tmp_path / "folder", tmp_path / "missing.pt", tmp_path / "empty.pt"
    folder.mkdir()
    empty.write_bytes(b"")
    got = index_archives([folder, real, missing, empty])
    assert got[0] is None and got[2] is None and got[3] is None and got[1] is not None
    for path in (folder, missing, empty):
        with pytest.raises(CorruptCheckpointError) as e:
            load_files([real, path])
        assert e.value.path == str(path)


def _verdict(fn):
    try:
        return "ok", fn()
    except ZeroFastError as e:
        return type(e), str(e)


def _damage(rng: random.Random, data: bytearray, hot: list[int]) -> str:
    at = rng.choice(hot) + rng.randrange(-4, 46)
    at = min(max(at, 0), len(data) - 1)
    kind = rng.randrange(3)
    if kind == 0:
        data[at] ^= 1 << rng.randrange(8)
        return f"flip a bit at {at}"
    if kind == 1:
        value = rng.choice([0, 0xFF, 0x7F, 0x80, rng.randrange(256)])
        data[at] = value
        return f"byte {at} -> {value}"
    del data[at:]
    return f"truncate at {at}"


@needs_core
@pytest.mark.parametrize("whole", [None, 1 << 40], ids=["mapped", "read-whole"])
def test_damaged_directories_get_the_reference_verdict(tmp_path, monkeypatch, whole):
    if whole is not None:  # the batch reads every victim whole, not only those of a few KiB
        monkeypatch.setattr(archive, "READ_WHOLE_BYTES", whole)
    rng = random.Random(SEED)
    files = _rank_files(LAYOUTS[0])[:2] + _rank_files(LAYOUTS[1])[:2]
    victim = tmp_path / "victim.pt"
    accepted = declined = 0
    for case in range(CASES):
        source = rng.choice(files)
        data = bytearray(source.read_bytes())
        # The records the reader parses: local headers, central entries, the end records.
        hot = [i for sig in (b"PK\x03\x04", b"PK\x01\x02", b"PK\x05\x06", b"PK\x06\x06", b"PK\x06\x07")
               for i in _find_all(data, sig)]
        what = _damage(rng, data, hot)
        victim.write_bytes(data)
        reference = _verdict(lambda: _reference(victim, monkeypatch))
        batch = index_archives([victim])[0]
        assert (batch is not None) == bool(_native(victim)[0]), what
        if batch is not None:
            _same_index(batch, reference[1]) if reference[0] == "ok" else None
        if _native(victim)[0]:
            accepted += 1
            assert reference[0] == "ok", f"case {case} ({what}): native accepted what the reference refuses: {reference}"
            _same_index(index_archive(victim), reference[1])
        else:
            declined += 1
            through = _verdict(lambda: index_archive(victim))
            if reference[0] == "ok":
                assert through[0] == "ok" and dict(through[1].entries) == dict(reference[1].entries), what
            else:
                assert through == reference, f"case {case} ({what}): {through} vs {reference}"
    assert accepted and declined, (accepted, declined)


def _find_all(data: bytes, sig: bytes) -> list[int]:
    out, at = [], data.find(sig)
    while at >= 0:
        out.append(at)
        at = data.find(sig, at + 1)
    return out


@pytest.fixture
def victim(tmp_path) -> Path:
    path = tmp_path / "model_states.pt"
    shutil.copy(_rank_files(LAYOUTS[0])[0], path)
    return path


def _refused(path: Path, reason: str, message: str) -> None:
    ok, why, _ = _native(path)
    assert not ok and why == reason
    with pytest.raises(CorruptCheckpointError, match=message) as e:
        index_archive(path)
    assert e.value.path == str(path)


@needs_core
def test_truncated_file_is_declined_and_refused_naming_it(victim):
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size - 30)
    _refused(victim, "no end of central directory record", ": expected a torch.save zip archive; the file is truncated")


@needs_core
def test_duplicate_names_are_declined_and_refused_naming_it(victim):
    import zipfile

    name = member(victim, "/data.pkl").filename
    with zipfile.ZipFile(victim, "a") as zf:
        zf.writestr(name.replace("/data.pkl", "/DATA.PKL"), b"\x80\x02N.")
    _refused(victim, "a name twice", "expected unique zip entry names, found '.*/DATA.PKL' twice")


@needs_core
def test_overlapping_entries_are_declined(victim):
    """Two entries sharing bytes: torch.save never writes that, so the native reader leaves it to
    the reference (which reads data.pkl past its end and refuses the extra bytes)."""
    info = member(victim, "/data.pkl")
    patch_central_directory(victim, "/data.pkl", compress_size=info.file_size + 64, file_size=info.file_size + 64)
    assert _native(victim)[:2] == (False, "entries overlap")
    index = index_archive(victim)
    assert index.directory is None and len(index.pickle_bytes) == info.file_size + 64


@needs_core
def test_storage_checks_fall_back_to_the_reference_messages(victim):
    index = index_archive(victim)
    assert index.directory is not None
    entry = next(e for e in index.entries.values() if "/data/" in e.name)
    key = entry.name.rsplit("/", 1)[1]
    with pytest.raises(CorruptCheckpointError, match=rf"the pickle declares {entry.size + 2} bytes for storage"):
        index.storage_offset(key, entry.size + 2)
    with pytest.raises(CorruptCheckpointError, match="expected zip entry '.*/data/nope'"):
        index.storage_offset("nope", 4)



# -- names: the numbered ones, the others, and names equal but for case -------------------------

def _add_entries(path: Path, names: list[str], shuffle: random.Random | None = None) -> None:
    """Append stored entries named ``names`` (each a few bytes of its own); with ``shuffle``, the
    central directory then lists all entries in a shuffled order (the data stays in file order)."""
    import zipfile

    with zipfile.ZipFile(path, "a") as zf:
        for i, name in enumerate(names):
            zf.writestr(name, bytes(range(i % 7 + 1)))
        if shuffle is not None:
            first = zf.filelist[0]  # kept first: the reference takes the folder from it
            rest = zf.filelist[1:]
            shuffle.shuffle(rest)
            zf.filelist[:] = [first, *rest]


def _prefix(path: Path) -> str:
    return member(path, "/data.pkl").filename.split("/", 1)[0]


def _other_names(prefix: str, count: int) -> list[str]:
    """Names the native reader cannot file by number: not decimal as str(n) writes it, past the
    entry count, not in data/, or spelled with capitals."""
    kinds = [f"{prefix}/data/k{{}}", f"{prefix}/data/{10**7}{{}}", f"{prefix}/data/0{{}}", f"{prefix}/extra/{{}}",
             f"{prefix}/Data/X{{}}"]
    return [kind.format(i) for i in range(count) for kind in kinds]


def _assert_reference_index(path: Path, monkeypatch) -> None:
    """The native reader accepts ``path``, builds the reference's index, and finds each storage
    key (as spelled and upper-cased) where the reference finds it."""
    reference = _reference(path, monkeypatch)
    native = index_archive(path)
    _same_index(native, reference)
    for entry in reference.entries.values():
        folder, _, key = entry.name.rpartition("/")
        if folder.lower() != f"{reference.prefix}/data".lower():
            continue
        for spelled in (key, key.upper()):
            expected = _verdict(lambda: reference.storage_offset(spelled, entry.size))
            assert native.directory.storage_offset(spelled, entry.size) == (
                expected[1] if expected[0] == "ok" else -1), spelled


@needs_core
def test_many_other_names_get_the_reference_index(victim, monkeypatch):
    _add_entries(victim, _other_names(_prefix(victim), 1000))
    assert len(_native(victim)[1]) > 5000
    _assert_reference_index(victim, monkeypatch)


@needs_core
def test_entries_listed_out_of_file_order_get_the_reference_index(victim, monkeypatch):
    _add_entries(victim, _other_names(_prefix(victim), 50), shuffle=random.Random(SEED))
    _assert_reference_index(victim, monkeypatch)
    info = member(victim, "/data.pkl")  # now its bytes run into the next entry's local header
    patch_central_directory(victim, "/data.pkl", compress_size=info.file_size + 64, file_size=info.file_size + 64)
    assert _native(victim)[:2] == (False, "entries overlap")
    assert index_archive(victim).directory is None


def _twins(prefix: str) -> dict[str, tuple[list[str], str]]:
    """Names to add, and one of them again but for case: among the numbered names (the folder's
    case too), among the others, and each at either end of the directory."""
    others = _other_names(prefix, 200)
    return {
        "numbered": ([], f"{prefix.upper()}/DATA/0"),
        "numbered_folder_case": ([], f"{prefix[0].swapcase()}{prefix[1:]}/data/1"),
        "numbered_among_others": (others, f"{prefix}/Data/2"),
        "other_first_added": (others, others[0].upper()),
        "other_last_added": (others, others[-1].swapcase()),
        "other_mid": (others, others[len(others) // 2].upper()),
        "pickle": (others, f"{prefix}/DATA.pkl"),
    }


@needs_core
@pytest.mark.parametrize("case", sorted(_twins("p")))
def test_names_equal_but_for_case_are_declined_with_the_reference_verdict(victim, monkeypatch, case):
    names, twin = _twins(_prefix(victim))[case]
    _add_entries(victim, [*names, twin])
    assert _native(victim)[:2] == (False, "a name twice")
    reference = _verdict(lambda: _reference(victim, monkeypatch))
    assert reference[0] is CorruptCheckpointError and "expected unique zip entry names" in reference[1]
    assert _verdict(lambda: index_archive(victim)) == reference
