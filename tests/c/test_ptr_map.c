/* The pointer map (cython/core/ptr_map.{c,h}): puts, gets and takes agree with a reference model
 * through growth, long collision runs (keys forced onto one home slot, runs that wrap past the
 * table's end) and deletions from the middle of runs (backward shift, no tombstones).
 * core: ptr_map.c */
#include <string.h>

#include "check.h"
#include "ptr_map.h"

#define N_KEYS 4000

/* The first n keys (multiples of 512, from start) whose home slot in a table of mask is `home`. */
static int keys_with_home(const ap_ptr_map *m, size_t home, uintptr_t start, uintptr_t *out, int n) {
    int found = 0;
    for (uintptr_t k = start; found < n; k += 512)
        if (ap_map_home(m, k) == home) out[found++] = k;
    return found;
}

static void basics(void) {
    ap_ptr_map m;
    CHECK(ap_map_init(&m, 100) == 0);
    CHECK_EQ(m.mask + 1, 128); /* rounded up to a power of two */
    CHECK_EQ(m.count, 0);
    int v1, v2;
    CHECK(ap_map_get(&m, 0x1000) == NULL);
    CHECK(ap_map_put(&m, 0x1000, &v1) == 0);
    CHECK(ap_map_put(&m, 0x1200, &v2) == 0);
    CHECK(ap_map_get(&m, 0x1000) == &v1);
    CHECK(ap_map_get(&m, 0x1200) == &v2);
    CHECK(ap_map_get(&m, 0x1400) == NULL);
    CHECK(ap_map_take(&m, 0x1400) == NULL); /* absent: nothing changes */
    CHECK_EQ(m.count, 2);
    CHECK(ap_map_take(&m, 0x1000) == &v1);
    CHECK(ap_map_get(&m, 0x1000) == NULL);
    CHECK(ap_map_take(&m, 0x1000) == NULL); /* taken once only */
    CHECK(ap_map_get(&m, 0x1200) == &v2);
    CHECK_EQ(m.count, 1);
    ap_map_destroy(&m);
    CHECK(m.keys == NULL && m.vals == NULL && m.count == 0);
}

/* One probe run holding keys of the same home, at the table's last slot so the run wraps to slot
   0; deleting from its middle must keep every later key reachable. */
static void collisions_and_wrap(void) {
    ap_ptr_map m;
    CHECK(ap_map_init(&m, 64) == 0);
    uintptr_t same[8], other[4];
    keys_with_home(&m, m.mask, 512, same, 8); /* home: the last slot */
    keys_with_home(&m, 1, 512, other, 4);     /* home: slot 1, inside the wrapped run */
    static int vals[12];
    for (int i = 0; i < 8; i++) CHECK(ap_map_put(&m, same[i], &vals[i]) == 0);
    for (int i = 0; i < 4; i++) CHECK(ap_map_put(&m, other[i], &vals[8 + i]) == 0);
    CHECK_EQ(m.count, 12);
    CHECK(m.keys[m.mask] == same[0] && m.keys[0] == same[1]); /* the run wrapped */
    for (int i = 0; i < 8; i++) CHECK(ap_map_get(&m, same[i]) == &vals[i]);
    for (int i = 0; i < 4; i++) CHECK(ap_map_get(&m, other[i]) == &vals[8 + i]);
    int order[] = {1, 0, 5, 7};
    for (int k = 0; k < 4; k++) {
        int i = order[k];
        CHECK(ap_map_take(&m, same[i]) == &vals[i]);
        CHECK(ap_map_get(&m, same[i]) == NULL);
        for (int j = 0; j < 8; j++)
            if (j != 1 && j != 0 && j != 5 && j != 7) CHECK(ap_map_get(&m, same[j]) == &vals[j]);
        for (int j = 0; j < 4; j++) CHECK(ap_map_get(&m, other[j]) == &vals[8 + j]);
    }
    CHECK_EQ(m.count, 8);
    ap_map_destroy(&m);
}

/* A deletion whose backward shift crosses the table's end: the run of home mask-1 fills slots
   mask-1 and mask, a key of home 0 sits at its home right after them. Taking the first key moves
   the second back; the key at slot 0 is at its home and must stay, or it is lost. */
static void shift_across_the_end(void) {
    ap_ptr_map m;
    CHECK(ap_map_init(&m, 64) == 0);
    uintptr_t run[2], at0;
    keys_with_home(&m, m.mask - 1, 512, run, 2);
    keys_with_home(&m, 0, 512, &at0, 1);
    int v[3];
    CHECK(ap_map_put(&m, run[0], &v[0]) == 0);
    CHECK(ap_map_put(&m, run[1], &v[1]) == 0);
    CHECK(ap_map_put(&m, at0, &v[2]) == 0);
    CHECK(m.keys[m.mask - 1] == run[0] && m.keys[m.mask] == run[1] && m.keys[0] == at0);
    CHECK(ap_map_take(&m, run[0]) == &v[0]);
    CHECK(m.keys[m.mask - 1] == run[1] && m.keys[m.mask] == 0 && m.keys[0] == at0);
    CHECK(ap_map_get(&m, run[1]) == &v[1]);
    CHECK(ap_map_get(&m, at0) == &v[2]);
    ap_map_destroy(&m);
}

/* Random puts and takes against a model, across several doublings. */
static void random_against_model(void) {
    static uintptr_t keys[N_KEYS];
    static int vals[N_KEYS], in[N_KEYS];
    ap_ptr_map m;
    CHECK(ap_map_init(&m, 1) == 0);
    CHECK_EQ(m.mask + 1, 64);
    unsigned long long rng = 7;
    /* random high bits, distinct low bits: a repeated key would be a second put of one address */
    for (int i = 0; i < N_KEYS; i++) keys[i] = (uintptr_t)(test_rand(&rng) % (1ull << 20)) << 23 | (uintptr_t)(i + 1) << 9;
    size_t count = 0, grew = 0, last_cap = m.mask + 1;
    for (int step = 0; step < 8 * N_KEYS; step++) {
        /* insert-heavy first (growth), then balanced (deletions among full runs) */
        int i = (int)(test_rand(&rng) % (step < 2 * N_KEYS ? N_KEYS : N_KEYS / 2));
        if (in[i]) {
            CHECK(ap_map_take(&m, keys[i]) == &vals[i]);
            count--;
        } else {
            CHECK(ap_map_put(&m, keys[i], &vals[i]) == 0);
            count++;
        }
        in[i] = !in[i];
        CHECK_EQ(m.count, count);
        CHECK(m.count * 2 <= m.mask + 1); /* load factor at most 1/2 */
        if (m.mask + 1 != last_cap) {
            CHECK_EQ(m.mask + 1, last_cap * 2); /* grows by doubling */
            last_cap = m.mask + 1;
            grew++;
        }
        if (step % 1000 == 0)
            for (int j = 0; j < N_KEYS; j++) CHECK(ap_map_get(&m, keys[j]) == (in[j] ? &vals[j] : NULL));
    }
    CHECK(grew >= 5); /* 64 -> at least 4096 slots */
    for (int j = 0; j < N_KEYS; j++) CHECK(ap_map_get(&m, keys[j]) == (in[j] ? &vals[j] : NULL));
    /* Emptied, the table is reusable and holds no stale key. */
    for (int j = 0; j < N_KEYS; j++)
        if (in[j]) CHECK(ap_map_take(&m, keys[j]) == &vals[j]);
    CHECK_EQ(m.count, 0);
    for (size_t s = 0; s <= m.mask; s++) CHECK(m.keys[s] == 0 && m.vals[s] == NULL);
    ap_map_destroy(&m);
}

int main(void) {
    basics();
    collisions_and_wrap();
    shift_across_the_end();
    random_against_model();
    puts("test_ptr_map: ok");
    return 0;
}
