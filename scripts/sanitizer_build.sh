# Sourced by scripts/asan.sh and scripts/tsan.sh: the copy of the tree and the sanitized build they
# share. Expects REPO, DIR, SRC, LOGS and PY set by the caller.

# The default work directory for sanitizer $1 (asan|tsan): one per user and per checkout, so that
# runs from two clones on one machine never build into, or read the logs of, each other's copy.
sanitizer_default_dir() {
    echo "/tmp/ascend-pool-$1-$(id -u)-$(printf '%s' "$REPO" | cksum | cut -d' ' -f1)"
}

# Holds an exclusive lock on $DIR for the rest of the run (fd 9): a second run of the same
# checkout waits for the first instead of removing the copy it is testing. $1 names the caller.
# The callers run the tests with 9>&-: a process the tests leave behind must not hold the lock.
sanitizer_lock() {
    mkdir -p "$DIR"
    exec 9>"$DIR/.lock"
    if ! flock -n 9; then
        echo "$1: another run holds $DIR; waiting for it ..." >&2
        flock 9
    fi
}

# Copies the working tree (tracked and untracked, not ignored; never the in-place build) into $SRC.
sanitizer_copy_tree() {
    mkdir -p "$SRC"
    (cd "$REPO" && git ls-files -z --cached --others --exclude-standard) |
        (cd "$REPO" && while IFS= read -r -d '' f; do [ -f "$f" ] && printf '%s\0' "$f"; done) |
        (cd "$REPO" && tar --null -T - -cf -) | tar -xf - -C "$SRC"
}

# Builds the copy with ASCEND_POOL_SANITIZE=$1 (address|thread); $2 names the caller in messages.
# No -j: setup.py builds the simulator twice from the same sources into the same objects, the second
# time as the legacy runtime; in parallel the two builds would mix their objects.
sanitizer_build() {
    echo "$2: building with -fsanitize=$1 in $SRC ..."
    if ! (cd "$SRC" && ASCEND_POOL_SANITIZE="$1" "$PY" setup.py build_ext --inplace \
            --build-temp "$DIR/build" >"$LOGS/build.log" 2>&1); then
        tail -30 "$LOGS/build.log" >&2
        echo "$2: build failed (log: $LOGS/build.log)" >&2
        exit 1
    fi
}

# Exits unless the built extension and simulator carry the sanitizer's runtime symbol $1.
sanitizer_check_instrumented() {
    if ! nm -D "$SRC"/ascend_pool/_core*.so "$SRC"/ascend_pool/_sim/libascendcl.so | grep "$1" >/dev/null; then
        echo "$2: the built extension is not instrumented" >&2
        exit 1
    fi
}
