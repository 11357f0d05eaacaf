/* Time helpers: monotonic clock, short delays, condition-variable deadlines. */
#include <errno.h>
#include <time.h>

#include "sim_internal.h"

uint64_t sim_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

void sim_sleep_ns(uint64_t ns)
{
    struct timespec ts = {(time_t)(ns / 1000000000ull), (long)(ns % 1000000000ull)};
    while (clock_nanosleep(CLOCK_MONOTONIC, 0, &ts, &ts) == EINTR)
        ;
}

/* Latency injection models tens of microseconds per aclrtMalloc: nanosleep overshoots by ~50 us
   there, so short waits spin on the clock to make the added time close to what was asked. */
static inline void sim_cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

void sim_delay_us(uint64_t us)
{
    if (us == 0)
        return;
    if (us >= 100) {
        sim_sleep_ns(us * 1000ull);
        return;
    }
    uint64_t end = sim_now_ns() + us * 1000ull;
    while (sim_now_ns() < end)
        sim_cpu_relax();
}

void sim_deadline_ms(struct timespec *ts, int64_t ms)
{
    clock_gettime(CLOCK_MONOTONIC, ts);
    ts->tv_sec += (time_t)(ms / 1000);
    ts->tv_nsec += (long)(ms % 1000) * 1000000L;
    if (ts->tv_nsec >= 1000000000L) {
        ts->tv_sec += 1;
        ts->tv_nsec -= 1000000000L;
    }
}

int sim_cond_init(pthread_cond_t *cv)
{
    pthread_condattr_t a;
    pthread_condattr_init(&a);
    pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
    int rc = pthread_cond_init(cv, &a);
    pthread_condattr_destroy(&a);
    return rc;
}
