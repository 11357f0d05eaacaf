/* Stream-ordered reuse.
 *
 * A block freed on stream S is tagged S: S may reuse it at once (its later work is ordered after
 * the free). Another stream T may reuse it only once S's queued work is done. When T finds nothing
 * of its own, it borrows S's free blocks by recording an event on S and making T wait on it
 * (aclrtStreamWaitEvent): no host wait, and T is ordered after every free S made so far. Blocks
 * marked with record_stream wait on the pending list until events on every user stream complete.
 * Events come from a cache, so steady state creates none.
 */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "current.h" /* AP_MAX_DEVICES */
#include "pool_internal.h"

int ap_stream_unusable(const ap_pool *p, int code) {
    /* Not 107003 (backend.h): taking a stream of another context for gone handed its blocks to
       other streams while its queued work could still use them. */
    return ap_backend_stream_gone_code(p->backend, code);
}

int ap_stream_elsewhere(const ap_pool *p, int code) {
    return p->backend->kind != AP_BACKEND_CUDA && code == 107003;
}

static void park(ap_pool *p, void *event, int marked, void *stream);
static void park_flying(ap_pool *p, void *event, void *stream, void *waiter, int n);
static void *event_get(ap_pool *p, void *stream, int *parked);

/* Records in flight of new-mode events (CANN 8.x, aclrtCreateEventExWithFlag: the acl backend
   without event_reset). hicann/runtime Event::Record takes one of the device's event ids for each
   such record until it has run (1,023 on Atlas inference cards, 65,535 or 65,536 elsewhere), and
   past them aclrtRecordEvent blocks the thread until a record completes: under the pool lock,
   behind a hung stream, for ever. So the pools of a process keep at most 1/AP_RECORDS_SHARE of
   the device's ids in records not known complete (counted per device, an atomic updated under
   each pool's own lock; a few threads may pass the check at once, far below the ids left). At
   the bound the pool first asks its own records (record_room) and then records nothing: a
   pending free owes its stream instead (ap_free_pending), a borrow skips the stream, a probe
   answers "not known idle". Known complete: a pending free's event found complete, or a parked
   event whose latest record is complete (its others all run before it, park_flying). */
static atomic_int records_out[AP_MAX_DEVICES];

static atomic_int *records_of(const ap_pool *p) {
    return &records_out[p->device >= 0 && p->device < AP_MAX_DEVICES ? p->device : 0];
}

static int counts_records(const ap_pool *p) {
    return p->backend->kind == AP_BACKEND_ACL && !ap_backend_event_reset(p->backend);
}

static int records_bound(const ap_pool *p) {
    /* CANN's event pages: 1,023 per device on Atlas inference cards (310P), 65,535 or more elsewhere */
    int ids = strncmp(p->backend->soc_name, "Ascend310P", 10) == 0 ? 1023 : 65535;
    return ids / AP_RECORDS_SHARE;
}

/* Live events of the reset scheme (aclrtCreateEventWithFlag(ACL_EVENT_SYNC): a runtime without
   new-mode events). hicann/runtime Event::Record keeps such an event's hardware id for its life
   (RT_EVENT_DDSYNC_NS), so every live event holds one of the device's ids, idle or not: frees
   marked with record_stream for a busy stream each hold one until the stream passes it, and
   without a bound the pools took all of them (1,023 on a 310P) and the framework's own event
   creation failed (207007). So the pools of a process keep at most the same share of the ids in
   live events (counted per device for every acl event a pool creates, destroys and gives up at
   its close; only the reset scheme is held to it: new-mode events hold ids only while recorded,
   bounded above). At the bound no event is created: a free owes its stream, as in new mode. */
static atomic_int events_held[AP_MAX_DEVICES];

static atomic_int *held_of(const ap_pool *p) {
    return &events_held[p->device >= 0 && p->device < AP_MAX_DEVICES ? p->device : 0];
}

static void live_add(ap_pool *p, int n) {
    p->live_events += n;
    if (p->backend->kind == AP_BACKEND_ACL) atomic_fetch_add(held_of(p), n);
}

/* Events the pools of a process hold on streams of another device (record_stream with a peer's
   stream: record_foreign), per that device. Each is made fresh on that device, recorded once and
   destroyed once that record is complete (or at the pool's close), so it holds one of that
   device's ids while it lives, in either scheme: counted with the device's own records or live
   events against the same share. Before, uncounted: frees marked for a busy peer stream took
   every id of the peer device. */
static atomic_int foreign_held[AP_MAX_DEVICES];

static void foreign_add(int device, int n) {
    if (device >= 0 && device < AP_MAX_DEVICES) atomic_fetch_add(&foreign_held[device], n);
}

/* 1 while the ids the process's pools hold on `device` (its pools' new-mode records, or their
   live reset-scheme events, and other devices' pools' events there) are under the share. */
static int ids_room(const ap_pool *p, int device) {
    if (p->backend->kind != AP_BACKEND_ACL || device < 0 || device >= AP_MAX_DEVICES) return 1;
    int own = ap_backend_event_reset(p->backend) ? atomic_load(&events_held[device]) : atomic_load(&records_out[device]);
    return own + atomic_load(&foreign_held[device]) < records_bound(p);
}

/* 1 when a call on `stream` failed (code) and the backend says the handle now names another
   device's stream whose work queued so far is done. The pool's stream with that handle was
   destroyed behind its back (live streams' handles are unique, and CANN's destroy runs the
   stream's work first), so none of its work is left; but frees named the new stream since (a peer's
   kernel used the block last) land in the old stream's slot, so its blocks go to every stream only
   once the new stream has run what was queued so far: an event of its device recorded there and
   queried, no wait. Before, the refusal (107003) read as busy for good: the blocks stayed out of
   reach of the device's other streams, and each new stream grew the pool. Asked only after a
   failure: a runtime that cannot tell a handle's device (a real CANN with a stream the backend did
   not make) keeps the answer it gave. */
static int moved_stream_idle(ap_pool *p, void *stream, int dev);

static int handle_moved(ap_pool *p, void *stream, int code) {
    int dev;
    return code && stream && p->backend->stream_device && p->backend->stream_device(p->backend, stream, &dev) == 0 &&
           dev != p->device && moved_stream_idle(p, stream, dev);
}

/* 1 when the work queued so far on `stream`, now a stream of device `dev`, is done (or the stream
   is gone): an event of dev recorded on it and queried, no wait; 0 when not, or not known. */
static int moved_stream_idle(ap_pool *p, void *stream, int dev) {
    int complete = 0;
    void *ev = NULL;
    if (!ids_room(p, dev) || p->backend->event_create(p->backend, dev, &ev) != 0) return 0;
    int rc = p->backend->event_record(p->backend, ev, stream);
    if (rc == 0 && p->backend->event_query(p->backend, ev, &complete) != 0) complete = 0;
    p->backend->event_destroy(p->backend, ev); /* CANN's destroy does not wait for the record */
    return rc == 0 ? complete : ap_stream_unusable(p, rc);
}

/* 0: the reset scheme's live events of this device are at their bound (create none). */
static int event_room(const ap_pool *p) {
    return p->backend->kind != AP_BACKEND_ACL || !ap_backend_event_reset(p->backend) || ids_room(p, p->device);
}

static void records_add(ap_pool *p, int n) {
    if (!n) return;
    atomic_fetch_add(records_of(p), n);
    p->records_out += n;
    if (n > 0) p->record_seq++; /* one record made: the latest */
}

/* A record on `stream` numbered seq has run: so have the records stranded there before it. */
static void records_seen(ap_pool *p, void *stream, uint64_t seq) {
    int slot = ap_slot_of(p, stream, 0);
    if (slot <= 0 || !p->slots[slot].stranded || seq <= p->slots[slot].stranded_seq) return;
    records_add(p, -p->slots[slot].stranded);
    p->slots[slot].stranded = 0;
}

static void parked_recycle(ap_pool *p);
static void strand_probes(ap_pool *p);

/* The stream a pending free's event was recorded on at the free: its slot (under 2,048) and the
   slot's generation, so that the slot given to another stream since never matches. Never 0. */
#define KEY_SLOT_BITS 11
_Static_assert(AP_MAX_STREAMS <= 1 << KEY_SLOT_BITS, "a slot fits the key's slot bits");
static uint32_t event_key(const ap_pool *p, int slot) { return (p->slots[slot].gen << KEY_SLOT_BITS) | (uint32_t)slot; }

int ap_event_key_slot(ap_pool *p, uint32_t key) {
    int slot = (int)(key & ((1u << KEY_SLOT_BITS) - 1));
    return key && slot < p->n_slots && p->slots[slot].live && event_key(p, slot) == key ? slot : 0;
}

/* The live slot whose stream a key names, or NULL (0: not known; a retired or reassigned slot). */
static ap_stream_slot *key_slot(ap_pool *p, uint32_t key) {
    int slot = ap_event_key_slot(p, key);
    return slot ? &p->slots[slot] : NULL;
}

/* The gates of the last pass no longer speak for the frees they held (a gate went back to the
   event cache, its stream is gone or another's): the next pass asks every pending free. Counted,
   so that a pass during which it happens (records_reclaim from owed_done) does not end gated. */
static void gates_drop(ap_pool *p) {
    p->pending_gated = 0;
    p->gate_drops++;
}

/* Pending frees' events found complete go back now (events_done would find them later). */
static void records_reclaim(ap_pool *p) {
    if (p->n_parked) parked_recycle(p);
    strand_probes(p);
    ap_on_device(p);
    for (ap_block *b = p->pending_head; b; b = b->pending_next) {
        ap_block_uses *u = b->xs;
        for (int i = 0; u && i < u->n_events;) {
            int complete = 0;
            if (p->backend->event_query(p->backend, u->events[i], &complete) != 0 || !complete) {
                i++;
                continue;
            }
            void *ev = u->events[i];
            u->event_keys[i] = u->event_keys[u->n_events - 1];
            u->events[i] = u->events[--u->n_events];
            gates_drop(p); /* a gate may have gone back to the cache */
            records_add(p, -1);
            ap_event_put(p, ev);
        }
    }
}

/* 1: a new-mode record may be made now (records_add after it succeeds); always 1 elsewhere. */
static int record_room(ap_pool *p) {
    if (!counts_records(p) || ids_room(p, p->device)) return 1;
    /* Asked in vain since the last allocation, and nothing of this pool seen complete since: not
       again (each free and each owed stream at the bound would ask every record of the pool). */
    if (p->reclaim_tick == p->tick + 1 && p->reclaim_out == p->records_out) return 0;
    records_reclaim(p);
    if (ids_room(p, p->device)) return 1;
    p->reclaim_tick = p->tick + 1;
    p->reclaim_out = p->records_out;
    return 0;
}

/* An event recorded (not waited on) goes back to the cache once that record is known complete.
   CANN: an event of aclrtCreateEventWithFlag(ACL_EVENT_SYNC) keeps one hardware flag, set by each
   record when it runs and cleared only by aclrtResetEvent, and the borrow path resets a cached
   event on the lending stream before recording it for a wait (event_for_wait): a record still
   queued on another stream could run after that reset and set the flag early. So a record not
   known complete is parked until it is (destroyed when nothing can tell). CUDA: back at once. */
static void event_put_recorded(ap_pool *p, void *event, void *stream, int complete, int known) {
    if (counts_records(p)) { /* new mode: its records hold event ids until they have run */
        int n = p->records_carry + 1;
        p->records_carry = 0;
        if (known && complete) {
            records_seen(p, stream, p->record_seq);
            records_add(p, -n);
            ap_event_put(p, event);
        } else {
            park_flying(p, event, stream, NULL, n);
        }
        return;
    }
    if (!ap_backend_event_reset(p->backend) || (known && complete)) ap_event_put(p, event);
    else park(p, event, known, stream);
}

/* An event whose record the runtime refused goes back as it was: parked again when it came parked
   (its earlier records on `stream` may still be queued), else to the cache. A new event was never
   recorded and a cached one's records are complete; parked, such an event would never come back:
   CANN answers NOT_READY for an event never recorded, so a probe of each stream handle the runtime
   does not know (a framework's destroyed streams) kept one parked, idle and counted, for the pool's
   life, and enough of them took the device's whole idle budget (every later event destroyed after
   one use). */
static void event_put_unrecorded(ap_pool *p, void *event, void *stream, int parked) {
    if (counts_records(p) && parked) {
        int n = p->records_carry;
        p->records_carry = 0;
        park_flying(p, event, stream, NULL, n);
    } else if (parked) {
        park(p, event, 1, stream);
    } else {
        ap_event_put(p, event);
    }
}

/* Asks, without waiting, whether the work queued on stream so far is done: an event recorded now
   and queried at once. 1 done, 0 not yet (or no event to ask with), -1 the runtime refuses the
   stream (unusable: destroyed elsewhere, garbage; or its handle is another device's stream now:
   handle_moved), AP_STREAM_ELSEWHERE the stream is in a context this thread cannot reach (not
   done, as far as anyone here can tell). */
static int stream_idle(ap_pool *p, void *stream) {
    ap_on_device(p);
    if (!record_room(p)) return 0; /* new mode, at the bound: not known idle */
    int parked;
    void *ev = event_get(p, stream, &parked);
    if (!ev) return 0;
    int rc = p->backend->event_record(p->backend, ev, stream), complete = 0;
    if (rc != 0) { /* only the record speaks for the stream; a failed query is the event's */
        event_put_unrecorded(p, ev, stream, parked);
        return ap_stream_unusable(p, rc) || handle_moved(p, stream, rc) ? -1
               : ap_stream_elsewhere(p, rc)                              ? AP_STREAM_ELSEWHERE
                                                                         : 0;
    }
    if (counts_records(p)) records_add(p, 1);
    rc = p->backend->event_query(p->backend, ev, &complete);
    event_put_recorded(p, ev, stream, complete, rc == 0); /* recorded, never waited on */
    return rc == 0 && complete;
}

void ap_slot_retire(ap_pool *p, int slot) {
    if (slot <= 0 || !p->slots[slot].live) return;
    records_add(p, -p->slots[slot].stranded); /* the runtime no longer knows the stream */
    p->slots[slot].stranded = 0;
    ap_free_retag_slot(p, slot, 0);
    p->slots[slot].live = 0;
    if (p->slots[slot].gate) gates_drop(p); /* its frees are asked again, not left to its gate */
    p->slots[slot].gate = NULL;
    if (p->last_slot == slot) p->last_slot = 0;
}

int ap_stream_gone(ap_pool *p, int slot) {
    if (slot <= 0 || !p->slots[slot].stream) return 0;
    void *stream = p->slots[slot].stream;
    int dev, gone = 0, retire = 1;
    if (p->backend->stream_device && p->backend->stream_device(p->backend, stream, &dev) == 0 && dev != p->device) {
        /* its handle now names another device's stream: ours was destroyed, but blocks freed
           naming the new one since (a peer's kernel used them last) are in the slot too: they go
           to every stream once its queued work is done (handle_moved); before, at once, and the
           next request got a block that the peer's kernel still wrote */
        gone = -3;
        retire = moved_stream_idle(p, stream, dev);
    } else if (stream_idle(p, stream) == -1) {
        gone = -2;
    }
    if (gone && retire) ap_slot_retire(p, slot);
    return gone;
}

/* The table is full: streams destroyed behind the pool's back (a framework that creates and
   destroys its streams) still hold slots, since the pool learns of a destroy only when it next
   calls the runtime on that stream. Asks each once (an event record, no wait) and retires those
   the runtime no longer knows; returns a freed slot, or -1 when every stream is alive. Rare: once
   per AP_MAX_STREAMS - 1 streams the pool saw die unseen. */
static int reclaim_destroyed_slots(ap_pool *p) {
    int freed = -1;
    for (int i = 1; i < p->n_slots; i++) {
        if (!p->slots[i].live || !p->slots[i].stream || stream_idle(p, p->slots[i].stream) != -1) continue;
        ap_slot_retire(p, i);
        if (freed < 0) freed = i;
    }
    AP_ASSERT(freed < 0 || (!p->slots[freed].trees[0].count && !p->slots[freed].trees[1].count));
    return freed;
}

/* 1 when a side stream (not NULL) may take a new slot: side streams hold at most
   AP_MAX_SIDE_STREAMS, so one stays free for the default stream until it has its own. Asked only
   when a new stream gets a slot; counts only when at most one place is left. */
static int side_room(const ap_pool *p) {
    int free = AP_MAX_STREAMS - p->n_slots, has_default = 0;
    if (free >= 2) return 1;
    for (int i = 1; i < p->n_slots; i++) {
        if (p->slots[i].live) has_default |= !p->slots[i].stream;
        else if (!p->slots[i].trees[0].count && !p->slots[i].trees[1].count) free++;
    }
    return free >= (has_default ? 1 : 2);
}

int ap_slot_of(ap_pool *p, void *stream, int create) {
    int last = p->last_slot;
    if (last > 0 && p->slots[last].live && p->slots[last].stream == stream) return last;
    int dead = -1;
    for (int i = 1; i < p->n_slots; i++) {
        if (p->slots[i].live && p->slots[i].stream == stream) {
            p->last_slot = i;
            return i;
        }
        if (!p->slots[i].live && dead < 0 && !p->slots[i].trees[0].count && !p->slots[i].trees[1].count)
            dead = i;
    }
    if (!create) return -1;
    /* Another device's stream would order this device's memory on the wrong queue (and an event of
       this device cannot be recorded on it: asked first). Where the runtime cannot tell a stream's
       device (a real CANN with a foreign handle), it is trusted. */
    int dev;
    if (stream && p->backend->stream_device && p->backend->stream_device(p->backend, stream, &dev) == 0 &&
        dev != p->device)
        return -3;
    /* A stream seen for the first time: one question to the runtime, so that a handle it does not
       know never gets a slot (no event is ever recorded on it later). */
    int idle = stream ? stream_idle(p, stream) : 1;
    if (idle == -1) return -2;
    if (idle == AP_STREAM_ELSEWHERE && create != 2) return -4; /* 2: the C ABI's free (ap_pool_free) */
    int i = dead;
    if (stream ? !side_room(p) : i < 0 && p->n_slots == AP_MAX_STREAMS) {
        int freed = reclaim_destroyed_slots(p);
        if (stream ? !side_room(p) : freed < 0) return -1;
        if (i < 0) i = freed;
    }
    if (i < 0) {
        if (p->n_slots == AP_MAX_STREAMS) return -1;
        if (p->n_slots == p->slots_cap) {
            int cap = p->slots_cap * 2;
            ap_stream_slot *s = realloc(p->slots, (size_t)cap * sizeof *s);
            if (!s) return -1;
            p->slots = s;
            p->slots_cap = cap;
        }
        i = p->n_slots++;
        p->slots[i].epoch = 0;
        p->slots[i].gen = 0;
        p->slots[i].gate = NULL;
    }
    ap_stream_slot *s = &p->slots[i];
    if (s->gate) gates_drop(p); /* the earlier stream's pending frees are asked again */
    s->gate = NULL;
    s->gen++; /* its earlier stream's events (event_key) are not this stream's */
    s->stream = stream;
    s->live = 1;
    s->epoch++; /* never reset: a wait begun (lock dropped) on this slot's earlier stream, whose
                   handle the runtime may give the new one, must not match it (waits.c) */
    s->trees[0] = (ap_free_tree){0};
    s->trees[1] = (ap_free_tree){0};
    s->stranded = 0;
    s->stranded_seq = 0;
    p->last_slot = i;
    return i;
}

/* Idle cached events of all of this process's pools, per device. Each pool keeps at most
   event_cache_max idle events, and all pools of a device together at most AP_EVENT_CACHE_MAX:
   a process with many tenant contexts on one device must not hold the device's few events
   (1,023 on Atlas inference cards) idle while the framework needs some. */
static atomic_int idle_events[AP_MAX_DEVICES];

static atomic_int *idle_of(const ap_pool *p) {
    return &idle_events[p->device >= 0 && p->device < AP_MAX_DEVICES ? p->device : 0];
}

/* Takes one of the device's AP_EVENT_CACHE_MAX idle places: 1, or 0 when none is left. One
   compare-and-swap, not a check and an add: pools under their own locks put events back at once,
   and two that both saw the last place took it both. */
static int idle_take(const ap_pool *p) {
    atomic_int *n = idle_of(p);
    int v = atomic_load(n);
    while (v < AP_EVENT_CACHE_MAX)
        if (atomic_compare_exchange_weak(n, &v, v + 1)) return 1;
    return 0;
}

/* Events a stream waited on (the borrow path) are reset on the waiting stream, and CANN's reset
   is asynchronous: it runs when that stream reaches it, after its wait. Recorded elsewhere before
   then, an event of aclrtCreateEventWithFlag (one hardware id for its life) could satisfy the
   old wait early, letting the borrowing stream run over a block the lending stream still
   writes, or be cleared by the late reset, hanging a later wait (aclrtResetEvent: "make sure it
   has run with a synchronizing call"). So such an event is recorded once more on the waiting
   stream itself, after its reset (stream order runs that record after the wait and the reset),
   and parked; once that record is complete the reset has run, and the event goes back to the
   cache as any recorded, never-waited event. Events recorded and not known complete (a probe of
   a busy stream, a borrow whose wait failed) are parked too (event_put_recorded). Meanwhile a
   parked event serves a record on its `stream` (ap_event_get): its records run before that. */
struct ap_parked_event {
    void *event;
    void *stream; /* every record of the event runs before the work queued on this stream so far */
    int marked; /* 0: never to be reused (its reset or its record failed); destroyed when no wait pins events */
    /* New mode (park_flying): records of the event not known complete, each holding an event id
       (0: a parked event of the reset scheme). Such an entry is no idle event (not counted among
       them): kept until its latest record is complete, which the others all run before. */
    int flying;
    void *waiter; /* new mode: a stream that waited on the latest record (NULL: none); work queued
                     on it since runs after every record too */
    uint64_t seq; /* new mode: the latest record's number (ap_pool.record_seq) */
};

static void event_destroy(ap_pool *p, void *event);

static void parked_recycle(ap_pool *p) {
    int kept = 0;
    for (int i = 0; i < p->n_parked; i++) {
        struct ap_parked_event pe = p->parked[i];
        int complete = 0, rc = -1;
        if (pe.marked) {
            ap_on_device(p);
            rc = p->backend->event_query(p->backend, pe.event, &complete);
        }
        if ((rc == 0 && !complete) || (rc != 0 && p->event_pins)) {
            p->parked[kept++] = pe; /* not yet (or destroyed once no wait holds event handles) */
            continue;
        }
        if (pe.flying) { /* its latest record has run, so have the others */
            if (rc == 0) records_seen(p, pe.stream, pe.seq);
            records_add(p, -pe.flying);
        }
        else atomic_fetch_sub(idle_of(p), 1);
        if (rc == 0) /* the waiting stream ran the reset: as new */
            ap_event_put(p, pe.event);
        else /* no reset to count on (or nothing to tell it by): never recorded again */
            event_destroy(p, pe.event);
    }
    p->n_parked = kept;
}

/* A parked event whose records all run before the work queued on `stream` so far (a reset there
   comes after them: event_for_wait), or NULL. */
static void *take_parked(ap_pool *p, void *stream) {
    for (int i = p->n_parked - 1; i >= 0; i--) {
        struct ap_parked_event *pe = &p->parked[i];
        if (!pe->marked || (pe->stream != stream && !(pe->waiter && pe->waiter == stream))) continue;
        void *ev = pe->event;
        if (pe->flying) p->records_carry = pe->flying; /* the record made now runs after them */
        else atomic_fetch_sub(idle_of(p), 1);
        p->parked[i] = p->parked[--p->n_parked];
        return ev;
    }
    return NULL;
}

/* New mode, no idle event: a parked one with records still out is reused for another stream, its
   records left counted on the stream of its latest one (the slot's `stranded`) until a later
   record there is seen complete (records_seen; strand_probes asks at the records bound). So
   one event serves two streams taking turns, as CUDA's, and every record stays counted. NULL when
   none has a live slot. */
static void *strand(ap_pool *p) {
    for (int i = p->n_parked - 1; i >= 0; i--) {
        struct ap_parked_event *pe = &p->parked[i];
        int slot;
        if (!pe->flying || !pe->marked || (slot = ap_slot_of(p, pe->stream, 0)) <= 0) continue;
        p->slots[slot].stranded += pe->flying;
        if (pe->seq > p->slots[slot].stranded_seq) p->slots[slot].stranded_seq = pe->seq;
        void *ev = pe->event;
        p->parked[i] = p->parked[--p->n_parked];
        return ev;
    }
    return NULL;
}

/* At the records bound: each stream with stranded records and no parked record newer than them
   is asked once (a record past the bound, at most one per such stream until it is seen). */
static void strand_probes(ap_pool *p) {
    for (int s = 1; s < p->n_slots; s++) {
        ap_stream_slot *sl = &p->slots[s];
        if (!sl->live || !sl->stranded) continue;
        int newer = 0;
        for (int i = 0; i < p->n_parked && !newer; i++)
            newer = p->parked[i].flying && p->parked[i].stream == sl->stream && p->parked[i].seq > sl->stranded_seq;
        if (newer) continue;
        void *ev = NULL;
        if (p->n_cached_events) {
            atomic_fetch_sub(idle_of(p), 1);
            ev = p->event_cache[--p->n_cached_events];
        } else if (p->backend->event_create(p->backend, p->device, &ev) == 0) {
            p->stats.events_created++;
            live_add(p, 1);
        } else {
            continue;
        }
        int complete = 0;
        if (p->backend->event_record(p->backend, ev, sl->stream) != 0) {
            ap_event_put(p, ev);
            continue;
        }
        records_add(p, 1);
        int known = p->backend->event_query(p->backend, ev, &complete) == 0;
        p->records_carry = 0;
        event_put_recorded(p, ev, sl->stream, complete, known);
    }
}

/* ap_event_get; *parked: 1 when the event is a parked one (take_parked), else 0. New mode: a
   parked event only where the caller carries its records (stream_idle, event_for_wait:
   records_carry); a pending free's event holds one record. */
static void *event_get_for(ap_pool *p, void *stream, int *parked, int carry_ok) {
    *parked = 0;
    if (p->n_parked && !p->n_cached_events) {
        void *ev = carry_ok || !counts_records(p) ? take_parked(p, stream) : NULL;
        if (ev) {
            *parked = 1;
            return ev;
        }
        parked_recycle(p);
        if (!p->n_cached_events && counts_records(p)) {
            ev = strand(p);
            if (ev) return ev;
        }
    }
    if (p->n_cached_events) {
        atomic_fetch_sub(idle_of(p), 1);
        return p->event_cache[--p->n_cached_events];
    }
    void *ev = NULL;
    if (!event_room(p) || p->backend->event_create(p->backend, p->device, &ev) != 0) return NULL;
    p->stats.events_created++;
    live_add(p, 1);
    return ev;
}

static void *event_get(ap_pool *p, void *stream, int *parked) {
    return event_get_for(p, stream, parked, 1);
}

void *ap_event_get(ap_pool *p, void *stream) {
    int parked;
    return event_get(p, stream, &parked);
}

static void event_destroy(ap_pool *p, void *event) {
    p->backend->event_destroy(p->backend, event);
    live_add(p, -1);
}

/* Back into the cache, which holds at most event_cache_max idle events: the device's events are
   few (1,023 on Atlas inference cards), so a burst of cross-stream frees must not keep them all.
   While a wait outside the lock holds handles (event_pins), none is destroyed. */
void ap_event_put(ap_pool *p, void *event) {
    if (!(p->n_cached_events < p->event_cache_max && idle_take(p))) {
        if (!p->event_pins) {
            event_destroy(p, event);
            return;
        }
        atomic_fetch_add(idle_of(p), 1); /* kept past the bound while pinned, and counted */
    }
    if (p->n_cached_events == p->event_cache_cap) {
        int cap = p->event_cache_cap ? p->event_cache_cap * 2 : 16;
        void **c = realloc(p->event_cache, (size_t)cap * sizeof *c);
        if (!c) {
            atomic_fetch_sub(idle_of(p), 1);
            event_destroy(p, event);
            return;
        }
        p->event_cache = c;
        p->event_cache_cap = cap;
    }
    p->event_cache[p->n_cached_events++] = event;
}

static void park(ap_pool *p, void *event, int marked, void *stream) {
    if (p->n_parked) parked_recycle(p);
    if (p->n_parked == p->parked_cap) {
        int cap = p->parked_cap ? p->parked_cap * 2 : 8;
        struct ap_parked_event *a = realloc(p->parked, (size_t)cap * sizeof *a);
        if (a) {
            p->parked = a;
            p->parked_cap = cap;
        }
    }
    /* The cache's bounds hold here too, per pool and for all pools of the device together
       (parked events count as idle ones: the device's events are few, 1,023 on Atlas inference
       cards); while waits pin event handles nothing is destroyed. */
    int room = p->n_parked < p->parked_cap;
    int counted = room && p->n_parked < p->event_cache_max && idle_take(p);
    if (counted || (room && p->event_pins)) {
        if (!counted) atomic_fetch_add(idle_of(p), 1); /* kept past the bound while pinned, and counted */
        p->parked[p->n_parked++] = (struct ap_parked_event){.event = event, .stream = stream, .marked = marked};
        return;
    }
    if (p->event_pins) return; /* no room and none may be destroyed: the handle is left, not reused */
    event_destroy(p, event); /* CANN's aclrtDestroyEvent does not block: freed once its work completes */
}

/* New mode: an event with n records not known complete, all run before the work queued so far on
   `stream` (the stream of its latest record) and on `waiter` (a stream that waited on it, or NULL),
   so a record on either may reuse it at once (the pingpong of two streams: one event). Kept
   whatever the idle bounds: its records are counted in records_out until the pool sees the latest
   complete (destroyed now, they could never be). */
static void park_flying(ap_pool *p, void *event, void *stream, void *waiter, int n) {
    if (n <= 0) {
        ap_event_put(p, event);
        return;
    }
    if (p->n_parked == p->parked_cap) {
        int cap = p->parked_cap ? p->parked_cap * 2 : 8;
        struct ap_parked_event *a = realloc(p->parked, (size_t)cap * sizeof *a);
        if (!a) { /* no host memory: forgotten (the runtime frees the ids once the records run) */
            records_add(p, -n);
            if (!p->event_pins) event_destroy(p, event); /* else left: a wait outside the lock may hold it (park) */
            return;
        }
        p->parked = a;
        p->parked_cap = cap;
    }
    p->parked[p->n_parked++] = (struct ap_parked_event){event, stream, 1, n, waiter, p->record_seq};
}

void ap_event_put_waited(ap_pool *p, void *event, void *recorded_on, void *waiting_stream) {
    /* CANN: reset after aclrtStreamWaitEvent, on the waiting stream, before any new record
       (docs/cann-rules-events.md), and reused only once that stream has run the reset (above).
       An event that cannot be reset is never reused. CUDA (no event_reset): reusable at once. */
    int (*reset)(ap_backend *, void *, void *) = ap_backend_event_reset(p->backend);
    if (!reset && counts_records(p)) { /* new mode: no reset; parked until its record has run */
        int n = p->records_carry + 1;
        p->records_carry = 0;
        park_flying(p, event, recorded_on, waiting_stream, n);
        return;
    }
    if (!reset) {
        ap_event_put(p, event);
        return;
    }
    int marked = reset(p->backend, event, waiting_stream) == 0 &&
                 p->backend->event_record(p->backend, event, waiting_stream) == 0;
    park(p, event, marked, waiting_stream);
}

void ap_foreign_events_gone(ap_block_uses *u) {
    for (int i = 0; i < u->n_fevents; i++) foreign_add(u->foreign_device[i], -1);
}

int ap_records_counted(const ap_pool *p) {
    if (!counts_records(p)) return 0;
    int n = 0;
    for (int i = 0; i < p->n_parked; i++) n += p->parked[i].flying;
    for (const ap_block *b = p->pending_head; b; b = b->pending_next) n += b->xs ? b->xs->n_events : 0;
    for (int s = 1; s < p->n_slots; s++) n += p->slots[s].stranded;
    return n;
}

void ap_events_trim(ap_pool *p, int keep) {
    if (p->n_parked) parked_recycle(p);
    while (p->n_cached_events > keep) {
        event_destroy(p, p->event_cache[--p->n_cached_events]);
        atomic_fetch_sub(idle_of(p), 1);
    }
}

void ap_events_destroy(ap_pool *p) {
    ap_events_trim(p, 0);
    for (int i = 0; i < p->n_parked; i++) { /* closing: the runtime frees them once their work completes */
        event_destroy(p, p->parked[i].event);
        if (!p->parked[i].flying) atomic_fetch_sub(idle_of(p), 1);
    }
    free(p->parked);
    p->parked = NULL;
    p->n_parked = p->parked_cap = 0;
    /* Closing: records still out are the runtime's to finish (their ids go back as they run). */
    atomic_fetch_sub(records_of(p), p->records_out);
    p->records_out = 0;
    /* Events destroyed at the close with their pending blocks, or left to a wait still holding
       their handles: no longer this pool's. */
    live_add(p, (int)-p->live_events);
    free(p->event_cache);
    p->event_cache = NULL;
    p->n_cached_events = p->event_cache_cap = 0;
}

/* Records an event after the work queued on stream so far. NULL if no event could be had (the
   caller then waits for the stream on the host instead); *code is then the runtime's refusal of
   the record, or 0 when no event was to be had. */
static void *record_on_carry(ap_pool *p, void *stream, int *code, int carry_ok) {
    ap_on_device(p);
    *code = 0;
    if (!record_room(p)) return NULL; /* new mode, at the bound */
    int parked;
    void *ev = event_get_for(p, stream, &parked, carry_ok);
    if (!ev) return NULL;
    if ((*code = p->backend->event_record(p->backend, ev, stream)) != 0) {
        event_put_unrecorded(p, ev, stream, parked);
        return NULL;
    }
    if (counts_records(p)) records_add(p, 1);
    return ev;
}

/* An event for a pending free: one record, counted until event_done finds it complete. */
static void *record_on_code(ap_pool *p, void *stream, int *code) {
    return record_on_carry(p, stream, code, 0);
}

static void *record_on(ap_pool *p, void *stream) {
    int code;
    return record_on_code(p, stream, &code);
}

/* An event recorded on stream for another stream to wait on (the borrow path). CANN: a cached
   event has a record that ran since its last reset (the borrow path's own record on the waiting
   stream, a probe's, a pending free's), and the hardware flag of an ACL_EVENT_SYNC event stays
   set until aclrtResetEvent (hicann/runtime Event::Record keeps the event's id, Event::WaitSendCheck
   sends every wait to the device): recorded again as it is, the wait would pass at once, before
   the new record, and the borrowing stream would reuse blocks the lending stream still writes.
   So the event is reset on the lending stream first: that stream runs the reset, then the
   record, and every earlier record of the event has completed (event_put_recorded: parked until
   then) or runs before the work queued on that same stream, so before the reset (ap_event_get:
   such a parked event serves a record on that stream at once). An event whose reset or record
   fails is never reused. NULL and *code as record_on_code. */
static void *event_for_wait(ap_pool *p, void *stream, int *code) {
    int (*reset)(ap_backend *, void *, void *) = ap_backend_event_reset(p->backend);
    if (!reset) return record_on_carry(p, stream, code, 1); /* back through ap_event_put_waited or event_put_recorded */
    ap_on_device(p);
    *code = 0;
    void *ev = ap_event_get(p, stream);
    if (!ev) return NULL;
    if ((*code = reset(p->backend, ev, stream)) != 0 ||
        (*code = p->backend->event_record(p->backend, ev, stream)) != 0) {
        park(p, ev, 0, stream);
        return NULL;
    }
    return ev;
}

/* Shared with waits.c (pool_internal.h); here, beside the blocking pass, so that the event cache's
   C test links this file alone. */
int64_t ap_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* What is left of one sync_timeout_ms for the whole wait (-1: no limit); 0 when it is spent. */
int ap_time_left(const ap_pool *p, int64_t start) {
    if (p->cfg.sync_timeout_ms < 0) return -1;
    int64_t left = p->cfg.sync_timeout_ms - (ap_now_ms() - start);
    return left > 0 ? (int)left : 0;
}

/* The start of the blocking pass this thread runs (a pool's destroy, which runs it alone), else -1:
   its waits share one sync_timeout_ms, as empty_cache's (waits.c). A full limit each, a close with
   N frees pending behind a hung stream (record_stream on a dead collective's) took N times it. */
static _Thread_local int64_t blocking_since = -1;

/* The limit of one blocking wait: what the pass has left (0: spent), else sync_timeout_ms. */
static int wait_limit(const ap_pool *p) {
    return blocking_since < 0 ? p->cfg.sync_timeout_ms : ap_time_left(p, blocking_since);
}

static int limit_spent(ap_pool *p, const char *what, void *handle, ap_error *err) {
    return ap_set_error(err, AP_E_TIMEOUT, 0, "waiting for %s %p on device %d: the limit of %d ms was spent on the "
                        "other pending frees", what, handle, p->device, p->cfg.sync_timeout_ms);
}

static int sync_stream(ap_pool *p, void *stream, ap_error *err) {
    int limit = wait_limit(p);
    if (limit == 0) return limit_spent(p, "stream", stream, err);
    ap_on_device(p);
    int rc = p->backend->stream_sync(p->backend, stream, limit);
    if (rc == 0) return AP_OK;
    char msg[AP_RUNTIME_MSG];
    p->backend->error_message(p->backend, rc, msg, sizeof msg);
    if (ap_stream_elsewhere(p, rc))
        return ap_set_error(err, AP_E_INVALID_STREAM, rc,
                            "stream %p of device %d is not in this thread's context (%d): its work cannot be "
                            "waited for from here: %s", stream, p->device, rc, msg);
    return ap_set_error(err, rc == 507046 || rc == 507047 ? AP_E_TIMEOUT : AP_E_DEVICE, rc,
                        "waiting for stream %p on device %d failed after %d ms: %s", stream, p->device,
                        p->cfg.sync_timeout_ms, msg);
}

static void pending_unlink(ap_pool *p, ap_block *prev, ap_block *b) {
    AP_ASSERT(b->state == AP_BLOCK_PENDING && (prev ? prev->pending_next : p->pending_head) == b);
    if (prev) prev->pending_next = b->pending_next;
    else p->pending_head = b->pending_next;
    if (p->pending_tail == b) p->pending_tail = prev;
    b->pending_next = NULL;
}

/* A use by a stream of another device (note_foreign_use): an event of that device recorded on it
   now. 1: recorded (the caller keeps it in fevents); 0: none to spare (the device's share of ids
   is held, or the runtime refused): the stream is owed, asked again at the next pass; -1: the
   stream is gone with its work (the runtime no longer knows it, or its handle now names another
   device's stream: owed, the block waited for a stream no event of its device can reach). */
static int record_foreign(ap_pool *p, void *stream, int device, void **out) {
    void *ev = NULL;
    if (!ids_room(p, device)) return 0;
    int rc = p->backend->event_create(p->backend, device, &ev);
    if (rc != 0) return 0;
    rc = p->backend->event_record(p->backend, ev, stream);
    if (rc == 0) {
        foreign_add(device, 1);
        *out = ev;
        return 1;
    }
    p->backend->event_destroy(p->backend, ev);
    if (ap_stream_unusable(p, rc)) return -1;
    int now;
    if (p->backend->stream_device && p->backend->stream_device(p->backend, stream, &now) == 0 && now != device)
        return -1;
    return 0;
}

/* While a block is pending, u->foreign/foreign_device hold first the streams of its fevents (index
   for index: the device each event's id is counted on), then the n_foreign streams still owed an
   event (record_foreign found none to spare). Asks each owed one (blocking: waits for it instead)
   and moves those recorded among the first; AP_E_BUSY while any is still owed. */
static int foreign_owed_done(ap_pool *p, ap_block_uses *u, int blocking, ap_error *err) {
    int i = u->n_fevents, end = u->n_fevents + u->n_foreign;
    while (i < end) {
        void *s = u->foreign[i], *ev = NULL;
        int16_t dev = u->foreign_device[i];
        int r;
        if (blocking) {
            ap_error e = {0};
            if (sync_stream(p, s, &e) != AP_OK && !ap_stream_unusable(p, e.device_code)) {
                if (err) *err = e;
                return e.status;
            }
            r = -1; /* waited for: nothing left to record */
        } else {
            r = record_foreign(p, s, dev, &ev);
        }
        if (r == 0) {
            i++;
            continue;
        }
        if (r > 0) { /* to the front, with its event; the owed one there comes here (asked already) */
            int f = u->n_fevents;
            u->foreign[i] = u->foreign[f];
            u->foreign_device[i] = u->foreign_device[f];
            u->foreign[f] = s;
            u->foreign_device[f] = dev;
            u->fevents[u->n_fevents++] = ev;
            i++;
        } else { /* gone, or waited for: the last owed one takes its place */
            u->foreign[i] = u->foreign[end - 1];
            u->foreign_device[i] = u->foreign_device[end - 1];
            end--;
        }
        u->n_foreign = (uint16_t)(end - u->n_fevents);
    }
    u->n_foreign = (uint16_t)(end - u->n_fevents);
    return u->n_foreign ? AP_E_BUSY : AP_OK;
}

void ap_free_pending(ap_pool *p, ap_block *b, int tag) {
    ap_block_uses *u = b->xs;
    u->n_events = 0;
    u->n_owed = 0;
    /* The free's own stream (i == -1), then each use. Retired slots have no queued work left
       (settled, or the runtime dropped the stream): no event on them, ever (tag 0: a retired
       stream's). */
    for (int i = -1; i < u->n_uses; i++) {
        int slot = i < 0 ? tag : u->uses[i];
        if ((i < 0 ? slot == 0 : slot == tag) || !p->slots[slot].live) continue;
        void *s = p->slots[slot].stream;
        void *ev = record_on(p, s);
        if (ev) {
            u->event_keys[u->n_events] = event_key(p, slot);
            u->events[u->n_events++] = ev;
        } else if (counts_records(p) || !event_room(p) || sync_stream(p, s, NULL) != AP_OK) /* no event
                     to spare: wait now instead (pool.h: the one wait under the lock, rare); new
                     mode: never (at the records bound, or the runtime refused the record:
                     record_room); nor at the reset scheme's live-event bound (event_room) */
            u->owed[u->n_owed++] = s; /* still running (or failed): the block waits for it */
    }
    u->n_fevents = 0; /* every foreign use owed, then asked for an event (foreign_owed_done) */
    (void)foreign_owed_done(p, u, 0, NULL);
    b->state = AP_BLOCK_PENDING;
    u->n_uses = 0;
    b->pending_next = NULL;
    if (p->pending_tail) p->pending_tail->pending_next = b;
    else p->pending_head = b;
    p->pending_tail = b;
    ap_stats_pending(&p->stats, b->seg->pool, (int64_t)b->size, +1);
    ap_history_add_free(&p->history, AP_ACT_FREE_REQUESTED, b->addr, b->requested, p->slots[tag].stream, b->ctx);
}

/* The runtime released the memory of the pending frees of an earlier life (ap_pool_runtime_check;
   `old` says which segments): they are taken out of the list with no runtime call, their events
   (gone with that runtime) counted out, never queried or destroyed; the gates are dropped (one may
   be such an event). Each stays PENDING, with no events, for the caller to forget with its segment. */
void ap_pending_forget(ap_pool *p, int (*old)(const ap_pool *, const ap_segment *)) {
    ap_block *prev = NULL, *b = p->pending_head;
    for (int s = 1; s < p->n_slots; s++) p->slots[s].gate = NULL;
    gates_drop(p);
    p->pending_checked = NULL;
    while (b) {
        ap_block *next = b->pending_next;
        if (old(p, b->seg)) {
            ap_block_uses *u = b->xs;
            if (u) {
                if (counts_records(p)) records_add(p, -(int)u->n_events);
                live_add(p, -(int)u->n_events);
                ap_foreign_events_gone(u);
                u->n_events = u->n_fevents = u->n_owed = u->n_foreign = 0;
            }
            pending_unlink(p, prev, b);
            ap_stats_pending(&p->stats, b->seg->pool, (int64_t)b->size, -1);
            ap_stat_dec(&p->stats, AP_STAT_REQUESTED_BYTES, b->seg->pool, (int64_t)b->requested);
        } else {
            prev = b;
        }
        b = next;
    }
}

/* The runtime released the pool's events with its memory (ap_pool_runtime_check): the idle and
   parked ones are forgotten with no runtime call (a cached dead handle was tried first at every
   record after aclFinalize and aclInit, refused, and cached again: every cross-stream free owed
   its stream), counted out of the device's idle, live and record counts as a close counts them
   (ap_events_destroy); records stranded on streams of that runtime too. Events a wait outside the
   lock holds (event_pins) are that wait's: it finds them refused. */
void ap_events_forget(ap_pool *p) {
    int records = 0;
    atomic_fetch_sub(idle_of(p), p->n_cached_events);
    live_add(p, -p->n_cached_events);
    p->n_cached_events = 0;
    for (int i = 0; i < p->n_parked; i++) {
        if (p->parked[i].flying) records += p->parked[i].flying;
        else atomic_fetch_sub(idle_of(p), 1);
        live_add(p, -1);
    }
    p->n_parked = 0;
    for (int s = 1; s < p->n_slots; s++) {
        records += p->slots[s].stranded;
        p->slots[s].stranded = 0;
    }
    if (counts_records(p)) records_add(p, -records);
    p->records_carry = 0;
}

/* Streams a pending block still owes a wait (ap_free_pending): each becomes an event once one
   can be had (recorded now, it covers at least the work queued before the free), or, blocking,
   a stream wait. A stream the runtime no longer knows has no work left. */
static int owed_done(ap_pool *p, ap_block *b, int blocking, ap_error *err) {
    ap_block_uses *u = b->xs;
    while (u->n_owed) {
        void *s = u->owed[u->n_owed - 1];
        if (blocking) {
            ap_error e = {0};
            if (sync_stream(p, s, &e) != AP_OK && !ap_stream_unusable(p, e.device_code)) {
                if (err) *err = e;
                return e.status;
            }
        } else {
            void *ev = record_on(p, s);
            if (ev) {
                AP_ASSERT(u->n_events < u->cap + u->fcap + 1);
                u->event_keys[u->n_events] = 0; /* recorded after later frees' events: no gate's */
                u->events[u->n_events++] = ev;
            } else if (stream_idle(p, s) != -1) {
                return AP_E_BUSY; /* no event to spare yet (or out of reach): asked again at the next pass */
            } /* else the runtime no longer knows the stream: no work of it is left */
        }
        u->n_owed--;
    }
    return AP_OK;
}

/* AP_OK once ev has completed (blocking: waited for), AP_E_BUSY while not, else the wait's error. */
static int event_done(ap_pool *p, ap_block *b, void *ev, int blocking, ap_error *err) {
    if (!blocking) {
        int complete = 0;
        return p->backend->event_query(p->backend, ev, &complete) == 0 && complete ? AP_OK : AP_E_BUSY;
    }
    int limit = wait_limit(p);
    if (limit == 0) return limit_spent(p, "event", ev, err);
    int rc = p->backend->event_sync(p->backend, ev, limit);
    if (rc == 0) return AP_OK;
    char msg[AP_RUNTIME_MSG];
    p->backend->error_message(p->backend, rc, msg, sizeof msg);
    return ap_set_error(err, rc == 507047 || rc == 507046 ? AP_E_TIMEOUT : AP_E_DEVICE, rc,
                        "waiting for the streams that used block 0x%lx on device %d: %s", (unsigned long)b->addr,
                        p->device, msg);
}

/* *gated: cleared when a non-blocking pass leaves b pending for a reason no gate covers (an owed
   stream, an event of no known stream, another device's event). */
static int events_done(ap_pool *p, ap_block *b, int blocking, ap_error *err, int *gated) {
    ap_block_uses *u = b->xs;
    if (u && u->n_owed) {
        int rc = owed_done(p, b, blocking, err);
        if (rc != AP_OK) {
            *gated = 0;
            return rc;
        }
    }
    if (u && u->n_events) ap_on_device(p);
    while (u && u->n_events) {
        void *ev = u->events[u->n_events - 1];
        ap_stream_slot *on = blocking ? NULL : key_slot(p, u->event_keys[u->n_events - 1]);
        /* Its stream's gate, recorded at an earlier free (the list is in free order), was found not
           complete in this pass: one stream runs its work in order, so neither is this one. */
        if (on && on->gate) return AP_E_BUSY;
        int rc = event_done(p, b, ev, blocking, err);
        if (rc == AP_E_BUSY && on) on->gate = ev;
        else if (rc != AP_OK) *gated = 0; /* no gate covers it (or its query failed: asked again) */
        if (rc != AP_OK) return rc;
        if (counts_records(p)) records_add(p, -1);
        ap_event_put(p, u->events[--u->n_events]);
    }
    if (u && u->n_foreign) {
        int rc = foreign_owed_done(p, u, blocking, err);
        if (rc != AP_OK) {
            *gated = 0; /* another device's stream: no gate of this pool covers it */
            return rc;
        }
    }
    /* Another device's events are destroyed, not cached; never while a wait outside the lock
       (waits.c) may still hold their handles: asked again at the next pass. */
    while (u && u->n_fevents) {
        *gated = 0;
        if (p->event_pins) return AP_E_BUSY;
        int rc = event_done(p, b, u->fevents[u->n_fevents - 1], blocking, err);
        if (rc != AP_OK) return rc;
        u->n_fevents--;
        foreign_add(u->foreign_device[u->n_fevents], -1);
        p->backend->event_destroy(p->backend, u->fevents[u->n_fevents]);
    }
    return AP_OK;
}

/* 1 while every gate of the last pass is still not complete: then no pending free is (pending_gated).
   One query per stream that holds pending frees back, as PyTorch's process_events (the oldest
   event of each stream): before, each allocation asked every pending free's events, and a
   framework with thousands of frees pending behind a busy stream (record_stream on a
   communication stream) paid a runtime query per pending free at every allocation. */
static int gates_hold(ap_pool *p) {
    ap_on_device(p);
    for (int s = 1; s < p->n_slots; s++) {
        void *gate = p->slots[s].gate;
        int complete = 0;
        if (gate && (p->backend->event_query(p->backend, gate, &complete) != 0 || complete)) return 0;
    }
    return 1;
}

int ap_process_pending(ap_pool *p, int blocking, ap_error *err) {
    ap_block *prev = NULL, *b = p->pending_head;
    if (!blocking && p->pending_gated && gates_hold(p)) {
        /* The frees checked before all still wait: only those made since are asked. Their events
           were recorded after every gate, so a stream's gate still covers them (events_done). */
        prev = p->pending_checked;
        b = prev ? prev->pending_next : p->pending_head;
        if (!b) return AP_OK;
    } else {
        for (int s = 1; s < p->n_slots; s++) p->slots[s].gate = NULL;
    }
    int status = AP_OK, gated = !blocking;
    uint64_t drops = p->gate_drops;
    if (blocking) blocking_since = ap_now_ms();
    p->pending_gated = 0;
    while (b) {
        ap_block *next = b->pending_next;
        int rc = events_done(p, b, blocking, err, &gated);
        if (rc == AP_OK) {
            pending_unlink(p, prev, b);
            ap_stats_pending(&p->stats, b->seg->pool, (int64_t)b->size, -1);
            ap_stat_dec(&p->stats, AP_STAT_REQUESTED_BYTES, b->seg->pool, (int64_t)b->requested);
            /* completed later, from whatever call came next: the block's frames, not that call's */
            if (p->history.capacity)
                ap_history_record_ctx(&p->history, AP_ACT_FREE_COMPLETED, b->addr, b->requested, NULL, b->ctx);
            ap_free_insert(p, b, 0);
        } else {
            if (rc != AP_E_BUSY) status = rc;
            prev = b;
        }
        b = next;
    }
    blocking_since = -1;
    /* each free left waits for an event no earlier than its stream's gate (events_done) */
    p->pending_gated = gated && p->pending_head && p->gate_drops == drops;
    p->pending_checked = p->pending_tail;
    return status;
}

int ap_settle_slot(ap_pool *p, int slot, ap_error *err) {
    (void)err;
    if (slot <= 0) return AP_OK;
    ap_stream_slot *s = &p->slots[slot];
    ap_cache_flush(p);
    if (!s->trees[0].count && !s->trees[1].count) return AP_OK;
    /* Under the lock: ask, never wait (pool.h). A busy stream stays as it is; waits.c waits for it
       with the lock dropped when a caller really needs it. */
    int idle = stream_idle(p, s->stream);
    if (idle == -1) {
        ap_slot_retire(p, slot);
        return AP_OK;
    }
    if (idle != 1) return AP_E_BUSY; /* 0: busy; AP_STREAM_ELSEWHERE: out of reach, so not known idle */
    ap_free_retag_slot(p, slot, 0);
    return AP_OK;
}

int ap_settle_free_slots(ap_pool *p, ap_error *err) {
    int any = 0;
    for (int slot = 1; slot < p->n_slots; slot++)
        if ((p->slots[slot].trees[0].count || p->slots[slot].trees[1].count) && ap_settle_slot(p, slot, err) == AP_OK)
            any = 1;
    return any;
}

size_t ap_borrow_from_streams(ap_pool *p, int to, int pool, size_t rsize, ap_error *err) {
    (void)err;
    size_t moved = 0;
    ap_cache_flush(p);
    for (int s = 1; s < p->n_slots; s++) {
        if (s == to) continue;
        ap_free_tree *t = &p->slots[s].trees[pool];
        /* Skip a stream whose blocks could not make a fit even merged with every other free byte. */
        if (!t->count || t->bytes + p->slots[to].trees[pool].bytes + p->slots[0].trees[pool].bytes < rsize)
            continue;
        int code;
        void *ev = event_for_wait(p, p->slots[s].stream, &code);
        int target = to;
        if (!ev && (ap_stream_unusable(p, code) || handle_moved(p, p->slots[s].stream, code))) {
            /* Destroyed behind the pool's back (a framework's stream; its handle perhaps another
               device's stream's now): no work of it is left, so its blocks serve every stream.
               Left alone, they stayed out of reach of every later stream and each new stream
               grew the pool. */
            moved += t->count;
            ap_slot_retire(p, s);
            continue;
        }
        if (!ev) continue; /* no event: leave its blocks alone (never a host wait under the lock) */
        if (p->backend->stream_wait_event(p->backend, p->slots[to].stream, ev) != 0) {
            event_put_recorded(p, ev, p->slots[s].stream, 0, 1); /* recorded, not waited on: back once complete */
            continue;
        }
        ap_event_put_waited(p, ev, p->slots[s].stream, p->slots[to].stream);
        p->stats.stream_migrations++;
        /* Take just the best fit when one block is enough, so that the other stream keeps the
           rest of its cache (two streams that alternate would otherwise pull every block back
           and forth); else everything, so that neighbours can merge into a fit. */
        ap_block *fit = ap_tree_best_fit(t, rsize);
        if (fit && target == to) {
            ap_free_remove(p, fit);
            fit->state = AP_BLOCK_MOVING;
            ap_free_insert(p, fit, target);
            moved += 1;
        } else {
            moved += t->count;
            ap_free_retag_slot(p, s, target);
        }
    }
    return moved;
}

void ap_pool_forget_stream(ap_pool *p, void *stream) {
    pthread_mutex_lock(&p->lock);
    int slot = stream ? ap_slot_of(p, stream, 0) : -1;
    /* The caller's answer may be stale (register_stream asked with the GIL released): a stream of
       this device made with the handle since has work ordered on its cached blocks, which
       retagged to every stream would be handed out under that work. */
    if (slot > 0) ap_stream_gone(p, slot);
    pthread_mutex_unlock(&p->lock);
}

int ap_pool_stream_idle(ap_pool *p, void *stream) {
    pthread_mutex_lock(&p->lock);
    int idle = stream_idle(p, stream);
    pthread_mutex_unlock(&p->lock);
    return idle == AP_STREAM_ELSEWHERE ? 0 : idle;
}
