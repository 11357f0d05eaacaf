/* Sharing a pool block with other processes of the node (the pool's side of the backend's IPC).
 *
 * A block to be shared gets a segment of its own: a device allocation of whole 2 MiB pages that
 * holds nothing else, so exporting it never exposes a neighbour's memory. The segment is one of
 * the pool's segments - counted once, in the exporting pool's reserved bytes, its limit and its
 * tenant's quota (through the quota hook), shown in snapshots - but its block is never in the
 * pool's live map or free lists: ap_pool_malloc can never hand it out, ap_pool_free refuses it, and
 * only ap_share_release gives it back. Releasing withdraws the key and frees the segment; when the
 * runtime refuses because importers still map it, nothing changes (AP_E_BUSY) and the caller
 * retries later (ascend_pool/sharing.py does, in the background).
 *
 * A pool that closes while importers still hold one of its shared blocks detaches it first
 * (ap_share_detach): it leaves the pool's accounting, keeps the backend, and is released later
 * without a pool (p == NULL).
 *
 * A block of a runtime that released it (ap_share_lost) is forgotten by its release, with no
 * runtime call (its address may be another allocation's by now), and refused by export, set_pids
 * and unexport.
 *
 * Thread safety: the pool's structures are touched under its lock; the export itself (which may
 * copy the block's pages, in the simulator) runs outside it. One ap_share is used by one thread at
 * a time (the Python layer serialises calls on it).
 */
#ifndef AP_SHARE_H
#define AP_SHARE_H

#include "pool.h"

#define AP_SHARE_PAGE ((size_t)2 << 20) /* export granularity: the NPU's huge page */

enum { AP_SHARE_ALLOCATED = 0, AP_SHARE_EXPORTED = 1, AP_SHARE_RELEASED = 2 };

typedef struct ap_share {
    ap_backend *backend;
    ap_segment *seg;      /* NULL once detached from its pool, or released */
    uintptr_t base;
    size_t size;          /* segment bytes: the request rounded up to whole pages */
    size_t requested;
    int device;
    int state;            /* AP_SHARE_* */
    uint64_t life;        /* the backend's runtime life it was allocated in (ap_backend_life) */
    char key[AP_IPC_KEY_MAX];
} ap_share;

/* A dedicated segment for `size` bytes, its one block allocated. Fails like a pool malloc
   (AP_E_LIMIT, AP_E_QUOTA, AP_E_OOM after releasing cached segments once, AP_E_INVALID_SIZE). */
int ap_share_alloc(ap_pool *p, size_t size, ap_share *s, ap_error *err);
/* Exports the whole segment; flags: AP_IPC_ANY_PROCESS | AP_IPC_READ_ONLY, or 0 (see backend.h).
   Writes s->key. */
int ap_share_export(ap_share *s, unsigned flags, ap_error *err);
int ap_share_set_pids(ap_share *s, const int32_t *pids, size_t n, ap_error *err);
/* Withdraws the key (the runtime refuses while imported: AP_E_BUSY); the block stays allocated. */
int ap_share_unexport(ap_share *s, ap_error *err);
/* Withdraws the key and frees the segment. p: its pool, or NULL once detached. AP_E_BUSY when the
   runtime refuses because other processes still import it (acl: ACL_ERROR_RT_IPC_ERROR). */
int ap_share_release(ap_pool *p, ap_share *s, ap_error *err);
/* 1 when the runtime released the block's memory and closed its key behind the pool (its life
   moved on: aclFinalize, then perhaps aclInit; resets that took the pools' device references):
   it is not to be exported, freed or closed again. probe: see ap_backend_life. */
int ap_share_lost(ap_share *s, int probe);
/* The pool's runtime check (ap_pool_runtime_check) found the shared segment of a runtime that
   released it: out of the pool's list, stats and quota at once, as its other memory; its structs
   stay for its ap_share (seg->shared AP_SHARE_WRITTEN_OFF), whose release or detach recycles them.
   Lock held. */
#define AP_SHARE_WRITTEN_OFF 2
void ap_share_write_off(ap_pool *p, ap_segment *seg);
/* Takes the segment out of its pool's lists, stats and quota, without freeing the memory. */
void ap_share_detach(ap_pool *p, ap_share *s);

#endif
