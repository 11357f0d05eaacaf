#!/usr/bin/env bash
# Every GPU check of the project in one short run, for the device machine (an NVIDIA GPU with
# PyTorch and CuPy installed, nothing to download): installs the package from this tree, then
#   1. the tests that need a CUDA device (tests/test_gpu_pool.py: stream-ordered reuse against
#      late kernels, record_stream, expandable segments on CUDA virtual memory, CUDA IPC sharing;
#      and the cuda-backend, pinned-host and VMM tests, which skip without a GPU elsewhere),
#   2. bench/gpu_integrations_check.py (torch's CUDAPluggableAllocator trains an MLP on our pool,
#      CuPy's allocator hook, numpy's pinned handler),
#   3. bench/gpu_bench.sh (the replays against PyTorch's caching allocator, cudaMallocAsync, CuPy).
# Results go to $OUT (default /tmp/gpu-session): env.txt, install.log, pytest.log,
# integrations.{log,json}, bench/. Exit status: 0 only when every step passed.
#
#   bash scripts/gpu_session.sh                 # whole session (about 6 minutes on an H200 machine)
#   BENCH_ARGS="--trace resnet18_train" bash scripts/gpu_session.sh
#   SKIP_BENCH=1 bash scripts/gpu_session.sh   # tests and integrations only (about 3 minutes)
#
# A setuptools >= 77 wheel in .whl/ (see bench/README.md) is installed first when the machine's
# is older: pyproject.toml's SPDX license field needs it.
set -u -o pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/gpu-session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
status=0

{ date -Is; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1; $PY -V;
  $PY -c "import setuptools, torch, cupy; print('setuptools', setuptools.__version__, 'torch', torch.__version__, 'cuda', torch.version.cuda, 'cupy', cupy.__version__)"; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if ! $PY -c "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 77)" && ls .whl/setuptools-*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps .whl/setuptools-*.whl >> "$OUT/install.log" 2>&1
fi
echo "== install"
if ! $PY -m pip install --no-build-isolation --no-deps --no-index . >> "$OUT/install.log" 2>&1; then
    tail -30 "$OUT/install.log"; exit 1
fi

echo "== GPU tests"
PYTHONSAFEPATH=1 timeout 300 $PY -m pytest -q -rs -p no:cacheprovider tests/test_gpu_pool.py tests/test_backend_cuda.py \
    tests/test_backend_host.py tests/test_backend_vmm.py tests/test_capi_symbols.py 2>&1 | tee "$OUT/pytest.log" || status=1

echo "== framework integrations"
PYTHONSAFEPATH=1 timeout 240 $PY bench/gpu_integrations_check.py --json "$OUT/integrations.json" 2>&1 \
    | tee "$OUT/integrations.log" || status=1

[ "${SKIP_BENCH:-0}" = 1 ] && exit $status
echo "== benchmark"
# shellcheck disable=SC2086
SKIP_BUILD=1 OUT="$OUT/bench" timeout 300 bash bench/gpu_bench.sh --micro-runs 3 ${BENCH_ARGS:-} || status=1
exit $status
