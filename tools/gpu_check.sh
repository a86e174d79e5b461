#!/usr/bin/env bash
# The GPU check of issue 37, for a lent GPU machine (an H200, 16 cores, torch 2.11 cu130, nvcc 13.0,
# no DeepSpeed, no network; docs: ../shared/docs/gpu-machine.md). In one call of about 8 minutes:
#
#   info       the machine: GPU, cores, memory, /dev/shm, huge pages, torch, nvcc, compilers
#   build      the native core with its CUDA kernels (FORCE_CUDA=1, CXX=/usr/bin/g++ unless set),
#              and beside it, at once, the core without them ($ZF_NO_CUDA_KERNELS_ENV)
#   ds         DeepSpeed from the wheels in $WHEELS (pip --no-index --no-deps --target $DS_DIR;
#              DS_DIR goes on the PYTHONPATH of DeepSpeed's own commands only)
#   nokernels  device="cuda" with the CUDA kernels switched off ($ZF_NO_CUDA_KERNELS_ENV): a small
#              save reconstructed (eager fp32/bf16/as stored, lazy, load_into, export), bit for bit
#              against the CPU
#   tests      tests/test_cuda.py and tests/test_ring.py under pytest
#   bench      one process, $GB GB of fp32 masters, best of $REPEAT: the floors, reconstruct
#              cpu/cuda, lazy, load_into, export cpu/cuda, DeepSpeed's dict + .to("cuda")
#   fresh      fresh processes, medians of $ROUNDS: zerofast cpu against DeepSpeed (eager ZeRO-3,
#              export), the plain-copy floor, ops.load_native()
#   sweep      warm eager ZeRO-3 on the CPU for ZEROFAST_READERS in $SWEEP_READERS, huge pages 0/1
#   big        the $GB_BIG GB save (the $GB GB one removed first): the floors, cpu fp32, cuda
#              fp32 and bf16, DeepSpeed's dict + .to("cuda")
#
# then the summary: every table, issue 37's "Done when" targets as PASS / FAIL / NOT MEASURED,
# and each stage's time against its limit. Everything goes to $OUT as it is made: <stage>.log,
# bench-4GB.json/.md, bench-12GB.json/.md, fresh.json/.md, sweep.json/.md, nokernels.json,
# stages.tsv, summary.md, targets.json.
#
#   OUT=/tmp/gpucheck bash tools/gpu_check.sh                  # on the GPU machine
#   STAGES="build tests" bash tools/gpu_check.sh               # some stages only
#   DRY_RUN=1 OUT=/tmp/gpucheck bash tools/gpu_check.sh        # a CPU dry run: device="cpu", tiny
#                                                              # saves, no build, no cuda tests
#
# Settings (environment): STAGES, PYTHON, CXX, WHEELS, DS_DIR, GB (4), GB_BIG (12), REPEAT (2),
# ROUNDS (3), SWEEP_ROUNDS (3), SWEEP_READERS (1,2,4,8,16,32), BUDGET_S (450: the whole run's
# seconds; each stage gets at most its own limit and what is left after keeping the later stages'
# minimum), SHM_ROOT (the tmpfs folder of the saves, removed at the end unless KEEP_SAVES=1),
# ZF_NO_CUDA_KERNELS_ENV (ZEROFAST_CUDA_KERNELS=0: the setting that builds/loads the core without
# its CUDA kernels), TORCH_CUDA_ARCH_LIST (unset: the visible GPU's).
#
# Peak use on the H200 machine: /dev/shm 8 GB (4 GB save + its export) then 12 GB (the 12 GB save
# alone); RAM below 50 GB (12 GB save + a 12 GB copy + 12 GB pinned, at most two at once).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD

DRY=${DRY_RUN:-0}
OUT=${OUT:-/tmp/zerofast-gpu-check}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
if [ "$DRY" = 1 ]; then
    [ -x .venv/bin/python ] && DEFAULT_PY=.venv/bin/python || DEFAULT_PY=python3
    DEVICE=cpu
    GB=${GB:-0.05}
    GB_BIG=${GB_BIG:-0.3}
    ROUNDS=${ROUNDS:-2}
    SWEEP_ROUNDS=${SWEEP_ROUNDS:-1}
    SWEEP_READERS=${SWEEP_READERS:-1,2,16}
    STAGES=${STAGES:-"info ds nokernels bench fresh sweep big"}
    SHM_ROOT=${SHM_ROOT:-/dev/shm/zf-gpucheck-dry}
else
    DEFAULT_PY=python3
    DEVICE=cuda
    GB=${GB:-4}
    GB_BIG=${GB_BIG:-12}
    ROUNDS=${ROUNDS:-3}
    SWEEP_ROUNDS=${SWEEP_ROUNDS:-3}
    SWEEP_READERS=${SWEEP_READERS:-1,2,4,8,16,32}
    STAGES=${STAGES:-"info build ds nokernels tests bench fresh sweep big"}
    SHM_ROOT=${SHM_ROOT:-/dev/shm/zf-gpucheck}
    export CXX=${CXX:-/usr/bin/g++}  # /opt/gcc's wrapper links libstdc++ statically
    export FORCE_CUDA=1
fi
PY=${PYTHON:-$DEFAULT_PY}
PY=$(command -v "$PY" || echo "$PY")
case "$PY" in /*) ;; *) PY=$REPO/$PY ;; esac
REPEAT=${REPEAT:-2}
BUDGET=${BUDGET_S:-450}
DS_DIR=${DS_DIR:-/tmp/zf-deepspeed}
ZF_NO_CUDA_KERNELS_ENV=${ZF_NO_CUDA_KERNELS_ENV:-ZEROFAST_CUDA_KERNELS=0}
# The checkout in place (nothing installed); the native core required, never the slow reference.
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" ZEROFAST_NATIVE=1 PYTHONUNBUFFERED=1
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 MAX_JOBS=${MAX_JOBS:-$(nproc)}
export REPO BUDGET OUT PY DEVICE GB GB_BIG REPEAT ROUNDS SWEEP_ROUNDS SWEEP_READERS SHM_ROOT DS_DIR ZF_NO_CUDA_KERNELS_ENV DRY
mkdir -p "$SHM_ROOT"
: >"$OUT/stages.tsv"
cleanup() { [ "${KEEP_SAVES:-0}" = 1 ] || rm -rf "$SHM_ROOT"; }
trap cleanup EXIT

ORDER="info build ds nokernels tests bench fresh sweep big"
# Seconds on the H200 machine: expected, the most a stage may take, the least worth starting it.
declare -A EXPECTED=([info]=3 [build]=60 [ds]=10 [nokernels]=25 [tests]=40 [bench]=55 [fresh]=90 [sweep]=110 [big]=75)
declare -A LIMIT=([info]=30 [build]=240 [ds]=60 [nokernels]=120 [tests]=150 [bench]=180 [fresh]=150 [sweep]=150 [big]=180)
declare -A LEAST=([info]=2 [build]=40 [ds]=5 [nokernels]=15 [tests]=20 [bench]=45 [fresh]=40 [sweep]=25 [big]=70)
SUMMARY_S=15
T0=$SECONDS

selected() { case " $STAGES " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

# DeepSpeed's arguments for the benchmarks: what the ds stage found, else a probe of their own.
ds_args() {
    if [ -f "$OUT/deepspeed.txt" ]; then
        if [ -s "$OUT/deepspeed.txt" ]; then echo "--ds-path $DS_DIR"; else echo "--no-deepspeed"; fi
    else
        echo "--ds-path $DS_DIR"
    fi
}
export -f ds_args

stage_info() {
    date -u
    echo "cores $(nproc); $(free -g | awk '/Mem:/ {print "memory " $2 " GiB, available " $7 " GiB"}')"
    df -h /dev/shm | tail -1
    echo "huge pages: enabled $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null), defrag $(cat /sys/kernel/mm/transparent_hugepage/defrag 2>/dev/null)"
    nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv,noheader 2>&1 | head -4
    "$PY" -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', torch.version.cuda, '| threads', torch.get_num_threads())"
    (nvcc --version 2>/dev/null || /usr/local/cuda/bin/nvcc --version 2>/dev/null) | tail -1
    echo "CXX=${CXX:-c++}: $(${CXX:-c++} --version 2>/dev/null | head -1)"
    echo "device=$DEVICE GB=$GB GB_BIG=$GB_BIG REPEAT=$REPEAT ROUNDS=$ROUNDS SWEEP_ROUNDS=$SWEEP_ROUNDS BUDGET=${BUDGET}s"
    echo "no-kernels setting: $ZF_NO_CUDA_KERNELS_ENV; saves under $SHM_ROOT"
    git log -1 --format='checkout %h %s' 2>/dev/null | cut -c1-120 || true
    return 0
}

stage_build() {
    # Both cores at once: with the CUDA kernels (the one measured), and without them (nokernels).
    (env $ZF_NO_CUDA_KERNELS_ENV "$PY" -m zerofast build >"$OUT/build-nokernels.log" 2>&1
     echo "core without CUDA kernels: build rc $? (log build-nokernels.log)") &
    local t=$SECONDS
    "$PY" -m zerofast build >"$OUT/build-cuda.log" 2>&1
    local rc=$?
    echo "core with CUDA kernels: build rc $rc in $((SECONDS - t)) s (log build-cuda.log)"
    wait
    if [ $rc -ne 0 ]; then tail -40 "$OUT/build-cuda.log"; return $rc; fi
    "$PY" -c "
from zerofast.native import ops, proof
devices = list(proof.kernel_devices())
print('the core loads with kernels for', devices)
assert 'cuda' in devices, 'the native core was built without its CUDA kernels: see build-cuda.log'"
}

stage_ds() {
    rm -f "$OUT/deepspeed.txt"
    if [ -n "${WHEELS:-}" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
        rm -rf "$DS_DIR"
        echo "installing $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS into $DS_DIR"
        "$PY" -m pip install -q --no-index --no-deps --target "$DS_DIR" "$WHEELS"/*.whl 2>&1 | tail -5
    else
        echo "WHEELS not set or holds no wheels: DeepSpeed only if it imports already"
    fi
    local v
    v=$(PYTHONPATH="$REPO:$DS_DIR" "$PY" -c "import deepspeed
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
print(deepspeed.__version__)" 2>"$OUT/deepspeed-import.log" | tail -1)
    echo -n "$v" >"$OUT/deepspeed.txt"
    if [ -n "$v" ]; then echo "DeepSpeed $v imports"; else echo "DeepSpeed does not import:"; tail -3 "$OUT/deepspeed-import.log"; fi
    return 0
}

stage_nokernels() {
    if [ "$DRY" != 1 ]; then  # built by the build stage; this retries one that failed there
        env $ZF_NO_CUDA_KERNELS_ENV "$PY" -m zerofast build >>"$OUT/build-nokernels.log" 2>&1 \
            || { echo "the core without CUDA kernels did not build:"; tail -20 "$OUT/build-nokernels.log"; return 1; }
    fi
    env $ZF_NO_CUDA_KERNELS_ENV "$PY" benchmarks/gpu_fresh.py compare --root "$SHM_ROOT" --device "$DEVICE" \
        --expect-no-kernels --json "$OUT/nokernels.json"
    local rc=$?
    # And as on a GPU machine without nvcc: none found (CUDA_HOME names an empty place), no FORCE_CUDA.
    echo "-- again with nvcc out of sight (CUDA_HOME=/nonexistent, FORCE_CUDA unset)"
    env -u FORCE_CUDA CUDA_HOME=/nonexistent "$PY" benchmarks/gpu_fresh.py compare --root "$SHM_ROOT" \
        --device "$DEVICE" --expect-no-kernels --json "$OUT/nokernels-nonvcc.json" || rc=1
    return $rc
}

stage_tests() {
    "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_cuda.py tests/test_ring.py
}

stage_bench() {
    "$PY" benchmarks/gpu_bench.py --root "$SHM_ROOT" --gb "$GB" --repeat "$REPEAT" --device "$DEVICE" \
        --json "$OUT/bench-4GB.json" --md "$OUT/bench-4GB.md" $(ds_args)
}

stage_fresh() {
    "$PY" benchmarks/gpu_fresh.py fresh --root "$SHM_ROOT" --gb "$GB" --rounds "$ROUNDS" \
        --json "$OUT/fresh.json" --md "$OUT/fresh.md" $(ds_args)
}

stage_sweep() {
    "$PY" benchmarks/gpu_fresh.py sweep --root "$SHM_ROOT" --gb "$GB" --rounds "$SWEEP_ROUNDS" \
        --readers "$SWEEP_READERS" --json "$OUT/sweep.json" --md "$OUT/sweep.md"
}

stage_big() {
    # /dev/shm holds one 12 GB save and its output, not two saves: the others go first.
    find "$SHM_ROOT" -mindepth 1 -maxdepth 1 ! -name "zero3-${GB_BIG}GB-w4" -exec rm -rf {} +
    "$PY" benchmarks/gpu_bench.py --root "$SHM_ROOT" --gb "$GB_BIG" --repeat "$REPEAT" --device "$DEVICE" \
        --cases read,copy,pinned,pageable,cpu_fp32,cuda_fp32,cuda_bf16,deepspeed \
        --json "$OUT/bench-12GB.json" --md "$OUT/bench-12GB.md" $(ds_args)
}
export -f stage_info stage_build stage_ds stage_nokernels stage_tests stage_bench stage_fresh stage_sweep stage_big

run_stage() {
    local name=$1 later=0 seen=0 s
    for s in $ORDER; do
        if [ "$s" = "$name" ]; then seen=1; elif [ $seen = 1 ] && selected "$s"; then later=$((later + LEAST[$s])); fi
    done
    local left=$((BUDGET - (SECONDS - T0) - SUMMARY_S - later))
    local limit=${LIMIT[$name]}
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 10 ]; then
        echo "== $name: skipped, the budget is spent (${left}s left after the later stages' share)"
        printf '%s\tskipped (budget)\t0\t%s\t%s\n' "$name" "$limit" "${EXPECTED[$name]}" >>"$OUT/stages.tsv"
        return
    fi
    echo "== $name (limit ${limit}s; log $OUT/$name.log) $(date -u +%T)"
    local t=$SECONDS
    timeout -k 10 "$limit" bash -c "stage_$name" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]} status=ok
    [ "$rc" -ne 0 ] && status="rc $rc"
    [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && status="timed out"
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - t))" "$limit" "${EXPECTED[$name]}" >>"$OUT/stages.tsv"
    echo "== $name: $status in $((SECONDS - t)) s"
}

for stage in $ORDER; do
    selected "$stage" && run_stage "$stage"
done
for stage in $STAGES; do
    case " $ORDER " in *" $stage "*) ;; *) echo "unknown stage $stage (stages: $ORDER)" ;; esac
done

echo "== summary ($((SECONDS - T0)) s so far; $OUT/summary.md)"
timeout 60 "$PY" benchmarks/gpu_report.py "$OUT" $([ "$DRY" = 1 ] && echo --dry-run)
! grep -qv $'\tok\t' "$OUT/stages.tsv"
