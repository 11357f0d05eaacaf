/* Internal types and functions shared by the simulator's source files. Nothing here is exported.
 *
 * Layout (one concept per file):
 *   errmsg.c   per-thread error message (aclGetRecentErrMsg)     clock.c    time, sleeps, deadlines
 *   units.c    byte-size parsing ("64GiB")                      config.c   environment -> sim_config
 *   registry.c live handles (streams, events, contexts)         proc.c     process identity/liveness
 *   node.c     node-wide capacity in shared memory              dmem.c     mapped allocations
 *   memory.c   aclrtMalloc/Free/GetMemInfo                      host.c     aclrtMallocHost/FreeHost
 *   stream.c   streams and their FIFO workers                   event.c    events
 *   context.c  contexts, the thread's current device            device.c   aclInit/Finalize, devices
 *   faults.c   fault injection and latency                      control.c  ascendsim_* API
 *   vmm.c      virtual memory: reservations, physical handles, maps
 *   foreign.c  other users' node records (node_record.h: the record's layout)
 *   ipc.c      sharing device memory between processes (aclrtIpcMem*)
 */
#ifndef ASCEND_SIM_INTERNAL_H
#define ASCEND_SIM_INTERNAL_H

#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include "acl_api.h"

/* Device memory as the simulated kernels and copies touch it. In a ThreadSanitizer build
   (setup.py: ASCEND_POOL_SANITIZE=thread) these accesses are not instrumented: they model the
   device, not host code, and two streams writing one block is legal there (record_stream); the
   tests' byte patterns catch a block reused too early. Instrumented, every such fill was a race
   report that TSan symbolized to match its suppression, slowing a 3 MiB fill to seconds and the
   stress tests' streams past their 60 s waits. Elsewhere: plain memset/memcpy. */
#if defined(ASCEND_POOL_TSAN)
__attribute__((no_sanitize_thread, noinline)) static void sim_dev_memset(void *dst, int v, size_t n)
{
    volatile unsigned char *d = dst;
    for (size_t i = 0; i < n; i++)
        d[i] = (unsigned char)v;
}
__attribute__((no_sanitize_thread, noinline)) static void sim_dev_memcpy(void *dst, const void *src, size_t n)
{
    volatile unsigned char *d = dst;
    const volatile unsigned char *s = src;
    for (size_t i = 0; i < n; i++)
        d[i] = s[i];
}
#else
#define sim_dev_memset memset
#define sim_dev_memcpy memcpy
#endif

#define SIM_MAX_DEVICES 64
#define SIM_MAX_EVENTS_PER_DEVICE 65536
#define SIM_BASE_ALIGN 64                      /* device allocation bases, like the real runtime */
#define SIM_HUGE_PAGE ((size_t)2 << 20)        /* madvise(MADV_HUGEPAGE) from this size up */
#define SIM_DEFAULT_DEVICES 8
#define SIM_DEFAULT_HBM ((uint64_t)64 << 30)   /* an Atlas 800T A2 device */
#define SIM_NODE_NAME_MAX 64

/* ---- config.c ---- */
/* ---- errmsg.c ---- */
/* Records "<call>: <message> (aclError <code>)" as the calling thread's recent error; returns code. */
int sim_fail(int code, const char *call, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* ---- clock.c ---- */
uint64_t sim_now_ns(void); /* CLOCK_MONOTONIC */
/* Waits `us` microseconds: spinning below 100 us (sleeps are too coarse there), sleeping above. */
void sim_delay_us(uint64_t us);
void sim_sleep_ns(uint64_t ns);
/* Absolute CLOCK_MONOTONIC deadline `ms` milliseconds from now, for pthread_cond_timedwait. */
void sim_deadline_ms(struct timespec *ts, int64_t ms);
/* Initialises a condition variable that waits on CLOCK_MONOTONIC (immune to clock changes). */
int sim_cond_init(pthread_cond_t *cv);

/* ---- units.c ---- */
int sim_parse_size(const char *text, uint64_t *bytes); /* 0 ok, -1 malformed/overflow */

/* ---- config.c ---- */
/* The documented rules of one CANN generation or SoC (docs/cann-rules.md has each rule's source).
   strict, the default, is an Atlas A2 (910B) card under the rules of every CANN version. */
struct sim_profile {
    char name[16];               /* strict | cann8.0 | cann8.2 | cann8.3 | 310p | 950 */
    char soc_name[32];           /* what aclrtGetSocName answers */
    uint32_t event_limit;        /* synchronizing events per device: 65536, 1023 on 310P */
    int reserve_flags_match;     /* CANN 8.0.x: aclrtReserveMemAddress flags = page type mapped */
    int malloc_pad;              /* aclrtMalloc adds 32 bytes after rounding (not on 950) */
    int event_ex;                /* aclrtCreateEventExWithFlag works (else 207000, as a runtime
                                    that exports it without the feature) */
    uint32_t stream_limit;       /* streams per device, default streams included: 1984 on A2/A3 and
                                    950 (2048 in CANN 8.0's pages), 1024 on 310P */
    int ddr_device;              /* the device's memory is DDR, no HBM (310P): aclrtGetMemInfo answers
                                    it for the DDR attributes and converts HBM ones to them */
    int device_ipc_events;       /* ACL_EVENT_DEVICE_USE_ONLY and ACL_EVENT_IPC events exist (A2, A3,
                                    950; not 310P: 207000, CANN's aclrtCreateEvent[Ex]WithFlag pages) */
    int ipc_flags_reserved;      /* CANN 8.2.RC1 / 8.3.RC1alpha001 pages: the flags of
                                    aclrtIpcMemGetExportKey and aclrtIpcMemImportByKey are reserved,
                                    "fixed to 0": anything else answers 107000 */
};
struct sim_config {
    int devices;                 /* this process's devices (ASCEND_RT_VISIBLE_DEVICES, else the node's) */
    int phys[SIM_MAX_DEVICES];   /* the node's device behind each of them (its records: node.c, ipc.c) */
    uint64_t hbm;                /* bytes per device */
    uint64_t malloc_latency_us;
    uint64_t free_latency_us;
    uint64_t fail_malloc_nth;    /* 0: off */
    int64_t fail_after_bytes;    /* < 0: off */
    uint64_t host_pinned;        /* ASCEND_SIM_HOST_PINNED: host bytes aclrtMallocHost may pin */
    char node[SIM_NODE_NAME_MAX + 1];
    char shm_dir[PATH_MAX];
    struct sim_profile profile;  /* ASCEND_SIM_PROFILE: which documented rules apply */
};
/* Fills cfg from the environment (and the ascendsim_configure overrides). On a bad value returns
   ACL_ERROR_INVALID_PARAM with the message naming the variable, for `call`. */
int sim_config_load(struct sim_config *cfg, const char *call);
/* Devices only (aclrtGetDeviceCount works before aclInit, as the real one does): the count this
   process sees and (phys, when not NULL) the node device behind each. */
int sim_config_devices(int *devices, int *phys, const char *call);
/* The logical device of this process behind node device phys, or -1 when it does not see it. */
int sim_logical_device(int phys);
/* Synchronizing events a device may hold at once under the active profile (65536; 1023 on 310p).
   event.c refuses more with ACL_ERROR_RT_NO_EVENT_RESOURCE. */
int sim_event_limit(int device);

/* ---- registry.c: every live handle, so a garbage pointer is never dereferenced ---- */
enum { SIM_H_STREAM = 1, SIM_H_EVENT = 2, SIM_H_CONTEXT = 3, SIM_H_PHYS = 4 };
struct sim_obj {
    uint32_t type;
    _Atomic uint32_t refs;       /* the registry's reference + one per user in flight */
    uintptr_t handle;            /* what users hold: never reused, never a valid address */
    struct sim_obj *hnext;       /* hash chain */
    void (*destroy)(struct sim_obj *);
};
#define SIM_HANDLE(o) ((void *)(o)->handle)
void sim_obj_init(struct sim_obj *o, uint32_t type, void (*destroy)(struct sim_obj *));
void sim_obj_ref(struct sim_obj *o);
void sim_obj_unref(struct sim_obj *o);
int sim_reg_add(struct sim_obj *o);                              /* assigns o->handle; 0, or -1 */
struct sim_obj *sim_reg_get(const void *handle, uint32_t type);  /* +1 ref, or NULL */
struct sim_obj *sim_reg_take(const void *handle, uint32_t type); /* unregisters; caller owns ref */
/* Unregisters every object (for aclFinalize); *out gets a malloc'ed array the caller owns. */
size_t sim_reg_take_all(struct sim_obj ***out);
/* The live objects of `type` that match(o, arg), each referenced (the caller puts them and frees
   *out); 0 and *out NULL when none match or memory is short. */
size_t sim_reg_get_matching(uint32_t type, int (*match)(struct sim_obj *o, void *arg), void *arg,
                            struct sim_obj ***out);
void sim_reg_reset(void); /* fork child: forget everything (the parent's objects leak) */

/* ---- proc.c ---- */
uint64_t sim_proc_start_time(int pid); /* /proc/PID/stat field 22; 0 if unknown */
/* The directory of the node records (each aclInit's $ASCEND_SIM_SHM_DIR): leases live there. */
void sim_proc_use_dir(const char *dir);
/* This process's lease id (random, non-zero; its lease file is held from the first call). */
uint64_t sim_proc_self_id(void);
/* 0 when this process holds its leases (private and public) in the directory of the last
   sim_proc_use_dir, trying again to make them if an earlier try failed; else
   ACL_ERROR_RT_RESOURCE_ALLOC_FAIL with a message naming the file and errno. Whatever names this
   process in a shared record must succeed here first: without its leases it is dead to others. */
int sim_proc_lease_ready(const char *call);
/* Removes what this user's processes killed in dir left behind: leases being made (unlocked,
   over a minute old), node and IPC records being made (their maker's lease dead), and dead
   leases no record names any more. Best effort, at attach. */
void sim_proc_sweep_abandoned(const char *dir);
/* 1 alive (the lease of id is held), 0 dead, -1 cannot tell. pid is only a label. */
int sim_proc_alive(int pid, uint64_t id);
/* For another user's slot (foreign.c): 1 when the public lease of uid's process id is held, 0 when
   it is not (or is no file of that uid), -1 cannot tell. Never removes anything. */
int sim_proc_foreign_alive(unsigned uid, uint64_t id, int life_fd);
/* A process's life lock on a node record it has a slot in (node.c): an exclusive lock (F_OFD_SETLK,
   F_WRLCK: only a process that may write the record, its owner user's, can take one) on one byte
   named by its lease id, past the record's data; the kernel drops it when the process dies, in any
   namespace, as it drops a lease. It proves the process alive when its lease files were removed
   under it (a cleanup of /dev/shm, an init container): before 2026-12-05 its slot was then
   reclaimed, or skipped by other users' sums, and its device memory handed out again. 0 when
   taken on fd (the record open for writing), else -1 (the lease alone tells then). */
int sim_proc_life_hold(int fd);
void sim_proc_fork_window_enter(void); /* no fork until leave: around a life descriptor's open and registration */
void sim_proc_fork_window_leave(void);
/* 1 when a process holds the life lock of lease id on the record open as fd (any descriptor of
   it, read-only included), 0 when none does, -1 when it cannot be told (fd < 0). */
int sim_proc_life_held(int fd, uint64_t id);
/* 1 when this process runs in a user namespace other than the initial one (/proc/self/uid_map is
   not the identity "0 0 4294967295"), its map's lines ("inside outside count", joined by "; ")
   in map and the uid its geteuid() maps to outside in *outside (-1 when the map leaves it out);
   0 otherwise or when it cannot tell. From the map read once (../common/host_ids.h). */
int sim_proc_user_namespace(char *map, size_t len, long *outside);
/* 1 when this process runs in a user namespace as the overflow uid: files of owners its map leaves
   out show as its own uid, so an ownership check cannot tell them apart (device.c warns). */
int sim_proc_runs_as_overflow_uid(void);
/* This process's host uid (../common/host_ids.h: geteuid() through /proc/self/uid_map, read once):
   what node records, leases and IPC files are named by and record, so that one host user's
   processes inside and outside a user namespace share them. */
unsigned sim_host_uid(void);
/* 1 when a file owned by st_uid (fstat's: this namespace's view) belongs to the host's uid `host`:
   this user's own when st_uid == geteuid(), untranslated; another's through the uid map. */
int sim_owned_by(unsigned st_uid, unsigned host);
/* The inode of this process's pid namespace (0 if unknown). */
uint64_t sim_proc_pidns(void);
/* As sim_proc_alive, and for an owner of *our* pid namespace (pidns equal, /proc ours) a pid that
   is gone or a zombie is dead at once, before its lease drops (start_time: a label only). */
int sim_proc_owner_alive(int pid, uint64_t id, uint64_t pidns, uint64_t start_time, int life_fd);
/* A lock in a shared record between the processes of this user on the node (node.c, ipc.c):
   `word` holds the holder's lease id, 0 when free. Not a robust pthread mutex: those name their
   holder by thread id, which pid namespaces repeat (every container's first process is pid 1),
   so a waiter dying in one namespace made the kernel mark a live holder of the same id in another
   dead, and two processes entered at once. A waiter checks the holder's lease (dropped by the
   kernel at death, in any namespace) every 50 ms and takes a dead holder's lock over
   (*took_over = 1). Threads of one process exclude each other through the same word. 0, or
   ETIMEDOUT after timeout_s seconds. */
int sim_proc_lock(_Atomic uint64_t *word, int timeout_s, int *took_over, int life_fd);
void sim_proc_unlock(_Atomic uint64_t *word);
/* The node-level process id aclrtDeviceGetBareTgid answers (never a getpid() value). */
int32_t sim_proc_bare_tgid(void);

/* ---- node.c: capacity shared by the processes (of every user) of a simulated node ---- */
int sim_node_attach(int dev, const struct sim_config *cfg, const char *call);
void sim_node_detach(int dev);
/* Takes bytes from the device's node-wide capacity for this process: 0, or 1 when it would
   exceed the total (after reclaiming dead processes' bytes), or -1 on an internal error. */
int sim_node_reserve(int dev, uint64_t bytes);
void sim_node_release(int dev, uint64_t bytes);
/* Charges a device allocation of bytes (aclrtMalloc, aclrtMallocPhysical) to this process and
   the node, after the injected faults (latency, nth malloc, byte cap): 0, or the runtime's code
   with the error set. sim_uncharge gives the bytes back. (memory.c) */
int sim_charge(int dev, size_t bytes, const char *call);
void sim_uncharge(int dev, size_t bytes);
/* Bytes held on the device by every live process of the node, this user's and other users' (this
   user's dead ones are reclaimed first, other users' dead ones skipped). */
uint64_t sim_node_used(int dev);
void sim_node_reset(void); /* fork child */

/* ---- dmem.c: mapped allocations, looked up by address range ---- */
struct sim_alloc {
    uintptr_t base;
    size_t size;         /* the rounded (and padded) size: the extent reads/fills may touch */
    size_t charged;      /* aclrtMalloc's: device bytes it takes, size in whole 2 MiB pages when huge */
    void *map;
    size_t map_len;
    int device;          /* -1 for host memory */
    uint32_t pins;       /* in-flight reads/fills; guarded by the tree's lock */
    int freed;           /* unmapped by the last unpin */
    int poison;          /* fill with 0xDD before unmapping */
    int tree;            /* the tree it was inserted in (whose lock guards pins) */
    int read_only;       /* mapped PROT_READ (an import of a read-only export): fills are refused */
};
/* SIM_TREE_VMM holds the VMM reservations (vmm.c): a pin of device memory that is not an
   aclrtMalloc allocation succeeds when the range lies in one reservation and every page of it is
   mapped (sim_vmm_covered); the pin is then on the reservation.
   SIM_TREE_IPC holds the memory this process imported from another one (ipc.c): a device pin
   that finds neither of the above looks there, and succeeds while the exporter still shares the
   memory (sim_ipc_usable). */
enum { SIM_TREE_DEVICE = 0, SIM_TREE_HOST = 1, SIM_TREE_VMM = 2, SIM_TREE_IPC = 3, SIM_TREE_COUNT = 4 };
/* Maps `size` bytes (alignment `align`, huge pages advised when huge != 0). NULL on failure. */
struct sim_alloc *sim_alloc_map(size_t size, size_t align, int huge);
void sim_alloc_unmap(struct sim_alloc *a);
void sim_alloc_insert(int tree, struct sim_alloc *a);
struct sim_alloc *sim_alloc_remove(int tree, const void *base); /* exact base, or NULL */
/* Pins the allocation containing [ptr, ptr+n) so it stays mapped; NULL if no live one does. */
struct sim_alloc *sim_alloc_pin(int tree, const void *ptr, size_t n);
void sim_alloc_unpin(int tree, struct sim_alloc *a);
/* Unmaps now, or when the last pin goes. */
void sim_alloc_release(int tree, struct sim_alloc *a);
/* The entry containing [ptr, ptr+n) (n 0 counts as 1), without pinning it: the caller must keep it
   alive otherwise (vmm.c: its own lock serialises every insert and remove of SIM_TREE_VMM). */
struct sim_alloc *sim_alloc_lookup(int tree, const void *ptr, size_t n);
/* Waits (polling) until no read or fill holds a pin on `a`. The caller first makes new pins of the
   memory in question fail: removes `a` from its tree, or (a reservation) clears those pages under
   the tree's lock; pins elsewhere in the reservation only make the wait longer. */
void sim_alloc_wait_unpinned(struct sim_alloc *a);
/* The lock that guards a tree and its entries' pins (vmm.c changes what pins check under it). */
void sim_alloc_lock(int tree);
void sim_alloc_unlock(int tree);
size_t sim_alloc_take_all(int tree, struct sim_alloc ***out);
void sim_alloc_reset(void); /* fork child */

/* ---- faults.c ---- */
void sim_faults_from_config(const struct sim_config *cfg);
void sim_faults_reset(void);
int sim_fault_malloc_nth(void);        /* 1: this malloc must fail */
int sim_fault_event_create_nth(void);
int sim_fault_event_query_nth(void);
int64_t sim_fault_after_bytes(void);   /* < 0: off */
void sim_fault_malloc_latency(void);
void sim_fault_free_latency(void);
void sim_faults_set_malloc_nth(uint64_t n);
void sim_faults_set_event_create_nth(uint64_t n);
void sim_faults_set_event_query_nth(uint64_t n);
void sim_faults_set_after_bytes(int64_t bytes);
void sim_faults_set_malloc_latency(uint64_t us);
void sim_faults_set_free_latency(uint64_t us);

/* ---- vmm.c ---- */
/* 1 when every page of [p, p+n) in reservation `resv` (a SIM_TREE_VMM entry) is mapped. Called by
   dmem.c with SIM_TREE_VMM's lock held. */
int sim_vmm_covered(const struct sim_alloc *resv, uintptr_t p, size_t n);
/* aclFinalize, after the streams are gone: unmaps and frees everything, closes the backing files. */
void sim_vmm_finalize(void);
/* Per-device counters, in the order of the last SIM_VMM_NSTATS fields of ascendsim_stats_fields. */
#define SIM_VMM_NSTATS 6
void sim_vmm_stats(int dev, uint64_t out[SIM_VMM_NSTATS]);

/* ---- ipc.c ---- */
/* aclrtFree's hook. Call with sim_ipc_lock() held, before removing the allocation at devPtr:
   returns 0 when it may be freed (closing its exports when no live process imports them), or
   ACL_ERROR_RT_IPC_ERROR (recorded for `call`) when another process still imports part of it. */
void sim_ipc_lock(void);
void sim_ipc_unlock(void);
int sim_ipc_free_check(const void *devPtr, const char *call);
/* 1 when an entry of SIM_TREE_IPC may be read or filled: its exporter is alive and still shares
   it. Called by dmem.c on a pinned entry. */
int sim_ipc_usable(const struct sim_alloc *a);
/* For ascendsim_read/launch_fill after a failed pin: when [ptr, ptr+n) is imported memory that is
   no longer usable, records why and returns ACL_ERROR_RT_IPC_ERROR; else 0. */
int sim_ipc_explain(const void *ptr, size_t n, const char *call);
/* For ascendsim_launch_fill on a pinned entry `a` with a->read_only: records why the write is
   refused (naming the key and its exporter) and returns ACL_ERROR_RT_NO_PERMISSION. */
int sim_ipc_refuse_write(const struct sim_alloc *a, const void *ptr, size_t n, const char *call);
/* aclFinalize, after the streams are gone: closes this process's imports and exports. */
void sim_ipc_finalize(void);

/* ---- stream.c ---- */
enum { SIM_W_FILL = 1, SIM_W_WAIT = 2, SIM_W_HANG = 3 };
struct sim_stream;
struct sim_work {
    struct sim_work *next;
    int kind;
    void *ptr;                 /* fill */
    size_t n;
    int value;
    uint64_t delay_us;
    struct sim_stream *wait_on; /* wait: a reference, dropped when the item is done */
    uint64_t wait_pos;          /* wait: until wait_on has completed this many items */
    uint64_t hang_id;           /* hang: until the stream's released hang id reaches it */
};
struct sim_stream {
    struct sim_obj obj;
    int device;
    int is_default;
    struct sim_context *ctx;    /* the context it was created in (a reference held); NULL: a default stream */
    pthread_mutex_t mu;
    pthread_cond_t work_cv;     /* worker: new work, release, exit */
    pthread_cond_t done_cv;     /* waiters: `completed` moved */
    struct sim_work *head, *tail;
    uint64_t submitted, completed; /* item counts: an item's position is submitted after it */
    uint64_t hangs_requested, hangs_released;
    int closed;                 /* destroy started: no new work */
    int force;                  /* aclrtDestroyStreamForce: a hung item is abandoned */
    int exit;
    int has_thread;
    pthread_t thread;
};
/* Resolves a user handle (NULL: the current device's default stream) to a referenced stream. */
int sim_stream_get(aclrtStream handle, const char *call, struct sim_stream **out);
/* The same for the calls CANN runs only in the stream's own context (record, wait, reset,
   destroy): a created stream also needs the thread's current context to be the one it was
   created in (107002 with none, 107003 with another; the default stream: any of its device). */
int sim_stream_get_in_context(aclrtStream handle, const char *call, struct sim_stream **out);
/* 0 when the thread may run `call` on s as sim_stream_get_in_context says, else the failure. */
int sim_stream_check_context(struct sim_stream *s, const char *call);
void sim_stream_put(struct sim_stream *s);
/* Enqueues w (taking ownership); 107000 if the stream is being destroyed. */
int sim_stream_submit(struct sim_stream *s, struct sim_work *w, const char *call);
/* The position an event recorded now would complete at; 107000 if the stream is closing. */
int sim_stream_mark(struct sim_stream *s, uint64_t *pos, const char *call);
/* Waits until the stream has completed `pos` items: 0, or ETIMEDOUT (timeout_ms < 0: forever). */
int sim_stream_wait_pos(struct sim_stream *s, uint64_t pos, int64_t timeout_ms);
int sim_stream_is_done(struct sim_stream *s, uint64_t pos);
/* Enqueues a hang: the worker stops at it until sim_stream_release_hangs. */
int sim_stream_hang(struct sim_stream *s, const char *call);
void sim_stream_release_hangs(struct sim_stream *s);
/* Closes to new work, drains, joins the worker; the caller still owns its reference. */
void sim_stream_shutdown(struct sim_stream *s);

/* ---- context.c ---- */
struct sim_context {
    struct sim_obj obj;
    int device;
    int is_default;
    _Atomic int dead;          /* contexts are never freed: threads may still name them */
    _Atomic uint64_t life;     /* bumped when a dead context's struct serves a new context */
    struct sim_context *spare_next;
};
/* The calling thread's current device, or 107002 (recorded for `call`) when it has none. */
int sim_current_device(const char *call, int *dev);
/* Makes ctx (which the caller holds a reference on: its struct cannot serve another context
   meanwhile, context.c) the thread's current context on device dev. */
void sim_thread_set_device(int dev, struct sim_context *ctx);
/* The calling thread's current context, NULL when it has none. Not referenced: compare it, never
   keep it (another thread may destroy it and its struct serve another context at once). */
struct sim_context *sim_current_context(void);
/* The thread's current context with a reference for the caller (sim_obj_unref), or NULL. */
struct sim_context *sim_current_context_get(void);
/* aclrtSetDevice's half: device dev's default context (made on first use) with the device's
   reference count raised and a reference for the caller, all under the device's lock, so that a
   last aclrtResetDevice on another thread either comes first (a new context) or leaves it.
   NULL out of memory. */
struct sim_context *sim_default_context_acquire(int dev);
void sim_context_after_fork(void); /* fork child: the spare contexts' lock (and list) anew */
void sim_thread_clear_device(int dev);           /* if the thread's current device is dev */
/* A context's streams: their queued work waited for; then destroyed (handles invalid). */
void sim_drain_context_streams(struct sim_context *c);
void sim_destroy_context_streams(struct sim_context *c);

/* ---- device.c: global state ---- */
enum { SIM_UNINIT = 0, SIM_READY = 1, SIM_FINALIZING = 2 };
struct sim_device {
    pthread_mutex_t lock;          /* guards default_stream / default_ctx creation */
    struct sim_stream *default_stream;
    struct sim_context *default_ctx;
    _Atomic uint64_t mallocs, frees, held, live_events, events_created, live_streams, dropped_fills;
    _Atomic uint64_t poisoned_bytes;
    _Atomic uint64_t event_queries; /* aclrtQueryEventStatus and aclrtQueryEvent calls on its events (event.c) */
    _Atomic uint64_t id_events;    /* live events of aclrtCreateEventWithFlag: one event id each (event.c) */
    _Atomic int64_t refs;          /* aclrtSetDevice minus aclrtResetDevice, process-wide */
};
struct sim_global {
    _Atomic int state;
    _Atomic uint64_t generation;   /* bumped by aclInit/aclFinalize/fork: stale thread state */
    pthread_mutex_t life_lock;     /* serialises aclInit, aclFinalize, ascendsim_configure */
    struct sim_config cfg;         /* valid while READY */
    int override_devices;          /* ascendsim_configure; 0: none */
    uint64_t override_hbm;
    _Atomic uint64_t held_total;   /* this process's device bytes, all devices */
    _Atomic uint64_t host_held;    /* this process's pinned host bytes (host.c), in whole pages */
    _Atomic int poison;
    struct sim_device dev[SIM_MAX_DEVICES];
};
extern struct sim_global g_sim;

static inline int sim_ready(void) { return atomic_load_explicit(&g_sim.state, memory_order_acquire) == SIM_READY; }
/* 0 when initialised, else records ACL_ERROR_UNINITIALIZE for `call` and returns it. */
int sim_require_init(const char *call);
/* sim_require_init, then a wait's timeout: -1 (waits forever) or above 0, else records
   ACL_ERROR_RT_PARAM_INVALID for `call` and returns it (the stream, device and event waits). */
int sim_require_init_timeout(int32_t timeout, const char *call);
int sim_valid_device(int dev);

#endif
