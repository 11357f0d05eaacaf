/* Runtime lifecycle (aclInit/aclFinalize) and the device calls.
 *
 * aclInit reads the configuration from the environment (config.c), attaches every simulated
 * device to its node-wide record (node.c) and arms the configured faults. aclFinalize drains and
 * joins every stream, drops events and contexts, unmaps all memory (virtual memory too: vmm.c)
 * and gives the node back this process's share. A process may aclInit again after aclFinalize
 * (with a new configuration).
 *
 * Calls racing aclFinalize from other threads are outside the contract, as with the real
 * runtime; they may fail but do not crash (objects are reference counted, mappings of pinned
 * memory and node records outlive the call).
 *
 * After fork() the child has no runtime: the parent's streams have no threads there and its
 * device memory is the parent's. The child starts uninitialised and may call aclInit itself.
 */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "sim_internal.h"

struct sim_global g_sim = {.life_lock = PTHREAD_MUTEX_INITIALIZER};
static int ever_initialised;
/* CANN's aclInit reference count (hicann/runtime aclInitImpl): each aclInit adds one, the one that
   initialises and every later one, answered ACL_ERROR_REPEAT_INITIALIZE; aclFinalizeReference
   takes one and finalises at the last, aclFinalize clears it. life_lock. */
static uint64_t init_refs;

int sim_require_init(const char *call)
{
    if (sim_ready())
        return 0;
    return sim_fail(ACL_ERROR_UNINITIALIZE, call, "the runtime is not initialised: call aclInit first");
}

int sim_require_init_timeout(int32_t timeout, const char *call)
{
    int rc = sim_require_init(call);
    if (rc)
        return rc;
    if (timeout < -1 || timeout == 0)
        return sim_fail(ACL_ERROR_RT_PARAM_INVALID, call, "timeout %d ms is invalid: -1 (waits forever) or above 0",
                        (int)timeout);
    return 0;
}

int sim_valid_device(int dev)
{
    return dev >= 0 && dev < g_sim.cfg.devices;
}

static void reset_devices(void)
{
    for (int i = 0; i < SIM_MAX_DEVICES; i++) {
        struct sim_device *d = &g_sim.dev[i];
        pthread_mutex_init(&d->lock, NULL);
        d->default_stream = NULL;
        d->default_ctx = NULL;
        atomic_store(&d->mallocs, 0);
        atomic_store(&d->frees, 0);
        atomic_store(&d->held, 0);
        atomic_store(&d->live_events, 0);
        atomic_store(&d->id_events, 0);
        atomic_store(&d->events_created, 0);
        atomic_store(&d->live_streams, 0);
        atomic_store(&d->dropped_fills, 0);
        atomic_store(&d->poisoned_bytes, 0);
        atomic_store(&d->event_queries, 0);
        atomic_store(&d->refs, 0);
    }
}

static void after_fork_in_child(void)
{
    pthread_mutex_init(&g_sim.life_lock, NULL);
    reset_devices();
    sim_reg_reset();
    sim_context_after_fork();
    sim_alloc_reset();
    sim_node_reset();
    sim_faults_reset();
    atomic_store(&g_sim.held_total, 0);
    atomic_store(&g_sim.host_held, 0);
    atomic_fetch_add(&g_sim.generation, 1);
    init_refs = 0; /* the child has no runtime: its own aclInit starts the count again */
    atomic_store(&g_sim.state, SIM_UNINIT);
}

/* Once per process, on stderr, and only where the uid map of this process's user namespace leaves
   its euid out (a namespace whose map is not written yet, `unshare --user` alone): then its host
   uid cannot be told, so it names its node records and leases by geteuid(), which no process
   outside the namespace uses, and sees every file of the others as owned by the overflow uid:
   node.c skips those names as squatted and foreign.c trusts none of them. It shares no node
   record with the processes outside: each side counts only its own device memory (the device can
   be over-committed) and IPC keys do not cross. A map that holds the euid needs no word: records
   are named by the host uid (sim_host_uid), the host user's processes inside and outside the
   namespace share them (docs/containers.md). */
static void warn_user_namespace(const struct sim_config *cfg)
{
    static _Atomic int warned;
    char map[256];
    long outside;
    if (atomic_load(&warned) || !sim_proc_user_namespace(map, sizeof map, &outside))
        return;
    if (outside >= 0) {
        if (sim_proc_runs_as_overflow_uid() && !atomic_exchange(&warned, 1)) {
            fprintf(stderr,
                    "ascendsim: warning: this process runs in a user namespace (/proc/self/uid_map: %s) as the "
                    "overflow uid %u, which every file of an owner the map leaves out shows as: it cannot tell those "
                    "files from its own, so another host user's stale node records or leases in ASCEND_SIM_SHM_DIR "
                    "%s may be taken for its own. Run it as another uid (docs/containers.md).\n",
                    map[0] ? map : "empty", (unsigned)geteuid(), cfg->shm_dir);
            fflush(stderr);
        }
        return;
    }
    if (atomic_exchange(&warned, 1))
        return;
    fprintf(stderr,
            "ascendsim: warning: this process runs in a user namespace (/proc/self/uid_map: %s) whose map leaves "
            "its uid %u out, so its host uid cannot be told: it names its node records and leases by its uid "
            "inside the namespace, and the files of every other uid look owned by the overflow uid here, so it "
            "shares no node record with the node's processes outside this user namespace and counts none of "
            "theirs. Each side counts only the device memory it can see: simulated node '%s' (ASCEND_SIM_SHM_DIR "
            "%s) may be over-committed, and IPC keys do not cross. Give the namespace a uid map that holds the "
            "uid (docs/containers.md).\n", map[0] ? map : "empty", (unsigned)geteuid(), cfg->node, cfg->shm_dir);
    fflush(stderr);
}

__attribute__((constructor)) static void sim_boot(void)
{
    reset_devices();
    pthread_atfork(NULL, NULL, after_fork_in_child);
}

SIM_EXPORT aclError aclInit(const char *configPath)
{
    static const char call[] = "aclInit";
    pthread_mutex_lock(&g_sim.life_lock);
    int rc = 0;
    if (atomic_load(&g_sim.state) == SIM_READY) {
        /* Counted all the same: a caller that pairs its aclInit with aclFinalizeReference keeps
           the runtime until that call, as CANN's (docs/cann-rules.md R6). */
        init_refs++;
        rc = sim_fail(ACL_ERROR_REPEAT_INITIALIZE, call,
                      "the runtime is already initialised (init references now %llu: each aclInit takes one, "
                      "aclFinalizeReference gives one back)", (unsigned long long)init_refs);
        goto out;
    }
    if (configPath && *configPath && access(configPath, R_OK) != 0) {
        rc = sim_fail(ACL_ERROR_INVALID_FILE, call, "cannot read the configuration file '%s'", configPath);
        goto out;
    }
    struct sim_config cfg;
    if ((rc = sim_config_load(&cfg, call)) != 0)
        goto out;
    reset_devices();
    for (int d = 0; d < cfg.devices; d++) {
        if ((rc = sim_node_attach(d, &cfg, call)) != 0) {
            while (--d >= 0)
                sim_node_detach(d);
            goto out;
        }
    }
    g_sim.cfg = cfg;
    warn_user_namespace(&cfg);
    sim_faults_from_config(&cfg);
    atomic_store(&g_sim.held_total, 0);
    atomic_store(&g_sim.host_held, 0);
    atomic_store(&g_sim.poison, 0);
    atomic_fetch_add(&g_sim.generation, 1);
    ever_initialised = 1;
    init_refs = 1;
    atomic_store_explicit(&g_sim.state, SIM_READY, memory_order_release);
out:
    pthread_mutex_unlock(&g_sim.life_lock);
    return rc;
}

static void finalize_stream(struct sim_stream *s)
{
    sim_stream_release_hangs(s); /* a hung stream must not wedge aclFinalize */
    sim_stream_shutdown(s);
    sim_stream_put(s);
}

/* Releases everything of the process's runtime; life_lock held, the runtime ready. */
static void finalize_locked(void)
{
    atomic_store(&g_sim.state, SIM_FINALIZING);
    atomic_fetch_add(&g_sim.generation, 1);

    struct sim_obj **objs;
    size_t n = sim_reg_take_all(&objs);
    for (size_t i = 0; i < n; i++) { /* streams first: their workers may still touch memory */
        if (objs[i]->type == SIM_H_STREAM) {
            finalize_stream((struct sim_stream *)objs[i]);
            objs[i] = NULL;
        }
    }
    for (size_t i = 0; i < n; i++) {
        if (!objs[i])
            continue;
        if (objs[i]->type == SIM_H_CONTEXT)
            atomic_store(&((struct sim_context *)objs[i])->dead, 1);
        sim_obj_unref(objs[i]);
    }
    free(objs);
    for (int d = 0; d < g_sim.cfg.devices; d++) {
        struct sim_device *dv = &g_sim.dev[d];
        pthread_mutex_lock(&dv->lock);
        struct sim_stream *s = dv->default_stream;
        dv->default_stream = NULL;
        dv->default_ctx = NULL;
        pthread_mutex_unlock(&dv->lock);
        if (s)
            finalize_stream(s);
    }
    sim_vmm_finalize(); /* after the streams, whose fills may touch mapped memory */
    sim_ipc_finalize(); /* imports unmapped, exports closed; the exported memory goes below */
    for (int which = SIM_TREE_DEVICE; which <= SIM_TREE_HOST; which++) {
        struct sim_alloc **all;
        size_t m = sim_alloc_take_all(which, &all);
        for (size_t i = 0; i < m; i++)
            sim_alloc_release(which, all[i]);
        free(all);
    }
    for (int d = 0; d < g_sim.cfg.devices; d++)
        sim_node_detach(d); /* gives back this process's whole share at once */
    sim_faults_reset();
    atomic_store(&g_sim.held_total, 0);
    atomic_store(&g_sim.host_held, 0);
    init_refs = 0;
    atomic_store(&g_sim.state, SIM_UNINIT);
}

/* Finalises whatever the init reference count (CANN: "将aclInit接口的引用计数直接清零"). */
SIM_EXPORT aclError aclFinalize(void)
{
    static const char call[] = "aclFinalize";
    pthread_mutex_lock(&g_sim.life_lock);
    if (atomic_load(&g_sim.state) != SIM_READY) {
        int rc = ever_initialised
                     ? sim_fail(ACL_ERROR_REPEAT_FINALIZE, call, "the runtime is already finalised")
                     : sim_fail(ACL_ERROR_UNINITIALIZE, call, "the runtime was never initialised");
        pthread_mutex_unlock(&g_sim.life_lock);
        return rc;
    }
    finalize_locked();
    pthread_mutex_unlock(&g_sim.life_lock);
    return ACL_SUCCESS;
}

#if !ASCEND_SIM_LEGACY
/* CANN's reference-counted de-initialisation (hicann/runtime aclFinalizeReferenceImpl): takes
   one aclInit reference back and finalises when it was the last; *refCount (may be NULL) gets the
   count left. Without a reference: ACL_ERROR_REPEAT_FINALIZE, whether or not aclInit ever ran. */
SIM_EXPORT aclError aclFinalizeReference(uint64_t *refCount)
{
    static const char call[] = "aclFinalizeReference";
    pthread_mutex_lock(&g_sim.life_lock);
    if (refCount)
        *refCount = init_refs;
    int rc = ACL_SUCCESS;
    if (init_refs > 1)
        init_refs--;
    else if (init_refs == 1 && atomic_load(&g_sim.state) == SIM_READY)
        finalize_locked();
    else
        rc = sim_fail(ACL_ERROR_REPEAT_FINALIZE, call,
                      "no aclInit reference is left to give back (called more often than aclInit, or after "
                      "aclFinalize)");
    if (refCount)
        *refCount = init_refs;
    pthread_mutex_unlock(&g_sim.life_lock);
    return rc;
}
#endif

static int bad_device(const char *call, int32_t dev)
{
    return sim_fail(ACL_ERROR_RT_INVALID_DEVICEID, call,
                    "device id %d is out of range: this node has %d devices (0..%d)", (int)dev,
                    g_sim.cfg.devices, g_sim.cfg.devices - 1);
}

/* As in ACL: makes the device's default context current for this thread and adds one to the
   device's reference count (process-wide); only aclrtResetDevice takes it back. */
SIM_EXPORT aclError aclrtSetDevice(int32_t deviceId)
{
    static const char call[] = "aclrtSetDevice";
    int rc = sim_require_init(call);
    if (rc)
        return rc;
    if (!sim_valid_device(deviceId))
        return bad_device(call, deviceId);
    /* The context found, the device's count raised and a reference taken at once, under the
       device's lock: between finding the context and raising the count, the device's last
       aclrtResetDevice on another thread released it, and context.c's reuse could give its struct
       to another device's context before this thread made it current (the thread then ran in it). */
    struct sim_context *c = sim_default_context_acquire(deviceId);
    if (!c)
        return sim_fail(ACL_ERROR_RT_RESOURCE_ALLOC_FAIL, call, "out of host memory");
    sim_thread_set_device(deviceId, c);
    sim_obj_unref(&c->obj);
    return ACL_SUCCESS;
}

SIM_EXPORT aclError aclrtGetDevice(int32_t *deviceId)
{
    static const char call[] = "aclrtGetDevice";
    int rc = sim_require_init(call);
    if (rc)
        return rc;
    if (!deviceId)
        return sim_fail(ACL_ERROR_INVALID_PARAM, call, "deviceId is NULL");
    int dev;
    if ((rc = sim_current_device(call, &dev)) != 0)
        return rc;
    *deviceId = dev;
    return ACL_SUCCESS;
}

/* Works before aclInit, like the real one (frameworks count devices without initialising). */
SIM_EXPORT aclError aclrtGetDeviceCount(uint32_t *count)
{
    static const char call[] = "aclrtGetDeviceCount";
    if (!count)
        return sim_fail(ACL_ERROR_INVALID_PARAM, call, "count is NULL");
    if (sim_ready()) {
        *count = (uint32_t)g_sim.cfg.devices;
        return ACL_SUCCESS;
    }
    int n;
    pthread_mutex_lock(&g_sim.life_lock);
    int rc = sim_config_devices(&n, NULL, call);
    pthread_mutex_unlock(&g_sim.life_lock);
    if (rc)
        return rc;
    *count = (uint32_t)n;
    return ACL_SUCCESS;
}

/* The device's default context goes (its last reference was taken back) with its streams, once
   the work queued on them is done (CANN: "若默认Context或默认Stream下的任务还未完成，系统会等待任务完成后
   再释放": the last aclrtResetDevice waits for it, so a caller must not hold a lock other devices
   need across it). Threads still naming it get ACL_ERROR_RT_CONTEXT_NULL, and the next
   aclrtSetDevice makes a new one. */
static void release_default_context(int32_t deviceId, struct sim_context *released)
{
    sim_drain_context_streams(released);
    atomic_store(&released->dead, 1); /* never freed, its struct reused: see context.c */
    struct sim_obj *o = sim_reg_take(SIM_HANDLE(&released->obj), SIM_H_CONTEXT);
    if (o)
        sim_obj_unref(o); /* aclrtSetCurrentContext now refuses the handle */
    sim_thread_clear_device(deviceId);
    sim_destroy_context_streams(released);
}

/* Takes back `all` references (aclrtResetDeviceForce) or one (aclrtResetDevice). */
static aclError reset_device(const char *call, int32_t deviceId, int all)
{
    int rc = sim_require_init(call);
    if (rc)
        return rc;
    if (!sim_valid_device(deviceId))
        return bad_device(call, deviceId);
    struct sim_device *d = &g_sim.dev[deviceId];
    pthread_mutex_lock(&d->lock);
    int64_t refs = atomic_load(&d->refs);
    if (refs <= 0) {
        pthread_mutex_unlock(&d->lock);
        return sim_fail(ACL_ERROR_RT_PARAM_INVALID, call,
                        "device %d has no aclrtSetDevice reference left to reset (each "
                        "aclrtResetDevice must pair with one aclrtSetDevice)", (int)deviceId);
    }
    int64_t left = all ? 0 : refs - 1;
    atomic_store(&d->refs, left);
    struct sim_context *released = NULL;
    if (left == 0) {
        released = d->default_ctx;
        d->default_ctx = NULL;
    }
    pthread_mutex_unlock(&d->lock);
    if (released)
        release_default_context(deviceId, released);
    return ACL_SUCCESS;
}

/* Takes back one aclrtSetDevice reference. The last one releases the device's default context
   (CANN: "when the count reaches 0 the device's resources are really released"). A reset
   without a reference left is refused (CANN documents an error; no code is named, so the
   runtime's parameter code). The default context's streams go with it (their work waited for);
   events and memory stay until destroyed or aclFinalize. */
/* The node's device behind this process's logical device (ASCEND_RT_VISIBLE_DEVICES), and back:
   CANN's pair for a container that sees some of a node's NPUs renumbered from 0. */
static aclError map_device(const char *call, int32_t in, int32_t *out, int to_node)
{
    int rc = sim_require_init(call);
    if (rc)
        return rc;
    if (!out)
        return sim_fail(ACL_ERROR_INVALID_PARAM, call, "the output pointer is NULL");
    int dev = to_node ? (sim_valid_device(in) ? g_sim.cfg.phys[in] : -1) : sim_logical_device(in);
    if (dev < 0)
        return sim_fail(ACL_ERROR_RT_INVALID_DEVICEID, call,
                        to_node ? "device %d does not exist (this process sees %d)"
                                : "the node's device %d is not visible to this process (ASCEND_RT_VISIBLE_DEVICES; "
                                  "it sees %d)",
                        (int)in, g_sim.cfg.devices);
    *out = dev;
    return ACL_SUCCESS;
}

SIM_EXPORT aclError aclrtGetPhyDevIdByLogicDevId(int32_t logicDevId, int32_t *phyDevId)
{
    return map_device("aclrtGetPhyDevIdByLogicDevId", logicDevId, phyDevId, 1);
}

SIM_EXPORT aclError aclrtGetLogicDevIdByPhyDevId(int32_t phyDevId, int32_t *logicDevId)
{
    return map_device("aclrtGetLogicDevIdByPhyDevId", phyDevId, logicDevId, 0);
}

SIM_EXPORT aclError aclrtResetDevice(int32_t deviceId)
{
    return reset_device("aclrtResetDevice", deviceId, 0);
}

/* CANN's forced reset: every reference of the process at once (whoever took them: a library's
   pool too), so the default context goes now, as with the last aclrtResetDevice. A device with
   no reference left is refused, and so is an aclrtResetDevice after it (CANN: mixing the two in
   the wrong order returns an error). */
SIM_EXPORT aclError aclrtResetDeviceForce(int32_t deviceId)
{
    return reset_device("aclrtResetDeviceForce", deviceId, 1);
}

/* The SoC this simulated node stands for (ASCEND_SIM_PROFILE); NULL before aclInit, like the
   real call, which needs an initialised runtime. */
SIM_EXPORT const char *aclrtGetSocName(void)
{
    return sim_ready() ? g_sim.cfg.profile.soc_name : NULL;
}
