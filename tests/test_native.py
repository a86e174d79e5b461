"""The native core's build and load machinery (zerofast/native/): which kernels get built, where
a core is cached and what names it, the fallback to the reference, and a command line that
answers --help and --version without torch. The installs themselves: tests/test_install.py."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zerofast
from zerofast.native import ops
from zerofast.base.errors import NativeExtensionError
from zerofast.native import build, cache, cudaplan, loader, proof
from zerofast.native.cache import Unavailable
from zerofast.base.settings import settings
from tests.helpers import assert_bitwise_equal, expected_value, real_root, real_truth
from tests.test_cli import needs_deepspeed

REPO = Path(__file__).resolve().parent.parent
SMALL = "s2_bf16_w2_frozen_tied"


def _run_cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    code = ("import sys; from zerofast.cli import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "print('torch imported:', 'torch' in sys.modules)")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=str(REPO), **env), timeout=120)


@pytest.mark.parametrize("flag", ["--help", "--version"])
def test_help_and_version_do_not_import_torch(flag):
    done = _run_cli(flag)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("torch imported: False"), done.stdout


def test_version_names_torch_python_core_and_threads():
    ops.load_native()  # built (or found) for this torch: --version must name where it is
    lines = _run_cli("--version").stdout.splitlines()
    assert lines[0] == f"zerofast {zerofast.__version__}"
    assert lines[1].startswith(f"torch {torch.__version__} (")
    assert lines[2].startswith(f"python {sys.version.split()[0]} (")
    if loader.load(required=True).manifest.get("prebuilt"):  # a checkout where `make wheel` ran
        assert lines[3] == (f"native core: prebuilt, shipped in this package for torch >= {cache.floor_text()} (built "
                            f"with torch {torch.__version__}; nothing to compile), loaded on first use from "
                            f"{loader.load(required=True).path}")
    else:
        assert lines[3] == (f"native core: built here for {', '.join(proof.kernel_devices())} (with torch "
                            f"{torch.__version__}, for torch >= {cache.floor_text()}), loaded on first use from "
                            f"{loader.load(required=True).path}")
    assert lines[4].startswith("threads: ")


def test_version_says_why_the_core_is_not_available(tmp_path):
    lines = _run_cli("--version", CXX="/bin/false", ZEROFAST_CACHE_DIR=str(tmp_path)).stdout.splitlines()
    assert lines[3] == "native core: not available (the C++ compiler /bin/false does not run (`/bin/false --version` fails))"
    lines = _run_cli("--version", ZEROFAST_NATIVE="0").stdout.splitlines()
    assert lines[3].startswith("native core: off (ZEROFAST_NATIVE=0")


def test_version_of_a_core_not_built_yet(tmp_path):
    lines = _run_cli("--version", ZEROFAST_CACHE_DIR=str(tmp_path)).stdout.splitlines()
    assert lines[3].startswith("native core: not built yet: it is built on first use")


def test_loaded_core_is_the_cached_one_for_this_torch():
    loaded = loader.load(required=True)
    tag = cache.core_tag(cache.sources_dir(), cache.torch_identity())
    assert loaded.path.parent.parent == cache.tag_dir(settings(), tag)
    assert loaded.module.torch_version() == torch.__version__
    assert loaded.manifest["torch"] == torch.__version__ and loaded.manifest["torch_git"] == torch.version.git_version
    assert loaded.manifest["devices"] == list(proof.kernel_devices())


def test_torch_identity_is_read_without_importing_torch():
    # cache.torch_identity parses torch/version.py; it must agree with the imported torch.
    assert cache.torch_identity() == {"__version__": torch.__version__, "cuda": torch.version.cuda,
                                      "hip": torch.version.hip, "git_version": torch.version.git_version}


def test_core_tag_follows_every_source_but_not_the_torch_version(tmp_path):
    """The CPU core is built on torch's stable ABI: every torch from the floor on shares one core."""
    src = tmp_path / "csrc"
    shutil.copytree(cache.sources_dir(), src)
    identity = cache.torch_identity()
    tag = cache.core_tag(src, identity)
    assert tag == cache.core_tag(cache.sources_dir(), identity)
    header = src / "cpu" / "cast.h"
    header.write_text(header.read_text() + "\n// edited\n")
    assert cache.core_tag(src, identity) != tag
    tag = cache.core_tag(cache.sources_dir(), identity)
    assert cache.core_tag(cache.sources_dir(), {**identity, "__version__": "2.14.1", "git_version": "0" * 40}) == tag
    assert tag.startswith(f"torch{cache.floor_text()}+-")


def test_a_cuda_core_is_named_for_its_torch_build(monkeypatch):
    """The CUDA kernels use torch's full C++ API: their core is never shared between torch builds."""
    name = cache.core_name(("cpu", "cuda"), "9.0", "g++-12-x", "nvcc-13")
    identity = cache.torch_identity()
    monkeypatch.setattr(cache, "torch_identity", lambda: {**identity, "git_version": "0" * 40})
    assert cache.core_name(("cpu", "cuda"), "9.0", "g++-12-x", "nvcc-13") != name
    assert cache.core_name(("cpu",), None, "g++-12-x", None) == "cpu@g++-12-x"


@pytest.mark.parametrize("version, served", [("2.13.0+cpu", True), ("2.14.1", True), ("3.0.0", True),
                                              ("2.10.0", True), ("2.9.1", False), ("2.4.1+cu121", False)])
def test_the_core_serves_torch_from_its_floor_on(version, served):
    problem = cache.torch_floor_problem({"__version__": version})
    assert (problem is None) == served
    if not served:
        assert problem == (f"the native core is built on torch's stable ABI and serves torch >= {cache.floor_text()}; "
                           f"torch {version} is older, so the pure-torch reference runs (same bytes, slower)")


def test_an_older_torch_runs_the_reference_with_one_line(tmp_path):
    """A torch below the floor gets no build attempt: one line says why, the reference runs."""
    code = ("import torch; torch.__version__ = '2.9.1'\n"
            "from zerofast.native import cache, loader\n"
            "cache.torch_identity = lambda: {'__version__': '2.9.1', 'cuda': None, 'hip': None, 'git_version': 'x'}\n"
            "print(loader.load())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(REPO), ZEROFAST_NATIVE="auto",
                                   ZEROFAST_CACHE_DIR=str(tmp_path)))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "None"
    assert done.stderr.count("\n") == 1 and "serves torch >= " in done.stderr and "torch 2.9.1 is older" in done.stderr
    assert not (tmp_path / "native").exists()


def test_verify_takes_a_cpu_core_for_any_torch_from_its_floor(monkeypatch):
    core = loader.load(required=True)
    loader.verify(core.manifest)
    with pytest.raises(loader.Environment, match=r"serves torch >= 9\.9 but torch .* is running"):
        loader.verify({**core.manifest, "stable_torch": "9.9"})
    with pytest.raises(loader.Environment, match="the native core with CUDA kernels was built for torch"):
        monkeypatch.setattr(torch, "__version__", "2.14.1")
        loader.verify({**core.manifest, "devices": ["cpu", "cuda"]})


def test_cpu_torch_never_builds_cuda_even_with_nvcc(monkeypatch, tmp_path):
    monkeypatch.delenv("FORCE_CUDA", raising=False)
    monkeypatch.setattr(torch.version, "cuda", None)
    if shutil.which("nvcc") is None:  # a stand-in, so that the case is the one the issue names
        (tmp_path / "nvcc").write_text("#!/bin/sh\nexit 0\n")
        (tmp_path / "nvcc").chmod(0o755)
        monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert shutil.which("nvcc") is not None
    assert cudaplan.wanted_devices(settings()) == (("cpu",), None)


def test_cuda_archs_without_a_gpu_or_a_list_are_a_default(monkeypatch):
    # torch's builder alone raises IndexError here (nvcc, no GPU, no TORCH_CUDA_ARCH_LIST).
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for cuda, archs in (("13.0", cudaplan.DEFAULT_ARCHS[13]), ("12.8", cudaplan.DEFAULT_ARCHS[12]),
                        ("11.8", cudaplan.DEFAULT_ARCHS[11])):
        monkeypatch.setattr(torch.version, "cuda", cuda)
        assert cudaplan.cuda_archs(settings()) == archs
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    assert cudaplan.cuda_archs(settings()) == "9.0"
    assert cache.device_tag(("cpu", "cuda"), "8.0;9.0+PTX") == "cpu+cuda-8.0_9.0+PTX"


def test_force_cuda_asks_for_the_cuda_kernels(monkeypatch):
    monkeypatch.setenv("FORCE_CUDA", "1")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    assert cudaplan.wanted_devices(settings()) == (("cpu", "cuda"), "9.0")


def test_a_failed_build_is_remembered_for_its_compiler(tmp_path, monkeypatch):
    core = tmp_path / "cpu"
    cache.record_failure(core, settings(), "the build failed: x")
    assert cache.failure(core, settings()) == "the build failed: x"
    monkeypatch.setenv("CXX", "/bin/true")  # another compiler: worth another try
    assert cache.failure(core, settings()) is None
    cache.clear_failure(core)
    monkeypatch.delenv("CXX")
    assert cache.failure(core, settings()) is None


def test_preflight_names_what_is_missing(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-zf")
    with pytest.raises(Unavailable, match="no C\\+\\+ compiler: no-such-compiler-zf is not on the PATH"):
        cache.preflight(settings())
    monkeypatch.setattr(sys, "platform", "darwin")
    with pytest.raises(Unavailable, match="built on Linux only .darwin has no copy_file_range"):
        cache.preflight(settings())


def test_zerofast_native_must_be_0_1_or_auto(monkeypatch):
    monkeypatch.setenv("ZEROFAST_NATIVE", "yes")
    with pytest.raises(NativeExtensionError, match="ZEROFAST_NATIVE='yes': expected 1 .* 0 .* or auto"):
        ops.gather_cast([torch.zeros(2)], torch.tensor([[0, 0, 0, 2]]), torch.zeros(2))


def test_progress_lines_name_the_source(tmp_path):
    line = "[2/4] c++ -MMD -MF read_cast.o.d -O3 -c /x/zerofast/csrc/cpu/read_cast.cpp -o read_cast.o\n"
    assert build.progress_line(line) == "zerofast: [2/4] compiled cpu/read_cast.cpp"
    assert build.progress_line("[4/4] c++ a.o b.o -shared -o zerofast_C.so") == "zerofast: [4/4] linked"
    assert build.progress_line("Emitting ninja build file") is None
    # The build child's own first line, and a unit path as torch's builder quotes it.
    assert build.progress_line("zerofast: compiling 2 units (a.cpp, b.cpp)\n") == "zerofast: compiling 2 units (a.cpp, b.cpp)"
    quoted = "[1/3] c++ -MMD -c '/tmp/core/units/zerofast_cpu.cpp' -o zerofast_cpu.o"
    assert build.progress_line(quoted) == "zerofast: [1/3] compiled zerofast_cpu.cpp"


@pytest.mark.parametrize("devices", [("cpu",), ("cpu", "cuda")])
def test_units_include_every_source_once(tmp_path, devices):
    src = cache.sources_dir()
    units = cache.write_units(src, devices, tmp_path)
    included = [line.split('"')[1] for u in units if u.parent == tmp_path for line in u.read_text().splitlines()
                if line.startswith("#include")]
    included += [str(u.resolve()) for u in units if u.parent != tmp_path]  # CUDA files, compiled as they are
    expected = sorted(str(p.resolve()) for p in cache.source_files(src, devices))
    assert sorted(included) == expected and len(set(included)) == len(included)
    assert {p.name for p in (src / "cpu").glob("*.cpp")} <= {Path(i).name for i in included}
    assert [u.name for u in units][:2] == ["zerofast_python.cpp", "zerofast_cpu.cpp"]


@pytest.mark.parametrize("devices", [("cpu",), ("cpu", "cuda")])
def test_only_the_cpu_unit_targets_torchs_stable_abi(tmp_path, devices):
    # The define must come before any include, or torch's headers would already have been read
    # without it; the Python half and the CUDA kernels use torch's full C++ API and must not get it.
    units = {u.name: u.read_text().splitlines() for u in cache.write_units(cache.sources_dir(), devices, tmp_path)
             if u.parent == tmp_path}
    assert units["zerofast_cpu.cpp"][0] == f"#define TORCH_TARGET_VERSION {cache.target_version()}"
    assert cache.target_version() == "0x020a000000000000"  # 2.10, as torch/csrc/stable/version.h spells it
    others = [line for name, lines in units.items()
              for line in (lines[1:] if name == "zerofast_cpu.cpp" else lines)]
    assert others and all(line.startswith("#include ") for line in others)


def _unavailable(monkeypatch, reason: str) -> None:
    monkeypatch.setattr(loader, "_state", reason)
    monkeypatch.setattr(loader, "_warned", False)


@needs_deepspeed
def test_unavailable_core_falls_back_with_one_warning_and_the_same_bytes(monkeypatch, capfd):
    monkeypatch.delenv("ZEROFAST_NATIVE", raising=False)
    native = zerofast.reconstruct(real_root(SMALL))
    _unavailable(monkeypatch, "no C++ compiler: test")
    capfd.readouterr()
    first, second = zerofast.reconstruct(real_root(SMALL)), zerofast.reconstruct(real_root(SMALL))
    warnings = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("zerofast: warning:")]
    assert warnings == [f"zerofast: warning: native core not available (no C++ compiler: test); using the pure-torch "
                        f"reference: same results, {loader.SLOWDOWN} (ZEROFAST_NATIVE=1 makes this an error; "
                        "`zerofast doctor` says more)"]
    truth = real_truth(SMALL)
    stored = {**truth["trainable"], **truth["frozen"], **truth["buffers"]}
    for sd in (first, second):
        assert list(sd) == list(native) == truth["state_dict_keys"]
        for name in sd:
            assert_bitwise_equal(sd[name], native[name], name)
            assert_bitwise_equal(sd[name], expected_value(stored[truth["tied"].get(name, name)], torch.float32), name)


@needs_deepspeed
def test_zerofast_native_1_makes_an_unavailable_core_an_error(monkeypatch):
    monkeypatch.setenv("ZEROFAST_NATIVE", "1")
    _unavailable(monkeypatch, "no C++ compiler: test")
    with pytest.raises(NativeExtensionError, match=r"native core is not available \(no C\+\+ compiler: test\); "
                                                   "ZEROFAST_NATIVE=1 requires it"):
        zerofast.reconstruct(real_root(SMALL))


def test_build_command_reports_the_core():
    done = subprocess.run([sys.executable, "-m", "zerofast", "build"], capture_output=True, text=True, cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=1800)
    assert done.returncode == 0, done.stderr
    loaded = loader.load(required=True)
    assert done.stdout.strip() == f"native core for torch {torch.__version__} " \
                                  f"({', '.join(proof.kernel_devices())}): {loaded.path}"
    assert json.loads((loaded.path.parent / cache.MANIFEST).read_text())["torch"] == torch.__version__


def test_a_process_waits_for_the_one_building_and_loads_its_core(tmp_path):
    """The lock: while one process builds (here, this test holding the lock), another waits, then
    loads the finished core rather than compiling it again."""
    import fcntl

    built = loader.load(required=True).path.parent
    tag = cache.core_tag(cache.sources_dir(), cache.torch_identity())
    core = tmp_path / "native" / tag / built.name
    core.parent.mkdir(parents=True)
    code = "from zerofast.native import ops; print(ops.load_native().__file__)"
    with open(core.with_name(core.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO),
                                                               ZEROFAST_CACHE_DIR=str(tmp_path)))
        waiting = child.stderr.readline()
        assert waiting.startswith("zerofast: waiting for another process that is building the native core"), waiting
        shutil.copytree(built, core.with_name(".staged"))  # what a finished build leaves: renamed into place
        core.with_name(".staged").rename(core)
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err
    assert out.strip() == str(cache.library(core)) and "building" not in err


def test_build_command_failure_is_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "zerofast", "build"], capture_output=True, text=True, cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=str(REPO), CXX="/bin/false",
                                   ZEROFAST_CACHE_DIR=str(tmp_path)), timeout=600)
    assert done.returncode == 1
    assert done.stderr.splitlines() == ["zerofast: error: zerofast's native core could not be built (the C++ compiler "
                                        "/bin/false does not run (`/bin/false --version` fails))"]


def test_a_prebuilt_core_is_taken_only_for_its_own_tag(tmp_path, monkeypatch):
    """The wheel's core (make wheel) fits one Python, machine and set of sources (every torch from
    the floor on): any other tag is told why and builds its own; a package without one says nothing."""
    monkeypatch.setattr(cache, "PREBUILT", tmp_path / "_prebuilt")
    assert cache.prebuilt("torch-2.13.0-x") == (None, None)
    (tmp_path / "_prebuilt").mkdir()
    (tmp_path / "_prebuilt" / cache.MANIFEST).write_text(json.dumps(
        {"tag": "torch-2.13.0-x", "torch": "2.13.0+cpu", "python": "3.11.7", "machine": "x86_64", "devices": ["cpu"],
         "prebuilt": True}))
    assert cache.prebuilt("torch-2.13.0-x") == (tmp_path / "_prebuilt", None)
    core, why = cache.prebuilt("torch-2.14.1-y")
    assert core is None and why == ("the prebuilt core in this package is for Python 3.11.7 on x86_64, and does not "
                                    "fit this Python or these sources")


def test_the_cpu_core_uses_no_cxx_symbol_of_torch():
    """What lets one binary serve every torch from the floor on: the CPU core calls torch only
    through the stable ABI's C functions (aoti_torch_*, torch_*), never a C++ symbol of c10, ATen,
    torch or torch's Python bindings, whose layout changes between releases."""
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("needs binutils' nm to list the core's undefined symbols")
    core = loader.load(required=True)
    if "cuda" in core.manifest["devices"]:
        pytest.skip("a core with CUDA kernels uses torch's full C++ API by design (it serves one torch build)")
    undefined = subprocess.run([nm, "-D", "--undefined-only", str(core.path)], capture_output=True, text=True,
                               check=True).stdout.split()
    cxx_torch = [s for s in undefined if re.match(r"_ZN?K?(3c10|2at|5torch)|_Z\d+THP|THP", s)]
    assert cxx_torch == [], cxx_torch[:20]
    assert any(s.startswith("aoti_torch_") or s.startswith("torch_") for s in undefined)
