/* Breaks one invariant on purpose (argv[1] names which) so that tests/test_c_units.py can see
 * AP_ASSERT stop the program in a debug/ASan build (ASCEND_POOL_SANITIZE=1) and compile to nothing
 * in a release build. Not a test_*.c: it is meant to fail.
 * core: ptr_map.c stats.c free_tree.c block_arena.c */
#include <string.h>

#include "check.h"
#include "pool_internal.h"

int main(int argc, char **argv) {
    CHECK(argc == 2);
    const char *what = argv[1];
    if (!strcmp(what, "map_put_twice")) { /* one address, two records */
        ap_ptr_map m;
        CHECK(ap_map_init(&m, 64) == 0);
        int v;
        ap_map_put(&m, 0x2000, &v);
        ap_map_put(&m, 0x2000, &v);
        ap_map_destroy(&m);
    } else if (!strcmp(what, "stat_below_zero")) { /* freed more than was counted */
        ap_stats st;
        memset(&st, 0, sizeof st);
        ap_stat_inc(&st, AP_STAT_ALLOCATED_BYTES, AP_POOL_SMALL, 512);
        ap_stat_dec(&st, AP_STAT_ALLOCATED_BYTES, AP_POOL_SMALL, 1024);
    } else if (!strcmp(what, "tree_remove_absent")) { /* a block taken out of a tree it is not in */
        ap_segment s = {.base = 0x100000, .size = 1 << 20, .seq = 1};
        ap_block a = {.addr = 0x100000, .size = 4096, .seg = &s}, b = {.addr = 0x101000, .size = 4096, .seg = &s};
        ap_free_tree t = {0};
        ap_tree_insert(&t, &a);
        ap_tree_remove(&t, &b);
    } else if (!strcmp(what, "recycle_twice")) { /* one struct on the spare list twice */
        ap_pool *p = calloc(1, sizeof *p);
        CHECK(p != NULL);
        ap_block *b = ap_block_new(p);
        ap_block_recycle(p, b);
        ap_block_recycle(p, b);
        ap_arena_destroy(p);
        free(p);
    } else {
        fprintf(stderr, "unknown invariant %s\n", what);
        return 2;
    }
    puts("break_invariant: not stopped");
    return 0;
}
