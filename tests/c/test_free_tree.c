/* The best-fit tree (cython/core/free_tree.c): best fit is the smallest block of at least the
 * size, the oldest segment and then the lowest offset among equal sizes; removal, walks and
 * visits keep that order; a random workload agrees with a brute-force search at every step;
 * taking every block at once (ap_tree_take_all) lists them in tree order and leaves the tree empty
 * and usable; segments past the 2^24th of a pool still rank by age, and their blocks are found.
 * core: free_tree.c */
#include <string.h>

#include "check.h"
#include "free_tree.h"

#define N_RANDOM 1500

static ap_segment seg_old = {.base = 0x7f0000000000, .size = 1ull << 30, .seq = 1};
static ap_segment seg_young = {.base = 0x100000000, .size = 1ull << 30, .seq = 2}; /* lower address, younger */

static void set(ap_block *b, ap_segment *s, size_t offset, size_t size) {
    memset(b, 0, sizeof *b);
    b->seg = s;
    b->addr = s->base + offset;
    b->size = size;
}

typedef struct {
    size_t sizes[64];
    int n, stop_after;
} walk_log;

static int log_block(ap_block *b, void *arg) {
    walk_log *w = arg;
    w->sizes[w->n++] = b->size;
    return w->n == w->stop_after;
}

static void log_visit(ap_block *b, void *arg) { log_block(b, arg); }

static void best_fit_order(void) {
    ap_free_tree t = {0};
    ap_block b[8];
    set(&b[0], &seg_young, 0, 4096);
    set(&b[1], &seg_old, 8192, 4096);  /* same size, older segment, higher offset */
    set(&b[2], &seg_old, 4096, 4096);  /* same size and segment, lower offset: the best of the three */
    set(&b[3], &seg_old, 65536, 1024);
    set(&b[4], &seg_young, 65536, 1 << 20);
    set(&b[5], &seg_old, 1 << 21, 8192);
    for (int i = 0; i < 6; i++) {
        ap_tree_insert(&t, &b[i]);
        CHECK(ap_tree_check(&t));
    }
    CHECK_EQ(t.count, 6);
    CHECK_EQ(t.bytes, 4096 * 3 + 1024 + (1 << 20) + 8192);
    CHECK(ap_tree_best_fit(&t, 1) == &b[3]);
    CHECK(ap_tree_best_fit(&t, 1024) == &b[3]);
    CHECK(ap_tree_best_fit(&t, 1025) == &b[2]); /* not the younger segment's block at a lower address */
    CHECK(ap_tree_best_fit(&t, 4096) == &b[2]);
    CHECK(ap_tree_best_fit(&t, 4097) == &b[5]);
    CHECK(ap_tree_best_fit(&t, 1 << 20) == &b[4]);
    CHECK(ap_tree_best_fit(&t, (1 << 20) + 1) == NULL);
    CHECK(ap_tree_largest(&t) == &b[4]);

    ap_tree_remove(&t, &b[2]);
    CHECK(ap_tree_check(&t));
    CHECK(b[2].left == NULL && b[2].right == NULL);
    CHECK(ap_tree_best_fit(&t, 4096) == &b[1]); /* next in age, then offset */
    ap_tree_remove(&t, &b[1]);
    CHECK(ap_tree_best_fit(&t, 4096) == &b[0]);
    ap_tree_remove(&t, &b[4]);
    CHECK(ap_tree_largest(&t) == &b[5]);
    CHECK_EQ(t.count, 3);
    CHECK_EQ(t.bytes, 4096 + 1024 + 8192);

    /* Walks: ascending from the first block of at least the size, stopping when asked. */
    walk_log w = {.stop_after = 0};
    ap_tree_walk_from(&t, 2000, log_block, &w);
    CHECK_EQ(w.n, 2);
    CHECK_EQ(w.sizes[0], 4096);
    CHECK_EQ(w.sizes[1], 8192);
    w = (walk_log){.stop_after = 1};
    ap_tree_walk_from(&t, 1, log_block, &w);
    CHECK_EQ(w.n, 1);
    CHECK_EQ(w.sizes[0], 1024);
    w = (walk_log){.stop_after = 0};
    ap_tree_visit(&t, log_visit, &w);
    CHECK_EQ(w.n, 3);
    CHECK(w.sizes[0] == 1024 && w.sizes[1] == 4096 && w.sizes[2] == 8192);

    ap_tree_remove(&t, &b[0]);
    ap_tree_remove(&t, &b[3]);
    ap_tree_remove(&t, &b[5]);
    CHECK(t.root == NULL && t.count == 0 && t.bytes == 0);
    CHECK(ap_tree_best_fit(&t, 1) == NULL && ap_tree_largest(&t) == NULL);
}

/* Brute force: the block best fit must return. */
static ap_block *expected_fit(ap_block *blocks, const int *in, int n, size_t size) {
    ap_block *best = NULL;
    for (int i = 0; i < n; i++) {
        if (!in[i] || blocks[i].size < size) continue;
        if (!best || blocks[i].size < best->size ||
            (blocks[i].size == best->size && (blocks[i].seg->seq < best->seg->seq ||
                                              (blocks[i].seg == best->seg && blocks[i].addr < best->addr))))
            best = &blocks[i];
    }
    return best;
}

static void random_workload(void) {
    static ap_block blocks[N_RANDOM];
    static int in[N_RANDOM];
    static ap_segment segs[4];
    unsigned long long rng = 42;
    for (int s = 0; s < 4; s++) segs[s] = (ap_segment){.base = 0x10000000000ull * (4 - s), .size = 1ull << 34, .seq = s + 1};
    for (int i = 0; i < N_RANDOM; i++) /* few distinct sizes: many ties to order */
        set(&blocks[i], &segs[i % 4], (size_t)i << 20, 512 * (1 + test_rand(&rng) % 16));
    ap_free_tree t = {0};
    size_t bytes = 0;
    int count = 0;
    for (int step = 0; step < 6 * N_RANDOM; step++) {
        int i = (int)(test_rand(&rng) % N_RANDOM);
        if (in[i]) {
            ap_tree_remove(&t, &blocks[i]);
            bytes -= blocks[i].size;
            count--;
        } else {
            ap_tree_insert(&t, &blocks[i]);
            bytes += blocks[i].size;
            count++;
        }
        in[i] = !in[i];
        CHECK_EQ(t.count, count);
        CHECK_EQ(t.bytes, bytes);
        size_t want = 512 * (1 + test_rand(&rng) % 17);
        CHECK(ap_tree_best_fit(&t, want) == expected_fit(blocks, in, N_RANDOM, want));
        if (step % 97 == 0) CHECK(ap_tree_check(&t));
    }
    CHECK(ap_tree_check(&t));
}

/* ap_tree_check itself must see a broken tree (it backs check.c's report). */
static void check_sees_breakage(void) {
    ap_free_tree t = {0};
    ap_block b[3];
    set(&b[0], &seg_old, 0, 512);
    set(&b[1], &seg_old, 512, 1024);
    set(&b[2], &seg_old, 2048, 2048);
    for (int i = 0; i < 3; i++) ap_tree_insert(&t, &b[i]);
    CHECK(ap_tree_check(&t));
    t.bytes++;
    CHECK(!ap_tree_check(&t)); /* counts that do not match the blocks */
    t.bytes--;
    size_t old = b[0].size;
    b[0].size = 4096; /* the smallest key now sits where a larger one should */
    CHECK(!ap_tree_check(&t));
    b[0].size = old;
    CHECK(ap_tree_check(&t));
}

/* 100,000 blocks of one size over 50 segments (a stream's small frees): all come out, in tree
   order (segment age, then offset), links cleared; the tree is empty and takes them back. */
static void take_all_in_order(void) {
    enum { N = 100000, PER = 2000 };
    static ap_segment segs[N / PER];
    static ap_block b[N];
    ap_free_tree t = {0};
    CHECK(ap_tree_take_all(&t) == NULL);
    for (int s = 0; s < N / PER; s++) segs[s] = (ap_segment){.base = 0x10000000ull * (uint64_t)(N / PER - s), .size = 2u << 20, .seq = (uint64_t)s + 1};
    for (int k = 0; k < N; k++) { /* inserted in a scrambled order (7919 is prime to N) */
        int i = (int)(k * 7919ull % N);
        set(&b[i], &segs[i / PER], (size_t)(i % PER) * 1024, 512);
        ap_tree_insert(&t, &b[i]);
    }
    CHECK_EQ(t.count, N);
    ap_block *list = ap_tree_take_all(&t);
    CHECK(t.root == NULL && t.count == 0 && t.bytes == 0 && ap_tree_check(&t));
    int n = 0;
    for (ap_block *x = list; x; x = x->pending_next, n++) {
        CHECK(x == &b[n]); /* segment age first (the oldest at the highest address), then offset */
        CHECK(x->left == NULL && x->right == NULL);
    }
    CHECK_EQ(n, N);
    for (ap_block *x = list, *next; x; x = next) {
        next = x->pending_next;
        ap_tree_insert(&t, x);
    }
    CHECK(t.count == N && t.bytes == (size_t)N * 512 && ap_tree_check(&t));
    CHECK(ap_tree_best_fit(&t, 512) == &b[0]);
}

/* A long-running pool's segment counter past 2^24 (growths and releases, expandable splits):
   segments 2^24 + 1 on are younger than every segment before them, so best fit takes the old
   segments' blocks first, and equal blocks at equal offsets of segments 1 and 2^24 + 1 are two
   keys, the older first, each found by its removal (packed as seq << 40 | offset, a young segment
   ranked as old as segment 1, or older than segment 100). */
static void segments_past_the_24_bit_count(void) {
    enum { N = 64 };
    static ap_segment old[N], young[N];
    static ap_block a[N], b[N];
    for (int round = 0; round < 2; round++) {
        ap_free_tree t = {0};
        for (int i = 0; i < N; i++) {
            old[i] = (ap_segment){.base = 0x7f0000000000ull + (uint64_t)i * (4u << 20), .size = 2u << 20, .seq = (uint64_t)i + 1};
            young[i] = (ap_segment){.base = 0x100000000ull + (uint64_t)i * (4u << 20), .size = 2u << 20,
                                    .seq = (1ull << 24) + (uint64_t)i + 1};
            set(&a[i], &old[i], 4096, 512);
            set(&b[i], &young[i], 4096, 512);
        }
        for (int i = 0; i < N; i++) { /* both orders of insertion, so both sides of each rotation */
            ap_tree_insert(&t, round ? &b[i] : &a[i]);
            ap_tree_insert(&t, round ? &a[i] : &b[i]);
        }
        CHECK(ap_tree_check(&t) && t.count == 2 * N);
        CHECK(ap_tree_best_fit(&t, 512) == &a[0]); /* the oldest segment first */
        for (int i = 0; i < N; i++) { /* every removal finds its block */
            ap_tree_remove(&t, round ? &a[i] : &b[i]);
            CHECK(ap_tree_check(&t) && t.count == (size_t)(2 * N - 2 * i - 1));
            ap_tree_remove(&t, round ? &b[i] : &a[i]);
            CHECK(ap_tree_check(&t) && t.count == (size_t)(2 * N - 2 * i - 2));
            if (i + 1 < N) CHECK(ap_tree_best_fit(&t, 512) == &a[i + 1]);
        }
        CHECK(t.root == NULL);
    }
    /* Segment 2^24 + 2 is younger than segment 100: the old one's block first. */
    ap_free_tree t = {0};
    old[0] = (ap_segment){.base = 0x7f0000000000ull, .size = 2u << 20, .seq = 100};
    young[0] = (ap_segment){.base = 0x100000000ull, .size = 2u << 20, .seq = (1ull << 24) + 2};
    set(&a[0], &old[0], 4096, 512);
    set(&b[0], &young[0], 4096, 512);
    ap_tree_insert(&t, &b[0]);
    ap_tree_insert(&t, &a[0]);
    CHECK(ap_tree_best_fit(&t, 512) == &a[0]);
}

int main(void) {
    best_fit_order();
    segments_past_the_24_bit_count();
    take_all_in_order();
    random_workload();
    check_sees_breakage();
    puts("test_free_tree: ok");
    return 0;
}
