/* The exported C ABI (declared in ascend_pool/include/ascend_pool.h, which documents each call).
 *
 * Hot path: ascend_pool_malloc / ascend_pool_free find the calling thread's current pool with
 * ap_current_get (a thread-local read checked against its pool's ticket, else an atomic load of
 * the default; core/current.h) and call the pool, which takes only its own mutex. No GIL, no
 * Python object, no registry. A context closed while current on this thread is never reached: the
 * call fails with NOT_READY (free still finds live pools' blocks through the registry).
 *
 * In a child forked after the runtime was opened, every entry point refuses first (apc_forked),
 * before any lock or pool: those are the parent's, and may be locked forever.
 *
 * The one place that takes the GIL: apc_create_default(), when a device has no pool yet. The pool
 * object (its config, its backend) is Python's, so the module installs a callback at import
 * (apc_set_hooks) and this code calls it between PyGILState_Ensure and PyGILState_Release. No lock
 * of ours is held while it waits for the GIL. Like any code that needs the GIL, that first call
 * waits while another thread holds it: a thread that holds the GIL and waits for such a C thread
 * would deadlock with it. ascend_pool_init(device), or any Python use of the device before the C
 * threads start, creates the pool up front so that they never need Python. From interpreter exit
 * on (atexit) no call takes the GIL, and exit waits for those on their way to it (apc_gil_enter).
 */
#ifndef APC_EXPORTS_H
#define APC_EXPORTS_H

#include <Python.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <time.h>

#include "ascend_pool.h"
#include "capi/last_error.h"
#include "capi/registry.h"
#include "current.h"
#include "pool.h"

/* Creates the default pool of device (strict: a device that does not exist is an error; else it
   is quietly skipped). Returns ASCEND_POOL_OK or a code with a message in msg. Called with the GIL
   held; must not raise. */
typedef int (*apc_create_fn)(int device, int strict, char *msg, size_t len);

static _Atomic(apc_create_fn) apc_create_hook; /* NULL before import and from interpreter exit on */

static void apc_gil_after_fork(void);

/* Installed by capi.pxi at import; NULL at exit (after that, no Python code may run for us). */
static void apc_set_hooks(apc_create_fn create) {
    static atomic_flag fork_handler = ATOMIC_FLAG_INIT;
    if (create && !atomic_flag_test_and_set(&fork_handler)) pthread_atfork(NULL, NULL, apc_gil_after_fork);
    atomic_store(&apc_create_hook, create);
}

static int apc_python_usable(void) {
#if PY_VERSION_HEX >= 0x030D0000
    return Py_IsInitialized() && !Py_IsFinalizing();
#else
    return Py_IsInitialized() && !_Py_IsFinalizing();
#endif
}

/* A C thread must never wait for the GIL once the interpreter finalizes: Python then ends it in
   take_gil with pthread_exit (3.11, 3.12; 3.14 hangs it for ever), a forced unwind that a noexcept
   C++ frame of the framework's caller turns into std::terminate: the process aborted at exit. The
   check above cannot see a finalization that starts while the thread waits for the GIL, so calls
   that take it count themselves here, and at exit (atexit, before finalization) apc_python_close
   turns new ones away and waits for those on their way to finish. Either a call's increment is
   seen by the close (which waits for it) or the close's flag by the call (which turns back):
   both sequentially consistent. */
static atomic_int apc_gil_calls;     /* calls between apc_gil_enter and apc_gil_leave */
static atomic_int apc_python_closed; /* set at interpreter exit: no call takes the GIL after it */
static _Thread_local int apc_gil_mine; /* this thread's share of apc_gil_calls */

/* 1 when the caller may take the GIL (then apc_gil_leave after PyGILState_Release), else 0. */
static int apc_gil_enter(void) {
    atomic_fetch_add(&apc_gil_calls, 1);
    if (!atomic_load(&apc_python_closed) && apc_python_usable()) {
        apc_gil_mine++;
        return 1;
    }
    atomic_fetch_sub(&apc_gil_calls, 1);
    return 0;
}

static void apc_gil_leave(void) {
    apc_gil_mine--;
    atomic_fetch_sub(&apc_gil_calls, 1);
}

/* A forked child has only the forking thread: the calls other threads had on their way to the GIL
   are not its own (its exit would wait for them), but the forking thread's own are (an
   out-of-memory observer that forks: the child returns through the call's apc_gil_leave, and
   counted from 0 it left -1, which its exit waited for, 10 s). */
static void apc_gil_after_fork(void) { atomic_store(&apc_gil_calls, apc_gil_mine); }

/* Called at interpreter exit without the GIL (so that calls waiting for it get it and finish):
   from now on no C ABI call takes the GIL; waits up to ms for those already on their way. */
static void apc_python_close(unsigned ms) {
    atomic_store(&apc_python_closed, 1);
    struct timespec tick = {0, 1000000L};
    for (unsigned waited = 0; atomic_load(&apc_gil_calls) != 0 && waited < ms; waited++) nanosleep(&tick, NULL);
}

/* Python frames for a framework's allocations (its tensors come through this ABI) while a pool
   records stacks (record_memory_history(stacks="python")): when the calling thread holds the GIL
   (a Python op that allocates), the hook (capi.pxi) files its frames for pool p, before the pool's
   lock is taken; a thread without it records no frames (never waits for the GIL here). With no
   pool recording stacks the cost is one relaxed load. */
typedef void (*apc_frames_fn)(ap_pool *p, int freeing);
static _Atomic(apc_frames_fn) apc_frames_hook; /* NULL before import and from interpreter exit on */
static atomic_int apc_pools_with_stacks;       /* pools recording stacks (capi.pxi counts them) */

static void apc_set_frames_hook(apc_frames_fn fn) { atomic_store(&apc_frames_hook, fn); }
static void apc_stacks_changed(int delta) { atomic_fetch_add(&apc_pools_with_stacks, delta); }

/* Returns 1 when frames were filed: the caller clears them after its pool call (ap_history_set_ctx(0)),
   as the Python paths do, so that a later call on this thread that files none records none. */
static inline int apc_note_frames(ap_pool *p, int freeing) {
    if (__builtin_expect(atomic_load_explicit(&apc_pools_with_stacks, memory_order_relaxed) == 0, 1)) return 0;
    apc_frames_fn fn = atomic_load(&apc_frames_hook);
    if (fn && apc_python_usable() && PyGILState_Check()) {
        fn(p, freeing);
        return 1;
    }
    ap_history_set_ctx(0); /* no frames: not this thread's earlier ones either */
    return 0;
}

/* Out-of-memory observers (capi/oom_observers.pxi: attach_out_of_memory_observer), told of a C ABI
   allocation that failed for want of memory, as torch's allocator tells its observers: the hook
   runs under the GIL (taken here: the slow path of a failed call), after the pool is let go and
   with no lock of ours held. With none attached the cost is one relaxed load. */
typedef void (*apc_oom_fn)(int device, size_t size, size_t allowed, size_t free_b);
static _Atomic(apc_oom_fn) apc_oom_hook; /* NULL before import and from interpreter exit on */
static atomic_int apc_oom_watchers;      /* observers attached (oom_observers.pxi counts them) */

static void apc_set_oom_hook(apc_oom_fn fn) { atomic_store(&apc_oom_hook, fn); }
static void apc_oom_watchers_set(int n) { atomic_store(&apc_oom_watchers, n); }

static inline int apc_oom_watched(int rc) {
    return (rc == AP_E_OOM || rc == AP_E_LIMIT || rc == AP_E_QUOTA) &&
           atomic_load_explicit(&apc_oom_watchers, memory_order_relaxed) != 0;
}

static void apc_notify_oom(int device, size_t size, size_t allowed, size_t free_b) {
    if (!apc_gil_enter()) return;
    apc_oom_fn fn = atomic_load(&apc_oom_hook);
    if (fn) {
        PyGILState_STATE gil = PyGILState_Ensure();
        fn(device, size, allowed, free_b);
        PyGILState_Release(gil);
    }
    apc_gil_leave();
}

/* The backend name ("acl", "sim", "cuda") of device's process default pool, or NULL if none. */
static const char *apc_default_backend_name(int device) {
    ap_pool *p = ap_default_get(device);
    return p ? p->backend->name : NULL;
}

/* 0 when device may exist, else sets the error. */
static int apc_check_device(int device, const char *call) {
    int count = atomic_load_explicit(&apc_device_count, memory_order_relaxed);
    if (device < 0 || device >= AP_MAX_DEVICES || (count > 0 && device >= count)) {
        if (count > 0)
            apc_fail(ASCEND_POOL_E_INVALID_DEVICE, "%s: device %d does not exist (devices 0..%d)", call, device,
                     count - 1);
        else
            apc_fail(ASCEND_POOL_E_INVALID_DEVICE, "%s: device %d does not exist", call, device);
        return -1;
    }
    return 0;
}

/* Runs the module's callback under the GIL. The rare path: once per device per process. */
static int apc_create_default(int device, int strict, const char *call) {
    apc_create_fn create = NULL;
    char msg[400] = "";
    int rc;
    int entered = apc_gil_enter();
    if (entered) create = atomic_load(&apc_create_hook);
    if (!create) {
        if (entered) apc_gil_leave();
        apc_fail(ASCEND_POOL_E_NOT_READY,
                 "%s: no pool for device %d, and none can be made: the ascend_pool Python module is not imported "
                 "in this process, or Python is shutting down (import ascend_pool first)",
                 call, device);
        return ASCEND_POOL_E_NOT_READY;
    }
    PyGILState_STATE gil = PyGILState_Ensure();
    rc = create(device, strict, msg, sizeof msg);
    PyGILState_Release(gil);
    apc_gil_leave();
    if (rc != ASCEND_POOL_OK) apc_fail(rc, "%s: creating the default pool of device %d failed: %s", call, device, msg);
    return rc;
}

/* 1 (error set) in a child forked after this process had opened the runtime: there, every entry
   point refuses before touching anything, since the pools and locks it would reach are copies of
   the parent's, possibly locked forever by a parent thread that was inside a call at the fork. */
static inline int apc_forked(const char *call) {
    if (__builtin_expect(atomic_load_explicit(&ap_forked_from, memory_order_relaxed) == 0, 1)) return 0;
    char why[512];
    ap_backend_forked_message(why, sizeof why);
    apc_fail(ASCEND_POOL_E_DEVICE, "%s: %s", call, why);
    return 1;
}

/* 1 (error set) when the calling thread's current context for device was closed: it must leave
   that context's `with` block (or make another current) rather than silently use the default. */
static int apc_current_closed(int device, const char *call) {
    char label[64];
    if (!ap_current_closed(device, label, sizeof label)) return 0;
    apc_fail(ASCEND_POOL_E_NOT_READY,
             "%s: %s, current on this thread for device %d, was closed; leave its `with` block (the default "
             "pool serves again) or make an open context current",
             call, label, device);
    return 1;
}

/* The calling thread's pool for device (owner: its cache owner, ap_current_cache_owner, the pool a
   use_mem_pool block is above), created (as the process default) when there is none, and held
   (ap_pool_hold: a close waits for the call; give it back with ap_pool_unhold). NULL with the
   error set on failure. */
static inline ap_pool *apc_pool_for_ex(int device, int owner, const char *call) {
    if (apc_forked(call)) return NULL;
    ap_pool *p = device < 0 || device >= AP_MAX_DEVICES ? NULL : ap_pool_hold_as(device, owner);
    if (__builtin_expect(p != NULL, 1)) return p;
    if (apc_check_device(device, call) != 0 || apc_current_closed(device, call) ||
        apc_create_default(device, 1, call) != ASCEND_POOL_OK)
        return NULL;
    p = ap_pool_hold_as(device, owner);
    if (!p) apc_fail(ASCEND_POOL_E_NOT_READY, "%s: the default pool of device %d was closed", call, device);
    return p;
}

static inline ap_pool *apc_pool_for(int device, const char *call) { return apc_pool_for_ex(device, 0, call); }

/* The allocation of ascend_pool_malloc and of torch's hook (apc_torch_malloc), size > 0. */
static inline __attribute__((always_inline)) void *apc_malloc(size_t size, int device, void *stream) {
    ap_error err;
    void *out = NULL;
    ap_pool *p = apc_pool_for(device, "ascend_pool_malloc");
    if (!p) return NULL;
    err.message[0] = 0;
    int framed = apc_note_frames(p, 0);
    int rc = ap_pool_malloc(p, size, stream, &out, &err);
    if (framed) ap_history_set_ctx(0);
    size_t allowed = 0, free_b = 0;
    int watched = __builtin_expect(rc != AP_OK, 0) && apc_oom_watched(rc);
    if (watched) ap_pool_oom_figures(p, &allowed, &free_b); /* while held; observers run after */
    ap_pool_unhold(p);
    if (__builtin_expect(rc != AP_OK, 0)) {
        /* observers first: their own calls (a snapshot, say) must not replace this call's error */
        if (watched) apc_notify_oom(device, size, allowed, free_b);
        apc_fail(rc, "ascend_pool_malloc(%zu bytes, device %d, stream %p): %s", size, device, stream, err.message);
        return NULL;
    }
    return out;
}

APC_EXPORT void *ascend_pool_malloc(ssize_t size, int device, void *stream) {
    if (__builtin_expect(size <= 0, 0)) {
        apc_fail(ASCEND_POOL_E_INVALID_SIZE, "ascend_pool_malloc: size must be positive, got %zd bytes", size);
        return NULL;
    }
    return apc_malloc((size_t)size, device, stream);
}

/* torch's alloc hook's allocation (torch_alloc.cpp, bound through _core's
   _capi_torch_malloc_address; not exported): torch's size_t, sizes from 2**63 on included, which
   the pool refuses as out of memory as every size past the device, counted (num_ooms, the oom
   trace), told to the OOM observers and set as the last error. ascend_pool_malloc's ssize_t holds
   none of them: the hook refused them itself, none of that done. */
static void *apc_torch_malloc(size_t size, int device, void *stream) {
    if (__builtin_expect(size == 0, 0)) {
        apc_fail(ASCEND_POOL_E_INVALID_SIZE, "ascend_pool_malloc: size must be positive, got 0 bytes");
        return NULL;
    }
    return apc_malloc(size, device, stream);
}

/* stream == NULL frees on the allocation stream; a stream the pool cannot order on frees there too,
   with the error set (a void call that nobody retries must not leak): see ascend_pool.h. */
APC_EXPORT void ascend_pool_free(void *ptr, ssize_t size, int device, void *stream) {
    ap_error err;
    int how = stream == NULL ? AP_FREE_ON_ALLOC_STREAM : AP_FREE_ON_STREAM_ELSE_ALLOC, rc = AP_E_INVALID_PTR;
    (void)size; /* the pool knows each block's size */
    if (!ptr || apc_forked("ascend_pool_free")) return;
    ap_pool *p = device >= 0 && device < AP_MAX_DEVICES ? ap_pool_hold(device) : NULL;
    int framed = 0;
    err.message[0] = 0;
    if (__builtin_expect(p != NULL, 1)) {
        framed = apc_note_frames(p, 1);
        rc = ap_pool_free(p, ptr, stream, how, &err);
        if (__builtin_expect(rc != AP_E_INVALID_PTR, 1)) { /* freed, or an error of its own */
            if (framed) ap_history_set_ctx(0);
            ap_pool_unhold(p);
            if (rc != AP_OK) apc_fail(rc, "ascend_pool_free(%p, device %d): %s", ptr, device, err.message);
            return;
        }
    } else if (apc_check_device(device, "ascend_pool_free") != 0) {
        return;
    }
    /* Not the current pool's: a block allocated while another context of this device was current.
       Found and held (registry.h), freed without the registry lock: the free may wait for a stream
       (no event to be had), and opening or closing a pool takes that lock with the GIL held. */
    ap_pool *owner = apc_find_hold(device, ptr, 0, p); /* p, still held, is skipped: it was asked */
    if (owner) {
        rc = ap_pool_free(owner, ptr, stream, how, &err);
        ap_pool_unhold(owner);
    }
    if (framed) ap_history_set_ctx(0);
    if (p) ap_pool_unhold(p); /* only its address is read below */
    if (owner && rc == AP_OK) return;
    if (owner || p)
        apc_fail(rc, "ascend_pool_free(%p, device %d): %s", ptr, device, err.message);
    else
        apc_fail(AP_E_INVALID_PTR, "ascend_pool_free(%p, device %d): no live pool of device %d allocated it", ptr,
                 device, device);
}

APC_EXPORT void ascend_pool_init(int device) {
    if (apc_forked("ascend_pool_init")) return;
    /* The process default, not this thread's current pool: called inside use_mem_pool or `with
       ctx:` (torch's lazy init at a first tensor made in a MemPool block), the thread's pool was
       taken for it and no default was made, so other threads still waited for the GIL at their
       first allocation. */
    if (device >= 0 && device < AP_MAX_DEVICES && ap_default_get(device)) return;
    apc_create_default(device, 0, "ascend_pool_init");
}

/* Holds (capi_calls: a close waits for them, registry.h) the registered pools, or with `peer_of`
   those of its device and backend but itself, under the registry lock, for work done without it:
   a pool's waits for busy streams (up to sync_timeout_ms) must not hold that lock, which opening
   or closing a pool (under the GIL) takes. Held through the waits, it froze the interpreter, and
   a stream that needed a Python thread to finish was never released. Returns the count (*out:
   malloc'ed, for the caller to unhold and free), or -1 without host memory. */
static ssize_t apc_hold_pools(ap_pool ***out, const ap_pool *peer_of, int (*keep)(ap_pool *q)) {
    pthread_mutex_lock(&apc_reg_lock);
    ssize_t n = 0;
    ap_pool **held = *out = apc_reg_n ? malloc(apc_reg_n * sizeof *held) : NULL;
    if (apc_reg_n && !held) n = -1;
    for (size_t i = 0; held && i < apc_reg_n; i++) {
        ap_pool *q = apc_entry_pool(&apc_reg[i]);
        if (!q || (peer_of && (q == peer_of || q->device != peer_of->device || q->backend != peer_of->backend)) ||
            (keep && !keep(q)))
            continue;
        atomic_fetch_add_explicit(&q->capi_calls, 1, memory_order_seq_cst);
        held[n++] = q;
    }
    pthread_mutex_unlock(&apc_reg_lock);
    return n;
}

/* ap_set_peer_release_hook's hook: the idle cache of the process's other pools of self's device
   and backend that mode names (pool.h AP_PEERS_*), given back (each held, not the registry lock,
   while it is released). A live MemPool made without use_on_oom keeps its own, as torch's OOM path
   never takes a live MemPool's cached blocks (it lends a use_on_oom one's); an orphan's goes, and
   so does a pool's for a tenant context made from it (one family: ap_pool.family). */
static size_t apc_release_peers(ap_pool *self, int mode) {
    ap_pool **held;
    size_t released = 0;
    ssize_t n = apc_hold_pools(&held, self, NULL);
    struct ap_device_cap *cap = __atomic_load_n(&self->device_cap, __ATOMIC_RELAXED);
    uint64_t family = atomic_load(&self->family);
    int lenders = mode & (AP_PEERS_NO_LENDERS | AP_PEERS_ONLY_LENDERS);
    mode &= ~(AP_PEERS_NO_LENDERS | AP_PEERS_ONLY_LENDERS);
    for (ssize_t i = 0; i < n; i++) {
        ap_pool *q = held[i];
        int orphan = atomic_load(&q->orphan);
        int kin = family != 0 && atomic_load(&q->family) == family;
        int gives = mode == AP_PEERS_ORPHANS ? orphan : orphan || kin || !atomic_load(&q->keeps_idle);
        if (mode == AP_PEERS_CAP && __atomic_load_n(&q->device_cap, __ATOMIC_RELAXED) != cap) gives = 0;
        /* a live use_on_oom MemPool lends the default pool a block in place before its cache goes */
        int lender = !orphan && !kin && atomic_load(&q->lends);
        if ((lenders == AP_PEERS_NO_LENDERS && lender) || (lenders == AP_PEERS_ONLY_LENDERS && !lender)) gives = 0;
        if (gives) released += ap_pool_release_idle(q);
        ap_pool_unhold(held[i]);
    }
    free(held);
    return released;
}

/* ap_set_peer_lend_hook's hook: a free block of one of the live use_on_oom MemPools of self's
   device and backend (torch's use_on_oom_pools, in the order the registry holds them), allocated
   there (ap_pool_lend) for self's request; each held, not the registry lock, while it is asked. */
static void *apc_lend_from_peers(ap_pool *self, size_t size, void *stream) {
    ap_pool **held;
    void *out = NULL;
    ssize_t n = apc_hold_pools(&held, self, NULL);
    for (ssize_t i = 0; i < n; i++) {
        ap_pool *q = held[i];
        if (!out && atomic_load(&q->lends) && !atomic_load(&q->orphan) && ap_pool_lend(q, size, stream, &out) != AP_OK)
            out = NULL;
        ap_pool_unhold(q);
    }
    free(held);
    return out;
}

/* The pools torch's emptyCache empties (release_cached_blocks with the default pool id): every
   device's default pool, and the private pools no longer in use (here: pools dropped with blocks
   still allocated, the registry's orphans). A live MemPool keeps its cache, whether or not made
   current by use_mem_pool, as do other threads' tenant contexts; the calling thread's own `with
   ctx:` context is its device's pool here, emptied as ap.empty_cache() empties it. */
static int apc_empties(ap_pool *q) {
    return ap_default_get(q->device) == q || atomic_load(&q->orphan) || ap_current_cache_owner(q->device) == q;
}

APC_EXPORT void ascend_pool_empty_cache(void) {
    ap_error err;
    int failed = 0;
    ap_pool **held;
    if (apc_forked("ascend_pool_empty_cache")) return;
    ssize_t n = apc_hold_pools(&held, NULL, apc_empties); /* emptied without the registry lock: they may wait */
    if (n < 0) {
        apc_fail(AP_E_HOST_NOMEM, "ascend_pool_empty_cache: host memory exhausted");
        return;
    }
    for (ssize_t i = 0; i < n; i++) {
        int rc = ap_pool_empty_cache(held[i], &err);
        if (rc != AP_OK && !failed) {
            failed = 1;
            apc_fail(rc, "ascend_pool_empty_cache: device %d: %s", held[i]->device, err.message);
        }
        ap_pool_unhold(held[i]);
    }
    free(held);
}

APC_EXPORT void ascend_pool_reset(bool check_error) {
    (void)check_error; /* torch_npu's flag; failures go to the last error either way */
    if (apc_forked("ascend_pool_reset")) return;
    ascend_pool_empty_cache();
}

APC_EXPORT void ascend_pool_set_memory_fraction(double fraction, int device) {
    ap_stats st;
    if (!(fraction >= 0.0 && fraction <= 1.0)) { /* also refuses NaN */
        /* the fewest digits that read back as the double: %g's 6 showed 1.0000001 as "got 1" */
        char shown[32];
        for (int prec = 6; prec <= 17; prec++) {
            snprintf(shown, sizeof shown, "%.*g", prec, fraction);
            if (fraction != fraction || strtod(shown, NULL) == fraction) break;
        }
        apc_fail(ASCEND_POOL_E_INVALID_ARG,
                 "ascend_pool_set_memory_fraction: device %d: fraction must be in [0, 1], got %s", device, shown);
        return;
    }
    /* the thread's context or the default, not a MemPool in use: torch's fraction caps the device */
    ap_pool *p = apc_pool_for_ex(device, 1, "ascend_pool_set_memory_fraction");
    if (!p) return;
    ap_pool_get_stats(p, &st);
    ap_pool_set_limit(p, (size_t)floor(fraction * (double)st.device_total_bytes));
    ap_pool_unhold(p);
}

/* The device whose current pool owned this thread's last record_stream block: asked first. */
static _Thread_local int apc_record_device;

typedef int (*apc_block_stream_op)(ap_pool *, void *, void *, ap_error *);

/* record_stream's and erase_stream's C ABI: find the pool of ptr, then op on it (if_own: the
   variant that answers AP_E_NOT_HERE for a block of another pool, op: the one that refuses it). */
static void apc_stream_mark(const char *name, void *ptr, void *stream, apc_block_stream_op if_own,
                            apc_block_stream_op op) {
    ap_error err;
    int rc = AP_E_INVALID_PTR;
    err.message[0] = 0;
    if (apc_forked(name)) return;
    /* Not told the device: the thread's current pool of each device is asked (a hash lookup each,
       as the C ABI's free asks its device's), the device that owned the last block first; only
       a block of none of them (a MemPool or context not current here) takes the registry's scan.
       That scan held and asked every registered pool: 1.3-1.7 us with 129 pools. */
    ap_pool *owner = NULL;
    int devices = atomic_load_explicit(&apc_device_count, memory_order_relaxed);
    if (devices > AP_MAX_DEVICES) devices = AP_MAX_DEVICES;
    for (int i = 0; ptr && i < devices && !owner; i++) {
        int d = i == 0 ? apc_record_device : i == apc_record_device ? 0 : i;
        ap_pool *p = d < devices ? ap_pool_hold(d) : NULL;
        if (!p) continue;
        rc = if_own(p, ptr, stream, &err);
        ap_pool_unhold(p);
        if (rc != AP_E_NOT_HERE) {
            owner = p; /* only compared with NULL below: it is not held any more */
            apc_record_device = d;
        }
    }
    if (ptr && !owner) {
        rc = AP_E_INVALID_PTR;
        owner = apc_find_hold(-1, ptr, 0, NULL); /* held, no registry lock */
        if (owner) {
            rc = op(owner, ptr, stream, &err);
            ap_pool_unhold(owner);
        }
    }
    if (!owner)
        apc_fail(AP_E_INVALID_PTR, "%s(%p): not a live block of any pool", name, ptr);
    else if (rc != AP_OK)
        apc_fail(rc, "%s(%p, stream %p): %s", name, ptr, stream, err.message);
}

APC_EXPORT void ascend_pool_record_stream(void *ptr, void *stream) {
    apc_stream_mark("ascend_pool_record_stream", ptr, stream, ap_pool_record_stream_if_own, ap_pool_record_stream);
}

/* torch_npu's erase_stream hook (NPUPluggableAllocator's set_erase_stream_fn): undoes a
   record_stream. Found as ascend_pool_record_stream finds the block's pool. */
APC_EXPORT void ascend_pool_erase_stream(void *ptr, void *stream) {
    apc_stream_mark("ascend_pool_erase_stream", ptr, stream, ap_pool_erase_stream_if_own, ap_pool_erase_stream);
}

APC_EXPORT void *ascend_pool_base_alloc(void *ptr, size_t *size) {
    uintptr_t a = (uintptr_t)ptr, base = 0;
    size_t seg_size = 0;
    if (!size) {
        apc_fail(ASCEND_POOL_E_INVALID_ARG, "ascend_pool_base_alloc: size must point to a size_t");
        return NULL;
    }
    *size = 0;
    if (apc_forked("ascend_pool_base_alloc")) return NULL;
    ap_pool *owner = ptr ? apc_find_hold(-1, ptr, 1, NULL) : NULL; /* held, no registry lock */
    if (owner) {
        /* The segment (one device allocation) holding the block: what an IPC handle is made of. */
        pthread_mutex_lock(&owner->lock);
        for (ap_segment *s = owner->segments; s; s = s->next)
            if (a >= s->base && a < s->base + s->size) {
                base = s->base;
                seg_size = s->size;
                break;
            }
        pthread_mutex_unlock(&owner->lock);
        ap_pool_unhold(owner);
    }
    if (!base) {
        apc_fail(AP_E_INVALID_PTR, "ascend_pool_base_alloc(%p): not inside a live block of any pool", ptr);
        return NULL;
    }
    *size = seg_size;
    return (void *)base;
}

#endif
