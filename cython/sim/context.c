/* Contexts and the calling thread's current device.
 *
 * As in ACL, the current device is per thread: aclrtSetDevice makes the device's default context
 * current, aclrtCreateContext makes the new context current, aclrtSetCurrentContext switches the
 * thread to the context's device. Calls that need a device (malloc, streams, events) fail with
 * ACL_ERROR_RT_CONTEXT_NULL on a thread that has none, as the real runtime does.
 *
 * Contexts are never freed: a thread may still name a destroyed context as current, and checking
 * a flag on it is cheaper than a registry lookup on every malloc. A dead context's struct serves
 * the next context made (a new handle, its `life` bumped, so a thread still naming its last life
 * finds it gone): before, each one was kept for good, and a device whose last aclrtResetDevice
 * and next aclrtSetDevice came again and again (the only pool of a device closed and opened)
 * made a new default context each time, 64 B of host memory for the process's life. Its streams
 * hold a reference on it, so it is reused only once they are gone. A reference is taken only where
 * the struct cannot be dead meanwhile: through the registry, by a handle (one life's), or on the
 * default context under its device's lock (sim_default_context_acquire); never on t_ctx after a
 * check (the struct may be on the spare list, or serve another context, by then). aclInit/aclFinalize
 * bump a generation that makes every thread's choice stale; a forked child starts a new spare list.
 */
#include <stdlib.h>

#include "sim_internal.h"

static __thread int t_device = -1;
static __thread struct sim_context *t_ctx;
static __thread uint64_t t_gen;
static __thread uint64_t t_life; /* t_ctx's life when the thread chose it */
static __thread void *t_handle;  /* t_ctx's handle then: handles are never reused (registry.c) */

static struct sim_context *spare_contexts; /* dead, unreferenced: for the next context_new */
static pthread_mutex_t spare_mu = PTHREAD_MUTEX_INITIALIZER;

/* The last reference went (the registry's, its streams', in-flight users'): kept for reuse. */
static void context_destroy(struct sim_obj *o)
{
    struct sim_context *c = (struct sim_context *)o;
    atomic_store(&c->dead, 1);
    pthread_mutex_lock(&spare_mu);
    c->spare_next = spare_contexts;
    spare_contexts = c;
    pthread_mutex_unlock(&spare_mu);
}

/* True when the thread's current context was destroyed (or its struct serves another since). */
static inline int ctx_gone(const struct sim_context *c)
{
    return atomic_load_explicit(&c->dead, memory_order_acquire) ||
           atomic_load_explicit(&c->life, memory_order_relaxed) != t_life;
}

int sim_current_device(const char *call, int *dev)
{
    if (t_gen != atomic_load(&g_sim.generation) || t_device < 0)
        return sim_fail(ACL_ERROR_RT_CONTEXT_NULL, call,
                        "this thread has no current device: call aclrtSetDevice or "
                        "aclrtSetCurrentContext first");
    if (t_ctx && ctx_gone(t_ctx))
        return sim_fail(ACL_ERROR_RT_CONTEXT_NULL, call,
                        "this thread's current context %p was destroyed", t_handle);
    *dev = t_device;
    return 0;
}

struct sim_context *sim_current_context(void)
{
    if (t_gen != atomic_load(&g_sim.generation) || t_device < 0 || (t_ctx && ctx_gone(t_ctx)))
        return NULL;
    return t_ctx;
}

/* A reference lookup by the handle the thread chose, not by t_ctx: once the context is destroyed
   its struct may serve another context (another device's), and a reference taken on t_ctx after
   the check could land on a struct already dead (counted from 0 again: it would then be reused
   under the holder) or on its next life. The registry holds a context until just before its last
   reference goes, and a handle names one life only. */
struct sim_context *sim_current_context_get(void)
{
    if (!sim_current_context() || !t_ctx)
        return NULL;
    return (struct sim_context *)sim_reg_get(t_handle, SIM_H_CONTEXT);
}

void sim_thread_set_device(int dev, struct sim_context *ctx)
{
    t_device = dev;
    t_ctx = ctx;
    t_life = ctx ? atomic_load(&ctx->life) : 0;
    t_handle = ctx ? SIM_HANDLE(&ctx->obj) : NULL;
    t_gen = atomic_load(&g_sim.generation);
}

void sim_thread_clear_device(int dev)
{
    if (t_device == dev) {
        t_device = -1;
        t_ctx = NULL;
        t_handle = NULL;
    }
}

void sim_context_after_fork(void)
{
    /* another thread of the parent may have held it (context_new, context_destroy) at the fork;
       the list it guarded may be half-updated: its structs are left behind (64 B each) */
    pthread_mutex_init(&spare_mu, NULL);
    spare_contexts = NULL;
}

static struct sim_context *context_new(int dev, int is_default)
{
    pthread_mutex_lock(&spare_mu);
    struct sim_context *c = spare_contexts;
    if (c)
        spare_contexts = c->spare_next;
    pthread_mutex_unlock(&spare_mu);
    if (!c && !(c = calloc(1, sizeof *c)))
        return NULL;
    /* a new life first, then alive (release): a thread that sees it alive sees the new life */
    atomic_fetch_add_explicit(&c->life, 1, memory_order_relaxed);
    sim_obj_init(&c->obj, SIM_H_CONTEXT, context_destroy);
    c->device = dev;
    c->is_default = is_default;
    c->spare_next = NULL;
    atomic_store_explicit(&c->dead, 0, memory_order_release);
    sim_obj_ref(&c->obj); /* the creator's, besides the registry's: put it with sim_obj_unref */
    if (sim_reg_add(&c->obj) != 0) {
        context_destroy(&c->obj);
        return NULL;
    }
    return c;
}

struct sim_context *sim_default_context_acquire(int dev)
{
    struct sim_device *d = &g_sim.dev[dev];
    pthread_mutex_lock(&d->lock);
    struct sim_context *c = d->default_ctx;
    if (c)
        sim_obj_ref(&c->obj);
    else
        c = d->default_ctx = context_new(dev, 1); /* the creator's reference is the caller's */
    if (c)
        atomic_fetch_add(&d->refs, 1);
    pthread_mutex_unlock(&d->lock);
    return c;
}

SIM_EXPORT aclError aclrtCreateContext(aclrtContext *context, int32_t deviceId)
{
    static const char call[] = "aclrtCreateContext";
    int rc = sim_require_init(call);
    if (rc)
        return rc;
    if (!context)
        return sim_fail(ACL_ERROR_INVALID_PARAM, call, "context is NULL");
    if (!sim_valid_device(deviceId))
        return sim_fail(ACL_ERROR_RT_INVALID_DEVICEID, call, "device id %d is out of range (0..%d)",
                        (int)deviceId, g_sim.cfg.devices - 1);
    struct sim_context *c = context_new(deviceId, 0);
    if (!c)
        return sim_fail(ACL_ERROR_RT_RESOURCE_ALLOC_FAIL, call, "out of host memory");
    sim_thread_set_device(deviceId, c);
    *context = SIM_HANDLE(&c->obj);
    sim_obj_unref(&c->obj); /* the creator's: the registry holds it */
    return ACL_SUCCESS;
}

SIM_EXPORT aclError aclrtSetCurrentContext(aclrtContext context)
{
    static const char call[] = "aclrtSetCurrentContext";
    int rc = sim_require_init(call);
    if (rc)
        return rc;
    if (!context)
        return sim_fail(ACL_ERROR_INVALID_PARAM, call, "context is NULL");
    struct sim_obj *o = sim_reg_get(context, SIM_H_CONTEXT);
    if (!o)
        return sim_fail(ACL_ERROR_RT_PARAM_INVALID, call,
                        "%p is not a live context (never created, or destroyed)", context);
    struct sim_context *c = (struct sim_context *)o;
    sim_thread_set_device(c->device, c);
    sim_obj_unref(o);
    return ACL_SUCCESS;
}

SIM_EXPORT aclError aclrtGetCurrentContext(aclrtContext *context)
{
    static const char call[] = "aclrtGetCurrentContext";
    int rc = sim_require_init(call);
    if (rc)
        return rc;
    if (!context)
        return sim_fail(ACL_ERROR_INVALID_PARAM, call, "context is NULL");
    int dev;
    if ((rc = sim_current_device(call, &dev)) != 0)
        return rc;
    *context = t_ctx ? t_handle : NULL; /* t_ctx's struct may serve another context by now */
    return ACL_SUCCESS;
}

static int stream_of(struct sim_obj *o, void *ctx)
{
    return ((struct sim_stream *)o)->ctx == ctx;
}

/* Waits for the work queued so far on each of the context's streams. */
void sim_drain_context_streams(struct sim_context *c)
{
    struct sim_obj **streams;
    size_t n = sim_reg_get_matching(SIM_H_STREAM, stream_of, c, &streams);
    for (size_t i = 0; i < n; i++) {
        struct sim_stream *s = (struct sim_stream *)streams[i];
        uint64_t pos;
        if (sim_stream_mark(s, &pos, "aclrtDestroyContext") == 0)
            (void)sim_stream_wait_pos(s, pos, -1);
        sim_stream_put(s);
    }
    free(streams);
}

/* A context's resources go with it: its streams are drained (their queued work done, as
   aclrtDestroyStream waits for it), then their handles become invalid. Without this they lived
   on with a context no thread could enter again: never destroyable (107003 from every context),
   their worker threads kept for the process's life. */
void sim_destroy_context_streams(struct sim_context *c)
{
    struct sim_obj **streams;
    size_t n = sim_reg_get_matching(SIM_H_STREAM, stream_of, c, &streams);
    for (size_t i = 0; i < n; i++) {
        struct sim_stream *s = (struct sim_stream *)streams[i];
        sim_stream_shutdown(s);
        struct sim_obj *o = sim_reg_take(SIM_HANDLE(&s->obj), SIM_H_STREAM);
        if (o)
            sim_obj_unref(o); /* the registry's reference */
        sim_stream_put(s);
    }
    free(streams);
}

SIM_EXPORT aclError aclrtDestroyContext(aclrtContext context)
{
    static const char call[] = "aclrtDestroyContext";
    int rc = sim_require_init(call);
    if (rc)
        return rc;
    if (!context)
        return sim_fail(ACL_ERROR_INVALID_PARAM, call, "context is NULL");
    struct sim_obj *o = sim_reg_get(context, SIM_H_CONTEXT);
    if (!o)
        return sim_fail(ACL_ERROR_RT_PARAM_INVALID, call,
                        "%p is not a live context (never created, or already destroyed)", context);
    struct sim_context *c = (struct sim_context *)o;
    if (c->is_default) {
        int dev = c->device;
        sim_obj_unref(o);
        return sim_fail(ACL_ERROR_RT_PARAM_INVALID, call,
                        "%p is device %d's default context: it goes with aclrtResetDevice, not "
                        "aclrtDestroyContext", context, dev);
    }
    /* The streams' queued work is drained while the context is still valid: until it goes,
       another thread may still enter it and order on its streams (record an event), as on a
       stream being destroyed. Invalidating the context first made those calls 107003 while the
       work ran: a pool could then neither reuse the blocks freed on them nor order after them. */
    sim_drain_context_streams(c);
    sim_obj_unref(o); /* the registry still holds the context until the take below */
    if (!sim_reg_take(context, SIM_H_CONTEXT))
        return sim_fail(ACL_ERROR_RT_PARAM_INVALID, call, "%p was destroyed concurrently", context);
    atomic_store(&c->dead, 1);
    if (t_ctx == c) {
        t_device = -1;
        t_ctx = NULL;
    }
    sim_destroy_context_streams(c);
    sim_obj_unref(&c->obj);
    return ACL_SUCCESS;
}
