#!/usr/bin/env bash
# The GPU check, for a lent GPU machine: an H200 with torch 2.11 cu130, nvcc 13.0, ninja and
# pytest, and no network. It builds the extension with CUDA, runs the `cuda` tests, and times
# device="cuda" against the CPU on a synthesized checkpoint of a few GB, in under 8 minutes.
# The table comes last; logs and JSON go to $OUT (the device tool's folder) or /tmp.
#
#   bash tools/gpu_check.sh        # PYTHON=python3 GB=3 REPEAT=2 TORCH_CUDA_ARCH_LIST=9.0
#
# Only torch and pytest are needed: the cuda tests use no hypothesis, safetensors or tqdm, and
# skip the real-checkpoint case when DeepSpeed is absent.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOGS=${OUT:-/tmp/zerofast-gpu-check}
mkdir -p "$LOGS"
export FORCE_CUDA=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-$(nproc)}
export PYTHONUNBUFFERED=1 PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1

echo "== machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" -c "import torch; print('torch', torch.__version__, '| cuda', torch.version.cuda, '| gpu', torch.cuda.is_available())"
nvcc --version | tail -1

echo "== build with CUDA (log: $LOGS/build.log)"
start=$SECONDS
# The checkout is used in place (PYTHONPATH), nothing installed: `zerofast build` compiles the
# native core with its CUDA kernels (FORCE_CUDA=1 above) against this torch into the cache.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" ZEROFAST_NATIVE=1
timeout 300 "$PY" -m zerofast build >"$LOGS/build.log" 2>&1 || { tail -40 "$LOGS/build.log"; exit 1; }
build_s=$((SECONDS - start))
"$PY" - <<'PY' || { tail -40 "$LOGS/build.log"; exit 1; }
from zerofast import ops
assert "cuda" in ops.load_native().built_devices(), "the native core was built without its CUDA kernels"
print("native core built with CUDA kernels")
PY

echo "== cuda tests (log: $LOGS/tests.log)"
start=$SECONDS
timeout 150 "$PY" -m pytest -q -rs -m cuda -p no:cacheprovider tests/test_cuda.py >"$LOGS/tests.log" 2>&1
tests_rc=$?
tests_s=$((SECONDS - start))
tail -25 "$LOGS/tests.log"

echo "== benchmark"
start=$SECONDS
timeout 150 "$PY" benchmarks/gpu_bench.py --gb "${GB:-3}" --repeat "${REPEAT:-2}" --json "$LOGS/bench.json" 2>&1 \
    | tee "$LOGS/bench.log"
bench_rc=${PIPESTATUS[0]}
bench_s=$((SECONDS - start))

echo "== summary: build ${build_s}s, tests ${tests_s}s (rc $tests_rc), benchmark ${bench_s}s (rc $bench_rc)"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
