/* The layout of a node record (node.c), shared with the reader of other users' records (foreign.c).
 * Internal to the simulator. */
#ifndef ASCEND_SIM_NODE_RECORD_H
#define ASCEND_SIM_NODE_RECORD_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "sim_internal.h"

#define NODE_MAGIC 0x314d495344435341ull /* "ASCDSIM1" */
#define NODE_VERSION 3u /* 2: slots named by lease id; 3: a lease-id lock, not a robust mutex */
#define NODE_SLOTS 256
#define NODE_LOCK_TIMEOUT_S 10           /* a lock held this long means a wedged peer */
#define NODE_PROBES 100000               /* record names tried before giving up (one open each) */
#define NODE_LOOKAHEAD 64                /* names looked at past the first free one */
#define NODE_FOREIGN_MAX 64              /* other users' records counted per device (foreign.c) */

struct node_slot {
    _Atomic int32_t pid;                 /* 0: free */
    _Atomic uint32_t instance;           /* which loaded copy of the simulator in that process */
    _Atomic uint64_t start_time;         /* the owner's lease id (proc.c), despite the name */
    _Atomic uint64_t pidns;              /* the owner's pid namespace (inode): what pid is relative to */
    _Atomic uint64_t proc_start;         /* /proc/PID/stat field 22 in that namespace */
    _Atomic uint64_t bytes;
};

struct node_record {
    uint64_t magic;
    uint32_t version;
    uint32_t record_size;
    uint32_t owner_uid;
    uint32_t nslots;
    uint32_t device;
    uint32_t reserved;
    uint64_t total_bytes;
    char node[SIM_NODE_NAME_MAX + 8];
    _Atomic uint64_t lock_owner;         /* the holder's lease id, 0: free (proc.c: sim_proc_lock) */
    _Atomic uint64_t recoveries;         /* times a dead holder's lock was recovered */
    struct node_slot slots[NODE_SLOTS];
};

/* "ascendsim-<uid>-<node>-dev<dev>" and, for index >= 1, ".<index>" after it (no directory). */
int sim_node_record_name(char *out, size_t len, unsigned uid, const char *node, int dev, int index);

/* ---- foreign.c: other users' records of this node ---- */
/* Bytes that other users' live processes hold on the node's device dev (cfg.phys[], not a number
   ASCEND_RT_VISIBLE_DEVICES gave it) of node cfg: the sum of their records' slots (each record at
   most the total). check_alive: skip slots whose owner's public lease is not
   held (slower: one open per slot); else every claimed slot counts. rescan: look for new records
   even if the directory seems unchanged. Never fails: records that cannot be trusted count 0. */
uint64_t sim_foreign_used(int dev, const struct sim_config *cfg, int check_alive, int rescan);
void sim_foreign_reset(void); /* fork child, aclInit: forget the cached records */

#endif
