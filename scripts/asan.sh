#!/usr/bin/env bash
# AddressSanitizer run: builds the pool extension and the simulated NPU with -fsanitize=address
# (setup.py honours ASCEND_POOL_SANITIZE=address) in a copy of the tree, so the normal in-place
# build is untouched, then runs the core tests under it with the simulator's poisoning on (freed
# device memory is filled with 0xDD, so a block the pool hands out after returning it reads as
# garbage in the tests' pattern checks), and prints a summary.
#
#   scripts/asan.sh                      # the core tests (list below)
#   scripts/asan.sh tests/test_pool_basic.py -k malloc   # any pytest arguments instead
#
# Environment: ASAN_DIR (default /tmp/ascend-pool-asan-$UID-<checksum of this checkout's path>)
# holds the copy, the build and the ASan logs (a second run of the same checkout waits for the
# first); ASAN_REBUILD=0 skips the build when the copy already has one.
# Exit status: 0 when the tests pass and ASan reported nothing, 1 otherwise.
set -u -o pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
. "$REPO/scripts/sanitizer_build.sh"
DIR="${ASAN_DIR:-$(sanitizer_default_dir asan)}"
SRC="$DIR/src"
LOGS="$DIR/logs"
sanitizer_lock asan.sh
# In the suite's own (alphabetical) order: test_backend_acl.py opens a second simulator instance,
# which must happen before the process holds device memory (see
# test_reliability_found_bugs.py::test_second_simulator_instance_in_a_process_keeps_the_node_accounting).
CORE_TESTS=(
    tests/test_backend_acl.py tests/test_backend_devices.py tests/test_backend_vmm.py tests/test_c_units.py tests/test_capi_errors.py
    tests/test_capi_hostpool.py tests/test_capi_symbols.py
    tests/test_containers.py
    tests/test_context_close.py tests/test_expandable.py tests/test_fork_safety.py tests/test_free_cache_merge.py
    tests/test_ledger_files.py tests/test_ledger_reclaim.py
    tests/test_pool_basic.py tests/test_pool_boundaries.py tests/test_pool_errors.py tests/test_pool_knobs.py tests/test_pool_oom.py
    tests/test_policy_bounds.py tests/test_pool_model.py tests/test_pool_property.py tests/test_pool_stateful_knobs.py
    tests/test_pool_stats_active.py tests/test_pool_threads_model.py
    tests/test_medium_segments.py
    tests/test_quota_context.py
    tests/test_reliability_faults.py
    tests/test_reliability_property.py tests/test_reliability_stress.py tests/test_replay.py
    tests/test_torch_semantics.py tests/test_torch_history.py
    tests/test_sim_ipc.py tests/test_sim_memory.py tests/test_sim_streams.py tests/test_snapshot_torch.py tests/test_stream_order.py
    tests/test_pool_sizes.py tests/test_pool_locking.py tests/test_stream_lifecycle.py tests/test_events_cann.py
    tests/test_stress_threads.py tests/test_stress_process.py tests/test_vmm_policy_bounds.py
    tests/test_stats_oversize.py tests/test_pool_lifecycle.py tests/test_sim_node.py tests/test_sim_node_users.py
    tests/test_sharing_users.py tests/test_close_races.py tests/test_wait_bounds.py tests/test_oom_observers.py
    tests/test_fuzz_sequences.py tests/test_backend_contexts.py
    tests/test_limit_small_room.py tests/test_stream_device_refs.py tests/test_ledger_guard.py
    tests/test_runtime_life.py tests/test_scale_streams.py tests/test_mempool_torch_semantics.py
)

start=$(date +%s)
LIBASAN="$(gcc -print-file-name=libasan.so)"
if [ ! -e "$LIBASAN" ]; then
    echo "asan.sh: gcc has no libasan.so ($LIBASAN); install libasan (e.g. apt-get install libasan8)" >&2
    exit 1
fi

# 1. A copy of the working tree (tracked and untracked, not ignored) -- never the in-place build.
#    A rebuild starts from scratch: setup.py does not track headers, so an incremental build
#    could keep objects compiled against old ones.
if [ "${ASAN_REBUILD:-1}" != 0 ]; then
    rm -rf "$SRC" "$DIR/build"
fi
mkdir -p "$SRC" "$LOGS"
rm -f "$LOGS"/asan.* "$LOGS"/selfcheck.*
sanitizer_copy_tree

# 2. The sanitized build.
if [ "${ASAN_REBUILD:-1}" != 0 ] || [ ! -e "$SRC/ascend_pool/_sim/libascendcl.so" ]; then
    sanitizer_build address asan.sh
fi
sanitizer_check_instrumented __asan_init asan.sh
built=$(date +%s)

# 3. The simulator's poisoning, on for every test: a pytest plugin in the copy that turns it on
#    whenever the simulated runtime is (re)initialised and before each test body.
cat >"$SRC/tests/_asan_poison.py" <<'EOF'
"""Loaded by scripts/asan.sh: keeps the simulator's poisoning of freed device memory on."""
import pytest

def _poison(on=True):
    try:
        from ascend_pool import sim

        sim.set_poison(on)
    except Exception:  # runtime not initialised yet: the backend hook below catches that moment
        pass


def pytest_configure(config):
    import ascend_pool.backend as backend

    opened = backend._open

    def _open(name, path):
        b = opened(name, path)
        if name == "sim":
            _poison()
        return b

    backend._open = _open


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    _poison()


def pytest_terminal_summary(terminalreporter):
    from ascend_pool import sim

    try:
        terminalreporter.write_line(f"asan.sh: simulator poisoned {sim.stats(0)['poisoned_bytes']} freed bytes "
                                    "on device 0 in this process")
    except Exception:
        pass
EOF

# 4. Self-check: an intentional heap overflow (the simulator copying 4096 bytes into a 64-byte
#    host buffer) must be reported, or this setup would prove nothing.
(cd "$SRC" && env LD_PRELOAD="$LIBASAN" ASAN_OPTIONS="detect_leaks=0:log_path=$LOGS/selfcheck" \
    PYTHONMALLOC=malloc PYTHONPATH="$SRC" ASCEND_SIM_NODE="asanself$$" ASCEND_SIM_SHM_DIR="$LOGS" \
    "$PY" -c "
import ctypes, ascend_pool as ap
from ascend_pool import sim
pool = ap.Pool(0, backend='sim')
x = pool.malloc(4096)
sim.attach().ascendsim_read(x, ctypes.create_string_buffer(64), 4096)
") >/dev/null 2>&1 9>&-
if cat "$LOGS"/selfcheck.* 2>/dev/null | grep "ERROR: AddressSanitizer: heap-buffer-overflow" >/dev/null; then
    selfcheck="caught (heap-buffer-overflow in ascendsim_read)"
else
    echo "asan.sh: self-check failed: an intentional overflow was not reported" >&2
    exit 1
fi
rm -f "$LOGS"/selfcheck.* "$LOGS"/ascendsim-*-asanself*

# 5. The tests, under ASan (reports go to $LOGS/asan.PID, children included).
if [ $# -gt 0 ]; then TESTS=("$@"); else TESTS=("${CORE_TESTS[@]}"); fi
echo "asan.sh: running ${#TESTS[@]} test path(s) under AddressSanitizer ..."
(cd "$SRC" && env LD_PRELOAD="$LIBASAN" \
    ASAN_OPTIONS="detect_leaks=0:log_path=$LOGS/asan:halt_on_error=1:abort_on_error=0" \
    PYTHONPATH="$SRC:$SRC/tests" PYTHONMALLOC=malloc \
    "$PY" -m pytest -q -p no:cacheprovider -p _asan_poison "${TESTS[@]}") >"$LOGS/pytest.log" 2>&1 9>&-
rc=$?
end=$(date +%s)

# 6. Summary.
reports=$(cat "$LOGS"/asan.* 2>/dev/null | grep -c "ERROR: AddressSanitizer" || true)
echo "----------------------------------------------------------------------------"
echo "asan.sh summary"
echo "  build:  $((built - start)) s   tests: $((end - built)) s   total: $((end - start)) s"
echo "  self-check: an intentional overflow was $selfcheck"
echo "  pytest: $(grep -E '^[0-9]+ (passed|failed)|^=+ .*(passed|failed|error)' "$LOGS/pytest.log" | tail -1)"
grep -E "^asan.sh: simulator poisoned" "$LOGS/pytest.log" | sed 's/^/  /'
echo "  AddressSanitizer reports: $reports  (logs: $LOGS/asan.*; pytest output: $LOGS/pytest.log)"
if [ "$reports" -gt 0 ]; then
    for f in "$LOGS"/asan.*; do
        echo "--- $f"
        grep -A25 "ERROR: AddressSanitizer" "$f" | head -40
    done
fi
if [ "$rc" -ne 0 ]; then
    grep -E "^(FAILED|ERROR) " "$LOGS/pytest.log" | head -20 | sed 's/^/  /'
    # A process killed by a signal (an AP_ASSERT's abort, a fatal Python error) writes no summary:
    # CI keeps only this script's output, so the end of pytest's (faulthandler's traceback
    # included) is shown here.
    echo "  pytest exit status $rc; the last lines of its output:"
    tail -60 "$LOGS/pytest.log" | sed 's/^/  | /'
fi
[ "$rc" -eq 0 ] && [ "$reports" -eq 0 ]
