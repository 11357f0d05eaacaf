#!/usr/bin/env bash
# ThreadSanitizer run: builds the pool extension and the simulated NPU with -fsanitize=thread -O1 -g
# (setup.py honours ASCEND_POOL_SANITIZE=thread) in a copy of the tree, as scripts/asan.sh does,
# then runs the given tests or scripts with libtsan preloaded and prints the reports that touch
# the project's code.
#
#   scripts/tsan.sh build                                  # only the build
#   scripts/tsan.sh tests/test_stress_threads.py -k free   # pytest arguments
#   scripts/tsan.sh run repros/r01_x.py                    # any python script under TSan
#
# Environment: TSAN_DIR (default /tmp/ascend-pool-tsan-$UID-<checksum of this checkout's path>)
# holds the copy, the build and the logs (a second run of the same checkout waits for the
# first); TSAN_REBUILD=0 skips the build when the copy already has one.
# CPython and numpy are not instrumented: a report whose stacks are all inside libpython/numpy
# is noise; tsan.supp (written below) suppresses the interpreter's own, and the summary counts
# only reports that name a file of cython/ or ascend_pool/.
# Exit status: 0 when the run passes and TSan reported nothing in the project's code.
set -u -o pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
LIBTSAN="$(gcc -print-file-name=libtsan.so)"
. "$REPO/scripts/sanitizer_build.sh"
DIR="${TSAN_DIR:-$(sanitizer_default_dir tsan)}"
SRC="$DIR/src"
LOGS="$DIR/logs"
sanitizer_lock tsan.sh
if [ ! -e "$LIBTSAN" ]; then
    echo "tsan.sh: gcc has no libtsan.so; install libtsan (e.g. apt-get install libtsan2)" >&2
    exit 1
fi

mkdir -p "$SRC" "$LOGS"
if [ "${TSAN_REBUILD:-1}" != 0 ] || [ ! -e "$SRC/ascend_pool/_sim/libascendcl.so" ]; then
    rm -rf "$SRC" "$DIR/build"
    sanitizer_copy_tree
    sanitizer_build thread tsan.sh
    sanitizer_check_instrumented __tsan_init tsan.sh
fi
cat >"$DIR/tsan.supp" <<'SUPP'
# The interpreter and numpy are not instrumented: their own accesses look racy. (The GIL itself is
# seen: its pthread calls are intercepted, so no called_from_lib for libpython.)
race:libpython*
race:_PyEval*
race:PyObject_*
race:_multiarray_umath*
race:*/Modules/*
race:*/Objects/*
race:*/Python/*
# (The simulator's device memory, which its stream threads fill, is not instrumented in this
# build: cython/sim/sim_internal.h sim_dev_memset.)
# glibc frees a dlopen()ed library's dynamic TLS at thread exit: TSan does not order that free
# after the exited thread's own writes (a known false positive).
race:_dl_deallocate_tls
race:__GI__dl_deallocate_tls
SUPP
[ "${1:-}" = build ] && exit 0

rm -f "$LOGS"/tsan.*
# (exitcode=0: a test's child process must not fail for a report, the summary below counts them;
# handle_segv=0 handle_sigbus=0: tests that expect a process to die of SIGSEGV/SIGBUS, and the
# ledger's SIGBUS guard, see the kernel's signal, not TSan's handler)
TSAN_ENV=(LD_PRELOAD="$LIBTSAN" PYTHONPATH="$SRC:$SRC/tests" PYTHONMALLOC=malloc
    TSAN_OPTIONS="halt_on_error=0 exitcode=0 handle_segv=0 handle_sigbus=0 second_deadlock_stack=1 report_signal_unsafe=0 history_size=4 suppressions=$DIR/tsan.supp log_path=$LOGS/tsan ${TSAN_EXTRA:-}")
if [ "${1:-}" = run ]; then
    shift
    (cd "$SRC" && env "${TSAN_ENV[@]}" timeout "${TSAN_TIMEOUT:-600}" "$PY" "$@") 9>&-
else
    (cd "$SRC" && env "${TSAN_ENV[@]}" timeout "${TSAN_TIMEOUT:-1200}" "$PY" -m pytest -q -p no:cacheprovider "$@") 9>&-
fi
rc=$?
# A report counts when its SUMMARY (the top frame of the first access) is in the project's code.
reports=$(cat "$LOGS"/tsan.* 2>/dev/null | grep -E "^SUMMARY: ThreadSanitizer" | grep -cE "cython/|ascend_pool/" || true)
echo "tsan.sh: reports by kind and place (logs: $LOGS/tsan.*):"
cat "$LOGS"/tsan.* 2>/dev/null | grep -E "^SUMMARY: ThreadSanitizer" | sort | uniq -c | sort -rn | sed 's/^/  /'
echo "tsan.sh: exit $rc, reports in the project's code: $reports"
[ "$rc" -eq 0 ] && [ "$reports" -eq 0 ]
