"""What a new user meets first (issue 45), one defect a test: Ctrl-C in the command's first
seconds, an interrupted or failed export into a new folder, a mistyped flag, an output folder
that cannot be written, the commands' help, and the README's quick start.

Where the behaviour belongs to the process (the exit code, what reaches stderr, a signal), the
command runs as ``python -m zerofast`` in a child process, on the pure-torch reference."""
from __future__ import annotations

import os
import re
import resource
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import zerofast
from zerofast.cli import main
from zerofast.testing.synthesize import LayoutSpec, ParamSpec, synthesize

from tests.helpers import ctrl_c_as_in_a_terminal

REPO = Path(__file__).resolve().parent.parent
CHILD_ENV = dict(os.environ, PYTHONPATH=str(REPO), PYTHONDONTWRITEBYTECODE="1", ZEROFAST_NATIVE="0")
INTERRUPTED = "zerofast: interrupted\n"
TMP_NAME = re.compile(r"\.zerofast-tmp")

SMALL = LayoutSpec(stage=2, world_size=2, model_dtype=torch.bfloat16,
                   groups=[[ParamSpec(f"layers.{i}.weight", (64, 64)) for i in range(4)]],
                   with_optimizer_states=False)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("first-contact") / "ckpt"
    synthesize(root, SMALL)
    return root


def _zerofast(*args, env=CHILD_ENV, **options) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zerofast", *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120, **options)


# ---------------------------------------------------------------------------------------------
# 1. Ctrl-C while the command imports torch
#
# A stand-in ``torch`` package, first on the path, says on stdout when the command starts to
# import torch, so that the signal is sent then and not at a guessed moment: before Python runs
# any of zerofast (its own start-up) a traceback is Python's, not ours. The stand-in then either
# waits for the signal or imports the real torch, whose import the signal lands in.

_STAND_IN = """
import os, sys
sys.stdout.write("importing torch\\n")
sys.stdout.flush()
if os.environ["STAND_IN_MODE"] == "wait":
    import time
    for _ in range(1200):  # short sleeps: a signal landing just before one sleep's system call
        time.sleep(0.1)    # is not seen until that call returns, and 120 s would outlast the test
here = os.environ["STAND_IN_DIR"]
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
del sys.modules["torch"]  # the import that runs this file returns whatever is there at its end
import torch
"""


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("stand-in")
    (folder / "torch").mkdir()
    (folder / "torch" / "__init__.py").write_text(_STAND_IN)
    return folder


def _interrupt_the_import(stand_in: Path, mode: str, args: list[str], delay: float) -> tuple[int, str]:
    """Run the command, send SIGINT ``delay`` seconds after it starts importing torch, and return
    its exit code and stderr."""
    env = dict(CHILD_ENV, PYTHONPATH=f"{stand_in}{os.pathsep}{REPO}", STAND_IN_DIR=str(stand_in), STAND_IN_MODE=mode)
    proc = subprocess.Popen([sys.executable, "-m", "zerofast", *args], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=ctrl_c_as_in_a_terminal)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready and proc.stdout.readline() == "importing torch\n", "the command never imported torch"
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err


@pytest.mark.parametrize("args", [["inspect", "/nonexistent"],  # torch: as the command starts
                                  ["export", "/nonexistent", "out", "--dtype", "bf16"]],  # in parsing --dtype
                         ids=["inspect", "export-dtype"])
def test_ctrl_c_while_torch_imports_is_one_line_and_exit_130(stand_in, args):
    rc, err = _interrupt_the_import(stand_in, "wait", args, 0.0)
    assert (rc, err) == (130, INTERRUPTED)


def test_ctrl_c_anywhere_in_the_real_import_of_torch_is_never_a_traceback(stand_in):
    finished = (1, "zerofast: error: /nonexistent: expected a DeepSpeed checkpoint folder, found no such directory\n")
    outcomes = []
    for delay in (0.0, 0.05, 0.1, 0.2, 0.4, 0.7, 1.0):
        rc, err = _interrupt_the_import(stand_in, "real", ["inspect", "/nonexistent"], delay)
        assert "Traceback" not in err, f"SIGINT {delay} s into the import: {err}"
        # Late enough, the command has finished. Earlier, a KeyboardInterrupt raised inside
        # torch's import could come out as numpy's ImportError, or as a C++ abort.
        assert (rc, err) in ((130, INTERRUPTED), finished), \
            f"SIGINT {delay} s into the import: exit {rc}: {err}"
        outcomes.append(err)
    assert INTERRUPTED in outcomes, "no signal landed before the command finished"


# ---------------------------------------------------------------------------------------------
# 2. An interrupted or failed export leaves nothing that was not there before it

def _interrupt_while_writing(done: int, total: int) -> None:
    if done:  # data has reached the temporary folder
        raise KeyboardInterrupt


@pytest.mark.parametrize("had", ["nothing", "the parent", "an empty output folder"])
def test_an_interrupted_export_leaves_only_the_folders_there_before(ckpt, tmp_path, had):
    out = tmp_path / "new" / "out"
    if had != "nothing":
        (out if had == "an empty output folder" else out.parent).mkdir(parents=True)
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(KeyboardInterrupt):
        zerofast.export(ckpt, out, max_shard_size="8KB", progress=_interrupt_while_writing)
    assert sorted(tmp_path.rglob("*")) == before


def test_a_folder_holding_files_stays_after_an_interrupted_export(ckpt, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(KeyboardInterrupt):
        zerofast.export(ckpt, out, overwrite=True, progress=_interrupt_while_writing)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def _file_size_limit(nbytes: int):
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))


def test_a_failed_export_into_a_new_folder_leaves_no_folder(ckpt, tmp_path):
    out = tmp_path / "new" / "out"
    # The first weight file exceeds the limit: EFBIG (Python ignores SIGXFSZ).
    proc = _zerofast("export", ckpt, out, preexec_fn=_file_size_limit(4096))
    assert proc.returncode == 1, proc.stderr
    assert "could not write this file: File too large (EFBIG)" in proc.stderr
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# 3. A mistyped flag: the command's usage, and the nearest flag

@pytest.mark.parametrize("args,typo,meant", [
    (["export", "--dtpye", "bf16", "ckpt", "out"], "--dtpye", "--dtype"),
    (["export", "ckpt", "out", "--max_shard_size", "4GB"], "--max_shard_size", "--max-shard-size"),
    # a required flag mistyped: argparse would say --world-size is missing
    (["reshard", "ckpt", "out", "--world_size", "2"], "--world_size", "--world-size"),
    (["zero-to-fp32", "ckpt", "out", "--max-shard-size", "4GB"], "--max-shard-size", "--max_shard_size"),
    (["--verison"], "--verison", "--version"),
])
def test_a_mistyped_flag_names_the_nearest_flag_of_its_command(args, typo, meant):
    proc = _zerofast(*args)
    command = "zerofast" if args[0].startswith("-") else f"zerofast {args[0]}"
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"usage: {command} [-h]")
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert errors == [f"{command}: error: unrecognized arguments: {typo} (did you mean {meant}?)"]
    assert proc.stderr.splitlines()[-1] == errors[0]


def test_an_unknown_flag_with_nothing_near_it_gets_no_hint():
    proc = _zerofast("export", "ckpt", "out", "--zzzzzz")
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1] == "zerofast export: error: unrecognized arguments: --zzzzzz"


# ---------------------------------------------------------------------------------------------
# 4. An output folder that cannot be written: the error names the folder the user gave

def test_a_read_only_output_folder_is_named_not_the_temporary_folder(ckpt, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("running as root: a read-only folder is writable; see the EEXIST test below")
        proc = _zerofast("export", ckpt, ro)
    finally:
        ro.chmod(0o755)
    assert proc.returncode == 1
    assert proc.stderr == (f"zerofast: error: {ro}: cannot create a temporary folder in the output folder: "
                           "Permission denied (EACCES)\n")
    assert list(ro.iterdir()) == []  # the user's folder stays


def test_a_temporary_folder_that_cannot_be_made_is_reported_by_the_output_folder(ckpt, tmp_path):
    # As root too: a file already holding the temporary folder's name makes its mkdir fail.
    out = tmp_path / "out"
    out.mkdir()
    (out / f".zerofast-tmp-{os.getpid()}").write_text("in the way")
    with pytest.raises(zerofast.ExportError) as caught:
        zerofast.export(ckpt, out, overwrite=True)
    assert str(caught.value) == f"{out}: cannot create a temporary folder in the output folder: File exists (EEXIST)"
    assert caught.value.path == str(out)
    assert [p.name for p in out.iterdir()] == [f".zerofast-tmp-{os.getpid()}"]


def test_an_output_folder_under_a_file_is_named(ckpt, tmp_path):
    (tmp_path / "somefile").write_text("")
    out = tmp_path / "somefile" / "out"
    proc = _zerofast("export", ckpt, out)
    assert proc.returncode == 1
    assert proc.stderr == f"zerofast: error: {out}: cannot create the output folder: Not a directory (ENOTDIR)\n"
    assert not TMP_NAME.search(proc.stderr)


# ---------------------------------------------------------------------------------------------
# 5. Every command has a line in ``zerofast --help`` and a description in its own --help

def _help(capsys, *args: str) -> str:
    with pytest.raises(SystemExit) as exited:
        main([*args, "--help"])
    assert exited.value.code == 0
    return capsys.readouterr().out


COMMANDS = ["export", "zero-to-fp32", "reshard", "to-universal", "to-dcp", "inspect", "verify", "diff", "build",
            "doctor"]


def test_every_command_has_a_line_in_the_top_level_help(capsys):
    listing = _help(capsys).split("COMMAND\n", 2)[-1].split("\n\n")[0]
    # "    name   help", or "    name" with the help on the next line (a long name)
    rows = dict(re.findall(r"^    (\S+)(?: +|\n {16})(\S.*)$", listing, re.MULTILINE))
    assert sorted(rows) == sorted(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_a_description_in_its_own_help(capsys, command):
    paragraphs = _help(capsys, command).split("\n\n")
    assert paragraphs[0].startswith(f"usage: zerofast {command}")
    assert not paragraphs[1].startswith(("positional arguments:", "options:")), paragraphs[1]


# ---------------------------------------------------------------------------------------------
# 6. The README's quick start works from inside the clone

def test_the_quick_start_installs_from_inside_the_clone():
    readme = (REPO / "README.md").read_text()
    quick = readme.split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    assert "./zerofast" not in quick  # the package folder, not a project: pip refuses it
    assert re.search(r"^pip install \.\s", quick, re.MULTILINE)
    assert '`pip install ".[export]"`' in quick
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in quick
    assert (REPO / "pyproject.toml").is_file()  # what `pip install .` reads there
