/* Expandable mode's device-call policy: how much a growth maps, and when idle chunks are traded
 * (unmapped here, mapped again where a growth needs them) so that reserved memory stays under its
 * earlier peak. The inequality and its argument: docs/placement-policy-expandable.md.
 *
 * Why a trade at all: unlike a classic segment, a free chunk inside a segment can be unmapped on
 * its own, so reserved memory can stay at the level the workload's own peak needs instead of
 * growing by every fragmentation mishap. A trade unmaps idle chunks and maps the same physical
 * memory where the growth needs it (expandable.c keeps the handles: two calls a chunk, not four).
 * But trading every time lets a loop whose layout differs a little each step pay for the same
 * memory every step (unlimited trades: 25-3,800 % of allocations in device calls).
 *
 * Trades (discretionary calls D: each unmap, and the map or free of its spare, charged 2):
 *   D(t) <= rho * A(t) + B,  rho = AP_VMM_TRADE_PER_1000 / 1000, B = AP_VMM_TRADE_BURST,
 * A(t) the allocations so far, for every t, by construction: the credit starts at B, earns rho
 * per allocation, never exceeds B, and a trade unmaps at most credit / 2 chunks (it is cut short
 * there). Half of the burst is kept for trades at a new high of live bytes (the moments that set
 * peak reserved, which run out as the high rises); other trades only spend the credit above it.
 * Without credit the growth simply raises the peak, which then holds without calls. A trade at a new
 * high maps all the chunks it unmapped again (expandable.c), none freed: a freed spare leaves room
 * under the peak that later growths refill on no credit. Those refills double up to a chunk, never
 * past the peak, so they cost calls per chunk, not per page (ap_vmm_growth_extra; the doc's bound on
 * R(t), "Refills double").
 *
 * Growth (calls G that map new physical memory): a growth maps whole chunks of at most
 * max(AP_VMM_CHUNK_MAX, need / AP_VMM_GROWTH_CHUNKS), so one costs at most 2 * 17 calls. Growths
 * to a new peak of reserved memory spend a second credit (rho_g per allocation, at most B_g;
 * rho + rho_g = 0.9 %, under the 1 % of allocations a steady state may spend in device calls);
 * one past it maps reserved / AP_VMM_OVERSHOOT_DIV bytes more than it needs, so that growing in
 * many small steps to R bytes costs O(log R) such growths: each lifts the peak by
 * reserved / 128 at least. Cost in memory: at most reserved / 128 (+ one page) mapped beyond need
 * at any peak, and none under a limit or quota (the extra bytes could make a request fail there).
 *
 * The longest-idle free block gives its chunks first (least likely to be needed soon), never the
 * block the growth itself extends; memory whose stream may still use it goes only after a wait
 * for that stream.
 *
 * Tried and dropped (harness of issue 19, 120 perturbed workloads): trades free of budget at new
 * highs (unbounded calls: 12.4 % of allocations over a whole trace), 20 MiB chunks for every
 * growth (a 1 GB tensor cost 100 calls), one chunk per growth (mean reduction 81.5 %, 2 workloads
 * above torch_npu: a large chunk is unmapped only when wholly free), an overshoot of 1/16 - 1/64
 * of reserved (83.3 - 85.1 %: the leftover at the peak costs gpt2 up to 20 points), a trade
 * credit earned by rises of the live high (84.6 %).
 */
#include "pool_internal.h"

#define AP_VMM_TRADE_PER_1000 4  /* trade credit earned per 1,000 allocations, in calls (rho) */
#define AP_VMM_TRADE_BURST 200   /* most trade credit held at once, in calls (B) */
#define AP_VMM_TRADE_KEEP_PCT 50 /* share of the burst only trades at a new high of live bytes may spend */
#define AP_VMM_GROW_PER_1000 5   /* calls of exact growth earned per 1,000 allocations (rho_g) */
#define AP_VMM_GROW_BURST 64    /* most exact-growth credit held at once, in calls (B_g) */
#define AP_VMM_OVERSHOOT_DIV 128 /* a growth past its budget maps 1/128 of reserved memory more (f) */
#define AP_VMM_TRADE_CHARGE 2    /* calls charged per unmap: the unmap, and the map or free of its spare */


void ap_vmm_policy_init(ap_pool *p) {
    p->vmm_credit = (int64_t)AP_VMM_TRADE_BURST * 1000;
    p->vmm_growth_credit = (int64_t)AP_VMM_GROW_BURST * 1000;
    p->vmm_refill_step = 0;
}

size_t ap_vmm_growth_extra(ap_pool *p, size_t need, size_t chunks) {
    size_t reserved = ap_reserved(p);
    if (reserved + need <= p->reserved_watermark) {
        /* Maps again room under the peak (a refill, or a trade's growth): one that needed the
           released room again maps, beyond its need, what such growths mapped since the last new
           peak, at most one chunk and never past the peak. The first is exact; consecutive ones
           double, so room released and needed again (churn) is mapped back in O(log(c / g)) growths
           and then whole chunks, where it took one a page before (2 MiB small-pool refills, one
           growth each); the peak, and so the waste at it, is never raised by it (doc, "Refills double"). */
        size_t cap = ap_vmm_chunk_cap(p, need), room = p->reserved_watermark - reserved - need;
        size_t x = p->vmm_refill_step;
        if (need + x > cap) x = need < cap ? cap - need : 0;
        if (x > room) x = room;
        x = x / p->vmm_granularity * p->vmm_granularity;
        p->vmm_refill_step += need + x;
        return x;
    }
    p->vmm_refill_step = 0; /* a new peak: what was released is mapped again */
    ap_credit_add(&p->vmm_growth_credit, ap_ticks_since(p->tick, &p->vmm_growth_tick), AP_VMM_GROW_PER_1000,
                  (int64_t)AP_VMM_GROW_BURST * 1000);
    if (p->vmm_growth_credit > 0) {
        p->vmm_growth_credit -= (int64_t)chunks * 2 * 1000; /* may end in debt by one growth */
        return 0;
    }
    return ap_round_up(reserved / AP_VMM_OVERSHOOT_DIV, p->vmm_granularity);
}

void ap_vmm_make_room(ap_pool *p, size_t rsize, size_t need, const ap_block *keep) {
    size_t reserved = ap_reserved(p);
    p->vmm_trade_high = 0;
    if (reserved + need <= p->reserved_watermark) return;
    size_t over = reserved + need - p->reserved_watermark;

    ap_stat alloc = ap_stat_read(&p->stats, AP_STAT_ALLOCATED_BYTES, AP_STAT_ALL);
    if (alloc.peak > p->vmm_live_high) p->vmm_live_high = alloc.peak; /* survives reset_peaks */
    int high = alloc.current + (int64_t)rsize > p->vmm_live_high;
    p->vmm_trade_high = high;
    /* max_split_size: a free block that the fit rules refuse to this request however large it is
       (free_blocks.c fit_allowed, torch's get_free_block: max_split_size or more for a smaller
       request, rsize + 20 MiB or more for one at least that large) is, for it, as idle as a wholly
       free segment, and growing past the peak beside such blocks on the trade credit alone left an
       expandable pool reserving up to 6x what it did without the knob (torch's fuzz pattern: 764
       MiB against 162). Their whole chunks are traded for the growth first, outside the credit: at
       most the growth's excess over the peak, in at most AP_VMM_GROWTH_CHUNKS + 1 unmaps, so a
       growth with such a trade costs at most twice a growth's 34 calls (doc, "Blocks the fit rules
       refuse"). */
    if (p->cfg.max_split_size != AP_NO_LIMIT) {
        size_t refused = rsize < p->cfg.max_split_size ? p->cfg.max_split_size : rsize + AP_LARGE_BUFFER;
        size_t got = ap_vmm_release_for_growth(p, over, keep, AP_VMM_GROWTH_CHUNKS + 1, refused);
        if (got >= over) return;
        over -= got;
    }
    int64_t cap = (int64_t)AP_VMM_TRADE_BURST * 1000;
    ap_credit_add(&p->vmm_credit, ap_ticks_since(p->tick, &p->vmm_credit_tick), AP_VMM_TRADE_PER_1000, cap);
    int64_t avail = p->vmm_credit - (high ? 0 : cap / 100 * AP_VMM_TRADE_KEEP_PCT);
    int64_t max_unmaps = avail / (AP_VMM_TRADE_CHARGE * 1000);
    if (max_unmaps <= 0) return;
    int64_t before = p->stats.num_device_unmap;
    ap_vmm_release_for_growth(p, over, keep, max_unmaps, 0);
    p->vmm_credit -= (p->stats.num_device_unmap - before) * AP_VMM_TRADE_CHARGE * 1000;
    AP_ASSERT(p->vmm_credit >= 0); /* cut short at the credit: D(t) <= rho * A(t) + B holds */
}
