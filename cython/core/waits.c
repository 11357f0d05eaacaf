/* Device waits with the pool mutex dropped (the lock table is in pool.h).
 *
 * Under the lock, the work is taken out: the streams to wait for (with each slot's epoch) and the
 * event handles of pending frees (pinned: no event is destroyed while a wait may hold it). The
 * lock is dropped, the waits run, the lock is retaken, and a stream's free blocks serve every
 * stream only if no block entered its trees meanwhile (a free after the wait began is not covered
 * by it). Pending frees are then completed by a query, which now finds their events done.
 */
#include <limits.h>
#include <string.h>

#include "pool_internal.h"

#define WAIT_BATCH 64 /* streams and events per round; a caller with more runs more rounds */
#define NOT_WAITED INT_MIN /* a stream left unwaited (no runtime code is negative) */

typedef struct {
    void *stream;
    int slot;
    uint32_t epoch;
    int rc;
} wait_item;

static int wait_error(ap_pool *p, ap_error *err, int rc, const char *what, void *handle, const char *msg) {
    if (ap_stream_elsewhere(p, rc))
        return ap_set_error(err, AP_E_INVALID_STREAM, rc,
                            "%s %p of device %d is not in this thread's context (%d): its work cannot be "
                            "waited for from here (its blocks stay its own): %s", what, handle, p->device, rc, msg);
    if (ap_stream_unusable(p, rc))
        return ap_set_error(err, AP_E_INVALID_STREAM, rc,
                            "stream %p on device %d is not usable (%d): %s; the pool no longer orders work "
                            "on it", handle, p->device, rc, msg);
    return ap_set_error(err, rc == 507046 || rc == 507047 ? AP_E_TIMEOUT : AP_E_DEVICE, rc,
                        "waiting for %s %p on device %d failed (limit %d ms): %s", what, handle, p->device,
                        p->cfg.sync_timeout_ms, msg);
}

static int limit_spent(ap_pool *p, ap_error *err) {
    return ap_set_error(err, AP_E_TIMEOUT, 0, "waiting for the streams and pending frees of device %d: the limit of "
                        "%d ms was spent", p->device, p->cfg.sync_timeout_ms);
}

int ap_wait_tagged_streams(ap_pool *p, int64_t start) {
    ap_cache_flush(p); /* recently freed small blocks are tagged too */
    int busy = 0;
    for (int i = 1; i < p->n_slots; i++) {
        ap_stream_slot *s = &p->slots[i];
        if (!s->live || (!s->trees[0].count && !s->trees[1].count)) continue;
        int left = ap_time_left(p, start); /* one sync_timeout_ms for them all, as every wait here */
        if (left == 0) {                /* spent: the rest is given up (documented at close) */
            busy++;
            continue;
        }
        ap_on_device(p);
        int rc = p->backend->stream_sync(p->backend, s->stream, left); /* gone, or timed out: given up */
        busy += rc == 507046 || rc == 507047;
    }
    return busy;
}

int ap_wait_stream_unslotted(ap_pool *p, void *stream, ap_error *err) {
    char msg[AP_RUNTIME_MSG];
    pthread_mutex_unlock(&p->lock);
    ap_on_device(p);
    int rc = p->backend->stream_sync(p->backend, stream, ap_time_left(p, ap_now_ms()));
    if (rc != 0) p->backend->error_message(p->backend, rc, msg, sizeof msg); /* read at once: the thread's latest */
    pthread_mutex_lock(&p->lock);
    if (rc != 0) return wait_error(p, err, rc, "stream", stream, msg);
    ap_process_pending(p, 0, NULL); /* frees waiting on events of their own recorded on it are done */
    return AP_OK;
}

int ap_wait_unlocked(ap_pool *p, int slot, int pending, ap_error *err) {
    int from = 1;
    return ap_wait_unlocked_from(p, slot, &from, ap_now_ms(), pending, err);
}

int ap_wait_unlocked_from(ap_pool *p, int slot, int *from, int64_t start, int pending, ap_error *err) {
    wait_item items[WAIT_BATCH];
    void *events[WAIT_BATCH];
    int n = 0, ne = 0, status = AP_OK, s;
    ap_cache_flush(p);
    for (s = *from < 1 ? 1 : *from; s < p->n_slots && n < WAIT_BATCH; s++) {
        ap_stream_slot *sl = &p->slots[s];
        if (!sl->live) continue;
        if (slot > 0 ? s != slot : slot != AP_WAIT_EVERY_STREAM && !sl->trees[0].count && !sl->trees[1].count)
            continue;
        items[n++] = (wait_item){sl->stream, s, sl->epoch, 0};
    }
    *from = s; /* where the next round starts: p->n_slots once every slot was looked at */
    /* Of the pending frees' events recorded on one stream at their frees (event_keys), the latest
       only: the list is in free order, and once it has run so have the others on that stream.
       Taken one by one, 64 a round, empty_cache's four rounds covered some 128 frees, and with
       more of them behind running streams it returned with the rest still pending and their
       segments kept. The other events (an owed stream's, another device's) as before. */
    void *latest[AP_MAX_STREAMS];
    if (pending && p->pending_head) {
        memset(latest, 0, (size_t)p->n_slots * sizeof latest[0]);
        for (ap_block *b = p->pending_head; b; b = b->pending_next)
            for (int i = 0; b->xs && i < b->xs->n_events; i++) {
                int on = ap_event_key_slot(p, b->xs->event_keys[i]);
                if (on) latest[on] = b->xs->events[i];
            }
        for (int s = 1; s < p->n_slots && ne < WAIT_BATCH; s++)
            if (latest[s] && (slot <= 0 || s == slot)) events[ne++] = latest[s];
    }
    /* One stream's wait (destroy_stream: slot > 0) takes only the frees' events recorded on it: the
       other streams' pending frees are not its own, and one behind a busy stream (record_stream on
       a communication stream) held destroy_stream of an idle stream for sync_timeout_ms, then
       failed it (the stream kept). */
    for (ap_block *b = pending && slot <= 0 ? p->pending_head : NULL; b && ne < WAIT_BATCH; b = b->pending_next) {
        for (int i = 0; b->xs && i < b->xs->n_events && ne < WAIT_BATCH; i++)
            if (!ap_event_key_slot(p, b->xs->event_keys[i])) events[ne++] = b->xs->events[i];
        for (int i = 0; b->xs && i < b->xs->n_fevents && ne < WAIT_BATCH; i++) events[ne++] = b->xs->fevents[i];
    }
    if (!n && !ne) {
        /* No event to wait for, but a pending free may owe only streams destroyed behind the
           pool's back (no event could be recorded on them at its free): asked now, they settle
           (owed_done). Returned early, empty_cache kept such a block, and its segment, for good. */
        if (pending && p->pending_head) ap_process_pending(p, 0, NULL);
        return AP_OK;
    }
    p->event_pins++;
    pthread_mutex_unlock(&p->lock);

    ap_on_device(p);
    /* The runtime's message about a failed wait is read right after the call that failed: it is
       the thread's most recent one, so read later it may be another call's, naming another handle. */
    char stream_msg[AP_RUNTIME_MSG], event_msg[AP_RUNTIME_MSG];
    void *failed_stream = NULL; /* the first stream whose wait failed: its message is kept */
    /* One sync_timeout_ms bounds the whole wait, not each stream and event in it (N hung frees
       took N times the limit; a caller running rounds gives every round its first one's start);
       once a wait has failed the rest are not waited for: they are left as they are
       (NOT_WAITED: no retag), and the call reports the first failure. */
    int spent = 0;
    ap_error local = {0};
    for (int i = 0; i < n; i++) {
        int left = ap_time_left(p, start);
        if (!spent && left == 0) {
            status = limit_spent(p, &local);
            spent = 1;
        }
        if (spent) {
            items[i].rc = NOT_WAITED;
            continue;
        }
        items[i].rc = p->backend->stream_sync(p->backend, items[i].stream, left);
        if (items[i].rc != 0 && !failed_stream) {
            failed_stream = items[i].stream;
            p->backend->error_message(p->backend, items[i].rc, stream_msg, sizeof stream_msg);
            spent = 1;
        }
    }
    for (int i = 0; i < ne && !spent; i++) {
        int left = ap_time_left(p, start);
        if (left == 0) { /* the remaining pending frees stay pending */
            status = limit_spent(p, &local);
            break;
        }
        int rc = p->backend->event_sync(p->backend, events[i], left);
        if (rc != 0) {
            p->backend->error_message(p->backend, rc, event_msg, sizeof event_msg);
            status = wait_error(p, &local, rc, "event", events[i], event_msg);
            spent = 1;
        }
    }

    pthread_mutex_lock(&p->lock);
    AP_ASSERT(p->event_pins > 0);
    if (--p->event_pins == 0) ap_events_trim(p, p->event_cache_max); /* what the pins kept beyond the cache bound */
    ap_cache_flush(p); /* blocks cached meanwhile enter the trees (and bump their slot's epoch) */
    for (int i = 0; i < n; i++) {
        ap_stream_slot *sl = &p->slots[items[i].slot];
        if (!sl->live || sl->stream != items[i].stream) continue; /* retired meanwhile */
        int rc = items[i].rc;
        if (rc == 0) {
            if (sl->epoch == items[i].epoch) ap_free_retag_slot(p, items[i].slot, 0);
            continue;
        }
        if (rc == NOT_WAITED) continue; /* the limit was spent on another wait */
        /* degrade: never wedge. Only the stream waited for: a slot whose epoch moved may hold a
           new stream the runtime gave the same handle (or new blocks of the dead one, found
           gone again later) */
        if (ap_stream_unusable(p, rc) && sl->epoch == items[i].epoch) ap_slot_retire(p, items[i].slot);
        if (status == AP_OK) {
            char msg[AP_RUNTIME_MSG];
            if (items[i].stream == failed_stream) memcpy(msg, stream_msg, sizeof msg);
            else p->backend->error_message(p->backend, rc, msg, sizeof msg);
            status = wait_error(p, &local, rc, "stream", items[i].stream, msg);
        }
    }
    ap_process_pending(p, 0, NULL);
    if (status != AP_OK && err) *err = local;
    return status;
}
