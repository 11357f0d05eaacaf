/* AP_ASSERT: the invariants that comments state, checked in debug and ASan builds
 * (ASCEND_POOL_SANITIZE=1, or AP_DEBUG) and compiled out otherwise, so the hot path pays nothing.
 * A header of its own so that the data-structure files (free tree, pointer map, stats) assert
 * without pulling in the whole pool. A failure names the file, line and condition, then aborts:
 * a broken invariant means the pool's state is already wrong, and going on would hide where. */
#ifndef AP_INVARIANT_H
#define AP_INVARIANT_H

#if defined(ASCEND_POOL_SANITIZE) || defined(AP_DEBUG)
#include <stdio.h>
#include <stdlib.h>
#define AP_CHECKED 1
#define AP_ASSERT(cond)                                                                                \
    do {                                                                                               \
        if (!(cond)) {                                                                                 \
            fprintf(stderr, "ascend_pool: invariant failed at %s:%d: %s\n", __FILE__, __LINE__, #cond); \
            abort();                                                                                   \
        }                                                                                              \
    } while (0)
#else
#define AP_CHECKED 0
#define AP_ASSERT(cond) ((void)0)
#endif

#endif
