"""Hostile input for the checkers and the readers beside them: crafted and damaged safetensors
shards given to ``verify``, ``load_exported`` and ``diff``; a damaged ZeRO-1 rank file given to
``optimizer_state``; bad settings given to the CLI. Each must end in a typed error (or a report
finding) naming the file, never a raw exception."""
from __future__ import annotations

import contextlib
import io
import json
import struct
from pathlib import Path

import pytest
import torch

import zerofast
from zerofast import cli
from zerofast.base.errors import ExportError, InconsistentCheckpointError, SettingsError
from zerofast.hf.formats import safetensors_files as sf
from zerofast.base.settings import Settings


def _shard(path: Path, header, data: bytes = b"", raw: bytes | None = None) -> Path:
    head = raw if raw is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + data)
    return path


def _good(path: Path) -> Path:
    from safetensors.torch import save_file

    save_file({"a": torch.arange(4, dtype=torch.float32), "b": torch.ones(2, 3, dtype=torch.bfloat16)}, path,
              metadata={"format": "pt"})
    return path


F32 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}

# (file maker, what the error says): each broken as the safetensors project refuses it.
CRAFTED = {
    "array header": (lambda p: _shard(p, [1, 2, 3]), "header is a JSON list, not an object"),
    "string header": (lambda p: _shard(p, "x"), "header is a JSON str"),
    "duplicate key": (lambda p: _shard(p, None, b"\0" * 8, raw=b'{"a":' + json.dumps(F32).encode() + b',"a":'
                                       + json.dumps(F32).encode() + b"}"), "appears twice"),
    "hole": (lambda p: _shard(p, {"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8),
             r"bytes \[0, 4\) of its data, before tensor 'a', belong to no tensor"),
    "overlap": (lambda p: _shard(p, {"a": F32, "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}},
                                 b"\0" * 8), "overlap those of 'a'"),
    "bytes past the last tensor": (lambda p: _shard(p, {"a": F32}, b"\0" * 12), "4 bytes past its last tensor"),
    "truncated": (lambda p: _shard(p, {"a": F32}, b"\0" * 5), "its header needs"),
    "header longer than the file": (lambda p: p.write_bytes(struct.pack("<Q", 1000) + b"{}"), "a header of 1,000"),
    "header over the cap": (lambda p: p.write_bytes(struct.pack("<Q", sf.HEADER_LIMIT + 1) + b" " * 16),
                            "more than the 100,000,000"),
    "no length prefix": (lambda p: p.write_bytes(b"abc"), "only 3 bytes"),
    "not UTF-8": (lambda p: _shard(p, None, raw=b'{"\xff":1}'), "UnicodeDecodeError"),
    "deep nesting": (lambda p: _shard(p, None, raw=b"[" * 100_000 + b"]" * 100_000), "could not read its header"),
    "unknown dtype": (lambda p: _shard(p, {"a": {"dtype": "Q9", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8),
                      "which safetensors does not define"),
    "float shape": (lambda p: _shard(p, {"a": {"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}}, b"\0" * 8),
                    "not a list of non-negative integers"),
    "negative shape": (lambda p: _shard(p, {"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}},
                                        b"\0" * 8), "not a list of non-negative integers"),
    "reversed offsets": (lambda p: _shard(p, {"a": {"dtype": "F32", "shape": [0], "data_offsets": [8, 0]}},
                                          b"\0" * 8), "0 <= begin <= end"),
    "wrong byte count": (lambda p: _shard(p, {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}},
                                          b"\0" * 8), "which do not fit its shape"),
    "entry not an object": (lambda p: _shard(p, {"a": [1, 2]}), "not a safetensors tensor entry"),
    "extra entry key": (lambda p: _shard(p, {"a": dict(F32, x=1)}, b"\0" * 8), "not a safetensors tensor entry"),
    "metadata not strings": (lambda p: _shard(p, {"__metadata__": {"format": 1}, "a": F32}, b"\0" * 8),
                             "__metadata__ is not an object of strings"),
}


@pytest.mark.parametrize("name", CRAFTED)
def test_load_exported_refuses_each_crafted_shard_naming_the_file(tmp_path, name):
    make, message = CRAFTED[name]
    make(tmp_path / "model.safetensors")
    with pytest.raises(ExportError, match=message) as e:
        zerofast.load_exported(tmp_path)
    assert "model.safetensors" in str(e.value)


@pytest.mark.parametrize("name", CRAFTED)
def test_verify_reports_each_crafted_shard_and_the_cli_prints_lines(tmp_path, name):
    make, message = CRAFTED[name]
    make(tmp_path / "model.safetensors")
    report = zerofast.verify(tmp_path)
    assert not report.ok
    assert any(__import__("re").search(message, f.message) for f in report.failures), report.lines()
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["verify", str(tmp_path)])
    assert code == 1 and "Traceback" not in err.getvalue() and "model.safetensors" in out.getvalue()


def test_the_safetensors_projects_own_files_pass(tmp_path):
    from safetensors.torch import load_file

    path = _good(tmp_path / "model.safetensors")
    head = sf.read_header(path)
    assert set(head.entries) == {"a", "b"} and head.cut == [] and head.metadata == {"format": "pt"}
    tensors, metadata = sf.read(path)
    theirs = load_file(path)
    assert metadata == {"format": "pt"} and set(tensors) == set(theirs)
    for k in theirs:
        assert tensors[k].dtype == theirs[k].dtype and torch.equal(tensors[k].view(torch.uint8).reshape(-1),
                                                                    theirs[k].view(torch.uint8).reshape(-1))


def test_verify_lists_every_problem_of_a_partly_truncated_shard(tmp_path):
    """A truncated shard whose header also has a malformed entry and an overlap: every problem is
    listed, and the tensors before the cut are still found."""
    header = {"a": F32, "bad": {"dtype": "F32", "shape": "x", "data_offsets": [0, 0]},
              "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]},
              "c": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}
    path = _shard(tmp_path / "model.safetensors", header, b"\0" * 12)
    problems = []
    head = sf.read_header(path, lambda check, name, message, **detail: problems.append((check, name, message)))
    assert set(head.entries) == {"a", "b"} and head.cut == ["c"]
    checks = sorted(c for c, _, _ in problems)
    assert checks == ["files", "files", "truncated"], problems
    report = zerofast.verify(tmp_path)
    assert len(report.failures) == 3 and [f.name for f in report.by_check("truncated")] == ["model.safetensors"]


def _index(folder: Path, weight_map) -> None:
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("doc", ['[1, 2]', '{"weight_map": 3}', '{"weight_map": {"a": ["x"]}}', "{", '"x"',
                                 '{"weight_map": {"a": "../../etc/passwd"}}', "[" * 50_000])
def test_verify_and_diff_refuse_crafted_indexes(tmp_path, doc):
    (tmp_path / "model.safetensors.index.json").write_text(doc)
    report = zerofast.verify(tmp_path)
    assert not report.ok and report.failures
    with pytest.raises(ExportError, match="cannot be read as an export"):
        zerofast.diff(tmp_path, tmp_path)
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = cli.main(["diff", str(tmp_path), str(tmp_path)])
    assert code == 1 and len(err.getvalue().strip().splitlines()) == 1 and "Traceback" not in err.getvalue()


def test_diff_refuses_a_damaged_shard_naming_it(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    _good(a / "model.safetensors")
    _shard(b / "model.safetensors", [1])
    with pytest.raises(ExportError, match="model.safetensors.*JSON list"):
        zerofast.diff(a, b)


def test_diff_exit_code(tmp_path):
    from safetensors.torch import save_file

    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    for folder, value in ((a, 1.0), (b, 1.0), (c, 2.0)):
        folder.mkdir()
        save_file({"w": torch.full((3,), value)}, folder / "model.safetensors", metadata={"format": "pt"})

    def run(*argv) -> int:
        with contextlib.redirect_stdout(io.StringIO()):
            return cli.main(["diff", *map(str, argv)])

    assert run(a, c) == 0  # the default is unchanged: a difference is not an error
    assert run(a, c, "--exit-code") == 1
    assert run(a, b, "--exit-code") == 0
    assert run(a, tmp_path / "missing", "--exit-code") == 1


@pytest.mark.parametrize("value", ["abc", "0", "-5", "nan", "inf", ""])
def test_a_bad_dist_timeout_is_a_zerofast_error(value):
    """A ZeroFastError, which cli.main prints as one line (a bare ValueError escaped it)."""
    with pytest.raises(SettingsError, match="ZEROFAST_DIST_TIMEOUT must be a positive number"):
        Settings(dist_timeout=value).dist_timeout_s()
    assert issubclass(SettingsError, ValueError) and issubclass(SettingsError, zerofast.ZeroFastError)
    assert Settings(dist_timeout="12.5").dist_timeout_s() == 12.5


def test_zero1_without_param_shapes_names_the_file(tmp_path):
    """A byte-level mutation can leave a ZeRO-1 save's 'param_shapes' None or short: the
    whole-parameter layout check names the model-states file (it indexed None before)."""
    from tests.planting import load, save
    from zerofast.testing.synthesize import LayoutSpec, ParamSpec, synthesize

    synthesize(tmp_path, LayoutSpec(1, 2, torch.bfloat16, [[ParamSpec("a.weight", (4, 3)), ParamSpec("b", (5,))]]))
    model = tmp_path / "global_step1" / "mp_rank_00_model_states.pt"
    pristine = load(model)
    for damaged in (None, []):
        obj = load(model)
        obj["param_shapes"] = damaged
        save(obj, model)
        with pytest.raises(InconsistentCheckpointError, match="param_shapes") as e:
            zerofast.optimizer_state(tmp_path, "exp_avg")
        assert e.value.path == str(model)
        save(pristine, model)
    assert set(zerofast.optimizer_state(tmp_path, "exp_avg")) == {"a.weight", "b"}
