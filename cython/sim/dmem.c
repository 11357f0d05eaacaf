/* Mapped allocations (device and host), found by address range.
 *
 * Each allocation is its own anonymous mapping with MAP_NORESERVE, so a simulated 64 GiB HBM
 * costs nothing until its pages are touched, and freed memory really goes back to the kernel.
 * Allocations of 2 MiB and more are placed on a 2 MiB boundary and advised MADV_HUGEPAGE: with
 * transparent huge pages in "madvise" mode that is what makes touching them cheap. Failure of the
 * advice is ignored (hugetlbfs pages are not assumed to exist; MAP_HUGETLB is never used).
 * Limit: the kernel's vm.max_map_count (65530 by default) bounds the number of live mappings.
 *
 * The live allocations sit in a balanced tree (glibc tsearch) ordered by address, so that the
 * simulator can check in O(log n) that [ptr, ptr+n) lies inside one live allocation before it
 * touches a byte: a garbage pointer is refused, never dereferenced. Work in flight (a read, a
 * fill) pins its allocation; an aclrtFree meanwhile unregisters it at once (the real runtime does
 * not wait for work either) but the unmapping waits for the last pin, so the worker never
 * faults on memory unmapped under it.
 *
 * A third tree holds the virtual-memory reservations of vmm.c. A device pin that finds no
 * aclrtMalloc allocation looks there: the range must lie in one reservation with every page of it
 * mapped (a block may span several physical handles mapped side by side), and the pin is taken on
 * the reservation, so that aclrtUnmapMem can wait for reads and fills in flight before it makes
 * the pages inaccessible again.
 *
 * A fourth tree holds the memory this process imported from other processes (ipc.c); a device pin
 * that finds nothing else looks there last, and succeeds only while the exporter still shares it.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* tdestroy */
#endif
#include <search.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "sim_internal.h"

struct tree {
    pthread_mutex_t mu;
    void *root;
    size_t count;
};

static struct tree trees[SIM_TREE_COUNT] = {{PTHREAD_MUTEX_INITIALIZER, NULL, 0},
                                            {PTHREAD_MUTEX_INITIALIZER, NULL, 0},
                                            {PTHREAD_MUTEX_INITIALIZER, NULL, 0},
                                            {PTHREAD_MUTEX_INITIALIZER, NULL, 0}};

/* Orders non-overlapping ranges; an overlapping pair compares equal, which is how a lookup of
   [ptr, ptr+n) finds the allocation it falls into. */
static int cmp_range(const void *x, const void *y)
{
    const struct sim_alloc *a = x, *b = y;
    if (a->base + a->size <= b->base)
        return -1;
    if (b->base + b->size <= a->base)
        return 1;
    return 0;
}

static size_t page_size(void)
{
    /* Cached on first use, perhaps by several threads' first allocations at once: atomic (a plain
       static was a data race, reported by scripts/tsan.sh), relaxed (each writes the same value). */
    static _Atomic size_t ps;
    size_t v = atomic_load_explicit(&ps, memory_order_relaxed);
    if (!v) {
        v = (size_t)sysconf(_SC_PAGESIZE);
        atomic_store_explicit(&ps, v, memory_order_relaxed);
    }
    return v;
}

struct sim_alloc *sim_alloc_map(size_t size, size_t align, int huge)
{
    size_t ps = page_size();
    if (size == 0 || size > SIZE_MAX / 2)
        return NULL;
    size_t len = (size + ps - 1) & ~(ps - 1);
    size_t boundary = huge ? SIM_HUGE_PAGE : (align > ps ? align : ps);
    size_t extra = boundary > ps ? boundary : 0;
    int flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;
    char *raw = mmap(NULL, len + extra, PROT_READ | PROT_WRITE, flags, -1, 0);
    if (raw == MAP_FAILED)
        return NULL;
    char *start = raw;
    if (extra) {
        /* Over-map, then trim both ends so the mapping starts on the boundary. */
        start = (char *)(((uintptr_t)raw + boundary - 1) & ~(uintptr_t)(boundary - 1));
        if (start > raw)
            munmap(raw, (size_t)(start - raw));
        size_t tail = (size_t)(raw + len + extra - (start + len));
        if (tail)
            munmap(start + len, tail);
    }
    if (huge)
        (void)madvise(start, len, MADV_HUGEPAGE); /* only advice: THP may be off */
    struct sim_alloc *a = calloc(1, sizeof *a);
    if (!a) {
        munmap(start, len);
        return NULL;
    }
    a->base = (uintptr_t)start;
    a->size = size;
    a->map = start;
    a->map_len = len;
    return a;
}

/* Fills with 0xDD only the pages that were ever touched (mincore): touching the others would make
   a large simulated allocation cost real memory (a 40 GiB free must not fault in 40 GiB). */
static void poison_resident(void *map, size_t size)
{
    const size_t page = 4096, chunk = 1u << 20; /* query 256 pages at a time */
    unsigned char vec[256];
    for (size_t off = 0; off < size; off += chunk) {
        size_t len = size - off < chunk ? size - off : chunk;
        if (mincore((char *)map + off, len, vec) != 0) return;
        for (size_t i = 0; i * page < len; i++)
            if (vec[i] & 1) {
                size_t n = len - i * page < page ? len - i * page : page;
                sim_dev_memset((char *)map + off + i * page, 0xDD, n);
            }
    }
}

void sim_alloc_unmap(struct sim_alloc *a)
{
    if (a->poison) /* what a use-after-free would read, were it still mapped */
        poison_resident(a->map, a->size);
    munmap(a->map, a->map_len);
    free(a);
}

void sim_alloc_insert(int which, struct sim_alloc *a)
{
    struct tree *t = &trees[which];
    a->tree = which;
    pthread_mutex_lock(&t->mu);
    if (tsearch(a, &t->root, cmp_range))
        t->count++;
    pthread_mutex_unlock(&t->mu);
}

struct sim_alloc *sim_alloc_remove(int which, const void *base)
{
    struct tree *t = &trees[which];
    struct sim_alloc key = {.base = (uintptr_t)base, .size = 1};
    pthread_mutex_lock(&t->mu);
    void **node = tfind(&key, &t->root, cmp_range);
    struct sim_alloc *a = node ? *node : NULL;
    if (a && a->base == (uintptr_t)base) { /* an interior pointer is not an allocation */
        tdelete(&key, &t->root, cmp_range);
        t->count--;
    } else {
        a = NULL;
    }
    pthread_mutex_unlock(&t->mu);
    return a;
}

/* The allocation holding all of [ptr, ptr+n) (n 0: the byte at ptr), or NULL. t->mu held. */
static struct sim_alloc *find_locked(struct tree *t, const void *ptr, size_t n)
{
    uintptr_t p = (uintptr_t)ptr;
    if (!ptr || p + n < p)
        return NULL;
    struct sim_alloc key = {.base = p, .size = n ? n : 1};
    void **node = tfind(&key, &t->root, cmp_range);
    struct sim_alloc *a = node ? *node : NULL;
    return a && p >= a->base && p + key.size <= a->base + a->size ? a : NULL;
}

struct sim_alloc *sim_alloc_pin(int which, const void *ptr, size_t n)
{
    struct tree *t = &trees[which];
    pthread_mutex_lock(&t->mu);
    struct sim_alloc *a = find_locked(t, ptr, n);
    if (a)
        a->pins++;
    pthread_mutex_unlock(&t->mu);
    if (a || which != SIM_TREE_DEVICE)
        return a;
    /* Not an aclrtMalloc allocation: mapped virtual memory (vmm.c)? */
    t = &trees[SIM_TREE_VMM];
    pthread_mutex_lock(&t->mu);
    a = find_locked(t, ptr, n);
    if (a && sim_vmm_covered(a, (uintptr_t)ptr, n))
        a->pins++;
    else
        a = NULL;
    pthread_mutex_unlock(&t->mu);
    if (a)
        return a;
    /* Memory imported from another process (ipc.c), while its exporter still shares it. */
    t = &trees[SIM_TREE_IPC];
    pthread_mutex_lock(&t->mu);
    a = find_locked(t, ptr, n);
    if (a)
        a->pins++;
    pthread_mutex_unlock(&t->mu);
    if (a && !sim_ipc_usable(a)) { /* checked outside the lock: it reads /proc */
        sim_alloc_unpin(SIM_TREE_IPC, a);
        a = NULL;
    }
    return a;
}

void sim_alloc_unpin(int which, struct sim_alloc *a)
{
    (void)which; /* a VMM reservation pinned through the device tree: its own tree's lock */
    struct tree *t = &trees[a->tree];
    pthread_mutex_lock(&t->mu);
    int unmap = --a->pins == 0 && a->freed;
    pthread_mutex_unlock(&t->mu);
    if (unmap)
        sim_alloc_unmap(a);
}

void sim_alloc_release(int which, struct sim_alloc *a)
{
    struct tree *t = &trees[which];
    pthread_mutex_lock(&t->mu);
    int now = a->pins == 0;
    if (!now)
        a->freed = 1; /* the last unpin unmaps */
    pthread_mutex_unlock(&t->mu);
    if (now)
        sim_alloc_unmap(a);
}

struct sim_alloc *sim_alloc_lookup(int which, const void *ptr, size_t n)
{
    struct tree *t = &trees[which];
    pthread_mutex_lock(&t->mu);
    struct sim_alloc *a = find_locked(t, ptr, n);
    pthread_mutex_unlock(&t->mu);
    return a;
}

void sim_alloc_wait_unpinned(struct sim_alloc *a)
{
    struct tree *t = &trees[a->tree];
    for (;;) {
        pthread_mutex_lock(&t->mu);
        uint32_t pins = a->pins;
        pthread_mutex_unlock(&t->mu);
        if (pins == 0)
            return;
        sim_sleep_ns(20000); /* pins last one memcpy/memset */
    }
}

void sim_alloc_lock(int which) { pthread_mutex_lock(&trees[which].mu); }
void sim_alloc_unlock(int which) { pthread_mutex_unlock(&trees[which].mu); }

/* twalk() takes no user argument: the collector runs under the tree's lock. */
static struct sim_alloc **walk_out;
static size_t walk_n;

static void collect(const void *node, VISIT v, int depth)
{
    (void)depth;
    if (v == postorder || v == leaf)
        walk_out[walk_n++] = *(struct sim_alloc *const *)node;
}

static void no_free(void *p) { (void)p; }

size_t sim_alloc_take_all(int which, struct sim_alloc ***out)
{
    struct tree *t = &trees[which];
    pthread_mutex_lock(&t->mu);
    walk_out = malloc((t->count ? t->count : 1) * sizeof *walk_out);
    walk_n = 0;
    if (walk_out) {
        twalk(t->root, collect);
        tdestroy(t->root, no_free);
        t->root = NULL;
        t->count = 0;
    }
    *out = walk_out;
    size_t n = walk_n;
    pthread_mutex_unlock(&t->mu);
    return n;
}

void sim_alloc_reset(void)
{
    for (int i = 0; i < SIM_TREE_COUNT; i++) {
        pthread_mutex_init(&trees[i].mu, NULL);
        trees[i].root = NULL; /* the parent's mappings stay in the child, unregistered */
        trees[i].count = 0;
    }
}
