#include "stats.h"

/* Active stats derived from allocated ones and pending: [0] counts, [1] bytes. */
static const int active_of[2] = {AP_STAT_ACTIVE, AP_STAT_ACTIVE_BYTES};
static const int allocated_of[2] = {AP_STAT_ALLOCATION, AP_STAT_ALLOCATED_BYTES};

void ap_stats_note_active(ap_stats *st, int pool) {
    int types[2] = {AP_STAT_ALL, 1 + pool};
    for (int k = 0; k < 2; k++)
        for (int t = 0; t < 2; t++) {
            ap_stat *pend = &st->pending[k][types[t]];
            int64_t active = ap_stat_read(st, allocated_of[k], types[t]).current + pend->current;
            if (active > pend->peak) pend->peak = active;
        }
}

void ap_stats_reset_peaks(ap_stats *st) {
    for (int i = 0; i < AP_N_STATS; i++)
        for (int j = 0; j < AP_N_STAT_TYPES; j++) st->s[i][j].peak = ap_stat_read(st, i, j).current;
    for (int k = 0; k < 2; k++)
        for (int j = 0; j < AP_N_STAT_TYPES; j++)
            st->pending[k][j].peak = ap_stat_read(st, allocated_of[k], j).current + st->pending[k][j].current;
    for (int k = 0; k < 2; k++) st->oversize[k].peak = st->oversize[k].current;
}

void ap_stats_export(const ap_stats *st, ap_stats *out) {
    *out = *st;
    for (int i = 0; i < AP_N_STATS; i++) out->s[i][AP_STAT_ALL] = ap_stat_read(st, i, AP_STAT_ALL);
    out->pending_free_blocks = st->pending[0][AP_STAT_ALL].current;
    out->pending_free_bytes = st->pending[1][AP_STAT_ALL].current;
    for (int k = 0; k < 2; k++)
        for (int j = 0; j < AP_N_STAT_TYPES; j++) {
            const ap_stat *alloc = &out->s[allocated_of[k]][j], *pend = &st->pending[k][j];
            ap_stat *active = &out->s[active_of[k]][j];
            /* Every allocation starts active; a block stops being active when freed, or, if it
               waited, when its events complete. While nothing waits, active == allocated. */
            active->current = alloc->current + pend->current;
            active->freed = alloc->freed - pend->current;
            active->peak = alloc->peak > pend->peak ? alloc->peak : pend->peak;
        }
}
