/* The registry of live handles (streams, events, contexts).
 *
 * A handle is looked up here, with its type, before anything is done with it: a garbage, foreign
 * or destroyed handle gets ACL_ERROR_RT_PARAM_INVALID instead of a crash. Lookups take a
 * reference, so an object that another thread destroys meanwhile stays valid until the last user
 * lets go.
 *
 * Handles are opaque void* as in ACL, but not the objects' addresses: they are serial numbers
 * placed in the non-canonical part of the 64-bit address space (0x5EED...), so that
 *  - a handle is never reused: a stale handle is always refused, even after the allocator has
 *    given its object's memory to a new object (with addresses, it would silently alias it);
 *  - code that dereferences a handle faults at once instead of reading simulator internals.
 *
 * One mutex over a chained hash table: the critical sections are a few loads, and handle lookups
 * are not on the pool's hot path (cached blocks need no runtime call).
 *
 * ASCEND_SIM_REUSE_STREAM_HANDLES=1 gives a destroyed stream's handle to the next stream created
 * (most recently destroyed first), as a real runtime's handles (heap pointers) may be reused: the
 * ABA a caller that remembers streams must survive. Off by default: a stale handle is then always
 * refused, which finds more bugs.
 */
#include <stdlib.h>
#include <string.h>

#include "sim_internal.h"

static pthread_mutex_t reg_mu = PTHREAD_MUTEX_INITIALIZER;
static struct sim_obj **buckets;
static size_t nbuckets, count;
static uint64_t next_serial = 1;

#define HANDLE_TAG ((uintptr_t)0x5EED000000000000ull)
#define HANDLE_SERIAL_BITS 44

#define RECYCLED_MAX 64
static uintptr_t recycled[RECYCLED_MAX]; /* destroyed streams' handles, when reuse is on */
static int n_recycled;
static int reuse_streams = -1;           /* -1: not read yet */

static int reusing_streams(void) /* called with reg_mu held */
{
    if (reuse_streams < 0) {
        const char *v = getenv("ASCEND_SIM_REUSE_STREAM_HANDLES");
        reuse_streams = v && strcmp(v, "1") == 0;
    }
    return reuse_streams;
}

static size_t slot(uintptr_t key, size_t n)
{
    uint64_t h = (uint64_t)key;
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    return (size_t)h & (n - 1);
}

static int grow(void)
{
    size_t n = nbuckets ? nbuckets * 2 : 1024;
    struct sim_obj **b = calloc(n, sizeof *b);
    if (!b)
        return -1;
    for (size_t i = 0; i < nbuckets; i++) {
        struct sim_obj *o = buckets[i];
        while (o) {
            struct sim_obj *next = o->hnext;
            size_t j = slot(o->handle, n);
            o->hnext = b[j];
            b[j] = o;
            o = next;
        }
    }
    free(buckets);
    buckets = b;
    nbuckets = n;
    return 0;
}

void sim_obj_init(struct sim_obj *o, uint32_t type, void (*destroy)(struct sim_obj *))
{
    o->type = type;
    atomic_init(&o->refs, 1); /* the registry's (or the creator's) reference */
    o->hnext = NULL;
    o->destroy = destroy;
}

void sim_obj_ref(struct sim_obj *o)
{
    atomic_fetch_add_explicit(&o->refs, 1, memory_order_relaxed);
}

void sim_obj_unref(struct sim_obj *o)
{
    if (o && atomic_fetch_sub_explicit(&o->refs, 1, memory_order_acq_rel) == 1)
        o->destroy(o);
}

int sim_reg_add(struct sim_obj *o)
{
    pthread_mutex_lock(&reg_mu);
    if (count + 1 > nbuckets && grow() != 0 && nbuckets == 0) {
        pthread_mutex_unlock(&reg_mu);
        return -1;
    }
    if (o->type == SIM_H_STREAM && n_recycled && reusing_streams())
        o->handle = recycled[--n_recycled];
    else /* 2^44 serials: at a million handles a second, half a year without repeating */
        o->handle = HANDLE_TAG | ((uintptr_t)(next_serial++ & ((1ull << HANDLE_SERIAL_BITS) - 1)) << 4) | o->type;
    size_t j = slot(o->handle, nbuckets);
    o->hnext = buckets[j];
    buckets[j] = o;
    count++;
    pthread_mutex_unlock(&reg_mu);
    return 0;
}

/* Finds (and with unlink, removes) a live object; called with reg_mu held. */
static struct sim_obj *find(const void *handle, uint32_t type, int unlink)
{
    uintptr_t key = (uintptr_t)handle;
    if (!handle || nbuckets == 0)
        return NULL;
    struct sim_obj **pp = &buckets[slot(key, nbuckets)];
    for (; *pp; pp = &(*pp)->hnext) {
        struct sim_obj *o = *pp;
        if (o->handle == key) {
            if (o->type != type)
                return NULL;
            if (unlink) {
                *pp = o->hnext;
                o->hnext = NULL;
                count--;
            }
            return o;
        }
    }
    return NULL;
}

struct sim_obj *sim_reg_get(const void *handle, uint32_t type)
{
    pthread_mutex_lock(&reg_mu);
    struct sim_obj *o = find(handle, type, 0);
    if (o)
        sim_obj_ref(o);
    pthread_mutex_unlock(&reg_mu);
    return o;
}

struct sim_obj *sim_reg_take(const void *handle, uint32_t type)
{
    pthread_mutex_lock(&reg_mu);
    struct sim_obj *o = find(handle, type, 1);
    if (o && type == SIM_H_STREAM && n_recycled < RECYCLED_MAX && reusing_streams())
        recycled[n_recycled++] = o->handle;
    pthread_mutex_unlock(&reg_mu);
    return o;
}

size_t sim_reg_take_all(struct sim_obj ***out)
{
    pthread_mutex_lock(&reg_mu);
    struct sim_obj **all = malloc((count ? count : 1) * sizeof *all);
    size_t n = 0;
    if (all) {
        for (size_t i = 0; i < nbuckets; i++) {
            for (struct sim_obj *o = buckets[i]; o;) {
                struct sim_obj *next = o->hnext;
                o->hnext = NULL;
                all[n++] = o;
                o = next;
            }
            buckets[i] = NULL;
        }
        count = 0;
    }
    pthread_mutex_unlock(&reg_mu);
    *out = all;
    return n;
}

size_t sim_reg_get_matching(uint32_t type, int (*match)(struct sim_obj *o, void *arg), void *arg,
                            struct sim_obj ***out)
{
    pthread_mutex_lock(&reg_mu);
    size_t n = 0;
    struct sim_obj **found = count ? malloc(count * sizeof *found) : NULL;
    for (size_t i = 0; found && i < nbuckets; i++)
        for (struct sim_obj *o = buckets[i]; o; o = o->hnext)
            if (o->type == type && match(o, arg)) {
                sim_obj_ref(o);
                found[n++] = o;
            }
    pthread_mutex_unlock(&reg_mu);
    if (!n) {
        free(found);
        found = NULL;
    }
    *out = found;
    return n;
}

void sim_reg_reset(void)
{
    pthread_mutex_init(&reg_mu, NULL);
    buckets = NULL;
    nbuckets = count = 0; /* serials keep counting: the parent's handles stay invalid here */
    n_recycled = 0;
}
