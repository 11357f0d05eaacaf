/* Copies the pool's segments, blocks and history under the lock, so that the Python side can
 * build PyTorch-schema snapshots without holding it. */
#include <stdlib.h>

#include "pool_internal.h"

int ap_pool_snapshot(ap_pool *p, ap_snapshot *out) {
    *out = (ap_snapshot){0};
    /* Cached blocks show merged with their free neighbours, as the next miss would merge them,
       without flushing: reading a snapshot must not change what the pool does next. */
    pthread_mutex_lock(&p->lock);
    size_t n_blocks = 0;
    for (ap_segment *s = p->segments; s; s = s->next)
        for (ap_block *b = s->first; b; b = b->next) n_blocks++;
    out->segments = malloc((p->n_segments ? p->n_segments : 1) * sizeof *out->segments);
    out->blocks = malloc((n_blocks ? n_blocks : 1) * sizeof *out->blocks);
    if (!out->segments || !out->blocks) {
        pthread_mutex_unlock(&p->lock);
        ap_snapshot_free(out);
        return AP_E_HOST_NOMEM;
    }
    size_t i = 0, j = 0;
    for (ap_segment *s = p->segments; s; s = s->next, i++) {
        ap_snap_segment *o = &out->segments[i];
        o->base = s->base;
        o->size = s->size;
        o->pool = s->pool;
        o->expandable = s->expandable;
        o->stream = s->alloc_slot ? p->slots[s->alloc_slot].stream : NULL;
        o->ctx = s->ctx;
        o->first_block = j;
        for (ap_block *b = s->first; b; b = b->next) /* a cached block is isolated: one free block */
            out->blocks[j++] = (ap_snap_block){b->addr, b->size, b->requested,
                                               b->state == AP_BLOCK_CACHED ? AP_BLOCK_FREE : b->state,
                                               b->state == AP_BLOCK_ALLOCATED || b->state == AP_BLOCK_PENDING ? ap_block_frames(b) : 0};
        o->n_blocks = j - o->first_block;
#if AP_CHECKED
        size_t covered = 0;
        for (size_t k = o->first_block; k < j; k++) covered += out->blocks[k].size;
        AP_ASSERT(covered == s->size); /* blocks tile their segment: PyTorch's snapshot readers rely on it */
#endif
    }
    AP_ASSERT(i == p->n_segments && j <= n_blocks);
    out->n_segments = i;
    out->n_blocks = j;
    /* PyTorch gathers the trace first: this snapshot's own event shows in the next one. */
    out->n_history = ap_history_copy(&p->history, &out->history);
    /* Its size is the bytes active at that moment (allocated or waiting for events), as PyTorch's. */
    size_t active = (size_t)(ap_stat_all_current(&p->stats, AP_STAT_ALLOCATED_BYTES) +
                             p->stats.pending[1][AP_STAT_ALL].current);
    ap_history_add(&p->history, AP_ACT_SNAPSHOT, 0, active, NULL);
    pthread_mutex_unlock(&p->lock);
    return AP_OK;
}

size_t ap_pool_history_copy(ap_pool *p, ap_history_entry **out) {
    /* The history alone, adding no snapshot event: what ascend_pool.snapshot reads to learn which
       user-metadata ids entries still name. */
    pthread_mutex_lock(&p->lock);
    size_t n = ap_history_copy(&p->history, out);
    pthread_mutex_unlock(&p->lock);
    return n;
}

size_t ap_pool_count_free_blocks(ap_pool *p) {
    /* As the snapshot shows them (a cached block is one free block), without copying anything or
       adding a snapshot event to the history. */
    size_t n = 0;
    pthread_mutex_lock(&p->lock);
    for (ap_segment *s = p->segments; s; s = s->next)
        for (ap_block *b = s->first; b; b = b->next) n += b->state == AP_BLOCK_FREE || b->state == AP_BLOCK_CACHED;
    pthread_mutex_unlock(&p->lock);
    return n;
}

int ap_pool_set_history(ap_pool *p, size_t capacity, uint32_t skip) {
    /* The new ring is made and the old one freed outside the lock: only the swap is under it. */
    ap_history fresh, old;
    if (ap_history_init(&fresh, capacity) != 0) return AP_E_HOST_NOMEM;
    pthread_mutex_lock(&p->lock);
    if (p->history.capacity == capacity) { /* unchanged: the entries so far are kept */
        old = fresh;
    } else {
        /* Resized while recording (torch_npu's _record_memory_history with another max_entries):
           the most recent entries stay, as torch's ring; only turning it off drops them. */
        if (capacity && p->history.capacity) ap_history_keep_recent(&fresh, &p->history);
        old = p->history;
        p->history = fresh;
        p->cfg.history_capacity = capacity;
    }
    p->history.skip = skip;
    pthread_mutex_unlock(&p->lock);
    ap_history_destroy(&old);
    return AP_OK;
}

void ap_snapshot_free(ap_snapshot *s) {
    free(s->segments);
    free(s->blocks);
    free(s->history);
    *s = (ap_snapshot){0};
}
