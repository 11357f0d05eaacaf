/* The block arena (cython/core/block_arena.c): structs come zeroed (record_stream's uses with
 * their inline arrays, grown on the heap past AP_MAX_USES streams), a recycled struct is the next
 * one handed out (LIFO: warm in cache), chunks of 256 are carved as needed and all freed at
 * destroy (LeakSanitizer checks that at exit), segments are numbered in creation order, and in ASan
 * builds a recycled struct is poisoned past its link word.
 * core: block_arena.c */
#include <string.h>

#include "check.h"
#include "pool_internal.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#endif

#define MANY 600

static int all_zero(const void *x, size_t n) {
    const unsigned char *c = x;
    for (size_t i = 0; i < n; i++)
        if (c[i]) return 0;
    return 1;
}

static void blocks(ap_pool *p) {
    ap_block *a = ap_block_new(p);
    CHECK(a && all_zero(a, sizeof *a));
    CHECK_EQ(p->n_chunks, 1);
    a->addr = 0x1000;
    a->size = 512;
    a->state = AP_BLOCK_ALLOCATED;
    ap_block_recycle(p, a);
#if defined(__SANITIZE_ADDRESS__)
    CHECK(__asan_address_is_poisoned(&a->size)); /* a read through a stale pointer is reported */
    CHECK(!__asan_address_is_poisoned(a));       /* the link word */
#endif
    ap_block *b = ap_block_new(p);
    CHECK(b == a && all_zero(b, sizeof *b)); /* reused first, and zeroed */
#if defined(__SANITIZE_ADDRESS__)
    CHECK(!__asan_address_is_poisoned(&b->size) && !__asan_address_is_poisoned(&b->pending_next));
#endif
    static ap_block *many[MANY];
    many[0] = b;
    for (int i = 1; i < MANY; i++) {
        many[i] = ap_block_new(p);
        CHECK(many[i] && all_zero(many[i], sizeof(ap_block)));
        many[i]->addr = (uintptr_t)i; /* distinct structs: nothing handed out twice */
        for (int j = 0; j < i; j += 37) CHECK(many[j] != many[i]);
    }
    CHECK_EQ(p->n_chunks, 3); /* 600 blocks in chunks of 256 */
    for (int i = 0; i < MANY; i++) ap_block_recycle(p, many[i]);
    for (int i = MANY - 1; i >= MANY - 10; i--) CHECK(ap_block_new(p) == many[i]); /* last in, first out */
    CHECK_EQ(p->n_chunks, 3);
}

static void segments_and_uses(ap_pool *p) {
    ap_segment *s1 = ap_segment_new(p), *s2 = ap_segment_new(p);
    CHECK(s1 && s2 && s1 != s2);
    CHECK(s2->seq == s1->seq + 1); /* creation order: the free tree's tie-break between equal sizes */
    ap_segment_recycle(p, s1);
    ap_segment *s3 = ap_segment_new(p);
    CHECK(s3 == s1 && s3->seq == s2->seq + 1); /* a reused struct is a new segment */
    CHECK(s3->first == NULL && s3->size == 0);
    ap_block_uses *u = ap_uses_new(p);
    /* zeroed but for its arrays, which are its inline ones */
    CHECK(u && all_zero(u->uses_in, sizeof u->uses_in) && all_zero(u->foreign, sizeof u->foreign));
    CHECK(u->n_uses == 0 && u->n_events == 0 && u->n_owed == 0 && u->n_foreign == 0 && ap_uses_ok(u));
    CHECK(u->cap == AP_MAX_USES && u->uses == u->uses_in && u->events == u->events_in);
    u->n_uses = 3;
    ap_uses_recycle(p, u);
    ap_block_uses *v = ap_uses_new(p);
    CHECK(v == u && v->n_uses == 0 && ap_uses_ok(v));
    /* Past the inline uses the arrays grow on the heap, keeping what they held, up to one use per
       stream slot; recycled, the struct comes back inline (the heap arrays freed: LeakSanitizer) */
    for (int i = 0; i < AP_MAX_STREAMS; i++) {
        if (v->n_uses == v->cap) CHECK(ap_uses_grow(v) == 0 && ap_uses_ok(v));
        v->uses[v->n_uses++] = (uint16_t)i;
    }
    CHECK(v->cap == AP_MAX_STREAMS && ap_uses_grow(v) == -1 && ap_uses_ok(v)); /* a slot each: no more */
    for (int i = 0; i < AP_MAX_STREAMS; i++) CHECK(v->uses[i] == i);
    for (int i = 0; i < v->cap + AP_MAX_FOREIGN + 1; i++) v->events[i] = v->owed[i] = v; /* all writable */
    ap_uses_recycle(p, v);
    ap_block_uses *w = ap_uses_new(p);
    CHECK(w == v && w->cap == AP_MAX_USES && w->uses == w->uses_in && ap_uses_ok(w));
    w->n_uses = AP_MAX_USES;
    CHECK(ap_uses_grow(w) == 0 && w->cap == 2 * AP_MAX_USES);
    ap_uses_shrink(w); /* as ap_pool_destroy does for a block still marked */
    CHECK(w->cap == AP_MAX_USES && w->uses == w->uses_in && ap_uses_ok(w));
}

int main(void) {
    ap_pool *p = calloc(1, sizeof *p);
    CHECK(p != NULL);
    blocks(p);
    segments_and_uses(p);
    ap_arena_destroy(p);
    CHECK(p->n_chunks == 0 && p->chunks == NULL && p->spare_blocks == NULL);
    /* usable again after destroy (a pool reopened in place) */
    ap_block *b = ap_block_new(p);
    CHECK(b && p->n_chunks == 1);
    ap_arena_destroy(p);
    free(p);
    puts("test_block_arena: ok");
    return 0;
}
