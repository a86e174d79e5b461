"""zerofast installed as a user installs it, into a fresh venv that holds only torch and numpy:
``pip install CLONE`` (build isolation on, no flags), ``pip install -e CLONE``, and the wheel
from ``python -m build``. Each install must reconstruct a real DeepSpeed checkpoint on the
native core, equal to DeepSpeed's ground truth bit for bit; without a working compiler the
same install must still reconstruct it, on the reference, with one warning.

One venv serves every check (each fresh venv costs a torch install). It gets the very torch
wheel this suite runs on, so the checks share this process's core cache: a core built for the
same torch build, Python and sources is the right one for the venv too (its folder name says
so, zerofast/native/cache.py). The no-compiler check uses an empty cache of its own.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch

from zerofast.base.settings import settings
from zerofast.native import cache
from tests.helpers import assert_bitwise_equal, expected_value, real_root, real_truth
pytestmark = [pytest.mark.install, pytest.mark.deepspeed, pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="the real checkpoint is made by DeepSpeed 0.19.8, which is not installed (pip install deepspeed==0.19.8)")]

REPO = Path(__file__).resolve().parent.parent
LAYOUT = "s3_bf16_w2_frozen_tied"
PIP_TIMEOUT = 1200  # a torch install on a busy 2-core machine takes minutes

CHECK = textwrap.dedent("""
    import json, sys, torch, zerofast
    from zerofast.native import loader, proof
    first = zerofast.reconstruct(sys.argv[1])
    again = zerofast.reconstruct(sys.argv[1])
    torch.save({"first": first, "again": again}, sys.argv[2])
    core = loader.load()
    print(json.dumps({"zerofast": zerofast.__file__, "torch": torch.__version__,
                      "core": str(core.path) if core else None,
                      "devices": list(proof.kernel_devices()) if core else None}))
""")


def _run(cmd: list, env: dict | None = None, timeout: float = PIP_TIMEOUT, cwd: Path | None = None):
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env, timeout=timeout, cwd=cwd)
    assert done.returncode == 0, f"{' '.join(map(str, cmd))}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def _clean_env(**extra: str) -> dict:
    """This environment without what points Python at the checkout or this venv."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "ZEROFAST_NATIVE")}
    return {**env, **extra}


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("venv") / "v"
    _run([sys.executable, "-m", "venv", root])
    _run([root / "bin" / "python", "-m", "pip", "install", "--quiet", f"torch=={torch.__version__}", "numpy"],
         env=_clean_env())
    return root


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """The checkout as `git clone` would give it: its tracked and unignored files, nothing built."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs git and a git checkout to copy the sources as a clone would have them")
    dest = tmp_path_factory.mktemp("clone") / "zerofast"
    files = _run(["git", "-C", REPO, "ls-files", "-co", "--exclude-standard", "-z"]).stdout.split("\0")
    for name in filter(None, files):
        if (REPO / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)
    return dest


def _check(venv: Path, tmp_path: Path, **env: str) -> tuple[dict, str]:
    """Reconstruct the real checkpoint twice in the venv; compare with DeepSpeed's truth here."""
    out = tmp_path / "sd.pt"
    env = _clean_env(**{"ZEROFAST_CACHE_DIR": str(settings().cache_dir), **env})
    done = _run([venv / "bin" / "python", "-c", CHECK, real_root(LAYOUT), out], env=env, timeout=3600,
                cwd=tmp_path)
    truth = real_truth(LAYOUT)
    stored = {**truth["trainable"], **truth["frozen"], **truth["buffers"]}
    for sd in torch.load(out, weights_only=True).values():
        assert list(sd) == truth["state_dict_keys"]
        for name, value in sd.items():
            assert_bitwise_equal(value, expected_value(stored[truth["tied"].get(name, name)], torch.float32), name)
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def _pip(venv: Path, *args) -> None:
    _run([venv / "bin" / "python", "-m", "pip", "install", "--quiet", *args], env=_clean_env())


def _assert_native(report: dict, venv: Path) -> None:
    assert report["torch"] == torch.__version__
    assert report["core"] is not None and report["devices"] == ["cpu"]  # a CPU torch: no CUDA build


def test_pip_install_clone(venv, clone, tmp_path):
    _pip(venv, clone)
    report, _ = _check(venv, tmp_path, ZEROFAST_NATIVE="1")
    _assert_native(report, venv)
    assert Path(report["zerofast"]).is_relative_to(venv)
    assert not (clone / "build").exists() or not any((clone / "build").rglob("*.so"))  # nothing compiled


def test_pip_install_editable(venv, clone, tmp_path):
    _pip(venv, "-e", clone)
    report, _ = _check(venv, tmp_path, ZEROFAST_NATIVE="1")
    _assert_native(report, venv)
    assert Path(report["zerofast"]).is_relative_to(clone)


def _built(clone: Path, tmp_path: Path) -> tuple[Path, Path]:
    if importlib.util.find_spec("build") is None:
        pytest.skip("python -m build needs the `build` package (requirements-dev.txt)")
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "build", "--outdir", dist, clone])
    (sdist,), (wheel,) = dist.glob("*.tar.gz"), dist.glob("*.whl")
    return sdist, wheel


def test_sdist_and_wheel_from_python_m_build(venv, clone, tmp_path):
    sdist, wheel = _built(clone, tmp_path)
    sources = sorted(p.relative_to(clone).as_posix() for p in (clone / "csrc").rglob("*") if p.is_file())
    with tarfile.open(sdist) as t:
        in_sdist = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    assert set(sources) <= in_sdist, set(sources) - in_sdist  # headers included
    with zipfile.ZipFile(wheel) as z:
        in_wheel = set(z.namelist())
    assert {f"zerofast/{s}" for s in sources} <= in_wheel
    assert not [n for n in in_wheel if n.endswith(".so")]  # compiled at first use, for the torch installed
    _pip(venv, "--force-reinstall", "--no-deps", wheel)
    report, _ = _check(venv, tmp_path, ZEROFAST_NATIVE="1")
    _assert_native(report, venv)
    assert Path(report["zerofast"]).is_relative_to(venv)


def test_without_a_compiler_the_install_works_on_the_reference(venv, clone, tmp_path):
    _pip(venv, "--force-reinstall", "--no-deps", clone)
    cache = tmp_path / "empty-cache"  # no core built before: the compiler is needed, and is not there
    report, err = _check(venv, tmp_path, CXX="/bin/false", ZEROFAST_CACHE_DIR=str(cache))
    assert report["core"] is None
    warnings = [ln for ln in err.splitlines() if ln.startswith("zerofast: warning:")]
    assert len(warnings) == 1 and "native core not available (the C++ compiler /bin/false does not run" in warnings[0]
    assert "same results" in warnings[0], err
    version = _run([venv / "bin" / "zerofast", "--version"], env=_clean_env(CXX="/bin/false",
                                                                         ZEROFAST_CACHE_DIR=str(cache)))
    assert "native core: not available (the C++ compiler /bin/false does not run" in version.stdout
    assert not (cache / "native").exists() or not list((cache / "native").rglob("*.so"))


def _prebuilt_wheel(clone: Path, tmp_path: Path) -> Path:
    """`make wheel`'s two steps in a clone: the CPU core compiled into zerofast/_prebuilt, then
    `python -m build --wheel`."""
    if importlib.util.find_spec("build") is None:
        pytest.skip("python -m build needs the `build` package (requirements-dev.txt)")
    here = _clean_env(PYTHONPATH=str(clone), ZEROFAST_CACHE_DIR=str(tmp_path / "build-cache"))
    try:
        _run([sys.executable, "-m", "zerofast.native.prebuild"], env=here, cwd=clone, timeout=3600)
        _run([sys.executable, "-m", "build", "--wheel", "--outdir", tmp_path / "dist", clone])
    finally:  # the clone serves the other installs, which must carry no core
        shutil.rmtree(clone / "zerofast" / "_prebuilt", ignore_errors=True)
        shutil.rmtree(clone / "build", ignore_errors=True)
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    assert not wheel.name.endswith("-py3-none-any.whl"), wheel.name  # tagged for this Python and platform
    with zipfile.ZipFile(wheel) as z:
        assert {"zerofast/_prebuilt/zerofast_C.so", "zerofast/_prebuilt/manifest.json"} <= set(z.namelist())
    return wheel


def test_a_wheel_with_the_prebuilt_core_needs_no_compiler(venv, clone, tmp_path):
    """`make wheel`'s two steps in a clone (the CPU core compiled into zerofast/_prebuilt, then
    `python -m build --wheel`), installed where no compiler runs and the cache is empty: the
    native core loads from the wheel (issue 45), and `--version` says it is the prebuilt one."""
    _pip(venv, "--force-reinstall", "--no-deps", _prebuilt_wheel(clone, tmp_path))
    no_compiler = {"CXX": "/bin/false", "PATH": str(venv / "bin"), "ZEROFAST_CACHE_DIR": str(tmp_path / "empty"),
                   "ZEROFAST_NATIVE": "1"}
    report, err = _check(venv, tmp_path, **no_compiler)
    assert Path(report["core"]).parent.name == "_prebuilt" and Path(report["core"]).is_relative_to(venv)
    assert "building" not in err and "warning" not in err, err
    version = _run([venv / "bin" / "zerofast", "--version"], env=_clean_env(**no_compiler)).stdout
    assert (f"native core: prebuilt, shipped in this package for torch >= {cache.floor_text()} (built with torch "
            f"{torch.__version__}; nothing to compile)") in version
    assert not (tmp_path / "empty" / "native").exists() or not list((tmp_path / "empty" / "native").rglob("*.so"))


OTHER_TORCH = os.environ.get("ZEROFAST_TEST_OTHER_TORCH")  # e.g. 2.14.1: a torch other than the suite's


@pytest.mark.skipif(not OTHER_TORCH, reason="opt-in (ZEROFAST_TEST_OTHER_TORCH=2.14.1): installs another torch, "
                                              "5.5 GB for PyPI's default CUDA build")
def test_the_prebuilt_wheel_serves_another_torch(clone, tmp_path):
    """The wheel built here, against this torch, in a venv with another torch, no compiler and an
    empty cache: its stable-ABI core loads as it is (issue 45) and reconstructs bit for bit."""
    assert OTHER_TORCH != torch.__version__.split("+")[0], "name a torch other than the suite's"
    other = tmp_path / "other-venv"
    _run([sys.executable, "-m", "venv", other])
    _pip(other, f"torch=={OTHER_TORCH}", "numpy")
    _pip(other, "--no-deps", _prebuilt_wheel(clone, tmp_path))
    no_compiler = {"CXX": "/bin/false", "PATH": str(other / "bin"), "ZEROFAST_CACHE_DIR": str(tmp_path / "empty"),
                   "ZEROFAST_NATIVE": "1"}
    report, err = _check(other, tmp_path, **no_compiler)
    assert report["torch"].split("+")[0] == OTHER_TORCH
    assert Path(report["core"]).parent.name == "_prebuilt" and Path(report["core"]).is_relative_to(other)
    assert "building" not in err and "warning" not in err, err
    version = _run([other / "bin" / "zerofast", "--version"], env=_clean_env(**no_compiler)).stdout
    assert f"native core: prebuilt, shipped in this package for torch >= {cache.floor_text()}" in version
