/* The trace ring (cython/core/history.{c,h}): off at capacity 0 (ap_history_add records nothing),
 * entries copied oldest first, the oldest overwritten once the ring is full, each entry carrying
 * the recording thread's context id.
 * core: history.c */
#include "check.h"
#include "history.h"

static void off_records_nothing(void) {
    ap_history h;
    CHECK(ap_history_init(&h, 0) == 0);
    ap_history_add(&h, AP_ACT_ALLOC, 0x1000, 512, NULL);
    ap_history_entry *out = (ap_history_entry *)1;
    CHECK_EQ(ap_history_copy(&h, &out), 0);
    CHECK(out == NULL);
    ap_history_destroy(&h);
}

static void ring_keeps_the_newest(void) {
    ap_history h;
    CHECK(ap_history_init(&h, 4) == 0);
    ap_history_entry *out;
    CHECK_EQ(ap_history_copy(&h, &out), 0); /* nothing recorded yet */
    ap_history_set_ctx(7);
    ap_history_add(&h, AP_ACT_SEGMENT_ALLOC, 0x10000, 2 << 20, (void *)0x5);
    ap_history_set_ctx(0);
    ap_history_add(&h, AP_ACT_ALLOC, 0x10000, 100, (void *)0x5);
    CHECK_EQ(ap_history_copy(&h, &out), 2);
    CHECK(out[0].action == AP_ACT_SEGMENT_ALLOC && out[0].size == (2 << 20) && out[0].ctx == 7);
    CHECK(out[1].action == AP_ACT_ALLOC && out[1].addr == 0x10000 && out[1].stream == (void *)0x5 && out[1].ctx == 0);
    CHECK(out[0].time_us > 0 && out[1].time_us >= out[0].time_us);
    free(out);
    for (int i = 0; i < 7; i++) ap_history_add(&h, AP_ACT_FREE_REQUESTED, 0x20000 + (uintptr_t)i * 512, (size_t)i, NULL);
    CHECK_EQ(h.next, 9);
    CHECK_EQ(ap_history_copy(&h, &out), 4); /* the last four of nine, oldest first */
    for (int i = 0; i < 4; i++) {
        CHECK_EQ(out[i].size, 3 + i);
        CHECK_EQ(out[i].addr, 0x20000 + (3 + i) * 512);
    }
    free(out);
    ap_history_destroy(&h);
    CHECK(h.ring == NULL && h.capacity == 0);
}

int main(void) {
    off_records_nothing();
    ring_keeps_the_newest();
    puts("test_history: ok");
    return 0;
}
