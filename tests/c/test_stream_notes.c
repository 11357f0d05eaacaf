/* The acl backend's notes of its streams (cython/backend/stream_notes.h): each note found by its
 * handle after any mix of appends and removals (the last note moved into a removed one's place,
 * probe runs shifted back across the table's end), none found once removed, and the index kept
 * within eight times the live notes through a peak and back, so a process creating and
 * destroying streams for ever keeps it bounded. A random run checks it against a plain scan.
 * core: */
#include "check.h"
#include "stream_notes.h"

#define N_HANDLES 5000

/* Handles as CANN's: heap pointers, 16-byte aligned, reused once freed. */
static void *handle(int i) { return (void *)(uintptr_t)(0x7f0000000000ull + (unsigned long long)i * 0x40); }

static ptrdiff_t scan(const acl_stream_notes *t, void *stream) {
    for (size_t i = 0; i < t->n; i++)
        if (t->v[i].stream == stream) return (ptrdiff_t)i;
    return -1;
}

static void basics(void) {
    acl_stream_notes t = {0};
    CHECK_EQ(notes_find(&t, handle(1)), -1); /* empty, no index yet */
    for (int i = 0; i < 100; i++) CHECK(notes_append(&t, (struct acl_stream_dev){handle(i), i % 16, (uint64_t)i + 1, 0}) == 0);
    for (int i = 0; i < 100; i++) {
        ptrdiff_t at = notes_find(&t, handle(i));
        CHECK(at >= 0 && t.v[at].stream == handle(i) && t.v[at].device == i % 16 && t.v[at].serial == (uint64_t)i + 1);
    }
    CHECK_EQ(notes_find(&t, handle(100)), -1);
    notes_remove_at(&t, (size_t)notes_find(&t, handle(0))); /* the last note takes its place */
    CHECK_EQ(t.n, 99);
    CHECK_EQ(notes_find(&t, handle(0)), -1);
    CHECK_EQ(notes_find(&t, handle(99)), 0);
    notes_free(&t);
    CHECK(t.v == NULL && t.index == NULL && t.n == 0);
}

/* Handles that share a home slot, past the table's end and back to its start. */
static void shift_across_the_end(void) {
    acl_stream_notes t = {0};
    CHECK(notes_append(&t, (struct acl_stream_dev){handle(0), 0, 1, 0}) == 0);
    size_t mask = t.index_cap - 1;
    void *same[6];
    int n = 0;
    for (int i = 1; n < 6 && i < 1000000; i++) /* six handles whose home is the table's last slot */
        if ((notes_hash(handle(i)) & mask) == mask) same[n++] = handle(i);
    CHECK_EQ(n, 6);
    for (int i = 0; i < 6; i++) CHECK(notes_append(&t, (struct acl_stream_dev){same[i], 1, (uint64_t)i + 2, 0}) == 0);
    CHECK_EQ(t.index_cap, mask + 1); /* no regrowth moved them */
    for (int k = 0; k < 6; k++) { /* remove each in turn from the front of the run: the rest stay found */
        notes_remove_at(&t, (size_t)notes_find(&t, same[k]));
        CHECK_EQ(notes_find(&t, same[k]), -1);
        for (int j = k + 1; j < 6; j++) CHECK(notes_find(&t, same[j]) == scan(&t, same[j]) && scan(&t, same[j]) >= 0);
        CHECK(notes_find(&t, handle(0)) == scan(&t, handle(0)) && scan(&t, handle(0)) >= 0);
    }
    notes_free(&t);
}

static void random_against_a_scan(void) {
    acl_stream_notes t = {0};
    static char in[N_HANDLES];
    unsigned long long rng = 42;
    size_t peak_cap = 0;
    for (int step = 0; step < 400000; step++) {
        /* First a rise to most handles noted, then a fall to a few, then churn. */
        int phase = step < 100000 ? 0 : step < 200000 ? 1 : 2;
        int i = (int)(test_rand(&rng) % N_HANDLES);
        int add = phase == 0 ? test_rand(&rng) % 8 != 0 : phase == 1 ? test_rand(&rng) % 8 == 0 : test_rand(&rng) % 2;
        ptrdiff_t at = notes_find(&t, handle(i));
        CHECK(at == scan(&t, handle(i)));
        CHECK((at >= 0) == in[i]);
        if (add && !in[i]) {
            CHECK(notes_append(&t, (struct acl_stream_dev){handle(i), i % 16, (uint64_t)step, 0}) == 0);
            in[i] = 1;
        } else if (!add && in[i]) {
            notes_remove_at(&t, (size_t)at);
            in[i] = 0;
        }
        CHECK(t.index_cap > t.n * 2);
        CHECK(t.index_cap <= 64 || t.index_cap <= t.n * 8);
        if (t.index_cap > peak_cap) peak_cap = t.index_cap;
        if (step % 5000 == 0)
            for (int j = 0; j < N_HANDLES; j++) CHECK((notes_find(&t, handle(j)) >= 0) == in[j]);
    }
    CHECK(peak_cap >= 8192); /* the rise grew it, the fall shrank it (checked each step) */
    while (t.n) notes_remove_at(&t, t.n - 1);
    CHECK(t.index_cap <= 64);
    for (size_t s = 0; s < t.index_cap; s++) CHECK(t.index[s] == 0);
    notes_free(&t);
}

int main(void) {
    basics();
    shift_across_the_end();
    random_against_a_scan();
    puts("test_stream_notes: ok");
    return 0;
}
