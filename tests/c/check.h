/* The C unit tests' one assertion: CHECK(cond) prints file:line and the condition, then exits 1;
 * CHECK_EQ(a, b) also prints both values. Active in every build (unlike AP_ASSERT). Each test is a
 * program of its own, compiled and run by tests/test_c_units.py. */
#ifndef AP_TEST_CHECK_H
#define AP_TEST_CHECK_H

#include <stdio.h>
#include <stdlib.h>

#define CHECK(cond)                                                                 \
    do {                                                                            \
        if (!(cond)) {                                                              \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
            exit(1);                                                                \
        }                                                                           \
    } while (0)

#define CHECK_EQ(a, b)                                                                                   \
    do {                                                                                                 \
        long long a_ = (long long)(a), b_ = (long long)(b);                                              \
        if (a_ != b_) {                                                                                  \
            fprintf(stderr, "%s:%d: CHECK failed: %s == %s (%lld != %lld)\n", __FILE__, __LINE__, #a, #b, \
                    a_, b_);                                                                             \
            exit(1);                                                                                     \
        }                                                                                                \
    } while (0)

/* A small deterministic generator (xorshift64*), so every run tests the same sequence. */
static inline unsigned long long test_rand(unsigned long long *state) {
    unsigned long long x = *state;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *state = x;
    return x * 0x2545F4914F6CDD1Dull;
}

#endif
