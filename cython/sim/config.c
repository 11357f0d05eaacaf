/* The simulated node's configuration, read from the environment at aclInit.
 *
 *   ASCEND_SIM_DEVICES            number of devices, 1..64                      (default 8)
 *   ASCEND_SIM_HBM                bytes of HBM per device, e.g. 64GiB           (default 64GiB)
 *   ASCEND_SIM_MALLOC_LATENCY_US  microseconds added to each aclrtMalloc       (default 0)
 *   ASCEND_SIM_FREE_LATENCY_US    microseconds added to each aclrtFree         (default 0)
 *   ASCEND_SIM_FAIL_MALLOC_NTH    the Nth device malloc after aclInit fails once (default off)
 *   ASCEND_SIM_FAIL_AFTER_BYTES   mallocs taking this process above this many bytes fail
 *   ASCEND_SIM_HOST_PINNED        host bytes this process may pin with aclrtMallocHost, in whole
 *                                 pages (default: the host's physical memory, as lock-page memory
 *                                 cannot exceed it; past it 207001, as the real call fails)
 *   ASCEND_SIM_NODE               name of the simulated node sharing device capacity ("default")
 *   ASCEND_SIM_SHM_DIR            directory of the node's shared records     (default /dev/shm)
 *   ASCEND_SIM_PROFILE            strict | cann8.0 | cann8.2 | cann8.3 | 310p | 950 (default strict)
 *   ASCEND_SIM_SOC_NAME           what aclrtGetSocName answers instead of the profile's SoC name:
 *                                 one SoC has several names across CANN versions (an Ascend 950 is
 *                                 "Ascend910_9599" in some, "Ascend950PR_9599" in others)
 *   ASCEND_RT_VISIBLE_DEVICES     the runtime's own: the node devices this process sees, renumbered
 *                                 from 0 in that order ("3,5": devices 0 and 1 are the node's 3 and
 *                                 5), as a container given some of a node's NPUs sees them
 *
 * A profile is the set of documented rules of one CANN generation or SoC (docs/cann-rules.md):
 *   cann8.0  Atlas A2 on CANN 8.0.x: reserve flags must match the mapped page type (0 normal, 1 huge)
 *   cann8.2  Atlas A2 on CANN 8.2.RC1 (and 8.3.RC1alpha001): the IPC calls' flags are reserved, 0
 *            only (no ACL_RT_IPC_MEM_EXPORT_FLAG_DISABLE_PID_VALIDATION, no
 *            ACL_RT_IPC_MEM_IMPORT_FLAG_ENABLE_PEER_ACCESS); otherwise as cann8.3. strict does not
 *            take this rule: it would leave the suite without any-process shares and cross-device
 *            imports, which the later versions have
 *   cann8.3  Atlas A2 on current CANN: reserve flags 0 or 1 accepted for any page type
 *   310p     Atlas inference card (Ascend310P3): 1,023 synchronizing events per device; its memory
 *            is DDR (aclrtGetMemInfo: DDR attributes answer it, HBM ones are converted to them)
 *   950      Ascend 950: aclrtMalloc only rounds to 32 bytes (no padding)
 *   strict   an Atlas A2 under every version's rules (the 8.0 reserve rule included); its event
 *            limit is the A2's 65,536 (the 310p profile tests the card with the smaller one);
 *            aclrtCreateEventExWithFlag answers 207000 (a runtime that exports it without the
 *            feature), so that the pool runs the event scheme with the most rules to break
 *            (aclrtResetEvent after each wait); every other profile has it (CANN 8.0.RC1 on)
 * Device reference counting (aclrtSetDevice +1, aclrtResetDevice -1) holds in every profile.
 *
 * An empty variable counts as unset. A bad value fails aclInit with ACL_ERROR_INVALID_PARAM and
 * a message naming the variable and the value: a typo must not silently give a default device.
 */
#include <ctype.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "sim_internal.h"

#define MAX_LATENCY_US 10000000ull  /* 10 s: more is certainly a typo */
#define MAX_HBM ((uint64_t)1 << 50) /* 1 PiB keeps every sum far from overflow */

static const char *env(const char *name)
{
    const char *v = getenv(name);
    return (v && *v) ? v : NULL;
}

/* Strict unsigned integer: digits only (surrounding blanks allowed), no sign, no overflow. */
static int parse_uint(const char *s, uint64_t *out)
{
    while (isspace((unsigned char)*s))
        s++;
    if (!isdigit((unsigned char)*s))
        return -1;
    uint64_t v = 0;
    while (isdigit((unsigned char)*s)) {
        unsigned d = (unsigned)(*s++ - '0');
        if (v > (UINT64_MAX - d) / 10)
            return -1;
        v = v * 10 + d;
    }
    while (isspace((unsigned char)*s))
        s++;
    if (*s)
        return -1;
    *out = v;
    return 0;
}

static int get_uint(const char *name, uint64_t lo, uint64_t hi, uint64_t *out, const char *call)
{
    const char *v = env(name);
    if (!v)
        return 0;
    uint64_t x;
    if (parse_uint(v, &x) != 0 || x < lo || x > hi)
        return sim_fail(ACL_ERROR_INVALID_PARAM, call,
                        "%s='%s' is not a whole number from %llu to %llu", name, v,
                        (unsigned long long)lo, (unsigned long long)hi);
    *out = x;
    return 0;
}

static int get_size(const char *name, uint64_t lo, uint64_t hi, uint64_t *out, const char *call)
{
    const char *v = env(name);
    if (!v)
        return 0;
    uint64_t x;
    if (sim_parse_size(v, &x) != 0 || x < lo || x > hi)
        return sim_fail(ACL_ERROR_INVALID_PARAM, call,
                        "%s='%s' is not a byte size from %llu to %llu bytes "
                        "(write plain bytes or a unit: 64GiB, 512MiB, 1.5GB)",
                        name, v, (unsigned long long)lo, (unsigned long long)hi);
    *out = x;
    return 0;
}

/* ASCEND_RT_VISIBLE_DEVICES: a comma-separated list of distinct node devices. */
static int get_visible(int node_devices, int *devices, int *phys, const char *call)
{
    const char *v = env("ASCEND_RT_VISIBLE_DEVICES");
    int n = 0;
    if (!v) {
        for (int i = 0; i < node_devices; i++)
            if (phys)
                phys[i] = i;
        *devices = node_devices;
        return 0;
    }
    for (const char *p = v; *p;) {
        char *end;
        errno = 0;
        long d = isdigit((unsigned char)*p) ? strtol(p, &end, 10) : -1;
        int seen = 0;
        for (int i = 0; phys && i < n; i++)
            seen |= phys[i] == d;
        if (d < 0 || errno || d >= node_devices || n == SIM_MAX_DEVICES || seen || (*end && *end != ','))
            return sim_fail(ACL_ERROR_INVALID_PARAM, call,
                            "ASCEND_RT_VISIBLE_DEVICES='%s' is not a list of distinct devices of this node "
                            "(0 to %d, comma-separated)", v, node_devices - 1);
        if (phys)
            phys[n] = (int)d;
        n++;
        p = *end ? end + 1 : end;
    }
    if (n == 0)
        return sim_fail(ACL_ERROR_INVALID_PARAM, call, "ASCEND_RT_VISIBLE_DEVICES='%s' names no device", v);
    *devices = n;
    return 0;
}

int sim_config_devices(int *devices, int *phys, const char *call)
{
    uint64_t n = SIM_DEFAULT_DEVICES;
    int rc = get_uint("ASCEND_SIM_DEVICES", 1, SIM_MAX_DEVICES, &n, call);
    if (rc)
        return rc;
    if (g_sim.override_devices > 0)
        n = (uint64_t)g_sim.override_devices;
    int tmp[SIM_MAX_DEVICES];
    return get_visible((int)n, devices, phys ? phys : tmp, call);
}

int sim_logical_device(int phys)
{
    for (int i = 0; i < g_sim.cfg.devices; i++)
        if (g_sim.cfg.phys[i] == phys)
            return i;
    return -1;
}

static int node_name_ok(const char *s)
{
    size_t n = strlen(s);
    if (n == 0 || n > SIM_NODE_NAME_MAX || s[0] == '.')
        return 0;
    for (size_t i = 0; i < n; i++)
        if (!isalnum((unsigned char)s[i]) && s[i] != '_' && s[i] != '-' && s[i] != '.')
            return 0;
    return 1;
}

static const struct sim_profile PROFILES[] = {
    /* name       soc name        events  8.0 flags  pad  ex events  streams  DDR device  device/IPC events
                                                                                                 IPC flags 0 */
    {"strict",  "Ascend910B1",   65536,  1,         1,   0,         1984,    0,          1,  0},
    {"cann8.0", "Ascend910B1",   65536,  1,         1,   1,         2048,    0,          1,  0},
    {"cann8.2", "Ascend910B1",   65536,  0,         1,   1,         1984,    0,          1,  1},
    {"cann8.3", "Ascend910B1",   65536,  0,         1,   1,         1984,    0,          1,  0},
    {"310p",    "Ascend310P3",   1023,   0,         1,   1,         1024,    1,          0,  0},
    {"950",     "Ascend950PR",   65536,  0,         0,   1,         1984,    0,          1,  0},
};

static int get_profile(struct sim_profile *out, const char *call)
{
    const char *v = env("ASCEND_SIM_PROFILE");
    if (!v)
        v = "strict";
    for (size_t i = 0; i < sizeof PROFILES / sizeof PROFILES[0]; i++) {
        if (strcmp(v, PROFILES[i].name) == 0) {
            *out = PROFILES[i];
            return 0;
        }
    }
    return sim_fail(ACL_ERROR_INVALID_PARAM, call,
                    "ASCEND_SIM_PROFILE='%s' is not a profile (strict, cann8.0, cann8.2, cann8.3, 310p, 950)", v);
}

int sim_config_load(struct sim_config *cfg, const char *call)
{
    memset(cfg, 0, sizeof *cfg);
    cfg->hbm = SIM_DEFAULT_HBM;
    cfg->fail_after_bytes = -1;
    int rc = sim_config_devices(&cfg->devices, cfg->phys, call);
    if (!rc)
        rc = get_size("ASCEND_SIM_HBM", 1, MAX_HBM, &cfg->hbm, call);
    if (!rc)
        rc = get_uint("ASCEND_SIM_MALLOC_LATENCY_US", 0, MAX_LATENCY_US, &cfg->malloc_latency_us, call);
    if (!rc)
        rc = get_uint("ASCEND_SIM_FREE_LATENCY_US", 0, MAX_LATENCY_US, &cfg->free_latency_us, call);
    if (!rc)
        rc = get_uint("ASCEND_SIM_FAIL_MALLOC_NTH", 0, UINT64_MAX, &cfg->fail_malloc_nth, call);
    if (!rc && env("ASCEND_SIM_FAIL_AFTER_BYTES")) {
        uint64_t b = 0;
        rc = get_size("ASCEND_SIM_FAIL_AFTER_BYTES", 0, INT64_MAX, &b, call);
        cfg->fail_after_bytes = (int64_t)b;
    }
    if (!rc) {
        /* Pinned (lock-page) memory is resident: the real aclrtMallocHost fails past the host's
           RAM, where an unbounded NORESERVE mapping would not. */
        long pages = sysconf(_SC_PHYS_PAGES), ps = sysconf(_SC_PAGESIZE);
        cfg->host_pinned = pages > 0 && ps > 0 ? (uint64_t)pages * (uint64_t)ps : MAX_HBM;
        rc = get_size("ASCEND_SIM_HOST_PINNED", 0, MAX_HBM, &cfg->host_pinned, call);
    }
    if (!rc)
        rc = get_profile(&cfg->profile, call);
    if (rc)
        return rc;
    const char *soc = env("ASCEND_SIM_SOC_NAME");
    if (soc) {
        size_t n = strlen(soc);
        int ok = n < sizeof cfg->profile.soc_name;
        for (size_t i = 0; ok && i < n; i++)
            ok = isalnum((unsigned char)soc[i]) || soc[i] == '_' || soc[i] == '-';
        if (!ok)
            return sim_fail(ACL_ERROR_INVALID_PARAM, call,
                            "ASCEND_SIM_SOC_NAME='%s' is not a SoC name (1-%zu of A-Z a-z 0-9 _ -)", soc,
                            sizeof cfg->profile.soc_name - 1);
        strcpy(cfg->profile.soc_name, soc);
    }
    if (g_sim.override_hbm)
        cfg->hbm = g_sim.override_hbm;

    const char *node = env("ASCEND_SIM_NODE");
    if (!node)
        node = "default";
    if (!node_name_ok(node))
        return sim_fail(ACL_ERROR_INVALID_PARAM, call,
                        "ASCEND_SIM_NODE='%s' is not a node name (1-%d of A-Z a-z 0-9 _ - ., "
                        "not starting with '.')", node, SIM_NODE_NAME_MAX);
    strcpy(cfg->node, node);

    const char *dir = env("ASCEND_SIM_SHM_DIR");
    if (!dir)
        dir = "/dev/shm";
    struct stat st;
    if (dir[0] != '/' || strlen(dir) >= sizeof cfg->shm_dir - 128)
        return sim_fail(ACL_ERROR_INVALID_PARAM, call,
                        "ASCEND_SIM_SHM_DIR='%s' is not an absolute directory path", dir);
    int err = stat(dir, &st) != 0 ? errno : (S_ISDIR(st.st_mode) ? 0 : ENOTDIR);
    if (err)
        return sim_fail(ACL_ERROR_INVALID_PARAM, call,
                        "ASCEND_SIM_SHM_DIR='%s' is not a directory (%s); the simulated node keeps "
                        "its shared device records there", dir, strerror(err));
    strcpy(cfg->shm_dir, dir);
    return 0;
}

/* Live events allowed per device: the profile's (aclrtCreateEvent pages: 65,536; 1,023 on Atlas
   inference cards). ASCEND_SIM_EVENT_LIMIT (1..65536) overrides it, read at each call so that a
   test can lower it without a 310p profile; a bad value keeps the profile's. */
int sim_event_limit(int device)
{
    (void)device; /* one SoC per simulated node */
    const char *v = env("ASCEND_SIM_EVENT_LIMIT");
    uint64_t x;
    if (v && parse_uint(v, &x) == 0 && x >= 1 && x <= SIM_MAX_EVENTS_PER_DEVICE)
        return (int)x;
    return sim_ready() ? (int)g_sim.cfg.profile.event_limit : SIM_MAX_EVENTS_PER_DEVICE;
}
