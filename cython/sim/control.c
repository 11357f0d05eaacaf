/* The ascendsim_* control API (see ascendsim.h): work, inspection, faults, configuration and
 * counters for tests and demos. Nothing here exists in the real runtime.
 */
#include <stdlib.h>
#include <string.h>

#include "ascendsim.h"
#include "sim_internal.h"

#define MAX_FILL_DELAY_US (3600ull * 1000000ull) /* an hour: anything longer is a unit mistake */

SIM_EXPORT aclError ascendsim_launch_fill(aclrtStream stream, void *ptr, size_t nbytes, int value,
                                          uint64_t delay_us)
{
    static const char call[] = "ascendsim_launch_fill";
    int rc = sim_require_init(call);
    if (rc)
        return rc;
    if (delay_us > MAX_FILL_DELAY_US)
        return sim_fail(ACL_ERROR_INVALID_PARAM, call, "delay of %llu us is over an hour",
                        (unsigned long long)delay_us);
    struct sim_alloc *a = sim_alloc_pin(SIM_TREE_DEVICE, ptr, nbytes);
    if (!a && (rc = sim_ipc_explain(ptr, nbytes, call)) != 0)
        return rc; /* imported memory whose exporter exited or closed it */
    if (!a)
        return sim_fail(ACL_ERROR_RT_PARAM_INVALID, call,
                        "[%p, +%zu bytes) is not inside one live device allocation or mapped "
                        "virtual memory", ptr, nbytes);
    if (a->read_only) { /* an import of a read-only export: PROT_READ, a write would fault */
        rc = sim_ipc_refuse_write(a, ptr, nbytes, call);
        sim_alloc_unpin(SIM_TREE_DEVICE, a);
        return rc;
    }
    sim_alloc_unpin(SIM_TREE_DEVICE, a); /* checked again when the fill runs */
    struct sim_stream *s;
    if ((rc = sim_stream_get(stream, call, &s)) != 0)
        return rc;
    struct sim_work *w = calloc(1, sizeof *w);
    if (!w) {
        sim_stream_put(s);
        return sim_fail(ACL_ERROR_RT_RESOURCE_ALLOC_FAIL, call, "out of host memory");
    }
    w->kind = SIM_W_FILL;
    w->ptr = ptr;
    w->n = nbytes;
    w->value = value;
    w->delay_us = delay_us;
    rc = sim_stream_submit(s, w, call);
    sim_stream_put(s);
    return rc;
}

SIM_EXPORT aclError ascendsim_read(const void *ptr, void *dst, size_t nbytes)
{
    static const char call[] = "ascendsim_read";
    int rc = sim_require_init(call);
    if (rc)
        return rc;
    if (!dst && nbytes)
        return sim_fail(ACL_ERROR_INVALID_PARAM, call, "dst is NULL");
    struct sim_alloc *a = sim_alloc_pin(SIM_TREE_DEVICE, ptr, nbytes);
    if (!a && (rc = sim_ipc_explain(ptr, nbytes, call)) != 0)
        return rc; /* imported memory whose exporter exited or closed it */
    if (!a)
        return sim_fail(ACL_ERROR_RT_PARAM_INVALID, call,
                        "[%p, +%zu bytes) is not inside one live device allocation or mapped "
                        "virtual memory", ptr, nbytes);
    if (nbytes)
        sim_dev_memcpy(dst, ptr, nbytes);
    sim_alloc_unpin(SIM_TREE_DEVICE, a);
    return ACL_SUCCESS;
}

SIM_EXPORT aclError ascendsim_hang_stream(aclrtStream stream)
{
    static const char call[] = "ascendsim_hang_stream";
    int rc = sim_require_init(call);
    if (rc)
        return rc;
    struct sim_stream *s;
    if ((rc = sim_stream_get(stream, call, &s)) != 0)
        return rc;
    rc = sim_stream_hang(s, call);
    sim_stream_put(s);
    return rc;
}

SIM_EXPORT aclError ascendsim_release_stream(aclrtStream stream)
{
    static const char call[] = "ascendsim_release_stream";
    int rc = sim_require_init(call);
    if (rc)
        return rc;
    struct sim_stream *s;
    if ((rc = sim_stream_get(stream, call, &s)) != 0)
        return rc;
    sim_stream_release_hangs(s);
    sim_stream_put(s);
    return ACL_SUCCESS;
}

/* Setters need a live runtime: aclInit re-arms faults from the environment, so a value set
   before it would be silently lost. */
#define SETTER(name, type, apply)                                  \
    SIM_EXPORT aclError name(type v)                               \
    {                                                              \
        int rc = sim_require_init(#name);                          \
        if (rc)                                                    \
            return rc;                                             \
        apply(v);                                                  \
        return ACL_SUCCESS;                                        \
    }

SETTER(ascendsim_set_fail_malloc_nth, uint64_t, sim_faults_set_malloc_nth)
SETTER(ascendsim_set_fail_event_create_nth, uint64_t, sim_faults_set_event_create_nth)
SETTER(ascendsim_set_fail_event_query_nth, uint64_t, sim_faults_set_event_query_nth)
SETTER(ascendsim_set_fail_after_bytes, int64_t, sim_faults_set_after_bytes)
SETTER(ascendsim_set_malloc_latency_us, uint64_t, sim_faults_set_malloc_latency)
SETTER(ascendsim_set_free_latency_us, uint64_t, sim_faults_set_free_latency)

SIM_EXPORT aclError ascendsim_reset_faults(void)
{
    int rc = sim_require_init("ascendsim_reset_faults");
    if (rc)
        return rc;
    sim_faults_reset();
    return ACL_SUCCESS;
}

SIM_EXPORT aclError ascendsim_set_poison(int on)
{
    int rc = sim_require_init("ascendsim_set_poison");
    if (rc)
        return rc;
    atomic_store(&g_sim.poison, on != 0);
    return ACL_SUCCESS;
}

SIM_EXPORT aclError ascendsim_configure(int32_t devices, uint64_t hbm_bytes)
{
    static const char call[] = "ascendsim_configure";
    if (devices < 0 || devices > SIM_MAX_DEVICES)
        return sim_fail(ACL_ERROR_INVALID_PARAM, call, "devices=%d is not 0 (default) or 1..%d",
                        (int)devices, SIM_MAX_DEVICES);
    if (hbm_bytes > ((uint64_t)1 << 50))
        return sim_fail(ACL_ERROR_INVALID_PARAM, call, "hbm=%llu bytes is over 1 PiB",
                        (unsigned long long)hbm_bytes);
    pthread_mutex_lock(&g_sim.life_lock);
    int rc = 0;
    if (atomic_load(&g_sim.state) != SIM_UNINIT) {
        rc = sim_fail(ACL_ERROR_REPEAT_INITIALIZE, call,
                      "the runtime is already initialised: configure before aclInit (or after aclFinalize)");
    } else {
        g_sim.override_devices = devices;
        g_sim.override_hbm = hbm_bytes;
    }
    pthread_mutex_unlock(&g_sim.life_lock);
    return rc;
}

SIM_EXPORT aclError ascendsim_parse_size(const char *text, uint64_t *bytes)
{
    static const char call[] = "ascendsim_parse_size";
    if (!text || !bytes)
        return sim_fail(ACL_ERROR_INVALID_PARAM, call, "text or bytes is NULL");
    if (sim_parse_size(text, bytes) != 0)
        return sim_fail(ACL_ERROR_INVALID_PARAM, call,
                        "'%s' is not a byte size (plain bytes or a unit: 64GiB, 512MiB, 1.5GB)", text);
    return ACL_SUCCESS;
}

static const char STATS_FIELDS[] =
    "mallocs,frees,bytes_held,node_bytes_used,total_bytes,live_events,events_created,live_streams,dropped_fills,poisoned_bytes,"
    "phys_mallocs,phys_frees,phys_bytes,maps,unmaps,mapped_bytes,device_refs,event_queries";

SIM_EXPORT const char *ascendsim_stats_fields(void) { return STATS_FIELDS; }

SIM_EXPORT aclError ascendsim_get_stats(int32_t device, uint64_t *out, uint32_t n)
{
    static const char call[] = "ascendsim_get_stats";
    int rc = sim_require_init(call);
    if (rc)
        return rc;
    if (!sim_valid_device(device))
        return sim_fail(ACL_ERROR_INVALID_DEVICE, call, "device id %d is out of range (0..%d)",
                        (int)device, g_sim.cfg.devices - 1);
    if (!out && n)
        return sim_fail(ACL_ERROR_INVALID_PARAM, call, "out is NULL");
    struct sim_device *d = &g_sim.dev[device];
    uint64_t vm[SIM_VMM_NSTATS];
    sim_vmm_stats(device, vm);
    uint64_t v[] = {
        atomic_load(&d->mallocs),      atomic_load(&d->frees),          atomic_load(&d->held),
        sim_node_used(device),         g_sim.cfg.hbm,                   atomic_load(&d->live_events),
        atomic_load(&d->events_created), atomic_load(&d->live_streams), atomic_load(&d->dropped_fills),
        atomic_load(&d->poisoned_bytes),
        vm[0], vm[1], vm[2], vm[3], vm[4], vm[5], /* appended: existing positions never move */
        (uint64_t)atomic_load(&d->refs),
        atomic_load(&d->event_queries),
    };
    for (uint32_t i = 0; i < n && i < sizeof v / sizeof v[0]; i++)
        out[i] = v[i];
    return ACL_SUCCESS;
}

/* The device a live stream handle belongs to (NULL: the calling thread's default stream), for
   the acl backend's check of streams it did not create. CANN has no such query; the backend
   probes for this symbol and uses it only where it exists. */
SIM_EXPORT aclError ascendsim_stream_device(aclrtStream stream, int32_t *device)
{
    static const char call[] = "ascendsim_stream_device";
    int rc = sim_require_init(call);
    if (rc)
        return rc;
    if (!device)
        return sim_fail(ACL_ERROR_INVALID_PARAM, call, "device is NULL");
    struct sim_stream *s;
    if ((rc = sim_stream_get(stream, call, &s)) != 0)
        return rc;
    *device = s->device;
    sim_stream_put(s);
    return ACL_SUCCESS;
}

/* The active profile's name (ASCEND_SIM_PROFILE at aclInit), or NULL before aclInit. */
SIM_EXPORT const char *ascendsim_profile(void)
{
    return sim_ready() ? g_sim.cfg.profile.name : NULL;
}
