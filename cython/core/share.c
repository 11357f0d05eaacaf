/* Shared blocks: dedicated segments that other processes import (see share.h). */
#include <string.h>

#include "share.h"
#include "pool_internal.h"

#define ACL_ERROR_RT_IPC_ERROR 507022 /* the runtime refuses: importers still map the memory */

static int device_error(ap_backend *b, int device, ap_error *err, int rc, const char *what) {
    char msg[AP_RUNTIME_MSG];
    b->error_message(b, rc, msg, sizeof msg);
    int status = b->kind == AP_BACKEND_ACL && rc == ACL_ERROR_RT_IPC_ERROR ? AP_E_BUSY : AP_E_DEVICE;
    return ap_set_error(err, status, rc, "%s on device %d failed (%d): %s", what, device, rc, msg);
}

int ap_share_alloc(ap_pool *p, size_t size, ap_share *s, ap_error *err) {
    memset(s, 0, sizeof *s);
    if (size == 0) return ap_set_error(err, AP_E_INVALID_SIZE, 0, "size must be positive, got 0 bytes");
    if ((int64_t)size < 0 || size > (size_t)p->stats.device_total_bytes)
        return ap_set_error(err, AP_E_OOM, 0,
                            "out of memory: Tried to share %zu bytes on device %d: larger than the device's %lld bytes",
                            size, p->device, (long long)p->stats.device_total_bytes);
    size_t bytes = ap_round_up(size, AP_SHARE_PAGE);
    ap_block *b = NULL;
    pthread_mutex_lock(&p->lock);
    /* A device call follows, and on a refusal a release of the pool's idle segments: what the
       runtime released goes first, as in a malloc (its aclrtFree freed the application's buffer
       the new runtime had put at a cached segment's address). */
    ap_pool_runtime_check(p, 1);
    int rc = ap_segment_alloc(p, AP_POOL_LARGE, bytes, 0, 1, &b, err);
    if (rc != AP_OK && rc != AP_E_HOST_NOMEM && rc != AP_E_QUOTA) {
        /* Out of device memory or over the limit: give the device this pool's idle segments. */
        p->stats.num_alloc_retries++;
        ap_release_free_segments(p, (size_t)-1, 0, 0, NULL);
        rc = ap_segment_alloc(p, AP_POOL_LARGE, bytes, 0, 1, &b, err);
    }
    if (rc == AP_E_QUOTA) { /* the tenant's own cache first, as a pool malloc does */
        ap_release_free_segments(p, (size_t)-1, 0, 0, NULL);
        rc = ap_segment_alloc(p, AP_POOL_LARGE, bytes, 0, 1, &b, err);
    }
    if (rc == AP_E_QUOTA && p->quota.settle) {
        /* As a pool malloc's refusal (pool.c): the reserve under the lock skipped the give-back of
           dead processes' shares if the ledger's lock was busy; settle waits for it, this lock
           dropped (the caller holds the pool open: its close waits), and the block is asked again
           if some came back. Without it a share_malloc was refused where a malloc was granted. */
        ap_quota_hook q = p->quota;
        pthread_mutex_unlock(&p->lock);
        int settled = q.settle(q.ctx, p->device);
        pthread_mutex_lock(&p->lock);
        if (settled) {
            ap_pool_runtime_check(p, 1); /* the runtime may have been released meanwhile */
            rc = ap_segment_alloc(p, AP_POOL_LARGE, bytes, 0, 1, &b, err);
        }
    }
    if (rc != AP_OK) {
        if (rc == AP_E_QUOTA) p->stats.num_quota_exceeded++;
        else p->stats.num_ooms++;
        if (rc == AP_E_LIMIT) p->stats.num_oom_rejections++;
        if (rc == AP_E_DEVICE) err->status = rc = AP_E_OOM;
        pthread_mutex_unlock(&p->lock);
        return rc;
    }
    ap_free_remove(p, b); /* never in a free tree or the live map: malloc cannot hand it out */
    ap_mark_allocated(p, b, size, 0);
    b->seg->shared = 1;
    ap_history_note_alloc(p, b, size, NULL);
    s->backend = p->backend;
    s->seg = b->seg;
    s->base = b->addr;
    s->size = bytes;
    s->requested = size;
    s->device = p->device;
    s->life = b->seg->life;
    s->state = AP_SHARE_ALLOCATED;
    pthread_mutex_unlock(&p->lock);
    return AP_OK;
}

int ap_share_lost(ap_share *s, int probe) {
    return s->state != AP_SHARE_RELEASED && ap_backend_life(s->backend, s->device, probe) != s->life;
}

/* Export, set_pids, unexport of a block the runtime released: its address may be the new
   runtime's memory (an application's buffer), and its key is closed. */
static int lost_error(ap_share *s, ap_error *err) {
    return ap_set_error(err, AP_E_INVALID_PTR, 0,
                        "shared block 0x%lx on device %d was released by the runtime (aclFinalize, or resets that took "
                        "the pools' device references): its memory and key are gone; give it back with share_free",
                        (unsigned long)s->base, s->device);
}

int ap_share_export(ap_share *s, unsigned flags, ap_error *err) {
    if (ap_share_lost(s, 1)) return lost_error(s, err);
    if (s->state != AP_SHARE_ALLOCATED)
        return ap_set_error(err, AP_E_INVALID_PTR, 0, "block 0x%lx is %s", (unsigned long)s->base,
                            s->state == AP_SHARE_EXPORTED ? "exported already" : "released");
    if (!s->backend->has_ipc)
        return ap_set_error(err, AP_E_DEVICE, AP_ERR_MISSING_SYMBOL,
                            "the %s backend (%s) cannot share device memory between processes: the runtime lacks "
                            "its IPC calls", s->backend->name, s->backend->path);
    char key[AP_IPC_KEY_MAX] = "";
    int rc = s->backend->ipc_export(s->backend, s->device, (void *)s->base, s->size, key, sizeof key, flags);
    if (rc != 0) return device_error(s->backend, s->device, err, rc, "exporting the shared block");
    memcpy(s->key, key, sizeof key);
    s->state = AP_SHARE_EXPORTED;
    return AP_OK;
}

int ap_share_set_pids(ap_share *s, const int32_t *pids, size_t n, ap_error *err) {
    if (ap_share_lost(s, 1)) return lost_error(s, err);
    if (s->state != AP_SHARE_EXPORTED)
        return ap_set_error(err, AP_E_INVALID_PTR, 0, "block 0x%lx is not exported", (unsigned long)s->base);
    int rc = s->backend->ipc_set_pids(s->backend, s->device, s->key, pids, n);
    return rc ? device_error(s->backend, s->device, err, rc, "allowing importers") : AP_OK;
}

int ap_share_unexport(ap_share *s, ap_error *err) {
    if (s->state != AP_SHARE_EXPORTED) return AP_OK;
    if (ap_share_lost(s, 1)) return lost_error(s, err);
    int rc = s->backend->ipc_close(s->backend, s->device, s->key);
    if (rc != 0) return device_error(s->backend, s->device, err, rc, "withdrawing the shared block's key");
    s->state = AP_SHARE_ALLOCATED;
    return AP_OK;
}

/* Takes the segment out of the pool's list, stats and quota; its structs stay. Lock held. */
static void unbook(ap_pool *p, ap_segment *seg) {
    ap_block *b = seg->first;
    ap_segment_unlink(p, seg);
    ap_stat_dec(&p->stats, AP_STAT_ALLOCATION, AP_POOL_LARGE, 1);
    ap_stat_dec(&p->stats, AP_STAT_ALLOCATED_BYTES, AP_POOL_LARGE, (int64_t)b->size);
    ap_stat_dec(&p->stats, AP_STAT_REQUESTED_BYTES, AP_POOL_LARGE, (int64_t)b->requested);
    if (ap_oversize(p, AP_POOL_LARGE, b->size)) ap_stat_step(&p->stats.oversize[0], -1);
    ap_stat_dec(&p->stats, AP_STAT_RESERVED_BYTES, AP_POOL_LARGE, (int64_t)seg->size);
    if (p->quota.release) p->quota.release(p->quota.ctx, p->device, seg->size);
    ap_device_cap_unbook(p, seg->size);
    ap_history_add_free(&p->history, AP_ACT_FREE_REQUESTED, b->addr, b->requested, NULL, b->ctx);
    ap_history_add_free(&p->history, AP_ACT_FREE_COMPLETED, b->addr, b->requested, NULL, b->ctx);
    ap_history_add(&p->history, AP_ACT_SEGMENT_FREE, seg->base, seg->size, NULL);
}

void ap_share_write_off(ap_pool *p, ap_segment *seg) {
    unbook(p, seg);
    seg->shared = AP_SHARE_WRITTEN_OFF; /* its ap_share still points at it: recycled by unaccount */
}

/* Removes the segment from the pool's list, stats and quota (unless written off already), and
   recycles its structs. Lock held. */
static void unaccount(ap_pool *p, ap_share *s) {
    ap_segment *seg = s->seg;
    if (seg->shared != AP_SHARE_WRITTEN_OFF) unbook(p, seg);
    seg->first->state = AP_BLOCK_FREE;
    ap_block_recycle(p, seg->first);
    ap_segment_recycle(p, seg);
    s->seg = NULL;
}

int ap_share_release(ap_pool *p, ap_share *s, ap_error *err) {
    if (s->state == AP_SHARE_RELEASED) return AP_OK;
    if (p) pthread_mutex_lock(&p->lock);
    int rc = AP_OK;
    if (ap_share_lost(s, 1)) {
        /* Forgotten, not freed: the runtime freed it and closed its key (CANN's aclFinalize; the
           simulator unmaps it), and its address may be the new runtime's by now (an application's
           buffer there was freed under it). Counted as the pool's forgotten segments. */
        if (p && s->seg) {
            if (s->seg->shared != AP_SHARE_WRITTEN_OFF) { /* not yet by the pool's runtime check */
                p->lost_segments++;
                p->lost_bytes += s->size;
                p->lost_blocks++;
            }
            unaccount(p, s);
        }
        s->seg = NULL;
        s->state = AP_SHARE_RELEASED;
        if (p) pthread_mutex_unlock(&p->lock);
        return AP_OK;
    }
    if (s->state == AP_SHARE_EXPORTED) { /* the key first: the runtime refuses while imported */
        int code = s->backend->ipc_close(s->backend, s->device, s->key);
        if (code != 0) rc = device_error(s->backend, s->device, err, code, "withdrawing the shared block's key");
        else s->state = AP_SHARE_ALLOCATED;
    }
    if (rc == AP_OK) {
        int code = s->backend->free(s->backend, s->device, (void *)s->base);
        if (code != 0) {
            rc = device_error(s->backend, s->device, err, code, "freeing the shared block");
        } else {
            if (p && s->seg) {
                p->stats.num_device_free++;
                unaccount(p, s);
            }
            s->seg = NULL;
            s->state = AP_SHARE_RELEASED;
        }
    }
    if (p) pthread_mutex_unlock(&p->lock);
    return rc;
}

void ap_share_detach(ap_pool *p, ap_share *s) {
    pthread_mutex_lock(&p->lock);
    if (s->seg) unaccount(p, s);
    pthread_mutex_unlock(&p->lock);
}
