#include "stats.h"

void ap_stats_reset_peaks(ap_stats *st) {
    for (int i = 0; i < AP_N_STATS; i++)
        for (int j = 0; j < AP_N_STAT_TYPES; j++) st->s[i][j].peak = st->s[i][j].current;
}
