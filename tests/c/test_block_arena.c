/* The block arena (cython/core/block_arena.c): structs come zeroed (record_stream's uses with
 * their inline arrays, grown on the heap past AP_MAX_USES streams of the pool's device or
 * AP_MAX_FOREIGN of others), a recycled struct is the next
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

/* Streams of other devices grow the same allocation, interleaved with the uses, keeping what
   every array held, up to AP_FOREIGN_LIMIT; each array is writable to its end (ASan). */
static void foreign_uses(ap_pool *p, ap_block_uses *w) {
    w->n_uses = 0;
    for (int i = 0; i < AP_FOREIGN_LIMIT; i++) {
        if (w->n_foreign == w->fcap) CHECK(ap_uses_grow(w, 1) == 0 && ap_uses_ok(w));
        w->foreign_device[w->n_foreign] = (int16_t)(i % 7);
        w->foreign[w->n_foreign++] = (void *)(uintptr_t)(i + 1);
        if (i % 64 == 0 && w->n_uses < AP_MAX_STREAMS) {
            if (w->n_uses == w->cap) CHECK(ap_uses_grow(w, 0) == 0 && ap_uses_ok(w));
            w->uses[w->n_uses++] = (uint16_t)(i / 64);
        }
        if (i < 9) { /* a pending free's waits, carried through the first growth */
            w->events[w->n_events++] = (void *)(uintptr_t)(100 + i);
            w->owed[w->n_owed++] = (void *)(uintptr_t)(200 + i);
            w->fevents[w->n_fevents++] = (void *)(uintptr_t)(300 + i);
        }
    }
    CHECK(w->fcap == AP_FOREIGN_LIMIT && ap_uses_grow(w, 1) == -1 && ap_uses_ok(w)); /* the most */
    for (int i = 0; i < AP_FOREIGN_LIMIT; i++)
        CHECK(w->foreign[i] == (void *)(uintptr_t)(i + 1) && w->foreign_device[i] == i % 7);
    for (int i = 0; i < w->n_uses; i++) CHECK(w->uses[i] == i);
    for (int i = 0; i < 9; i++)
        CHECK(w->events[i] == (void *)(uintptr_t)(100 + i) && w->owed[i] == (void *)(uintptr_t)(200 + i) &&
              w->fevents[i] == (void *)(uintptr_t)(300 + i));
    for (int i = 0; i < w->cap + w->fcap + 1; i++) w->events[i] = w->owed[i] = w;
    for (int i = 0; i < w->fcap; i++) w->fevents[i] = w->foreign[i] = w;
    for (int i = 0; i < w->cap; i++) w->uses[i] = 1;
    CHECK((size_t)w->cap + w->fcap + 1 <= UINT16_MAX); /* the counts stay in range */
    w->n_uses = w->n_foreign = w->n_events = w->n_owed = w->n_fevents = 0;
    ap_uses_recycle(p, w);
    ap_block_uses *x = ap_uses_new(p);
    CHECK(x == w && ap_uses_ok(x) && x->fcap == AP_MAX_FOREIGN && x->foreign == x->foreign_in &&
          x->foreign_device == x->foreign_device_in && x->fevents == x->fevents_in);
    ap_uses_recycle(p, x);
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
    CHECK(u && all_zero(u->uses_in, sizeof u->uses_in) && all_zero(u->foreign_in, sizeof u->foreign_in));
    CHECK(u->n_uses == 0 && u->n_events == 0 && u->n_owed == 0 && u->n_foreign == 0 && ap_uses_ok(u));
    CHECK(u->cap == AP_MAX_USES && u->uses == u->uses_in && u->events == u->events_in);
    CHECK(u->fcap == AP_MAX_FOREIGN && u->foreign == u->foreign_in && u->fevents == u->fevents_in);
    u->n_uses = 3;
    ap_uses_recycle(p, u);
    ap_block_uses *v = ap_uses_new(p);
    CHECK(v == u && v->n_uses == 0 && ap_uses_ok(v));
    /* Past the inline uses the arrays grow on the heap, keeping what they held, up to one use per
       stream slot; recycled, the struct comes back inline (the heap arrays freed: LeakSanitizer) */
    for (int i = 0; i < AP_MAX_STREAMS; i++) {
        if (v->n_uses == v->cap) CHECK(ap_uses_grow(v, 0) == 0 && ap_uses_ok(v));
        v->uses[v->n_uses++] = (uint16_t)i;
    }
    CHECK(v->cap == AP_MAX_STREAMS && ap_uses_grow(v, 0) == -1 && ap_uses_ok(v)); /* a slot each: no more */
    for (int i = 0; i < AP_MAX_STREAMS; i++) CHECK(v->uses[i] == i);
    for (int i = 0; i < v->cap + AP_MAX_FOREIGN + 1; i++) v->events[i] = v->owed[i] = v; /* all writable */
    ap_uses_recycle(p, v);
    ap_block_uses *w = ap_uses_new(p);
    CHECK(w == v && w->cap == AP_MAX_USES && w->uses == w->uses_in && ap_uses_ok(w));
    w->n_uses = AP_MAX_USES;
    CHECK(ap_uses_grow(w, 0) == 0 && w->cap == 2 * AP_MAX_USES);
    ap_uses_shrink(w); /* as ap_pool_destroy does for a block still marked */
    CHECK(w->cap == AP_MAX_USES && w->uses == w->uses_in && ap_uses_ok(w));
    foreign_uses(p, w);
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
