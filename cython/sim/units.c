/* Byte sizes written by people: "64GiB", "512MiB", "1.5GB", "4096".
 *
 * The one parser for sizes, used for ASCEND_SIM_HBM / ASCEND_SIM_FAIL_AFTER_BYTES and, through
 * ascendsim_parse_size, by ascend_pool/sim.py, so that the environment and Python agree.
 * KiB/MiB/GiB/TiB and bare K/M/G/T are powers of 1024 (what memory sizes usually mean);
 * KB/MB/GB/TB are powers of 1000 (SI), so "1.5GB" is 1,500,000,000 bytes.
 */
#include <ctype.h>
#include <string.h>
#include <strings.h>

#include "sim_internal.h"

struct unit {
    const char *name;
    uint64_t mult;
};

static const struct unit UNITS[] = {
    {"", 1},
    {"b", 1},
    {"k", 1ull << 10}, {"kib", 1ull << 10}, {"kb", 1000ull},
    {"m", 1ull << 20}, {"mib", 1ull << 20}, {"mb", 1000000ull},
    {"g", 1ull << 30}, {"gib", 1ull << 30}, {"gb", 1000000000ull},
    {"t", 1ull << 40}, {"tib", 1ull << 40}, {"tb", 1000000000000ull},
};

int sim_parse_size(const char *text, uint64_t *bytes)
{
    if (!text || !bytes)
        return -1;
    const char *p = text;
    while (isspace((unsigned char)*p))
        p++;
    unsigned __int128 whole = 0, frac = 0, frac_den = 1;
    int digits = 0;
    while (isdigit((unsigned char)*p)) {
        whole = whole * 10 + (unsigned)(*p++ - '0');
        if (whole > UINT64_MAX)
            return -1;
        digits++;
    }
    if (*p == '.') {
        p++;
        while (isdigit((unsigned char)*p)) {
            /* 18 fraction digits are far below a byte's resolution; the rest only truncates. */
            if (frac_den < 1000000000000000000ull) {
                frac = frac * 10 + (unsigned)(*p - '0');
                frac_den *= 10;
            }
            p++;
            digits++;
        }
    }
    if (digits == 0)
        return -1;
    while (isspace((unsigned char)*p))
        p++;
    const char *u = p;
    while (isalpha((unsigned char)*p))
        p++;
    size_t ulen = (size_t)(p - u);
    while (isspace((unsigned char)*p))
        p++;
    if (*p != '\0')
        return -1;
    for (size_t i = 0; i < sizeof UNITS / sizeof UNITS[0]; i++) {
        if (strlen(UNITS[i].name) == ulen && strncasecmp(UNITS[i].name, u, ulen) == 0) {
            unsigned __int128 v = whole * UNITS[i].mult + frac * UNITS[i].mult / frac_den;
            if (v > UINT64_MAX)
                return -1;
            *bytes = (uint64_t)v;
            return 0;
        }
    }
    return -1;
}
