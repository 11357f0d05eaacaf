/* Events: markers recorded on a stream.
 *
 * An event holds (stream, position) from its latest aclrtRecordEvent; it is complete once that
 * stream's worker has completed `position` items, i.e. has passed the record. An event never
 * recorded is not CUDA's "complete" event: CANN's runtime (hicann/runtime, Event::QueryEventStatus,
 * Event::Wait, Event::Synchronize, for events of aclrtCreateEvent[WithFlag]) answers NOT_READY to
 * aclrtQueryEventStatus, COMPLETE to the deprecated aclrtQueryEvent and returns at once from
 * aclrtSynchronizeEvent. aclrtStreamWaitEvent on it is refused for an event without flags ("the
 * event has not been recorded", RT_ERROR_INVALID_VALUE = 107000); one with ACL_EVENT_SYNC
 * (RT_EVENT_DDSYNC_NS) gets its wait sent, which blocks the stream until the event is recorded.
 * aclrtResetEvent does not forget the last record: queries and syncs still answer for it; a wait
 * after the reset, too, blocks until the event is recorded again. The simulator refuses every
 * such wait with 107000 (its choice where the runtime would block) rather than hang a stream.
 * aclrtStreamWaitEvent captures the (stream, position) pair at call time, as CUDA does: recording
 * the event again later does not change what the waiting stream waits for.
 *
 * A stream may wait only on an event created with ACL_EVENT_SYNC, or by aclrtCreateEvent (the
 * runtime's default flag, 0x0E, holds RT_EVENT_DDSYNC): any other is refused with
 * ACL_ERROR_RT_FEATURE_NOT_SUPPORT (hicann/runtime ApiErrorDecorator::StreamWaitEvent); flag 0
 * is refused at creation (107000, ApiErrorDecorator::EventCreate).
 *
 * A device has sim_event_limit(device) event ids (65,536; 1,023 on Atlas inference cards, per
 * CANN's event pages): each live event of aclrtCreateEventWithFlag holds one, and each record of
 * an event of aclrtCreateEvent or aclrtCreateEventExWithFlag holds one until it has run (id_take);
 * past them creation fails with ACL_ERROR_RT_NO_EVENT_RESOURCE (207007).
 *
 * CANN's reuse rule (docs/cann-rules-events.md): an event of aclrtCreateEventWithFlag that a
 * stream waited on (aclrtStreamWaitEvent) is reset with aclrtResetEvent before it is recorded
 * again. (aclrtCreateEvent's events, RT_EVENT_DEFAULT, get a fresh hardware id at each record, as
 * new-mode ones do: hicann/runtime Event::Record; they do not support aclrtResetEvent and are
 * recorded again after a wait as they are.) The
 * simulator refuses such a record with ACL_ERROR_RT_PARAM_INVALID: the documentation states the
 * rule, not the code, so the code is the simulator's choice, made so that a test fails when the
 * pool breaks the rule. CUDA has no such rule. The reset is asynchronous, ordered on the waiting
 * stream after its wait ("call a synchronizing interface to make sure it has run, else the job
 * may fail or the card drop off the link"): a record on another stream before the waiting stream
 * has passed the reset is refused the same way (a record on the waiting stream itself is ordered
 * after the reset there). An event of aclrtCreateEventWithFlag keeps one hardware id, so
 * on a real NPU such a record could satisfy the old wait early, or be cleared by the late reset.
 *
 * That hardware id is a flag (hicann/runtime Event::Record: only events without flags and those
 * of aclrtCreateEventExWithFlag get a fresh id at each record; Event::WaitSendCheck sends every
 * wait on an ACL_EVENT_SYNC event to the device; Event::Reset, a write of the event's slot, is
 * what clears it): a record sets it when it runs, a wait passes once it is set, and nothing but
 * aclrtResetEvent clears it. So a wait on an ACL_EVENT_SYNC event passes as soon as any record
 * since its last reset has run, not only the latest one: recorded twice without a reset, the
 * event lets a wait pass while the newer record is still queued. The simulator models it (every
 * profile: the runtime code is the same for all): such a wait waits for the first record since
 * the last reset (`armed`), or for a record still queued when the reset was made on another
 * stream (it may run after the reset and set the flag again).
 *
 * Events of aclrtCreateEventExWithFlag ("new mode", CANN 8.0.RC1 on; hicann/runtime Event with
 * isNewMode_) get a fresh hardware id at every record, so a wait waits for the latest record,
 * CUDA's rule: recorded again after a wait, no reset is needed (aclrtResetEvent, and the
 * deprecated aclrtQueryEvent, are not supported on them: refused with 107000, the simulator's
 * code where the documentation says "returns an error"); a wait on one never recorded passes at
 * once (Event::WaitSendCheck, new mode) and aclrtQueryEventStatus answers COMPLETE for it.
 * Creating them takes no hardware resource; each record takes an event id until it has run
 * (id_take below). Under the `strict` profile the call answers
 * ACL_ERROR_RT_FEATURE_NOT_SUPPORT (207000), as a runtime that exports it without the feature.
 */
#include <errno.h>
#include <stdlib.h>

#include "sim_internal.h"

struct sim_event {
    struct sim_obj obj;
    int device;
    uint32_t flags;            /* ACL_EVENT_SYNC matters (waits, resets); the others are accepted */
    int waitable;              /* aclrtStreamWaitEvent may wait on it: ACL_EVENT_SYNC or _IPC, or aclrtCreateEvent's */
    int ex;                    /* aclrtCreateEventExWithFlag: waits wait for the latest record, no reset */
    int fresh_id;              /* a fresh hardware id at each record (new mode, and aclrtCreateEvent's
                                  RT_EVENT_DEFAULT): recorded again after a wait with no reset */
    pthread_mutex_t mu;
    struct sim_stream *stream; /* latest record (a reference), NULL if never recorded */
    uint64_t pos;
    int waited;                /* a stream waited on it since the last record or reset */
    int reset;                 /* reset since its last record: a wait would block until the next record */
    struct sim_stream *reset_stream; /* the latest reset's stream (a reference) and its position */
    uint64_t reset_pos;
    /* ACL_EVENT_SYNC: the record that sets the hardware flag first since the last reset (a
       reference; NULL: none yet), which every later wait waits for (see above) */
    struct sim_stream *armed;
    uint64_t armed_pos;
    struct sim_stream *waiter; /* the latest stream that waited on the latest record (a reference):
                                  a reset there runs after that record */
};

/* Hardware event ids of new-mode records (hicann/runtime Event::Record -> AllocEventIdResource):
   each record of an event of aclrtCreateEventExWithFlag takes an id from the device's pool, given
   back once that record has run (TryFreeEventIdAndCheckCanBeDelete). The pool is the device's
   event limit, shared with the live events of aclrtCreateEvent[WithFlag]. Past it the runtime's
   record blocks the thread until a record completes (it loops on RT_ERROR_DRV_NO_EVENT_RESOURCES);
   the simulator refuses it with ACL_ERROR_RT_NO_EVENT_RESOURCE (207007), its choice: a thread
   blocked there (perhaps under a caller's lock, behind a hung stream) would hide the mistake. */
struct id_hold {
    struct sim_stream *s; /* a reference */
    uint64_t pos;
};
static struct {
    pthread_mutex_t mu;
    struct id_hold *v;
    size_t n, cap;
} g_ids[SIM_MAX_DEVICES] = {[0 ... SIM_MAX_DEVICES - 1] = {.mu = PTHREAD_MUTEX_INITIALIZER}};

/* Takes an id for a record at (s, pos) on device dev (s NULL: none, only counts): 0, or 1 when
   the device has none left. */
static int id_take(int dev, struct sim_stream *s, uint64_t pos)
{
    struct id_hold done[64];
    size_t ndone = 0;
    int full = 0;
    pthread_mutex_lock(&g_ids[dev].mu);
    for (size_t i = 0; i < g_ids[dev].n;) { /* give back the ids of records that have run */
        struct id_hold *h = &g_ids[dev].v[i];
        if (ndone < 64 && sim_stream_is_done(h->s, h->pos)) {
            done[ndone++] = *h;
            *h = g_ids[dev].v[--g_ids[dev].n];
        } else {
            i++;
        }
    }
    uint64_t held = g_ids[dev].n + atomic_load(&g_sim.dev[dev].id_events);
    if (!s) {
        full = held > (uint64_t)sim_event_limit(dev); /* the caller's new event is among id_events */
    } else if (held >= (uint64_t)sim_event_limit(dev)) {
        full = 1;
    } else if (g_ids[dev].n == g_ids[dev].cap) {
        size_t cap = g_ids[dev].cap ? 2 * g_ids[dev].cap : 64;
        struct id_hold *v = realloc(g_ids[dev].v, cap * sizeof *v);
        if (!v)
            full = 1;
        else
            g_ids[dev].v = v, g_ids[dev].cap = cap;
    }
    if (!full && s) {
        sim_obj_ref(&s->obj);
        g_ids[dev].v[g_ids[dev].n++] = (struct id_hold){s, pos};
    }
    pthread_mutex_unlock(&g_ids[dev].mu);
    for (size_t i = 0; i < ndone; i++) /* not under our lock: may drop a stream's last reference */
        sim_stream_put(done[i].s);
    return full;
}

static void event_destroy(struct sim_obj *o)
{
    struct sim_event *e = (struct sim_event *)o;
    sim_stream_put(e->stream);
    sim_stream_put(e->reset_stream);
    sim_stream_put(e->armed);
    sim_stream_put(e->waiter);
    pthread_mutex_destroy(&e->mu);
    free(e);
}

static int get_event(aclrtEvent handle, const char *call, struct sim_event **out)
{
    struct sim_obj *o = sim_reg_get(handle, SIM_H_EVENT);
    if (!o)
        return sim_fail(ACL_ERROR_RT_PARAM_INVALID, call,
                        "%p is not a live event (never created, or already destroyed)", handle);
    *out = (struct sim_event *)o;
    return 0;
}

/* The latest record: a referenced stream (or NULL: never recorded) and its position. */
static struct sim_stream *snapshot(struct sim_event *e, uint64_t *pos)
{
    pthread_mutex_lock(&e->mu);
    struct sim_stream *s = e->stream;
    if (s)
        sim_obj_ref(&s->obj);
    *pos = e->pos;
    pthread_mutex_unlock(&e->mu);
    return s;
}

/* `plain`: aclrtCreateEvent, no flag argument */
static aclError create_event(aclrtEvent *event, uint32_t flags, int ex, int plain, const char *call)
{
    int rc = sim_require_init(call);
    if (rc)
        return rc;
    if (!event)
        return sim_fail(ACL_ERROR_INVALID_PARAM, call, "event is NULL");
    /* hicann/runtime ApiErrorDecorator::EventCreate[Ex]: a flag past the call's maximum is
       RT_ERROR_INVALID_VALUE (107000), not ACL's 100000; ACL_EVENT_IPC is ExWithFlag's only,
       ACL_EVENT_DEVICE_USE_ONLY and ACL_EVENT_EXTERNAL WithFlag's only */
    uint32_t known = ex ? ACL_EVENT_FLAGS_EX : ACL_EVENT_FLAGS_WITH_FLAG;
    if (flags & ~known)
        return sim_fail(ACL_ERROR_RT_PARAM_INVALID, call, "flag 0x%x has bits this call does not take (it takes 0x%x)",
                        flags, known);
    /* the same decorators: DEVICE_USE_ONLY (RT_EVENT_MC2), EXTERNAL and IPC come alone */
    if ((flags & ACL_EVENT_FLAGS_ALONE) && (flags & (flags - 1)))
        return sim_fail(ACL_ERROR_RT_PARAM_INVALID, call, "flag 0x%x: ACL_EVENT_DEVICE_USE_ONLY (0x%x), "
                        "ACL_EVENT_EXTERNAL (0x%x) and ACL_EVENT_IPC (0x%x) cannot be combined with other flags",
                        flags, ACL_EVENT_DEVICE_USE_ONLY, ACL_EVENT_EXTERNAL, ACL_EVENT_IPC);
    /* hicann/runtime ApiErrorDecorator::EventCreate/EventCreateEx: a flag with no known bit is
       RT_ERROR_INVALID_VALUE (aclrtCreateEvent passes the runtime's default, 0x0E) */
    if (flags == 0 && !plain)
        return sim_fail(ACL_ERROR_RT_PARAM_INVALID, call, "flag 0 is invalid: pass ACL_EVENT_SYNC (0x%x) for an "
                        "event that streams wait on, or use aclrtCreateEvent", ACL_EVENT_SYNC);
    int dev;
    if ((rc = sim_current_device(call, &dev)) != 0)
        return rc;
    if (ex && !g_sim.cfg.profile.event_ex)
        return sim_fail(ACL_ERROR_RT_FEATURE_NOT_SUPPORT, call,
                        "not supported under the simulator's '%s' profile (a runtime without the feature): "
                        "use aclrtCreateEventWithFlag", g_sim.cfg.profile.name);
    /* CANN's pages: Atlas A2/A3 and Ascend 950 only (the runtime: RT_FEATURE_IPC_EVENT, and
       CheckSupportMC2Feature for RT_EVENT_MC2, answer RT_ERROR_FEATURE_NOT_SUPPORT elsewhere) */
    if ((flags & (ACL_EVENT_DEVICE_USE_ONLY | ACL_EVENT_IPC)) && !g_sim.cfg.profile.device_ipc_events)
        return sim_fail(ACL_ERROR_RT_FEATURE_NOT_SUPPORT, call,
                        "flag 0x%x is not supported on %s (the simulator's '%s' profile): only Atlas A2/A3 and "
                        "Ascend 950 have device-only and IPC events", flags, g_sim.cfg.profile.soc_name,
                        g_sim.cfg.profile.name);
    if (sim_fault_event_create_nth())
        return sim_fail(ACL_ERROR_RT_NO_EVENT_RESOURCE, call,
                        "injected fault: this event creation was chosen to fail");
    struct sim_device *d = &g_sim.dev[dev];
    int limit = sim_event_limit(dev);
    /* Only aclrtCreateEventWithFlag's events take an id for life; aclrtCreateEvent's, as new-mode
       ones, take one at each record (CANN's aclrtCreateEvent page: "the system applies for the
       event resource only at aclrtRecordEvent"; hicann/runtime Event::Record, RT_EVENT_DEFAULT) */
    int life_id = !ex && !plain;
    if (life_id && (atomic_fetch_add(&d->id_events, 1) >= (uint64_t)limit || id_take(dev, NULL, 0))) {
        atomic_fetch_sub(&d->id_events, 1);
        return sim_fail(ACL_ERROR_RT_NO_EVENT_RESOURCE, call,
                        "device %d already has %d live events of aclrtCreateEventWithFlag or records of "
                        "aclrtCreateEvent[ExWithFlag] events not yet run (its limit): destroy or reuse events",
                        dev, limit);
    }
    struct sim_event *e = calloc(1, sizeof *e);
    if (e) {
        sim_obj_init(&e->obj, SIM_H_EVENT, event_destroy);
        e->device = dev;
        e->flags = flags;
        /* aclrtCreateEvent gets RT_EVENT_DEFAULT (0x0E), which holds RT_EVENT_DDSYNC */
        e->waitable = (flags & (ACL_EVENT_SYNC | ACL_EVENT_IPC)) || plain; /* IPC: waited on in new mode */
        e->ex = ex;
        e->fresh_id = ex || plain;
        pthread_mutex_init(&e->mu, NULL);
        if (sim_reg_add(&e->obj) != 0) {
            event_destroy(&e->obj);
            e = NULL;
        }
    }
    if (!e) {
        if (life_id)
            atomic_fetch_sub(&d->id_events, 1);
        return sim_fail(ACL_ERROR_RT_NO_EVENT_RESOURCE, call, "out of host memory");
    }
    atomic_fetch_add(&d->events_created, 1);
    if (!ex)
        atomic_fetch_add(&d->live_events, 1); /* the stat: live events of aclrtCreateEvent[WithFlag] */
    *event = SIM_HANDLE(&e->obj);
    return ACL_SUCCESS;
}

SIM_EXPORT aclError aclrtCreateEvent(aclrtEvent *event)
{
    return create_event(event, 0, 0, 1, "aclrtCreateEvent");
}

SIM_EXPORT aclError aclrtCreateEventWithFlag(aclrtEvent *event, uint32_t flag)
{
    return create_event(event, flag, 0, 0, "aclrtCreateEventWithFlag");
}

#if !ASCEND_SIM_LEGACY
SIM_EXPORT aclError aclrtCreateEventExWithFlag(aclrtEvent *event, uint32_t flag)
{
    return create_event(event, flag, 1, 0, "aclrtCreateEventExWithFlag");
}
#endif

/* The initialised runtime's event and stream of a call, each with a reference (0), or the
   runtime's error for whichever is not valid (nothing held then). */
static int event_and_stream(aclrtEvent event, aclrtStream stream, const char *call, struct sim_event **e,
                            struct sim_stream **s)
{
    int rc = sim_require_init(call);
    if (rc)
        return rc;
    if ((rc = get_event(event, call, e)) != 0)
        return rc;
    if ((rc = sim_stream_get_in_context(stream, call, s)) != 0) {
        sim_obj_unref(&(*e)->obj);
        return rc;
    }
    return 0;
}

/* hicann/runtime ApiErrorDecorator::EventRecord, ::StreamWaitEvent, ::EventReset: an event of
   ACL_EVENT_DEVICE_USE_ONLY (RT_EVENT_MC2) is recorded and waited on by device tasks, never
   through these calls (107000). Drops the caller's references when it fails. */
static aclError not_device_only(struct sim_event *e, struct sim_stream *s, aclrtEvent event, const char *call)
{
    if (!(e->flags & ACL_EVENT_DEVICE_USE_ONLY))
        return ACL_SUCCESS;
    sim_stream_put(s);
    sim_obj_unref(&e->obj);
    return sim_fail(ACL_ERROR_RT_PARAM_INVALID, call, "event %p was created with ACL_EVENT_DEVICE_USE_ONLY: only "
                    "tasks on the device record and wait on it", event);
}

/* ApiErrorDecorator::EventSynchronize, ::EventQuery[Status]: an ACL_EVENT_EXTERNAL event (model
   capture's task update) is neither synchronised nor queried (RT_ERROR_FEATURE_NOT_SUPPORT). */
static aclError not_external(struct sim_event *e, aclrtEvent event, const char *call)
{
    if (e->flags != ACL_EVENT_EXTERNAL)
        return ACL_SUCCESS;
    sim_obj_unref(&e->obj);
    return sim_fail(ACL_ERROR_RT_FEATURE_NOT_SUPPORT, call, "event %p was created with ACL_EVENT_EXTERNAL, which "
                    "does not support this call", event);
}

SIM_EXPORT aclError aclrtRecordEvent(aclrtEvent event, aclrtStream stream)
{
    static const char call[] = "aclrtRecordEvent";
    struct sim_event *e = NULL;
    struct sim_stream *s;
    int rc = event_and_stream(event, stream, call, &e, &s);
    if (rc || (rc = not_device_only(e, s, event, call)) != 0)
        return rc;
    if (e->device != s->device) { /* CANN: an event and the stream it is recorded on share a device */
        int ed = e->device, sd = s->device;
        sim_stream_put(s);
        sim_obj_unref(&e->obj);
        return sim_fail(ACL_ERROR_RT_STREAM_CONTEXT, call, "event %p belongs to device %d, stream %p to device %d: "
                        "record an event of the stream's device", event, ed, stream, sd);
    }
    uint64_t pos;
    if ((rc = sim_stream_mark(s, &pos, call)) != 0) {
        sim_stream_put(s);
        sim_obj_unref(&e->obj);
        return rc;
    }
    pthread_mutex_lock(&e->mu);
    if (e->waited && !e->fresh_id) {
        pthread_mutex_unlock(&e->mu);
        sim_stream_put(s);
        sim_obj_unref(&e->obj);
        return sim_fail(ACL_ERROR_RT_PARAM_INVALID, call,
                        "event %p was waited on (aclrtStreamWaitEvent) and not reset: call "
                        "aclrtResetEvent before recording it again", event);
    }
    /* A record on the stream that holds the reset is ordered after it: allowed at once. */
    if (!e->ex && e->reset_stream && e->reset_stream != s && !sim_stream_is_done(e->reset_stream, e->reset_pos)) {
        void *waiting = SIM_HANDLE(&e->reset_stream->obj);
        pthread_mutex_unlock(&e->mu);
        sim_stream_put(s);
        sim_obj_unref(&e->obj);
        return sim_fail(ACL_ERROR_RT_PARAM_INVALID, call,
                        "event %p has a reset (aclrtResetEvent) still queued on stream %p behind that "
                        "stream's wait: record it again only once the waiting stream has run the reset", event,
                        waiting);
    }
    if (e->fresh_id && id_take(e->device, s, pos)) {
        int dev = e->device, limit = sim_event_limit(dev);
        pthread_mutex_unlock(&e->mu);
        sim_stream_put(s);
        sim_obj_unref(&e->obj);
        return sim_fail(ACL_ERROR_RT_NO_EVENT_RESOURCE, call,
                        "device %d has no event id left (%d: records of aclrtCreateEvent[ExWithFlag] events "
                        "not yet run, and live events of aclrtCreateEventWithFlag): on an NPU this record "
                        "blocks the thread until a record completes", dev, limit);
    }
    struct sim_stream *old = e->stream;
    if ((e->flags & ACL_EVENT_SYNC) && !e->ex && !e->armed) { /* the first record since the reset sets the flag */
        sim_obj_ref(&s->obj);
        e->armed = s;
        e->armed_pos = pos;
    }
    e->stream = s; /* our reference moves into the event */
    e->pos = pos;
    e->reset = 0;
    pthread_mutex_unlock(&e->mu);
    sim_stream_put(old);
    sim_obj_unref(&e->obj);
    return ACL_SUCCESS;
}

/* 1 complete, 0 not yet, 2 never recorded, 3 never recorded and of aclrtCreateEventExWithFlag;
   or an aclError (negated to tell it apart). The deprecated query (`deprecated`) is refused for
   events of aclrtCreateEventExWithFlag ("not supported ... returns an error"). */
static int query(aclrtEvent event, int *status, int deprecated, const char *call)
{
    int rc = sim_require_init(call);
    if (rc)
        return -rc;
    if (!status)
        return -sim_fail(ACL_ERROR_INVALID_PARAM, call, "status is NULL");
    struct sim_event *e = NULL;
    if ((rc = get_event(event, call, &e)) != 0 || (rc = not_external(e, event, call)) != 0)
        return -rc;
    if (deprecated && e->ex) { /* ApiErrorDecorator::EventQuery: IsNewMode, RT_ERROR_FEATURE_NOT_SUPPORT */
        sim_obj_unref(&e->obj);
        return -sim_fail(ACL_ERROR_RT_FEATURE_NOT_SUPPORT, call, "event %p was created by aclrtCreateEventExWithFlag, "
                         "which does not support this call: use aclrtQueryEventStatus", event);
    }
    atomic_fetch_add(&g_sim.dev[e->device].event_queries, 1);
    if (sim_fault_event_query_nth()) {
        sim_obj_unref(&e->obj);
        return -sim_fail(ACL_ERROR_RT_PARAM_INVALID, call, "injected fault: this event query was chosen to fail");
    }
    uint64_t pos;
    struct sim_stream *s = snapshot(e, &pos);
    int done = !s ? 2 + e->ex : sim_stream_is_done(s, pos);
    sim_stream_put(s);
    sim_obj_unref(&e->obj);
    return done;
}

#if !ASCEND_SIM_LEGACY
SIM_EXPORT aclError aclrtQueryEventStatus(aclrtEvent event, int *status)
{
    int r = query(event, status, 0, "aclrtQueryEventStatus");
    if (r < 0)
        return -r;
    /* Never recorded: RT_EVENT_INIT, which the ACL layer answers as NOT_READY (CANN; CUDA says done);
       an event of aclrtCreateEventExWithFlag answers COMPLETE. */
    *status = r == 1 || r == 3 ? ACL_EVENT_RECORDED_STATUS_COMPLETE : ACL_EVENT_RECORDED_STATUS_NOT_READY;
    return ACL_SUCCESS;
}
#endif

/* Deprecated in CANN, with the opposite numbering: COMPLETE = 0, NOT_READY = 1. Never recorded:
   COMPLETE (rtEventQuery answers "not complete" only for a record still running). */
SIM_EXPORT aclError aclrtQueryEvent(aclrtEvent event, int *status)
{
    int r = query(event, status, 1, "aclrtQueryEvent");
    if (r < 0)
        return -r;
    *status = r ? ACL_EVENT_STATUS_COMPLETE : ACL_EVENT_STATUS_NOT_READY;
    return ACL_SUCCESS;
}

static aclError sync_event(aclrtEvent event, int32_t timeout, const char *call)
{
    /* below -1: ACL's check; 0: the runtime's (ApiErrorDecorator::EventSynchronize), both 107000 */
    int rc = sim_require_init_timeout(timeout, call);
    if (rc)
        return rc;
    struct sim_event *e = NULL;
    if ((rc = get_event(event, call, &e)) != 0 || (rc = not_external(e, event, call)) != 0)
        return rc;
    uint64_t pos;
    struct sim_stream *s = snapshot(e, &pos);
    if (s && sim_stream_wait_pos(s, pos, timeout) == ETIMEDOUT)
        rc = sim_fail(ACL_ERROR_RT_EVENT_SYNC_TIMEOUT, call,
                      "event %p did not complete within %d ms", event, (int)timeout);
    sim_stream_put(s);
    sim_obj_unref(&e->obj);
    return rc;
}

SIM_EXPORT aclError aclrtSynchronizeEvent(aclrtEvent event)
{
    return sync_event(event, -1, "aclrtSynchronizeEvent");
}

SIM_EXPORT aclError aclrtSynchronizeEventWithTimeout(aclrtEvent event, int32_t timeout)
{
    return sync_event(event, timeout, "aclrtSynchronizeEventWithTimeout");
}

SIM_EXPORT aclError aclrtStreamWaitEvent(aclrtStream stream, aclrtEvent event)
{
    static const char call[] = "aclrtStreamWaitEvent";
    int rc = sim_require_init(call);
    if (rc)
        return rc;
    struct sim_event *e = NULL;
    if ((rc = get_event(event, call, &e)) != 0)
        return rc;
    struct sim_stream *target;
    if ((rc = sim_stream_get_in_context(stream, call, &target)) != 0) {
        sim_obj_unref(&e->obj);
        return rc;
    }
    if ((rc = not_device_only(e, target, event, call)) != 0)
        return rc;
    if (!e->waitable) { /* ApiErrorDecorator::StreamWaitEvent: IsEventWithoutWaitTask, a warning */
        uint32_t flags = e->flags;
        sim_stream_put(target);
        sim_obj_unref(&e->obj);
        return sim_fail(ACL_ERROR_RT_FEATURE_NOT_SUPPORT, call,
                        "event %p was created with flag 0x%x, without ACL_EVENT_SYNC: streams cannot wait on "
                        "it (create it with ACL_EVENT_SYNC)", event, flags);
    }
    uint64_t pos = 0;
    struct sim_stream *old_waiter = NULL;
    pthread_mutex_lock(&e->mu);
    struct sim_stream *src = e->stream;
    int reset = e->reset, ex = e->ex;
    if (src && ex) { /* new mode: waits for the latest record, needs no reset */
        pos = e->pos;
        sim_obj_ref(&src->obj);
    } else if (src && !reset) { /* a wait on a recorded event: it needs a reset before its next record */
        pos = e->pos;
        if (e->armed) { /* ACL_EVENT_SYNC: the flag is set by the first record since the reset */
            src = e->armed;
            pos = e->armed_pos;
        }
        sim_obj_ref(&src->obj);
        e->waited = 1;
        sim_obj_ref(&target->obj);
        old_waiter = e->waiter;
        e->waiter = target;
    }
    pthread_mutex_unlock(&e->mu);
    sim_stream_put(old_waiter);
    sim_obj_unref(&e->obj);
    if (!src && ex) { /* never recorded, new mode: "wait first, return suc" (Event::WaitSendCheck) */
        sim_stream_put(target);
        return ACL_SUCCESS;
    }
    if (!src || (reset && !ex)) {
        sim_stream_put(target);
        if (!src)
            return sim_fail(ACL_ERROR_RT_PARAM_INVALID, call,
                            "event %p has never been recorded: record it (aclrtRecordEvent) before a stream "
                            "waits on it (on an NPU the wait fails, or with ACL_EVENT_SYNC blocks the stream "
                            "until a record)", event);
        return sim_fail(ACL_ERROR_RT_PARAM_INVALID, call,
                        "event %p was reset (aclrtResetEvent) and not recorded since: on an NPU this wait "
                        "would block until the event is recorded again", event);
    }
    if (src && sim_stream_is_done(src, pos)) { /* already complete: the wait would be a no-op item
                                                  (skipping it keeps idle streams idle) */
        sim_stream_put(src);
        src = NULL;
    }
    if (src) {
        struct sim_work *w = calloc(1, sizeof *w);
        if (!w) {
            sim_stream_put(src);
            rc = sim_fail(ACL_ERROR_RT_RESOURCE_ALLOC_FAIL, call, "out of host memory");
        } else {
            w->kind = SIM_W_WAIT;
            w->wait_on = src; /* the item owns this reference */
            w->wait_pos = pos;
            rc = sim_stream_submit(target, w, call);
        }
    }
    sim_stream_put(target);
    return rc;
}

SIM_EXPORT aclError aclrtDestroyEvent(aclrtEvent event)
{
    static const char call[] = "aclrtDestroyEvent";
    int rc = sim_require_init(call);
    if (rc)
        return rc;
    if (!event)
        return sim_fail(ACL_ERROR_INVALID_PARAM, call, "event is NULL");
    struct sim_obj *o = sim_reg_take(event, SIM_H_EVENT);
    if (!o)
        return sim_fail(ACL_ERROR_RT_PARAM_INVALID, call,
                        "%p is not a live event (never created, or already destroyed)", event);
    struct sim_event *e = (struct sim_event *)o;
    if (!e->ex)
        atomic_fetch_sub(&g_sim.dev[e->device].live_events, 1);
    if (!e->fresh_id)
        atomic_fetch_sub(&g_sim.dev[e->device].id_events, 1);
    sim_obj_unref(o); /* recorded work still pending is not waited for, as in the real runtime */
    return ACL_SUCCESS;
}

/* Lets the event be recorded again after a wait. The runtime orders the reset on `stream` (the
   waiting one, after its wait); a wait already enqueued captured its position, so resetting at
   once is the same as resetting in stream order here. The last record stays what queries and
   syncs answer for (CANN's Event::Reset keeps it); only a new wait needs a new record. */
SIM_EXPORT aclError aclrtResetEvent(aclrtEvent event, aclrtStream stream)
{
    static const char call[] = "aclrtResetEvent";
    struct sim_event *e = NULL;
    struct sim_stream *s;
    int rc = event_and_stream(event, stream, call, &e, &s);
    if (rc || (rc = not_device_only(e, s, event, call)) != 0)
        return rc;
    if (!(e->flags & ACL_EVENT_SYNC) || e->ex) {
        int ex = e->ex, waitable = e->waitable;
        uint32_t flags = e->flags;
        sim_stream_put(s);
        sim_obj_unref(&e->obj);
        if (!waitable) /* ApiErrorDecorator::EventReset: IsEventWithoutWaitTask, RT_ERROR_FEATURE_NOT_SUPPORT */
            return sim_fail(ACL_ERROR_RT_FEATURE_NOT_SUPPORT, call,
                            "event %p was created without ACL_EVENT_SYNC (flag 0x%x): no stream waits on it, so "
                            "it needs no reset", event, flags);
        if (ex)
            return sim_fail(ACL_ERROR_RT_PARAM_INVALID, call,
                            "event %p was created by aclrtCreateEventExWithFlag, which does not support "
                            "aclrtResetEvent (its waits wait for the latest record: none is needed)", event);
        return sim_fail(ACL_ERROR_RT_PARAM_INVALID, call,
                        "event %p was not created with ACL_EVENT_SYNC (aclrtCreateEventWithFlag): "
                        "CANN supports aclrtResetEvent only on those", event);
    }
    uint64_t reset_pos;
    sim_stream_mark(s, &reset_pos, call); /* ordered after the waiting stream's queued work */
    pthread_mutex_lock(&e->mu);
    struct sim_stream *old_reset = e->reset_stream, *old_armed = e->armed, *waiter = e->waiter;
    e->waiter = NULL;
    e->waited = 0;
    e->reset = 1;
    e->reset_stream = s; /* our reference moves into the event */
    e->reset_pos = reset_pos;
    /* The reset clears the flag when it runs. The latest record, still queued on another stream,
       may run after it and set the flag again: later waits then pass once it has run. A reset
       on the stream that waited for that record (the flag's first record since the last reset)
       runs after it. */
    int ordered = e->stream == s ||
                  (waiter == s && (!e->armed || (e->armed == e->stream && e->armed_pos == e->pos)));
    e->armed = NULL;
    if (e->stream && !ordered && !sim_stream_is_done(e->stream, e->pos)) {
        sim_obj_ref(&e->stream->obj);
        e->armed = e->stream;
        e->armed_pos = e->pos;
    }
    pthread_mutex_unlock(&e->mu);
    sim_stream_put(old_armed);
    sim_stream_put(waiter);
    sim_stream_put(old_reset);
    sim_obj_unref(&e->obj);
    return ACL_SUCCESS;
}
