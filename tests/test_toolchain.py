"""The native core's toolchain (issues 37 and 38): a built core is found without touching CUDA,
its folder names its compiler, it is proven sound before it is cached (it links the process's
libstdc++, an op's bad-argument error arrives whole), an unsound compiler is passed over for the
next one, and nvcc that does not fit (or ZEROFAST_CUDA_KERNELS=0) gives the CPU core."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from zerofast.native import ops
from zerofast.base.errors import DeviceError, NativeExtensionError
from zerofast.native import cache, cudaplan, loader, proof, toolchain
from zerofast.base.settings import settings

REPO = Path(__file__).resolve().parent.parent
SYSTEM_GXX = "/usr/bin/g++"


def _child(code: str, **env: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh Python on this checkout, ZEROFAST_NATIVE=1 unless ``env`` says."""
    full = dict(os.environ, PYTHONPATH=str(REPO), ZEROFAST_NATIVE="1")
    full.update(env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, cwd=REPO,
                          env=full, timeout=1800)


@pytest.fixture(scope="module")
def built() -> loader.Loaded:
    return loader.load(required=True)


def _copy_core(core: Path, cache_dir: Path) -> Path:
    """The built core copied into the cache at ``cache_dir``, where this torch and these sources look."""
    tag = cache.core_tag(cache.sources_dir(), cache.torch_identity())
    copy = cache_dir / "native" / tag / core.name
    shutil.copytree(core, copy)
    return copy


def _script(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + text + "\n")
    path.chmod(0o755)
    return path


# --- 1. No CUDA on load (issue 37) -----------------------------------------------------------

NO_CUDA = """
import sys, torch

def touched(*args, **kwargs):
    raise AssertionError("torch.cuda was asked")

for name in ("is_available", "device_count", "get_device_capability", "init", "_lazy_init", "current_device"):
    setattr(torch.cuda, name, touched)
"""


def test_a_built_core_loads_and_runs_on_the_cpu_without_touching_cuda(built, tmp_path):
    done = _child(NO_CUDA + f"""
import zerofast
from zerofast.native import ops
from zerofast.testing.synthesize import LayoutSpec, ParamSpec, synthesize

ops.load_native()
spec = LayoutSpec(stage=3, world_size=2, model_dtype=torch.bfloat16,
                  groups=[[ParamSpec("a", (8, 3)), ParamSpec("b", (5,))]],
                  with_optimizer_states=False)
truth = synthesize({str(tmp_path)!r}, spec)
got = zerofast.reconstruct({str(tmp_path)!r}, device="cpu")
for name, value in truth.trainable.items():
    assert torch.equal(got[name], value), name
print("cpp_extension imported:", "torch.utils.cpp_extension" in sys.modules)
""")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "cpp_extension imported: False"


def test_the_cuda_decision_reads_files_only(monkeypatch, tmp_path):
    """A CUDA torch with nvcc found: the folder's archs come from the record for these GPU models,
    not from torch.cuda, once a first process has asked it."""
    info = tmp_path / "gpus" / "0000:01:00.0" / "information"
    info.parent.mkdir(parents=True)
    info.write_text("Model: \t NVIDIA H200\nIRQ: 1\n")
    monkeypatch.setattr(cudaplan, "GPU_INFO", tmp_path / "gpus")
    monkeypatch.setenv("ZEROFAST_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CUDA_HOME", str(_script(tmp_path / "cuda" / "bin" / "nvcc", "exit 0").parent.parent))
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (9, 0))
    assert cudaplan.wanted_devices(settings()) == (("cpu", "cuda"), "9.0")
    for name in ("is_available", "device_count", "get_device_capability"):
        monkeypatch.setattr(torch.cuda, name, lambda *a: pytest.fail("torch.cuda asked again"))
    assert cudaplan.wanted_devices(settings()) == (("cpu", "cuda"), "9.0")
    assert json.loads((tmp_path / "cache" / "native" / cudaplan.ARCHS_MEMO).read_text()) == {"NVIDIA H200": "9.0"}


def _cuda_torch_with_nvcc(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("CUDA_HOME", str(_script(tmp_path / "cuda" / "bin" / "nvcc", "exit 0").parent.parent))
    monkeypatch.delenv("FORCE_CUDA", raising=False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: pytest.fail("torch.cuda asked"))


def test_no_visible_gpu_means_no_cuda_build(monkeypatch, tmp_path):
    """A CUDA torch and a toolkit, no GPU (issue 45: a 7-arch CUDA build took minutes before the
    CPU core): the CPU core alone, decided from /proc without touching CUDA."""
    _cuda_torch_with_nvcc(monkeypatch, tmp_path)
    monkeypatch.setattr(cudaplan, "GPU_INFO", tmp_path / "no-gpus")
    assert not cudaplan.gpus_visible()
    assert cudaplan.wanted_devices(settings()) == (("cpu",), None)
    monkeypatch.setenv("FORCE_CUDA", "1")  # a build node asked to build for GPUs it does not have
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    assert cudaplan.wanted_devices(settings()) == (("cpu", "cuda"), "9.0")


@pytest.mark.parametrize("visible", ["", "-1"])
def test_gpus_hidden_by_cuda_visible_devices_are_not_visible(monkeypatch, tmp_path, visible):
    info = tmp_path / "gpus" / "0000:01:00.0" / "information"
    info.parent.mkdir(parents=True)
    info.write_text("Model: \t NVIDIA H100\n")
    monkeypatch.setattr(cudaplan, "GPU_INFO", tmp_path / "gpus")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert cudaplan.gpus_visible()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    _cuda_torch_with_nvcc(monkeypatch, tmp_path)
    assert cudaplan.wanted_devices(settings()) == (("cpu",), None)


def test_an_nvcc_wrapper_script_gets_its_toolkits_headers(monkeypatch, tmp_path):
    """nvcc on the PATH as ``exec <toolkit>/bin/nvcc "$@"`` (issue 45's machine): torch's builder would
    take the wrapper's parent folder for the toolkit and miss cuda_runtime.h; the build is given the
    folder the real nvcc says it runs from."""
    toolkit = tmp_path / "cuda-13.0"
    (toolkit / "include").mkdir(parents=True)
    (toolkit / "include" / "cuda_runtime.h").write_text("")
    real = _script(toolkit / "bin" / "nvcc", f'echo "#$ _HERE_={toolkit / "bin"}" >&2')
    _script(tmp_path / "wrappers" / "bin" / "nvcc", f'exec {real} "$@"')
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", f"{tmp_path / 'wrappers' / 'bin'}{os.pathsep}{os.environ['PATH']}")
    assert cudaplan.find_nvcc(settings()) == str(tmp_path / "wrappers" / "bin" / "nvcc")
    assert cudaplan.toolkit_home(settings()) == str(toolkit)
    env = loader.build_env("c++", "9.0", True, loader.Job(settings(), False, False, False, []))
    assert env["CUDA_HOME"] == str(toolkit)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "asked"))  # asked for: taken as it is
    assert cudaplan.toolkit_home(settings()) == str(tmp_path / "asked")


# --- 2. The cache key names the compiler -----------------------------------------------------

def test_the_core_folder_names_its_compiler(built, tmp_path, monkeypatch):
    m = built.manifest
    assert built.path.parent.name == cache.core_name(("cpu",), None, toolchain.compiler_key(m["compiler"]), None)
    assert m["compiler_version"] == toolchain.compiler_version(m["compiler"]).splitlines()[0]
    wrapper = _script(tmp_path / "g++", f'exec {SYSTEM_GXX} "$@"')
    assert toolchain.compiler_key(str(wrapper)) != toolchain.compiler_key(SYSTEM_GXX)
    key = toolchain.compiler_key(str(wrapper))
    monkeypatch.setattr(toolchain, "compiler_version", lambda cxx: "g++ (other) 99.1")  # what it wraps changed
    assert toolchain.compiler_key(str(wrapper)) != key


def test_a_load_runs_at_most_the_compilers_version(built):
    done = _child("""
    import subprocess, sys
    started = []
    init = subprocess.Popen.__init__
    def record(self, args, *a, **k):
        started.append(list(args))
        init(self, args, *a, **k)
    subprocess.Popen.__init__ = record
    from zerofast.native import ops
    ops.load_native()
    print(started)
    """)
    assert done.returncode == 0, done.stderr
    started = eval(done.stdout.strip())
    assert len(started) <= 1 and all(args[1:] == ["--version"] for args in started), started


# --- 3. A core is proven before it is used ---------------------------------------------------

def test_the_built_core_links_the_process_libstdcxx_and_was_checked(built):
    assert toolchain.LIBSTDCXX in toolchain.needed_libraries(str(built.path))
    assert toolchain.linkage_problem(str(built.path)) is None
    assert built.manifest["links"] == toolchain.needed_libraries(str(built.path))
    assert built.manifest["checked"] == ["cpu"]


def test_a_library_with_its_own_static_libstdcxx_is_refused(tmp_path):
    src = tmp_path / "x.cpp"
    src.write_text('#include <sstream>\nextern "C" int f(long v) { std::ostringstream s; s << v; '
                   "return (int)s.str().size(); }\n")
    for flags, linked in (([], True), (["-static-libstdc++"], False)):
        lib = tmp_path / f"x{len(flags)}.so"
        subprocess.run([SYSTEM_GXX, "-shared", "-fPIC", *flags, str(src), "-o", str(lib)], check=True)
        assert (toolchain.LIBSTDCXX in toolchain.needed_libraries(str(lib))) is linked
        problem = toolchain.linkage_problem(str(lib))
        assert (problem is None) is linked
    assert problem.startswith(f"it does not link {toolchain.LIBSTDCXX} (it links ")


def test_an_op_error_arrives_whole_on_the_cpu(built):
    with pytest.raises(RuntimeError) as e:
        torch.ops.zerofast.gather_cast([torch.zeros(10)], torch.tensor(proof.BAD_SEGMENTS), torch.zeros(10))
    assert str(e.value).splitlines()[0] == proof.EXPECTED
    assert proof.message_problem("cpu") is None
    assert proof.run_problem("cpu") is None  # and a good call copies right


def test_a_device_not_checked_at_build_is_checked_once_at_its_first_call(built, tmp_path, monkeypatch, capfd):
    """What a GPU node's core gets at its first GPU call, run here for the CPU: the check in a child
    process, its verdict kept in the core's folder; a recorded failure drops the device's kernels."""
    copy = _copy_core(built.path.parent, tmp_path)
    monkeypatch.setattr(loader, "_state", built._replace(path=cache.library(copy),
                                                         manifest={**built.manifest, "checked": []}))
    monkeypatch.setattr(loader, "_checked", {})
    assert loader.device_problem("cpu") is None
    assert json.loads((copy / "checked-cpu.json").read_text()) == {"problem": None}
    (copy / "checked-cpu.json").write_text(json.dumps({"problem": "its cpu op crashed its check (SIGSEGV)"}))
    monkeypatch.setattr(loader, "_checked", {})
    monkeypatch.setenv("ZEROFAST_NATIVE", "auto")  # warned, not raised (make test runs under ZEROFAST_NATIVE=1)
    capfd.readouterr()
    assert loader.device_problem("cpu") == "its cpu op crashed its check (SIGSEGV)"
    assert capfd.readouterr().err.splitlines() == [
        "zerofast: warning: the native core's CPU kernels are not sound (its cpu op crashed its check (SIGSEGV)); "
        "device='cpu' runs on torch's own operations instead"]
    assert "cpu" not in ops.built_devices() and loader.unsound_devices() == {"cpu"}
    monkeypatch.setattr(loader, "_checked", {})
    monkeypatch.setenv("ZEROFAST_NATIVE", "1")
    with pytest.raises(NativeExtensionError, match="CPU kernels are not sound .*ZEROFAST_NATIVE=1 requires them"):
        loader.device_problem("cpu")


# --- 4. The next compiler where one gives no sound core --------------------------------------

def test_compilers_are_tried_cxx_first_then_the_path_then_the_system_one_per_real_path(tmp_path, monkeypatch):
    a = _script(tmp_path / "a" / "g++", "exit 0")
    b = _script(tmp_path / "b" / "g++", "exit 0")
    (tmp_path / "b" / "c++").symlink_to(a)  # the same compiler as a/g++ under another name
    clang = _script(tmp_path / "b" / "clang++", "exit 0")
    system = _script(tmp_path / "sys" / "g++", "exit 0")
    monkeypatch.setattr(toolchain, "SYSTEM_COMPILERS", (str(system), str(a)))
    monkeypatch.setenv("CXX", str(b))
    path = os.pathsep.join([str(tmp_path / "a"), str(tmp_path / "b")])
    assert list(toolchain.compiler_candidates(settings(), path)) == [str(b), str(a), str(clang), str(system)]
    monkeypatch.setenv("CXX", "no-such-compiler-zf")  # named first, so that its failure is said
    assert list(toolchain.compiler_candidates(settings(), path))[:2] == ["no-such-compiler-zf", str(a)]


def test_where_no_compiler_gives_a_sound_core_the_reference_runs_with_one_warning(tmp_path, monkeypatch, capfd):
    """Each compiler's build is stood in for by an unsound verdict (no compiling here): each is said
    once as it is passed over, and the warning that the reference runs names them all."""
    a, b = (str(_script(tmp_path / name / "g++", "exit 0")) for name in ("a", "b"))
    monkeypatch.setattr(toolchain, "compiler_candidates", lambda s, path: iter([a, b]))

    def unsound(core, devices, archs, cxx, job):
        raise loader.UnsoundBuild(f"{loader.NOT_SOUND}it does not link libstdc++.so.6")

    monkeypatch.setattr(loader, "_run_build", unsound)
    monkeypatch.setenv("ZEROFAST_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("ZEROFAST_NATIVE", "auto")
    monkeypatch.setattr(loader, "_state", None)
    monkeypatch.setattr(loader, "_warned", False)
    capfd.readouterr()
    assert loader.load() is None
    said = capfd.readouterr().err.splitlines()
    assert said[:2] == [f"zerofast: warning: {cxx} gave no sound core (its core is not sound: it does not link "
                        "libstdc++.so.6); trying the next C++ compiler" for cxx in (a, b)]
    assert said[2:] == [f"zerofast: warning: native core not available (no C++ compiler gave a sound core: {a}: its "
                        f"core is not sound: it does not link libstdc++.so.6; {b}: its core is not sound: it does not "
                        f"link libstdc++.so.6); using the pure-torch reference: same results, {loader.SLOWDOWN} "
                        "(ZEROFAST_NATIVE=1 makes this an error; `zerofast doctor` says more)"]


@pytest.mark.slow_build
def test_a_static_libstdcxx_compiler_is_passed_over_for_a_sound_one(built, tmp_path):
    """Issue 38's GPU machine, on the CPU: CXX, g++ and c++ are a wrapper that links a static
    libstdc++. Its core is built (the one build this test costs: minutes on 2 cores), found unsound
    (its messages are cut at the first integer) and refused; /usr/bin/g++'s core, copied from the
    built cache, is the one loaded, and its errors arrive whole."""
    _copy_core(built.path.parent, tmp_path / "cache")
    wrapper = _script(tmp_path / "wrap" / "static-g++", f'exec {SYSTEM_GXX} -static-libstdc++ "$@"')
    for name in ("g++", "c++"):
        (tmp_path / "wrap" / name).symlink_to(wrapper)
    env = dict(CXX=str(wrapper), PATH=f"{tmp_path / 'wrap'}{os.pathsep}{os.environ['PATH']}",
               ZEROFAST_CACHE_DIR=str(tmp_path / "cache"))
    code = """
    import torch
    from zerofast.native import loader
    print(loader.load(required=True).path)
    try:
        torch.ops.zerofast.gather_cast([torch.zeros(10)], torch.tensor([[1, 0, 0, 1]]), torch.zeros(10))
    except RuntimeError as e:
        print(str(e).splitlines()[0])
    """
    done = _child(code, **env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [str(tmp_path / "cache" / built.path.relative_to(settings().cache_dir)),
                                        proof.EXPECTED]
    refused = [ln for ln in done.stderr.splitlines()
               if ln.startswith(f"zerofast: warning: {wrapper} gave no sound core (its core is not sound: ")]
    assert len(refused) == 1 and "it does not link libstdc++.so.6" in refused[0], done.stderr
    assert "arrives cut short ('gather_cast: `segments['" in refused[0]  # the defect, reproduced
    again = _child(code, **env)  # the refusal is recorded: the next process loads the sound core in silence
    assert again.returncode == 0 and again.stdout == done.stdout and again.stderr == "", again.stderr
    version = _child("from zerofast.cli import main; main(['--version'])", **env).stdout.splitlines()
    assert version[3].endswith(f"loaded on first use from {done.stdout.splitlines()[0]}"), version
    doctor = subprocess.run([sys.executable, "-m", "zerofast", "doctor"], capture_output=True, text=True, cwd=REPO,
                            env=dict(os.environ, PYTHONPATH=str(REPO), **env), timeout=600).stdout.splitlines()
    assert f"core linkage: links {toolchain.LIBSTDCXX} (the process's: " in "\n".join(doctor)
    assert any(ln.startswith("not used: cpu@static-g++-") and "its core is not sound" in ln for ln in doctor), doctor


# --- 5. No CUDA kernels: the switch, and nvcc that does not fit -------------------------------

@pytest.mark.parametrize("nvcc, problem", [
    ('echo "Cuda compilation tools, release 13.0, V13.0.88"', None),
    ('echo "Cuda compilation tools, release 12.4, V12.4.131"',
     "{nvcc} is CUDA 12.4 but torch is built with CUDA 13.0 (the major versions differ)"),
    ("exit 1", "{nvcc} does not run (`{nvcc} --version` fails or names no release)"),
    (None, "no nvcc (looked in $CUDA_HOME/bin and /usr/local/cuda/bin)"),
], ids=["fits", "other-major", "fails", "missing"])
def test_nvcc_that_does_not_fit_is_named(nvcc, problem, tmp_path, monkeypatch):
    home = tmp_path / "cuda"
    (home / "bin").mkdir(parents=True)
    if nvcc is not None:
        _script(home / "bin" / "nvcc", nvcc)
    monkeypatch.setenv("CUDA_HOME", str(home))
    want = problem.format(nvcc=home / "bin" / "nvcc") if problem else None
    assert cudaplan.nvcc_problem(settings(), "13.0") == want


def test_the_switch_says_no_cuda_kernels_even_under_force_cuda(monkeypatch):
    monkeypatch.setenv("FORCE_CUDA", "1")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    assert cudaplan.wanted_devices(settings()) == (("cpu", "cuda"), "9.0")
    monkeypatch.setenv("ZEROFAST_CUDA_KERNELS", "0")
    assert cudaplan.wanted_devices(settings()) == (("cpu",), None)


def test_cuda_settings_are_read_as_torchs_builder_reads_them():
    from zerofast.base.settings import from_environment

    assert from_environment({}).cuda_kernels is True and from_environment({}).cuda_home is None
    assert from_environment({"ZEROFAST_CUDA_KERNELS": "0"}).cuda_kernels is False
    assert from_environment({"CUDA_PATH": "/p"}).cuda_home == "/p"
    assert from_environment({"CUDA_HOME": "/h", "CUDA_PATH": "/p"}).cuda_home == "/h"


@pytest.mark.parametrize("nvcc", ['echo "Cuda compilation tools, release 12.4, V12.4.131"', "exit 1"],
                         ids=["other-major", "fails"])
def test_an_unfit_nvcc_gives_the_cpu_core_with_one_line(nvcc, built, tmp_path):
    """A CUDA torch (simulated: torch.version.cuda set in the child) with FORCE_CUDA=1 and nvcc that
    cannot build for it: the CPU core (here the built one, copied), said once, in one line."""
    _copy_core(built.path.parent, tmp_path / "cache")
    home = _script(tmp_path / "cuda" / "bin" / "nvcc", nvcc).parent.parent
    code = """
    import torch
    torch.version.cuda = "13.0"
    from zerofast.native import ops
    print(ops.built_devices())
    """
    env = dict(FORCE_CUDA="1", CUDA_HOME=str(home), ZEROFAST_CACHE_DIR=str(tmp_path / "cache"))
    first, second = _child(code, **env), _child(code, **env)
    for done in (first, second):
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "['cpu']"
    said = first.stderr.splitlines()
    assert len(said) == 1 and said[0].startswith("zerofast: the CUDA kernels are not built ("), said
    assert said[0].endswith("; building the native core for the CPU only: device=\"cuda\" runs on torch's own GPU "
                            "operations")
    assert str(home / "bin" / "nvcc") in said[0]
    assert second.stderr == ""  # recorded: later processes go to the CPU core in silence


# --- 6. device="cuda" without CUDA kernels is no error ----------------------------------------

def test_a_core_without_gpu_kernels_does_not_refuse_the_gpu(built, monkeypatch):
    assert "cuda" not in ops.built_devices()
    with pytest.raises(DeviceError, match="sees no CUDA GPU"):  # no GPU visible: still refused
        ops.resolve_device("cuda")
    monkeypatch.setattr(ops, "device_of", lambda device: SimpleNamespace(available=lambda: True))
    asked = []
    monkeypatch.setattr(loader, "device_problem", asked.append)
    assert ops.resolve_device("cuda") == torch.device("cuda")
    assert asked == []  # no CUDA kernels: nothing to check
    monkeypatch.setattr(proof, "kernel_devices", lambda: ["cpu", "cuda"])
    assert ops.resolve_device("cuda") == torch.device("cuda")
    assert asked == ["cuda"]  # the first GPU call checks the CUDA kernels (once: device_problem keeps it)
