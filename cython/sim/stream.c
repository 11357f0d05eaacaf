/* Streams: a FIFO of work run by one worker thread per stream, asynchronously to the host.
 *
 * Work items: a fill (a delay, then a memset: what makes a block reused too early visibly
 * corrupt), a wait for another stream's progress (aclrtStreamWaitEvent), and a hang (blocks until
 * released, for timeout tests). Progress is counted: `submitted` items were enqueued, `completed`
 * have finished, in order. An event recorded on a stream is just a position in that count
 * ("complete once `completed` reaches it"), which is exactly "the worker has passed the record".
 *
 * Each device has a default stream (the NULL handle), created on first use. aclrtDestroyStream
 * refuses new work, drains what was submitted (CANN's destroy waits for the stream's tasks;
 * aclrtDestroyStreamForce is the one that does not: it drops what has not started, see
 * stream_shutdown_force), then joins the worker and only then makes
 * the handle invalid: until the work is done the stream is alive to every other thread, and an
 * event recorded on it meanwhile completes with that work. The object itself lives on while
 * events or other streams' waits still refer to it (reference counts).
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "sim_internal.h"

#define WORKER_STACK (256u << 10) /* the worker only sleeps and memsets: keep many streams cheap */

static void free_work(struct sim_work *w)
{
    if (w->wait_on)
        sim_stream_put(w->wait_on);
    free(w);
}

static void run_fill(struct sim_stream *s, struct sim_work *w)
{
    if (w->delay_us)
        sim_sleep_ns(w->delay_us * 1000ull);
    /* Freed meanwhile? Then drop the fill rather than write to unmapped memory. */
    struct sim_alloc *a = sim_alloc_pin(SIM_TREE_DEVICE, w->ptr, w->n);
    if (!a || a->read_only) { /* read-only: refused at launch; re-imported read-only since */
        if (a)
            sim_alloc_unpin(SIM_TREE_DEVICE, a);
        atomic_fetch_add(&g_sim.dev[s->device].dropped_fills, 1);
        return;
    }
    sim_dev_memset(w->ptr, w->value & 0xff, w->n);
    sim_alloc_unpin(SIM_TREE_DEVICE, a);
}

static void *worker(void *arg)
{
    struct sim_stream *s = arg;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (!s->head && !s->exit)
            pthread_cond_wait(&s->work_cv, &s->mu);
        struct sim_work *w = s->head;
        if (!w)
            break; /* exit requested and nothing left */
        s->head = w->next;
        if (!s->head)
            s->tail = NULL;
        if (w->kind == SIM_W_HANG) {
            while (s->hangs_released < w->hang_id && !s->force)
                pthread_cond_wait(&s->work_cv, &s->mu);
        } else {
            pthread_mutex_unlock(&s->mu);
            if (w->kind == SIM_W_FILL)
                run_fill(s, w);
            else if (w->kind == SIM_W_WAIT)
                sim_stream_wait_pos(w->wait_on, w->wait_pos, -1);
            pthread_mutex_lock(&s->mu);
        }
        s->completed++;
        pthread_cond_broadcast(&s->done_cv);
        pthread_mutex_unlock(&s->mu);
        free_work(w); /* may drop the last reference to another stream: not under our lock */
        pthread_mutex_lock(&s->mu);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

static void stream_destroy(struct sim_obj *o)
{
    struct sim_stream *s = (struct sim_stream *)o;
    /* shutdown joined the worker before the last reference could go */
    while (s->head) {
        struct sim_work *w = s->head;
        s->head = w->next;
        free_work(w);
    }
    pthread_cond_destroy(&s->work_cv);
    pthread_cond_destroy(&s->done_cv);
    pthread_mutex_destroy(&s->mu);
    if (s->ctx)
        sim_obj_unref(&s->ctx->obj);
    free(s);
}

static struct sim_stream *stream_new(int dev, int is_default)
{
    struct sim_stream *s = calloc(1, sizeof *s);
    if (!s)
        return NULL;
    sim_obj_init(&s->obj, SIM_H_STREAM, stream_destroy);
    s->device = dev;
    s->is_default = is_default;
    pthread_mutex_init(&s->mu, NULL);
    sim_cond_init(&s->work_cv);
    sim_cond_init(&s->done_cv);
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, WORKER_STACK);
    int rc = pthread_create(&s->thread, &attr, worker, s);
    pthread_attr_destroy(&attr);
    if (rc != 0) {
        stream_destroy(&s->obj);
        return NULL;
    }
    s->has_thread = 1;
    atomic_fetch_add(&g_sim.dev[dev].live_streams, 1);
    return s;
}

int sim_stream_get(aclrtStream handle, const char *call, struct sim_stream **out)
{
    if (handle) {
        struct sim_obj *o = sim_reg_get(handle, SIM_H_STREAM);
        if (!o)
            return sim_fail(ACL_ERROR_RT_PARAM_INVALID, call,
                            "%p is not a live stream (never created, or already destroyed)", handle);
        *out = (struct sim_stream *)o;
        return 0;
    }
    int dev, rc = sim_current_device(call, &dev);
    if (rc)
        return rc;
    struct sim_device *d = &g_sim.dev[dev];
    pthread_mutex_lock(&d->lock);
    if (!d->default_stream)
        d->default_stream = stream_new(dev, 1);
    struct sim_stream *s = d->default_stream;
    if (s)
        sim_obj_ref(&s->obj);
    pthread_mutex_unlock(&d->lock);
    if (!s)
        return sim_fail(ACL_ERROR_RT_NO_STREAM_RESOURCE, call,
                        "cannot start the default stream of device %d (no thread)", dev);
    *out = s;
    return 0;
}

int sim_stream_check_context(struct sim_stream *s, const char *call)
{
    if (!s->ctx)
        return 0;
    struct sim_context *cur = sim_current_context();
    if (!cur)
        return sim_fail(ACL_ERROR_RT_CONTEXT_NULL, call, "this thread has no current context (stream %p)",
                        SIM_HANDLE(&s->obj));
    if (cur != s->ctx)
        return sim_fail(ACL_ERROR_RT_STREAM_CONTEXT, call,
                        "stream %p is not in the current context: it belongs to context %p, the thread's "
                        "current one is %p", SIM_HANDLE(&s->obj), SIM_HANDLE(&s->ctx->obj), SIM_HANDLE(&cur->obj));
    return 0;
}

int sim_stream_get_in_context(aclrtStream handle, const char *call, struct sim_stream **out)
{
    int rc = sim_stream_get(handle, call, out);
    if (rc == 0 && (rc = sim_stream_check_context(*out, call)) != 0)
        sim_stream_put(*out);
    return rc;
}

void sim_stream_put(struct sim_stream *s)
{
    if (s)
        sim_obj_unref(&s->obj);
}

int sim_stream_submit(struct sim_stream *s, struct sim_work *w, const char *call)
{
    pthread_mutex_lock(&s->mu);
    if (s->closed) {
        pthread_mutex_unlock(&s->mu);
        free_work(w);
        return sim_fail(ACL_ERROR_RT_PARAM_INVALID, call, "stream %p is being destroyed", SIM_HANDLE(&s->obj));
    }
    w->next = NULL;
    if (s->tail)
        s->tail->next = w;
    else
        s->head = w;
    s->tail = w;
    s->submitted++;
    pthread_cond_signal(&s->work_cv);
    pthread_mutex_unlock(&s->mu);
    return 0;
}

int sim_stream_mark(struct sim_stream *s, uint64_t *pos, const char *call)
{
    /* A stream being destroyed still takes an event: it marks the work being drained. */
    (void)call;
    pthread_mutex_lock(&s->mu);
    *pos = s->submitted;
    pthread_mutex_unlock(&s->mu);
    return 0;
}

int sim_stream_hang(struct sim_stream *s, const char *call)
{
    struct sim_work *w = calloc(1, sizeof *w);
    if (!w)
        return sim_fail(ACL_ERROR_RT_RESOURCE_ALLOC_FAIL, call, "out of host memory");
    w->kind = SIM_W_HANG;
    pthread_mutex_lock(&s->mu);
    w->hang_id = ++s->hangs_requested;
    pthread_mutex_unlock(&s->mu);
    return sim_stream_submit(s, w, call);
}

int sim_stream_wait_pos(struct sim_stream *s, uint64_t pos, int64_t timeout_ms)
{
    struct timespec deadline;
    if (timeout_ms >= 0)
        sim_deadline_ms(&deadline, timeout_ms);
    int rc = 0;
    pthread_mutex_lock(&s->mu);
    while (s->completed < pos) {
        if (timeout_ms < 0) {
            pthread_cond_wait(&s->done_cv, &s->mu);
        } else if (pthread_cond_timedwait(&s->done_cv, &s->mu, &deadline) == ETIMEDOUT) {
            rc = s->completed < pos ? ETIMEDOUT : 0;
            break;
        }
    }
    pthread_mutex_unlock(&s->mu);
    return rc;
}

int sim_stream_is_done(struct sim_stream *s, uint64_t pos)
{
    pthread_mutex_lock(&s->mu);
    int done = s->completed >= pos;
    pthread_mutex_unlock(&s->mu);
    return done;
}

void sim_stream_release_hangs(struct sim_stream *s)
{
    pthread_mutex_lock(&s->mu);
    s->hangs_released = s->hangs_requested;
    pthread_cond_broadcast(&s->work_cv);
    pthread_mutex_unlock(&s->mu);
}

static void stop_worker(struct sim_stream *s);

void sim_stream_shutdown(struct sim_stream *s)
{
    pthread_mutex_lock(&s->mu);
    if (s->closed) { /* someone else is shutting it down: its work is drained all the same */
        while (s->completed < s->submitted)
            pthread_cond_wait(&s->done_cv, &s->mu);
        pthread_mutex_unlock(&s->mu);
        return;
    }
    s->closed = 1;
    while (s->completed < s->submitted)
        pthread_cond_wait(&s->done_cv, &s->mu);
    stop_worker(s);
}

/* Called with s->mu held by the one thread that closed s, its work done; returns unlocked. */
static void stop_worker(struct sim_stream *s)
{
    s->exit = 1;
    pthread_cond_broadcast(&s->work_cv);
    pthread_mutex_unlock(&s->mu);
    if (s->has_thread) {
        pthread_join(s->thread, NULL);
        s->has_thread = 0;
    }
    atomic_fetch_sub(&g_sim.dev[s->device].live_streams, 1);
}

/* aclrtDestroyStreamForce: the queued items that have not started are dropped (they never run),
   the running one is waited for (a hung one is abandoned: the runtime force-recycles the
   stream's tasks and returns once none is pending, hicann/runtime Stream::TearDown), then every
   position counts as complete, so that events recorded there complete and waits on them pass. */
static void stream_shutdown_force(struct sim_stream *s)
{
    pthread_mutex_lock(&s->mu);
    if (s->closed) { /* a destroy is draining it already */
        pthread_mutex_unlock(&s->mu);
        sim_stream_shutdown(s);
        return;
    }
    s->closed = 1;
    s->force = 1;
    struct sim_work *dropped = s->head;
    uint64_t n = 0;
    for (struct sim_work *w = dropped; w; w = w->next)
        n++;
    s->head = s->tail = NULL;
    pthread_cond_broadcast(&s->work_cv); /* a hung item stops */
    while (s->completed + n < s->submitted)
        pthread_cond_wait(&s->done_cv, &s->mu);
    s->completed = s->submitted;
    pthread_cond_broadcast(&s->done_cv);
    stop_worker(s);
    while (dropped) { /* not under our lock: a wait item may drop another stream's last reference */
        struct sim_work *w = dropped;
        dropped = w->next;
        free_work(w);
    }
}

SIM_EXPORT aclError aclrtCreateStream(aclrtStream *stream)
{
    static const char call[] = "aclrtCreateStream";
    int rc = sim_require_init(call);
    if (rc)
        return rc;
    if (!stream)
        return sim_fail(ACL_ERROR_INVALID_PARAM, call, "stream is NULL");
    int dev;
    if ((rc = sim_current_device(call, &dev)) != 0)
        return rc;
    /* CANN's aclrtCreateStream page: the hardware holds at most so many streams per device, the
       default streams included (1984 on Atlas A2/A3 and 950, 512 on 200I/500 A2, 1024 on
       inference cards; 2048 on A2 in CANN 8.0's pages), and past them creation fails
       (ACL_ERROR_RT_NO_STREAM_RESOURCE). Counted per process here (the hardware's count is the
       device's), checked before the stream starts: threads racing here may pass it by a few. */
    uint64_t live = atomic_load(&g_sim.dev[dev].live_streams);
    if (live >= g_sim.cfg.profile.stream_limit)
        return sim_fail(ACL_ERROR_RT_NO_STREAM_RESOURCE, call,
                        "device %d already has %llu streams (default streams included), its most [profile %s]",
                        dev, (unsigned long long)live, g_sim.cfg.profile.name);
    struct sim_stream *s = stream_new(dev, 0);
    if (!s)
        return sim_fail(ACL_ERROR_RT_NO_STREAM_RESOURCE, call, "cannot start a stream worker thread");
    s->ctx = sim_current_context_get(); /* a reference: its context is not reused while it lives */
    if (sim_reg_add(&s->obj) != 0) {
        sim_stream_shutdown(s);
        sim_stream_put(s);
        return sim_fail(ACL_ERROR_RT_NO_STREAM_RESOURCE, call, "out of host memory");
    }
    *stream = SIM_HANDLE(&s->obj);
    return ACL_SUCCESS;
}

static aclError sync_stream(aclrtStream stream, int32_t timeout, const char *call)
{
    /* ACL answers the runtime's code here, not 100000 (aclrtSynchronizeStreamWithTimeoutImpl: below
       -1); 0 passes ACL's check and the runtime's refuses it (ApiErrorDecorator::StreamSynchronize:
       timeout < -1 || timeout == 0, RT_ERROR_INVALID_VALUE) */
    int rc = sim_require_init_timeout(timeout, call);
    if (rc)
        return rc;
    /* The runtime's StreamSynchronize needs a current context, whichever stream it waits for
       (hicann/runtime ApiImpl::StreamSynchronize: 107002 without one). */
    if (!sim_current_context())
        return sim_fail(ACL_ERROR_RT_CONTEXT_NULL, call, "this thread has no current context (stream %p)", stream);
    struct sim_stream *s;
    if ((rc = sim_stream_get(stream, call, &s)) != 0)
        return rc;
    pthread_mutex_lock(&s->mu);
    uint64_t pos = s->submitted;
    pthread_mutex_unlock(&s->mu);
    if (sim_stream_wait_pos(s, pos, timeout) == ETIMEDOUT)
        rc = sim_fail(ACL_ERROR_RT_STREAM_SYNC_TIMEOUT, call,
                      "stream %p did not finish its work within %d ms", stream, (int)timeout);
    sim_stream_put(s);
    return rc;
}

SIM_EXPORT aclError aclrtSynchronizeStream(aclrtStream stream)
{
    return sync_stream(stream, -1, "aclrtSynchronizeStream");
}

SIM_EXPORT aclError aclrtSynchronizeStreamWithTimeout(aclrtStream stream, int32_t timeout)
{
    return sync_stream(stream, timeout, "aclrtSynchronizeStreamWithTimeout");
}

static int stream_on_device(struct sim_obj *o, void *dev)
{
    return ((struct sim_stream *)o)->device == *(int *)dev;
}

/* aclrtSynchronizeDevice[WithTimeout]: "blocks until the device of the context bound to the
   calling thread has finished its work" (with several devices, the current context's device):
   every stream of that device, the default stream and those of each of its contexts, as far as
   each had been submitted at the call. One limit for the whole wait; on timeout
   ACL_ERROR_RT_STREAM_SYNC_TIMEOUT, as the page says. */
static aclError sync_device(int32_t timeout, const char *call)
{
    int rc = sim_require_init_timeout(timeout, call);
    if (rc)
        return rc;
    int dev;
    if (!sim_current_context())
        return sim_fail(ACL_ERROR_RT_CONTEXT_NULL, call, "this thread has no current context");
    if ((rc = sim_current_device(call, &dev)) != 0)
        return rc;
    struct sim_obj **streams = NULL;
    size_t n = sim_reg_get_matching(SIM_H_STREAM, stream_on_device, &dev, &streams);
    struct sim_device *d = &g_sim.dev[dev];
    pthread_mutex_lock(&d->lock);
    struct sim_stream *def = d->default_stream;
    if (def)
        sim_obj_ref(&def->obj);
    pthread_mutex_unlock(&d->lock);
    uint64_t start = sim_now_ns();
    for (size_t i = 0; i <= n; i++) {
        struct sim_stream *s = i < n ? (struct sim_stream *)streams[i] : def;
        if (!s || rc)
            continue;
        pthread_mutex_lock(&s->mu);
        uint64_t pos = s->submitted;
        pthread_mutex_unlock(&s->mu);
        int64_t left = -1;
        if (timeout > 0) {
            int64_t spent = (int64_t)((sim_now_ns() - start) / 1000000);
            left = spent >= timeout ? 0 : timeout - spent;
        }
        if (sim_stream_wait_pos(s, pos, left) == ETIMEDOUT)
            rc = sim_fail(ACL_ERROR_RT_STREAM_SYNC_TIMEOUT, call,
                          "device %d did not finish its work within %d ms (stream %p busy)", dev, (int)timeout,
                          s->is_default ? NULL : SIM_HANDLE(&s->obj));
    }
    for (size_t i = 0; i < n; i++)
        sim_stream_put((struct sim_stream *)streams[i]);
    free(streams);
    sim_stream_put(def);
    return rc;
}

SIM_EXPORT aclError aclrtSynchronizeDevice(void)
{
    return sync_device(-1, "aclrtSynchronizeDevice");
}

#if !ASCEND_SIM_LEGACY
SIM_EXPORT aclError aclrtSynchronizeDeviceWithTimeout(int32_t timeout)
{
    return sync_device(timeout, "aclrtSynchronizeDeviceWithTimeout");
}
#endif

static aclError destroy_stream(aclrtStream stream, int force, const char *call)
{
    int rc = sim_require_init(call);
    if (rc)
        return rc;
    if (!stream)
        return sim_fail(ACL_ERROR_INVALID_PARAM, call, "stream is NULL (the default stream cannot be destroyed)");
    struct sim_stream *s;
    if ((rc = sim_stream_get_in_context(stream, call, &s)) != 0) /* "the stream must be in the current context" */
        return rc;
    if (force)
        stream_shutdown_force(s);
    else
        sim_stream_shutdown(s); /* the handle stays valid until the queued work is done */
    sim_stream_put(s);
    struct sim_obj *o = sim_reg_take(stream, SIM_H_STREAM);
    if (!o)
        return sim_fail(ACL_ERROR_RT_PARAM_INVALID, call,
                        "%p is not a live stream (never created, or already destroyed)", stream);
    sim_stream_put((struct sim_stream *)o);
    return ACL_SUCCESS;
}

SIM_EXPORT aclError aclrtDestroyStream(aclrtStream stream)
{
    return destroy_stream(stream, 0, "aclrtDestroyStream");
}

/* CANN: destroys the stream without waiting for its unfinished tasks (aclrtDestroyStreamForce.md) */
SIM_EXPORT aclError aclrtDestroyStreamForce(aclrtStream stream)
{
    return destroy_stream(stream, 1, "aclrtDestroyStreamForce");
}
