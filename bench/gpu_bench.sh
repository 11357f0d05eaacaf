#!/usr/bin/env bash
# The benchmark on a CUDA GPU, in one short script (for the device machine: run from the repository
# root; it builds the extension there, then runs `ascend-pool bench --backend cuda`).
#
#   OUT=/some/dir TRACES=/path/to/traces bash bench/gpu_bench.sh [extra bench options...]
#
# OUT     where the results go (default: $OUT of the device machine, else bench/results/gpu-DATE)
# TRACES  trace directory (default: ../shared/traces when present, else bench/shared_traces when
#         present -- a copy of the shared traces placed in the tree so that it travels with it --
#         else the traces bundled with the package)
#
# Writes: env.txt (GPU, driver, torch/cupy/rmm versions), build.log, bench_cuda.json,
# bench_cuda.md, bench.stderr. Peers that are not installed are skipped with their reason (in
# the JSON, the markdown and bench.stderr). Budget: about 1-2 min to build, 2-5 min to run on the
# shared traces (the 1.2 M-event llama trace dominates: direct mode calls cudaMalloc/cudaFree
# 1.2 M times, and the Python-loop peers replay it too); pass `--trace NAME` options to run fewer.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}  # the device machine has python3 only
OUT=${OUT:-bench/results/gpu-$(date +%Y%m%d)}
mkdir -p "$OUT"

if [ -z "${TRACES:-}" ]; then
    if [ -d ../shared/traces ]; then TRACES=../shared/traces
    elif [ -d bench/shared_traces ]; then TRACES=bench/shared_traces
    else TRACES=ascend_pool/traces
    fi
fi

{
    date -Is
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
    $PY -V 2>&1
    for m in numpy Cython torch cupy rmm; do
        $PY -c "import $m; print('$m', $m.__version__)" 2>&1 | tail -1
    done
    $PY -c "import torch; print('torch cuda', torch.version.cuda, 'available', torch.cuda.is_available())" 2>&1 | tail -1
    echo "traces: $TRACES"
} > "$OUT/env.txt"
cat "$OUT/env.txt"

if [ "${SKIP_BUILD:-0}" = 1 ]; then
    echo "using the installed ascend_pool (SKIP_BUILD=1)"
    RUN=(env PYTHONSAFEPATH=1 "$PY" -m ascend_pool.cli)  # not the source tree in the cwd
else
echo "building the extension..."
RUN=(env "PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m ascend_pool.cli)
if ! $PY setup.py build_ext --inplace --build-temp /tmp/build-gpu-bench -j "$(nproc)" > "$OUT/build.log" 2>&1; then
    # older setuptools: no -j
    $PY setup.py build_ext --inplace --build-temp /tmp/build-gpu-bench > "$OUT/build.log" 2>&1 || {
        tail -40 "$OUT/build.log"; exit 1; }
fi
fi

echo "running the benchmark..."
"${RUN[@]}" bench --backend cuda --traces "$TRACES" \
    --json "$OUT/bench_cuda.json" --markdown "$OUT/bench_cuda.md" --no-progress "$@" 2> "$OUT/bench.stderr"
rc=$?
cat "$OUT/bench.stderr"
[ -f "$OUT/bench_cuda.md" ] && cat "$OUT/bench_cuda.md"
exit $rc
