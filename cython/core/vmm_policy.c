/* Expandable mode's release policy: when a growth would lift reserved memory above its earlier
 * peak, trade idle chunks for the new mapping, within a budget of device calls.
 *
 * Why a trade at all: unlike a classic segment, a free chunk inside a segment can be unmapped on
 * its own, so reserved memory can stay at the level the workload's own peak needs instead of
 * growing by every fragmentation mishap. A trade unmaps idle chunks and maps the same physical
 * memory where the growth needs it (expandable.c keeps the handles: two calls a chunk, not four).
 * But trading every time lets a loop whose layout differs a little each step pay for the same
 * memory every step: measured with unlimited trades of 2 MiB pages, 25-3,800 % of allocations in
 * device calls on the shared traces.
 *
 * The budget, in device calls:
 *  - At a new high of allocated memory (live bytes plus this request above anything seen), trades
 *    are free of budget: this is the moment peak reserved is set, and such moments run out (each
 *    one raises the high), so they cannot recur step after step.
 *  - Otherwise a trade needs credit, which grows with allocations at AP_VMM_TRADE_PER_1000 calls
 *    per thousand allocations (0.4 %, well under the 1 % a steady state may spend) up to
 *    AP_VMM_TRADE_BURST calls. A trade that starts runs to its end and is charged afterwards,
 *    into debt if need be (each unmap twice: the map that reuses the chunk is the trade's other
 *    half): one cut short would spend calls and lift the peak anyway. Without credit the growth
 *    simply raises the peak, so a loop that keeps needing trades stops paying for them, and its
 *    higher peak then holds every step without calls. Over any N allocations, budgeted trades
 *    cost at most 0.4 % of N plus the burst plus one trade.
 *  - The longest-idle free block gives its chunks first (least likely to be needed soon), never the
 *    block the growth itself extends; memory whose stream may still use it goes only after a wait
 *    for that stream.
 *
 * Tried and dropped (mean waste reduction vs torch_npu's policy on the 6 shared traces; this
 * policy: 82.1 %): trading only memory idle for 1,000 allocations (64.7 %: the young free memory
 * at a training step's first peak stays mapped, gpt2 -11 %), unlimited trades (92 %, but up to
 * 3,800 % of allocations in calls), 2 MiB chunks with this budget (74.6 %, and up to 28 % of
 * allocations in calls over a whole trace), trades cut short when the credit runs out (81.8 %,
 * and lower on size-scaled variants of the traces), a credit proportional to the peak's growth
 * (carried into the steady state as bursts of calls).
 */
#include "pool_internal.h"

#define AP_VMM_TRADE_PER_1000 4 /* calls of credit per 1,000 allocations */
#define AP_VMM_TRADE_BURST 32   /* most calls of credit held at once */
#define AP_VMM_TRADE_CHARGE 2   /* credit charged per unmap: the unmap and the map that reuses it */

void ap_vmm_policy_init(ap_pool *p) { p->vmm_credit = (int64_t)AP_VMM_TRADE_BURST * 1000; }

void ap_vmm_make_room(ap_pool *p, size_t rsize, size_t need, const ap_block *keep) {
    size_t reserved = ap_reserved(p);
    if (reserved + need <= p->reserved_watermark) return;
    size_t over = reserved + need - p->reserved_watermark;

    const ap_stat *alloc = &p->stats.s[AP_STAT_ALLOCATED_BYTES][AP_STAT_ALL];
    if (alloc->peak > p->vmm_live_high) p->vmm_live_high = alloc->peak; /* survives reset_peaks */
    if (alloc->current + (int64_t)rsize > p->vmm_live_high) {
        ap_vmm_release_for_growth(p, over, keep);
        return;
    }

    /* Credit in thousandths of a call: + AP_VMM_TRADE_PER_1000 per allocation since last time. */
    int64_t cap = (int64_t)AP_VMM_TRADE_BURST * 1000;
    uint64_t ticks = p->tick - p->vmm_credit_tick;
    p->vmm_credit_tick = p->tick;
    /* (ticks capped first, so that the product cannot overflow) */
    uint64_t gain = (ticks < ((uint64_t)1 << 40) ? ticks : ((uint64_t)1 << 40)) * AP_VMM_TRADE_PER_1000;
    p->vmm_credit = p->vmm_credit + (int64_t)gain > cap ? cap : p->vmm_credit + (int64_t)gain;
    if (p->vmm_credit <= 0) return;
    int64_t before = p->stats.num_device_unmap + p->stats.num_device_free;
    ap_vmm_release_for_growth(p, over, keep);
    p->vmm_credit -= (p->stats.num_device_unmap + p->stats.num_device_free - before) * 1000 * AP_VMM_TRADE_CHARGE;
}
