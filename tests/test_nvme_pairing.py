"""Which swap file holds which swapped sub-group of a ZeRO-Infinity save (zerofast/layouts/nvme.py).

The save does not record the ``ds_id`` its file names use; these pin the rules that pair them
without DeepSpeed (the real saves are in tests/test_nvme.py, which needs DeepSpeed's async_io op).
"""
from __future__ import annotations

import pytest

from zerofast.base.errors import InconsistentCheckpointError
from zerofast.layouts import nvme

ALIGN = 1024


def test_post_order_puts_a_modules_own_parameters_after_its_childrens():
    names = ["cls", "a.w", "a.b.c.x", "a.b.w", "a.b.v", "d.w", "e"]
    assert nvme.post_order(names) == ["a.b.c.x", "a.b.w", "a.b.v", "a.w", "d.w", "cls", "e"]
    assert nvme.post_order(["x.0.w", "x.0.b", "x.1.w"]) == ["x.0.w", "x.0.b", "x.1.w"]  # no own params: unchanged


def _files(tmp_path, sizes: dict[tuple[int, int], int]) -> dict[tuple[int, int], object]:
    out = {}
    for (a, b), nbytes in sizes.items():
        path = tmp_path / f"{a}_{b}.tensor.swp"
        path.write_bytes(b"\0" * nbytes)
        out[(a, b)] = path
    return out


def test_guesses_that_name_different_files_fall_back_to_sizes(tmp_path):
    # A parent's parameter and its child's, each its own sub-group: the two orders name the files
    # the other way round. Different sizes settle it.
    masters = _files(tmp_path, {(0, 0): 2 * ALIGN, (1, 1): ALIGN})
    stems = nvme._pair(tmp_path, [0, 1], masters, [ALIGN, 2 * ALIGN], [[(0, 0), (1, 1)], [(1, 1), (0, 0)]], ALIGN)
    assert stems == ["1_1", "0_0"]


def test_guesses_that_disagree_on_equal_sizes_are_refused(tmp_path):
    masters = _files(tmp_path, {(0, 0): ALIGN, (1, 1): ALIGN})
    with pytest.raises(InconsistentCheckpointError, match="cannot tell which swap file"):
        nvme._pair(tmp_path, [0, 1], masters, [ALIGN, ALIGN], [[(0, 0), (1, 1)], [(1, 1), (0, 0)]], ALIGN)


def test_guesses_that_agree_name_the_files_even_when_sizes_cannot(tmp_path):
    masters = _files(tmp_path, {(7, 8): ALIGN, (9, 9): ALIGN})  # shifted by 7: ids go on across models
    stems = nvme._pair(tmp_path, [0, 1], masters, [ALIGN, ALIGN], [[(0, 1), (2, 2)], [(0, 1), (2, 2)]], ALIGN)
    assert stems == ["7_8", "9_9"]


def test_an_unknown_name_takes_no_part_in_naming(tmp_path):
    masters = _files(tmp_path, {(0, 0): ALIGN, (1, 1): 2 * ALIGN})
    stems = nvme._pair(tmp_path, [0, 1], masters, [ALIGN, 2 * ALIGN], [[None, (1, 1)]], ALIGN)
    assert stems == ["0_0", "1_1"]  # by size
