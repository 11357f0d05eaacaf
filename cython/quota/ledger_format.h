/* The node-wide quota ledger: the layout of one ledger file (one per device, per user or group).
 *
 * A ledger is a small file in shared memory (/dev/shm, or $ASCEND_POOL_LEDGER_DIR) that every
 * process using tenant contexts on that device maps MAP_SHARED. It holds:
 *   - a header naming what the file describes (magic, version, layout sizes, owner, device,
 *     backend, node) so that a file from another version, user or device is refused;
 *   - a table of tenants: name, quota (bytes), held (bytes reserved node-wide: the counter that
 *     reserve() moves with compare-and-swap), peak and counters;
 *   - a table of slots, one per live tenant context of a process (process instance id, tenant,
 *     bytes held by that context; the pid and its namespace as labels). A slot whose instance no
 *     longer holds its lease (proc_identity.h) is how a dead process's share is found and given back.
 *
 * Units: every byte count is bytes (uint64). Fields marked _Atomic are read and written lock-free;
 * the others change only under the file lock (ledger_file.h), and are read lock-free only where a
 * stale value is harmless (e.g. a slot's pid is written before its state is published).
 *
 * Sizes are fixed so that `sizeof` doubles as a layout check: a file whose recorded sizes differ
 * from this build's is from another version and is refused, never reinterpreted.
 *
 * What every format version keeps, so that a build can tell another build's ledger in use without
 * reading its layout (ascend_pool/tenants/ledger.py _probe): the magic and the version as the
 * header's first 12 bytes, flock() as the update lock, and a record lock (proc_identity.h's life
 * lock) held on the file by each process with a slot there, for as long as it maps the file. A
 * ledger of another version that nobody holds a lock on is replaced by the first process of this
 * build that opens it.
 *
 * Invariants (c(s): what tenant t's `held` counts on account of slot s):
 *   - t.held == sum of c(s) over t's used slots, + what dead slots left counted (t.uncertain bounds
 *     that excess, 0 when none is known);
 *   - a slot not inside an update (seq even) has c(s) == s.held and pending == 0; inside one (seq
 *     odd) s.held <= c(s) <= s.held + |pending|: which, a death there leaves unknown;
 *   - so, under the file lock (no slot is claimed or freed meanwhile), a reading of t.held between
 *     two readings of every used slot's seq that find each even and unchanged sees no update in
 *     flight: t.held - sum(s.held) is exactly what dead processes left counted, and the reclaim
 *     (ledger_slots.h apl_tenant_reconcile) takes it off. A negative excess (a counter below its
 *     slots, which no order of updates makes: a file written by hand) is made exact the same way,
 *     upward, the safe side.
 */
#ifndef AP_LEDGER_FORMAT_H
#define AP_LEDGER_FORMAT_H

#include <stdatomic.h>
#include <stdint.h>

#define APL_MAGIC 0x31524744454c5041ull /* "APLEDGR1" read as a little-endian uint64 */
#define APL_VERSION 3u                 /* 2: slots name a process instance (lease), not a pid; 3: a slot's
                                           seq brackets its updates, so that a reclaim can make its
                                           tenant's counter exact (a build of 2 would not move it) */
#define APL_TENANTS 64                  /* tenants per device ledger */
#define APL_SLOTS 1024                  /* live contexts per device, all processes together */
#define APL_NAME_MAX 64                 /* tenant name bytes, NUL included (so 63 characters) */
#define APL_NO_QUOTA UINT64_MAX         /* a tenant tracked but not limited */
#define APL_NO_GROUP UINT32_MAX         /* the file is private to its owner (mode 0600) */
#define APL_MAX_BYTES (1ull << 60)      /* no real device holds more: larger values mean corruption */

enum { APL_FREE = 0, APL_USED = 1 };   /* state of a tenant entry or a slot */
/* Where a tenant's quota came from: nobody (no quota), a process's declaration, the operator's
   tenants file. A declaration never overrides the operator's file, and never lifts a limit. */
enum { APL_SRC_NONE = 0, APL_SRC_DECLARED = 1, APL_SRC_OPERATOR = 2 };

typedef struct apl_header {
    uint64_t magic;
    uint32_t version;
    uint32_t header_size, tenant_size, slot_size; /* sizeof each, as built by the creator */
    uint32_t n_tenants, n_slots;
    uint64_t file_size;
    uint32_t owner_uid;                 /* creator's host uid (host_ids.h); must be the file's owner's */
    uint32_t group;                     /* host gid the file is shared with, or APL_NO_GROUP */
    int32_t device;
    uint32_t reserved0;
    char backend[16];                   /* "acl", "sim", "cuda" */
    char node[64];                      /* simulated node name (sim backend), else "" */
    _Atomic uint64_t reclaimed_slots;   /* slots of dead processes given back, ever */
    _Atomic uint64_t reclaimed_bytes;   /* bytes those slots held */
    _Atomic uint64_t uncertain_bytes;   /* see apl_tenant.uncertain: all tenants, ever */
    uint8_t pad[256 - 160];
} apl_header;

typedef struct apl_tenant {
    _Atomic uint32_t state;             /* APL_FREE / APL_USED; set under the file lock */
    _Atomic uint32_t warn_ppm;          /* warn level, parts per million of the quota (0: none) */
    char name[APL_NAME_MAX];            /* NUL-terminated; written before state becomes USED */
    _Atomic uint64_t quota;             /* bytes, or APL_NO_QUOTA */
    _Atomic uint64_t held;              /* bytes reserved node-wide: the compare-and-swap target */
    _Atomic uint64_t peak;              /* highest held since the entry was created */
    _Atomic uint64_t refusals;          /* reserve() calls refused, node-wide */
    _Atomic uint64_t uncertain;         /* bytes that a process killed inside reserve/release may
                                           or may not have moved; counted as held (the safe side)
                                           until a reclaim finds no live slot inside an update
                                           (apl_tenant_reconcile), or the tenant has none left */
    _Atomic uint32_t quota_src;         /* APL_SRC_*: who set the quota (ledger_slots.h) */
    _Atomic uint32_t quota_stamp;       /* APL_SRC_OPERATOR: the modification time (s) of the
                                           tenants file that set it (the newest file wins) */
    _Atomic uint64_t conflicts;         /* declarations that disagreed with the quota in force */
} apl_tenant;

typedef struct apl_slot {
    _Atomic uint32_t state;             /* APL_FREE / APL_USED; published last when claimed */
    int32_t pid;                        /* a label: the pid in the owner's own pid namespace */
    uint64_t instance;                  /* the owner's instance id: its lease (proc_identity.h) */
    uint32_t tenant;                    /* index into tenants[] */
    uint32_t reserved0;
    _Atomic uint64_t held;              /* bytes this context reserved; written only by its process */
    _Atomic int64_t pending;            /* +bytes inside reserve, -bytes inside release, else 0 */
    uint64_t pidns;                     /* inode of the owner's /proc/self/ns/pid */
    uint64_t start_time;                /* /proc/PID/stat field 22 in that namespace (0: unknown) */
    _Atomic uint64_t seq;               /* odd while its process is inside a reserve or release (set
                                           odd before `pending`, even after it is 0 again); written
                                           by its process, and by a clear under the file lock
                                           (ledger_slots.h). See "Invariants" above. */
} apl_slot;

typedef struct apl_file {
    apl_header h;
    apl_tenant tenants[APL_TENANTS];
    apl_slot slots[APL_SLOTS];
} apl_file;

_Static_assert(sizeof(apl_header) == 256, "ledger header layout");
_Static_assert(sizeof(apl_tenant) == 128, "ledger tenant layout");
_Static_assert(sizeof(apl_slot) == 64, "ledger slot layout");
_Static_assert(sizeof(_Atomic uint64_t) == 8 && ATOMIC_LLONG_LOCK_FREE == 2,
               "the ledger needs lock-free 64-bit atomics: they are shared between processes");

#endif
