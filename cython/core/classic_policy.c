/* Classic segments' release policy: trades of idle segments for a growth within a budget of
 * device calls that grows with the workload. The bound it gives and its argument:
 * docs/placement-policy.md.
 *
 * A *trade*: when a growth would lift reserved memory above its earlier peak (the watermark W),
 * wholly free segments are released first and the growth takes their place, so the pool takes the
 * workload's new shape instead of growing. Trading every time lets a loop whose layout differs a
 * little each step pay for the same memory every step (up to 6.3 % of allocations in steady-state
 * device calls on the bench's perturbed workloads), so a trade is paid from a credit:
 *  - a new pool starts with AP_TRADE_START calls; the credit grows by AP_TRADE_RATE thousandths of
 *    a call per allocation and, once the start is spent, holds at most AP_TRADE_BASE calls +
 *    AP_TRADE_HOLD thousandths of a call per allocation so far;
 *  - a growth that lifts the peak from W to W' earns AP_GROWTH_EARN * (W' - W) / W' calls, topping
 *    the credit up to at most AP_TRADE_START: a workload still taking its shape pays for the
 *    trades that keep its peak down; a steady one earns nothing (over the pool's life these sum
 *    to at most AP_GROWTH_EARN * (1 + ln(peak / first growth)));
 *  - a trade of k releases costs k + 1 calls (the releases and the growth that takes their place);
 *  - what the releases freed beyond the need stays as room under W (trade_room) only as far as
 *    the credit can pay one call for each refill of it (a refill takes at least one growth unit);
 *    the growth absorbs the rest. So the credit never goes below the refills still owed.
 * A growth without credit may lift the peak only while reserved memory stays under a floor of what
 * torch_npu's never-release policy has surely reserved by then (npu_floor); past it the trade is
 * paid from a second, small credit kept for that purpose (AP_PROTECT_*), so that calls are spent
 * beyond the budget only where the pool would otherwise pass torch_npu's floor (its room, as any
 * trade's, stays only as far as the trade credit pays for its refills).
 * Every device call is therefore a trade's or a refill's (paid from one credit or the other), a
 * growth that lifts the peak, or an explicit trim's (empty_cache, the out-of-memory path, a lowered
 * limit or quota, garbage collection; under a byte limit or quota a trade's leftover too) with the
 * growths that refill it. With A(t) allocations, G(t) peak-lifting growths, E(t) those, and
 * P(t) = sum over peak rises of (W' - W) / W':
 *     device calls(t) <= G(t) + E(t) + (AP_TRADE_RATE + AP_PROTECT_RATE) / 1000 * A(t)
 *                        + AP_GROWTH_EARN * P(t) + AP_TRADE_START + AP_PROTECT_START.
 *
 * Tried and dropped (docs/placement-policy.md has the figures): trades free of budget at a new
 * high of allocated memory; no credit spent under a proven lower bound of torch_npu's reserved
 * memory; absorbing every leftover (what this policy did before: -4 to -8 points on the perturbed
 * workloads); leaving every leftover with refills in debt (better by 1-2 points, but no bound);
 * prepaying each leftover's refills; trades only when they cover the whole need; a flat credit per
 * peak-lifting growth (3.2 % steady calls on a growing workload).
 */
#include "pool_internal.h"

#define AP_TRADE_RATE 6   /* credit per allocation, in thousandths of a call (0.6 %) */
#define AP_TRADE_HOLD 3   /* most credit held: this many thousandths of a call per allocation so far ... */
#define AP_TRADE_BASE 2   /* ... plus this many calls */
#define AP_TRADE_START 20 /* calls of credit a new pool starts with */
#define AP_GROWTH_EARN 32 /* calls a peak-lifting growth earns, times (W' - W) / W' (its share of the new peak) */
#define AP_PROTECT_RATE 1   /* the floor's credit per allocation, in thousandths of a call (0.1 %) ... */
#define AP_PROTECT_START 10 /* ... its start and the most it holds, in calls */

void ap_classic_policy_init(ap_pool *p) {
    p->trade_credit = (int64_t)AP_TRADE_START * 1000;
    p->protect_credit = (int64_t)AP_PROTECT_START * 1000;
}

/* Tops the credit up for the allocations since the last call; returns the whole calls it covers. */
static int64_t credit_calls(ap_pool *p) {
    uint64_t ticks = ap_ticks_since(p->tick, &p->trade_tick);
    uint64_t tick = p->tick < ((uint64_t)1 << 40) ? p->tick : ((uint64_t)1 << 40);
    int64_t cap = (int64_t)AP_TRADE_BASE * 1000 + (int64_t)tick * AP_TRADE_HOLD;
    if (p->trade_credit > cap) cap = p->trade_credit; /* the starting credit, not yet spent */
    ap_credit_add(&p->trade_credit, ticks, AP_TRADE_RATE, cap);
    /* The floor's credit is capped at its start, so that no window can spend more of it than
       AP_PROTECT_START plus what the window itself earned. */
    ap_credit_add(&p->protect_credit, ticks, AP_PROTECT_RATE, (int64_t)AP_PROTECT_START * 1000);
    AP_ASSERT(p->trade_credit >= 0 && p->protect_credit >= 0);
    return p->trade_credit / 1000;
}

/* A segment the policy may release now: wholly free, not the preallocated reserve, and no stream
   may still use it. */
static int releasable(const ap_segment *s) { return ap_segment_is_free(s) && !s->pinned && !s->first->tag; }

/* A lower bound of what torch_npu's never-release policy has reserved by now (its reserved memory
   only grows, so it is also below its final peak): its small and large pools never share a
   segment, so each holds at least the highest bytes ever allocated in it, in whole 2 MiB segments.
   The peaks are read lazily (here, not on the cached path) and kept, so reset_peak_stats cannot
   lower the bound; the pending request counts too (torch_npu must hold it with the live blocks). */
static size_t npu_floor(ap_pool *p, int pool, size_t rsize) {
    size_t total = 0;
    for (int k = 0; k < 2; k++) {
        const ap_stat *a = &p->stats.s[AP_STAT_ALLOCATED_BYTES][1 + k];
        size_t hi = (size_t)(a->peak > a->current ? a->peak : a->current);
        if (k == pool) hi = (size_t)a->current + rsize > hi ? (size_t)a->current + rsize : hi;
        if (hi > p->npu_floor[k]) p->npu_floor[k] = hi;
        total += ap_round_up(p->npu_floor[k], (size_t)2 << 20);
    }
    return total;
}

/* Smallest growth the pool makes (a small segment or a page): a refill of room takes at least this. */
static size_t growth_unit(const ap_pool *p) {
    return p->cfg.small_segment < p->cfg.page_size ? p->cfg.small_segment : p->cfg.page_size;
}

int64_t ap_classic_refills_owed(const ap_pool *p) {
    size_t unit = growth_unit(p);
    return (int64_t)((p->trade_room + unit - 1) / unit);
}

void ap_classic_peak_rose(ap_pool *p, size_t new_peak) {
    size_t wm = p->reserved_watermark;
    AP_ASSERT(new_peak > wm);
    p->trade_room = 0; /* reserved memory is at its peak: no room left under it */
    credit_calls(p);
    int64_t cap = (int64_t)AP_TRADE_START * 1000;
    if (p->trade_credit >= cap) return;
    int64_t earned = (int64_t)((double)AP_GROWTH_EARN * 1000.0 * (double)(new_peak - wm) / (double)new_peak);
    p->trade_credit = p->trade_credit + earned > cap ? cap : p->trade_credit + earned;
}

size_t ap_classic_make_room(ap_pool *p, int pool, size_t rsize, size_t size) {
    size_t reserved = ap_reserved(p), wm = p->reserved_watermark;
    if (reserved + size <= wm) { /* room under the peak: a trade's leftover, or an explicit trim's */
        if (p->trade_room > wm - reserved) p->trade_room = wm - reserved;
        if (p->trade_room) {
            credit_calls(p);
            p->trade_credit -= 1000;
            /* a refill takes at least a growth unit of room (the refills owed count so): under a
               limit set after the trade an exact-size segment may be smaller (segments.c) */
            size_t took = size > growth_unit(p) ? size : growth_unit(p);
            p->trade_room -= took < p->trade_room ? took : p->trade_room;
        }
        AP_ASSERT(p->trade_credit >= ap_classic_refills_owed(p) * 1000);
        return size;
    }
    int64_t calls = credit_calls(p); /* the room a trade leaves is paid for after it (below) */
    if (!p->n_free_segments) return size;
    /* Without credit the growth may lift the peak while the pool stays under what torch_npu has
       surely reserved; past that floor the trade is paid from the floor's own credit (protect):
       calls beyond the budget are spent only where the pool would pass torch_npu's floor. */
    int protect = 0;
    if (calls < 2) {
        if (reserved + size <= npu_floor(p, pool, rsize)) return size;
        protect = 1;
        calls = p->protect_credit / 1000;
        if (calls < 2) return size;
    }
    size_t over = reserved + size - wm;
    ap_cache_flush(p); /* cached blocks may be all that keeps a segment from being wholly free */
    /* Idle streams' wholly free segments become anyone's (asked, never waited for). */
    for (ap_segment *s = p->segments; s; s = s->next)
        if (ap_segment_is_free(s) && s->first->tag && !s->pinned) ap_settle_slot(p, s->first->tag, NULL);

    /* One segment that covers the need alone, the smallest (one call); else the largest first. */
    ap_segment *one = NULL;
    for (ap_segment *s = p->segments; s; s = s->next)
        if (releasable(s) && s->size >= over && (!one || s->size < one->size)) one = s;
    int64_t k = 0;
    if (one) {
        if (ap_segment_release(p, one, NULL) == AP_OK) k++;
    } else {
        size_t freed = 0;
        while (freed < over && k + 1 < calls) {
            ap_segment *big = NULL;
            for (ap_segment *s = p->segments; s; s = s->next)
                if (releasable(s) && s->size < over && (!big || s->size > big->size)) big = s;
            if (!big) break;
            size_t sz = big->size;
            if (ap_segment_release(p, big, NULL) != AP_OK) break;
            freed += sz;
            k++;
        }
    }
    if (!k) return size;
    if (protect) p->protect_credit -= (k + 1) * 1000;
    else p->trade_credit -= (k + 1) * 1000;
    AP_ASSERT(p->trade_credit >= 0 && p->protect_credit >= 0);
    reserved = ap_reserved(p);
    if (reserved + size >= wm) { /* the releases did not cover the need: a new peak, no room */
        p->trade_room = 0;
        return size;
    }
    /* All the room under the peak after this growth (an earlier trade's too). Under a byte limit or
       a tenant quota it stays, and its refills count as an explicit trim's: one large absorbing
       segment, pinned by a few live blocks, is memory no trim can return, and the tenant's next
       requests are refused although most of what it holds is free (the serve --replay demo's tight
       tenant: every run refused after the first one that hit its quota). So does room the device's
       memory fraction could not hold (far from the fraction the room is absorbed as without one).
       The own limit stays a rule of its own, not its room as the fraction's: the room under the
       peak always fits a limit above the peak, and absorbing under a limit at a workload's
       no-limit peak refused 2 workloads of 18 that its rule serves (and served 2 it refuses). */
    size_t room = wm - reserved - size;
    if (p->cfg.limit_bytes != AP_NO_LIMIT || p->quota.reserve || !ap_limit_fits(p, size, room)) {
        p->trade_room = 0;
        return size;
    }
    /* Otherwise room stays as far as the trade credit pays a call for each refill of it; the growth
       absorbs the rest (in whole pages). With 1 GiB pages a remainder of small segments may be
       less than a page: what neither covers stays unpaid (counted with explicit trims). */
    size_t unit = growth_unit(p), keep = (size_t)(p->trade_credit / 1000) * unit;
    if (keep > room) keep = room;
    size_t absorb = ap_round_up(room - keep, p->cfg.page_size);
    if (absorb > room) absorb = room / p->cfg.page_size * p->cfg.page_size;
    /* With max_split_size set, a block that large is never split (free_blocks.c should_split): a
       segment absorbed up to it went whole to this request, a 1000-byte one included (266 MiB
       allocated for it after a 300 MiB block was freed). It absorbs only what keeps it below. */
    if (p->cfg.max_split_size != AP_NO_LIMIT) {
        size_t below = p->cfg.max_split_size > size ? (p->cfg.max_split_size - size - 1) / p->cfg.page_size : 0;
        if (absorb > below * p->cfg.page_size) absorb = below * p->cfg.page_size;
    }
    /* A no_split pool's segment goes whole to this request (free_blocks.c should_split): what
       it absorbed served no one (a 2 MiB request got 66 MiB after a 100 MiB block was freed). */
    if (p->no_split) absorb = 0;
    p->trade_room = room - absorb < keep ? room - absorb : keep;
    AP_ASSERT(p->trade_credit >= ap_classic_refills_owed(p) * 1000);
    return size + absorb;
}
