"""``python -m zerofast.native.prebuild``: compile the CPU core against the torch in this environment
into ``zerofast/_prebuilt/`` (``make wheel`` runs it), so that the platform wheel made next carries
it and a user with the same torch build and Python gets a core without compiling anything.

The core is built, proven sound and recorded as every core is (:mod:`.build`), in ``build/``; only
the library and its manifest, with the tag it was built for added, are copied into the package.
The loader takes it only where that tag is the running one's (:func:`.cache.prebuilt`).
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from ..base.settings import settings
from . import build, cache, loader, toolchain

WORK = cache.PACKAGE.parent / "build" / "prebuilt-core"


def prebuild() -> Path:
    s = settings()
    tag = cache.core_tag(cache.sources_dir(), cache.torch_identity())
    cache.preflight_environment(s)
    cxx = cache.preflight_compiler(next(toolchain.compiler_candidates(s, cache.compiler_path())))
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.parent.mkdir(parents=True, exist_ok=True)
    log = WORK.with_name(WORK.name + ".build.log")
    job = loader.Job(s, True, True, True, [])
    if loader.run_build_child(WORK, ("cpu",), loader.build_env(cxx, None, False, job), log, True) != 0:
        raise cache.Unavailable(f"the build failed: {build.failure_line(log)} (log: {log})")
    manifest = {**cache.read_manifest(WORK), "tag": tag, "prebuilt": True}
    shutil.rmtree(cache.PREBUILT, ignore_errors=True)
    cache.PREBUILT.mkdir()
    shutil.copy2(cache.library(WORK), cache.library(cache.PREBUILT))
    (cache.PREBUILT / cache.MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")  # last: it marks it whole
    return cache.PREBUILT


def main() -> int:
    try:
        where = prebuild()
    except cache.Unavailable as e:
        print(f"zerofast: no prebuilt core: {e}", file=sys.stderr)
        return 1
    manifest = cache.read_manifest(where)
    print(f"zerofast: prebuilt core for torch {manifest['torch']} (Python {manifest['python']}) in {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
