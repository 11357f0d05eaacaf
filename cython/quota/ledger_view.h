/* A consistent copy of the ledger's tenants and slots for readers (metrics, tests, the CLI).
 *
 * Writers change a tenant's counter and then their slot (ledger_reserve.h), lock-free, so reading
 * the tables field by field can mix moments: one slot before a release, another after the
 * reserve that the release allowed, adding up to more than the quota ever held. The copy is
 * taken twice in a row until both agree ("double collect"): then nothing changed in between and
 * the copy is one moment's picture. Under a storm of changes it gives up after a bounded number
 * of tries and returns the last copy (then each number is still exact on its own).
 */
#ifndef AP_LEDGER_VIEW_H
#define AP_LEDGER_VIEW_H

#include <string.h>

#include "ledger_format.h"

typedef struct apl_tables {
    apl_tenant tenants[APL_TENANTS];
    apl_slot slots[APL_SLOTS];
} apl_tables;

/* Fills out (and scratch, a second buffer of the same size); returns 1 if the copy is consistent. */
static int apl_copy_tables(const apl_file *f, apl_tables *out, apl_tables *scratch) {
    memcpy(out->tenants, (const void *)f->tenants, sizeof out->tenants);
    memcpy(out->slots, (const void *)f->slots, sizeof out->slots);
    for (int attempt = 0; attempt < 1000; attempt++) {
        atomic_thread_fence(memory_order_acquire);
        memcpy(scratch->tenants, (const void *)f->tenants, sizeof scratch->tenants);
        memcpy(scratch->slots, (const void *)f->slots, sizeof scratch->slots);
        if (memcmp(out, scratch, sizeof *out) == 0) return 1;
        memcpy(out, scratch, sizeof *out);
    }
    return 0;
}

#endif
