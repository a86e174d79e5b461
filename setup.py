"""Packaging only: nothing is compiled at install time, so no build-time torch is ever involved.

The C++ sources (``csrc/``) go into the wheel as package data, ``zerofast/csrc``; the native
core is compiled from them against the torch that is installed, on first use or by
``zerofast build`` (see zerofast/native/). An editable install reads ``csrc/`` in the checkout.

``make wheel`` first compiles the CPU core into ``zerofast/_prebuilt/`` (zerofast/native/prebuild.py);
where that folder is there, the wheel carries it and is tagged for this Python and platform.
"""
import shutil
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
SOURCE_SUFFIXES = (".cpp", ".cu", ".h")
PREBUILT = ROOT / "zerofast" / "_prebuilt"
PREBUILT_FILES = ("zerofast_C.so", "manifest.json")


def _has_prebuilt() -> bool:
    return all((PREBUILT / name).is_file() for name in PREBUILT_FILES)


class BuildPyWithSources(build_py):
    """build_py, plus csrc/ copied to zerofast/csrc in the build tree (so into the wheel)."""

    def run(self):
        super().run()
        if self.editable_mode:  # the checkout's csrc/ is found next to the package
            return
        dest = Path(self.build_lib) / "zerofast" / "csrc"
        shutil.rmtree(dest, ignore_errors=True)
        for src in sorted((ROOT / "csrc").rglob("*")):
            if src.is_file() and src.suffix in SOURCE_SUFFIXES:
                target = dest / src.relative_to(ROOT / "csrc")
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, target)
        if _has_prebuilt():
            (Path(self.build_lib) / "zerofast" / "_prebuilt").mkdir(exist_ok=True)
            for name in PREBUILT_FILES:
                shutil.copyfile(PREBUILT / name, Path(self.build_lib) / "zerofast" / "_prebuilt" / name)


class DistributionWithCore(Distribution):
    """A distribution that carries a prebuilt core is for one Python ABI and platform: the wheel is
    tagged so, and its files go to the platform's library folder (the wheel's root), not to
    ``.data/purelib``."""

    def has_ext_modules(self):
        return _has_prebuilt()


setup(distclass=DistributionWithCore, cmdclass={"build_py": BuildPyWithSources})
