/* Fault injection: make chosen calls fail, or slow, exactly when asked.
 *
 * "Fail the Nth call" counts the calls that reach the fault point (parameters already valid)
 * from the moment the fault was armed (aclInit for the ASCEND_SIM_* variables, the setter call
 * otherwise), fails that one call, and disarms. A countdown taken with a compare-and-swap makes
 * "exactly once, exactly the Nth" hold even when many threads call at the same time.
 */
#include "sim_internal.h"

static _Atomic uint64_t malloc_countdown, event_create_countdown, event_query_countdown;
static _Atomic int64_t after_bytes = -1;
static _Atomic uint64_t malloc_latency_us, free_latency_us;

/* 1 when this call is the armed Nth; the countdown reaches 0 and stays there. */
static int take(_Atomic uint64_t *countdown)
{
    uint64_t v = atomic_load(countdown);
    while (v != 0) {
        if (atomic_compare_exchange_weak(countdown, &v, v - 1))
            return v == 1;
    }
    return 0;
}

void sim_faults_reset(void)
{
    atomic_store(&malloc_countdown, 0);
    atomic_store(&event_create_countdown, 0);
    atomic_store(&event_query_countdown, 0);
    atomic_store(&after_bytes, -1);
    atomic_store(&malloc_latency_us, 0);
    atomic_store(&free_latency_us, 0);
}

void sim_faults_from_config(const struct sim_config *cfg)
{
    sim_faults_reset();
    atomic_store(&malloc_countdown, cfg->fail_malloc_nth);
    atomic_store(&after_bytes, cfg->fail_after_bytes);
    atomic_store(&malloc_latency_us, cfg->malloc_latency_us);
    atomic_store(&free_latency_us, cfg->free_latency_us);
}

int sim_fault_malloc_nth(void) { return take(&malloc_countdown); }
int sim_fault_event_create_nth(void) { return take(&event_create_countdown); }
int sim_fault_event_query_nth(void) { return take(&event_query_countdown); }
int64_t sim_fault_after_bytes(void) { return atomic_load(&after_bytes); }
void sim_fault_malloc_latency(void) { sim_delay_us(atomic_load(&malloc_latency_us)); }
void sim_fault_free_latency(void) { sim_delay_us(atomic_load(&free_latency_us)); }

void sim_faults_set_malloc_nth(uint64_t n) { atomic_store(&malloc_countdown, n); }
void sim_faults_set_event_create_nth(uint64_t n) { atomic_store(&event_create_countdown, n); }
void sim_faults_set_event_query_nth(uint64_t n) { atomic_store(&event_query_countdown, n); }
void sim_faults_set_after_bytes(int64_t bytes) { atomic_store(&after_bytes, bytes < 0 ? -1 : bytes); }
void sim_faults_set_malloc_latency(uint64_t us) { atomic_store(&malloc_latency_us, us); }
void sim_faults_set_free_latency(uint64_t us) { atomic_store(&free_latency_us, us); }
