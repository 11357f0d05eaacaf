/* The free-block layer (cython/core/free_blocks.c) on a minimal pool: splitting on allocation,
 * coalescing with free neighbours on free (and not with allocated ones, nor with free ones of
 * another stream), the stricter tag of a merged block, retagging a slot, best fit across the own
 * stream's tree and the any-stream tree, the oversize rules, and a random workload with every
 * invariant recounted after each step.
 * core: free_blocks.c free_tree.c block_arena.c stats.c free_cache.c */
#include "mini_pool.h"

#define BASE 0x10000000u
#define SEG (2u << 20)
#define K 1024

static const ap_free_tree *tree(ap_pool *p, int slot, int pool) { return &p->slots[slot].trees[pool]; }

static void split_on_take(void) {
    ap_pool *p = mp_create();
    ap_segment *s = mp_segment(p, BASE, SEG, AP_POOL_SMALL);
    CHECK_EQ(p->n_free_segments, 1);
    ap_block *a = mp_alloc(p, 0, 4000, AP_POOL_SMALL);
    CHECK(a == s->first && a->addr == BASE && a->size == 4 * K && a->requested == 4000);
    ap_block *rest = a->next;
    CHECK(rest && rest->state == AP_BLOCK_FREE && rest->addr == BASE + 4 * K && rest->size == SEG - 4 * K);
    CHECK(rest->prev == a && rest->next == NULL);
    CHECK_EQ(p->n_free_segments, 0);
    CHECK_EQ(p->stats.s[AP_STAT_ALLOCATION][AP_STAT_SMALL].current, 1);
    CHECK_EQ(ap_stat_read(&p->stats, AP_STAT_ALLOCATED_BYTES, AP_STAT_ALL).current, 4 * K);
    CHECK_EQ(p->stats.s[AP_STAT_REQUESTED_BYTES][AP_STAT_SMALL].current, 4000);
    CHECK_EQ(p->stats.s[AP_STAT_INACTIVE_SPLIT][AP_STAT_SMALL].current, 1);
    CHECK_EQ(p->stats.s[AP_STAT_INACTIVE_SPLIT_BYTES][AP_STAT_SMALL].current, SEG - 4 * K);
    CHECK_EQ(tree(p, 0, AP_POOL_SMALL)->count, 1);
    mp_recount(p);
    mp_destroy(p);
}

static void coalesce_on_free(void) {
    ap_pool *p = mp_create();
    ap_segment *s = mp_segment(p, BASE, SEG, AP_POOL_SMALL);
    ap_block *a = mp_alloc(p, 0, 4 * K, AP_POOL_SMALL);
    ap_block *b = mp_alloc(p, 0, 8 * K, AP_POOL_SMALL);
    ap_block *c = mp_alloc(p, 0, 4 * K, AP_POOL_SMALL);
    CHECK(a->next == b && b->next == c && c->addr == BASE + 12 * K); /* best fit packs from the bottom */
    mp_recount(p);
    /* b between two allocated blocks: stays alone */
    ap_block *m = mp_free(p, b, 0, 0);
    CHECK(m == b && b->size == 8 * K && b->prev == a && b->next == c);
    CHECK_EQ(tree(p, 0, AP_POOL_SMALL)->count, 2);
    CHECK_EQ(p->stats.s[AP_STAT_INACTIVE_SPLIT][AP_STAT_SMALL].current, 2);
    mp_recount(p);
    /* a merges with b (its free right neighbour) */
    m = mp_free(p, a, 0, 0);
    CHECK(m == a && a->addr == BASE && a->size == 12 * K && a->next == c && c->prev == a);
    CHECK_EQ(tree(p, 0, AP_POOL_SMALL)->count, 2);
    mp_recount(p);
    /* c joins both sides: the segment is one free block again */
    m = mp_free(p, c, 0, 0);
    CHECK(m == a && s->first == a && a->size == SEG && a->next == NULL);
    CHECK_EQ(tree(p, 0, AP_POOL_SMALL)->count, 1);
    CHECK_EQ(p->n_free_segments, 1);
    CHECK_EQ(ap_stat_read(&p->stats, AP_STAT_INACTIVE_SPLIT, AP_STAT_ALL).current, 0);
    CHECK_EQ(ap_stat_read(&p->stats, AP_STAT_INACTIVE_SPLIT_BYTES, AP_STAT_ALL).current, 0);
    /* out of the count over time: the three rests split off, b, then a+b */
    CHECK_EQ(ap_stat_read(&p->stats, AP_STAT_INACTIVE_SPLIT, AP_STAT_ALL).freed, 5);
    mp_recount(p);
    mp_destroy(p);
}

static void stream_tags(void) {
    ap_pool *p = mp_create();
    mp_segment(p, BASE, SEG, AP_POOL_SMALL);
    ap_block *x = mp_alloc(p, 1, 4 * K, AP_POOL_SMALL);
    ap_block *y = mp_alloc(p, 2, 4 * K, AP_POOL_SMALL);
    ap_block *z = mp_alloc(p, 0, 4 * K, AP_POOL_SMALL);
    CHECK(x->next == y && y->next == z);
    mp_free(p, x, 1, 0);
    mp_free(p, y, 2, 0);
    /* Free neighbours of two streams do not merge: each may still be in use by its stream's work. */
    CHECK(x->next == y && x->tag == 1 && y->tag == 2);
    CHECK(mp_in_tree(tree(p, 1, AP_POOL_SMALL), x) && mp_in_tree(tree(p, 2, AP_POOL_SMALL), y));
    mp_recount(p);
    /* Best fit: the own stream's block or an any-stream one, never another stream's. */
    CHECK(ap_find_fit(p, 1, AP_POOL_SMALL, 4 * K) == x);
    CHECK(ap_find_fit(p, 2, AP_POOL_SMALL, 4 * K) == y);
    CHECK(ap_find_fit(p, 0, AP_POOL_SMALL, 4 * K) == z->next);
    CHECK(ap_find_fit(p, 1, AP_POOL_SMALL, 8 * K) == z->next); /* own one too small: any-stream */
    /* z (no stream) merges with y (stream 2) and with the any-stream rest: the merged block keeps
       the stricter tag, so the rest is now stream 2's until stream 2 is settled. */
    ap_block *m = mp_free(p, z, 0, 0);
    CHECK(m == y && y->tag == 2 && y->next == NULL && y->size == SEG - 4 * K);
    CHECK(ap_find_fit(p, 0, AP_POOL_SMALL, 512) == NULL);
    CHECK(ap_find_fit(p, 1, AP_POOL_SMALL, 8 * K) == NULL);
    CHECK(ap_find_fit(p, 2, AP_POOL_SMALL, 8 * K) == y);
    mp_recount(p);
    /* Stream 2 settled: its blocks serve every stream; y then merges with x (stream 1's). */
    ap_free_retag_slot(p, 2, 0);
    CHECK_EQ(tree(p, 2, AP_POOL_SMALL)->count, 0);
    CHECK_EQ(tree(p, 1, AP_POOL_SMALL)->count, 1);
    CHECK(x->size == SEG && x->tag == 1 && x->next == NULL);
    CHECK_EQ(p->n_free_segments, 1);
    mp_recount(p);
    ap_free_retag_slot(p, 1, 0);
    CHECK(ap_find_fit(p, 0, AP_POOL_SMALL, SEG) == x && x->tag == 0);
    mp_recount(p);
    mp_destroy(p);
}

/* Equal sizes: the stream's own block wins over an any-stream one (it needs no ordering, and
   leaves the any-stream block to every other stream). A small block is split down to a 512-byte
   rest, never further. */
static void ties_and_the_smallest_split(void) {
    ap_pool *p = mp_create();
    mp_segment(p, BASE, SEG, AP_POOL_SMALL);
    ap_block *own = mp_alloc(p, 1, 4 * K, AP_POOL_SMALL);
    mp_alloc(p, 0, 512, AP_POOL_SMALL);
    ap_block *any = mp_alloc(p, 0, 4 * K, AP_POOL_SMALL);
    mp_alloc(p, 0, 512, AP_POOL_SMALL);
    mp_free(p, any, 0, 0);
    mp_free(p, own, 1, 0);
    CHECK(ap_find_fit(p, 1, AP_POOL_SMALL, 4 * K) == own);
    CHECK(ap_find_fit(p, 2, AP_POOL_SMALL, 4 * K) == any);
    ap_block *b = mp_alloc(p, 1, 4 * K - 512, AP_POOL_SMALL);
    CHECK(b == own && b->size == 4 * K - 512 && b->next->size == 512 && b->next->state == AP_BLOCK_FREE);
    b = mp_alloc(p, 2, 4 * K - 1024, AP_POOL_SMALL);
    CHECK(b == any && b->size == 4 * K - 1024 && b->next->size == 1024);
    mp_recount(p);
    mp_destroy(p);
}

/* Expandable small pool: among candidates that pin no new page, equal sizes go to the lowest
   address (packing downwards so that the top pages empty). */
static void page_fit_lowest_address(void) {
    ap_pool *p = mp_create();
    p->vmm_granularity = SEG;
    mp_segment(p, BASE, 2 * SEG, AP_POOL_SMALL);
    size_t sizes[6] = {4 * K, 8 * K, SEG - 12 * K, 4 * K, 8 * K, SEG - 12 * K};
    ap_block *b[6];
    for (int i = 0; i < 6; i++) b[i] = mp_alloc(p, 0, sizes[i], AP_POOL_SMALL);
    CHECK(b[3]->addr == BASE + SEG && b[5]->next == NULL);
    mp_free(p, b[4], 0, 0); /* an 8 KiB hole in each page, both pages holding live blocks */
    mp_free(p, b[1], 0, 0);
    p->cfg.expandable = 1;
    CHECK(ap_find_fit(p, 0, AP_POOL_SMALL, 8 * K) == b[1]);
    CHECK(ap_find_fit(p, 0, AP_POOL_SMALL, 6 * K) == b[1]);
    p->cfg.expandable = 0;
    mp_recount(p);
    mp_destroy(p);
}

static void oversize_rules(void) {
    ap_pool *p = mp_create();
    p->cfg.max_split_size = 4u << 20;
    mp_segment(p, BASE, 8u << 20, AP_POOL_LARGE);
    /* Below max_split_size: a block of max_split_size or more is never handed out (nor split). */
    CHECK(ap_find_fit(p, 0, AP_POOL_LARGE, 2u << 20) == NULL);
    /* At or above it: taken whole, not split. */
    ap_block *b = mp_alloc(p, 0, 5u << 20, AP_POOL_LARGE);
    CHECK(b && b->size == (8u << 20) && b->next == NULL);
    mp_free(p, b, 0, 0);
    p->cfg.max_split_size = AP_NO_LIMIT;
    /* A large block is split only when the rest is at least large_split_min (1 MiB). */
    b = mp_alloc(p, 0, (8u << 20) - 512 * K, AP_POOL_LARGE);
    CHECK(b->size == 8u << 20 && b->next == NULL);
    mp_free(p, b, 0, 0);
    b = mp_alloc(p, 0, 6u << 20, AP_POOL_LARGE);
    CHECK(b->size == 6u << 20 && b->next && b->next->size == 2u << 20);
    mp_recount(p);
    mp_destroy(p);
}

#define N_LIVE 256

static void random_workload(void) {
    ap_pool *p = mp_create();
    mp_segment(p, BASE, SEG, AP_POOL_SMALL);
    mp_segment(p, BASE + 2 * SEG, SEG, AP_POOL_SMALL);
    mp_segment(p, BASE + 8 * SEG, 4 * SEG, AP_POOL_LARGE);
    ap_block *live[N_LIVE] = {0};
    unsigned long long rng = 2026;
    for (int step = 0; step < 4000; step++) {
        int i = (int)(test_rand(&rng) % N_LIVE);
        if (live[i]) {
            mp_free(p, live[i], (int)(test_rand(&rng) % MP_SLOTS), 0);
            live[i] = NULL;
        } else {
            int large = test_rand(&rng) % 4 == 0;
            size_t size = large ? (1u << 20) + test_rand(&rng) % (3u << 20) : 1 + test_rand(&rng) % (64 * K);
            live[i] = mp_alloc(p, (int)(test_rand(&rng) % MP_SLOTS), size, large ? AP_POOL_LARGE : AP_POOL_SMALL);
        }
        if (step % 500 == 250) ap_free_retag_slot(p, 1 + (int)(test_rand(&rng) % 2), 0);
        mp_recount(p);
    }
    for (int i = 0; i < N_LIVE; i++)
        if (live[i]) mp_free(p, live[i], 0, 0);
    ap_free_retag_slot(p, 1, 0);
    ap_free_retag_slot(p, 2, 0);
    mp_recount(p);
    CHECK_EQ(p->n_free_segments, 3); /* everything merged back into whole segments */
    CHECK_EQ(ap_stat_read(&p->stats, AP_STAT_ALLOCATED_BYTES, AP_STAT_ALL).current, 0);
    mp_destroy(p);
}

int main(void) {
    split_on_take();
    coalesce_on_free();
    stream_tags();
    ties_and_the_smallest_split();
    page_fit_lowest_address();
    oversize_rules();
    random_workload();
    puts("test_free_blocks: ok");
    return 0;
}
