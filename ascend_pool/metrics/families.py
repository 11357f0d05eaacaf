"""prometheus_client metric families from TenantSamples (see schema.py for names and units).

Labels: device and tenant on every per-tenant family, pool (small|large) where the pool splits
the figure, and pid, instance, uid, pid_here and pidns first when the samples come from several
processes (the node service: pids are per pid namespace, two containers' workers are both pid 1;
instance is unique; quotas are per user, so the same tenant name under two uids is two tenants;
pid_here is the pid in the service's own pid namespace, what kill and top take there, '' where it
does not see into the process's namespace, as `ascend-pool ps`'s PID_HERE; pidns is the namespace
`pid` is in, the inode `lsns -t pid` lists on the host, as ps's PIDNS).
Device-wide figures (free/total device memory) carry only `device`: they are the same for every
tenant, and repeating them per tenant would invite sums that count a device twice.
"""

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..stats import external_fragmentation
from .schema import DEVICE_FAMILIES, FAMILIES, FRAGMENTATION, NO_QUOTA, POOL_KINDS, QUOTA, QUOTA_WARN, WARN_PPM

_TYPES = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily}


def tenant_families(samples, with_pid=False, pids_here=None, pidns=None):
    """The per-(device, tenant) families for samples (an iterable of TenantSample). pids_here:
    {instance: its pid in the reader's pid namespace} for the node service's pid_here label
    ('' for a process it has no pid for); pidns: {instance: the inode of the pid namespace its pid
    is in} for the pidns label ('' where unknown)."""
    base = ["pid", "instance", "uid", "pid_here", "pidns"] if with_pid else []
    here = (pids_here or {}, pidns or {})
    tenant_labels = base + ["device", "tenant"]
    out = []
    for name, kind, doc, source, split in FAMILIES:
        fam = _TYPES[kind](name, doc, labels=tenant_labels + (["pool"] if split else []))
        for s in samples:
            lv = _labels(s, with_pid, here)
            if split:
                for pool in POOL_KINDS:
                    fam.add_metric(lv + [pool], s.values[f"{source}.{pool}"])
            else:
                fam.add_metric(lv, s.values[source])
        out.append(fam)
    frag = GaugeMetricFamily(FRAGMENTATION[0], FRAGMENTATION[1], labels=tenant_labels)
    quota = GaugeMetricFamily(QUOTA[0], QUOTA[1], labels=tenant_labels)
    warn = GaugeMetricFamily(QUOTA_WARN[0], QUOTA_WARN[1], labels=tenant_labels)
    for s in samples:
        frag.add_metric(_labels(s, with_pid, here), external_fragmentation(s.values))
        if s.values["quota_bytes"] != NO_QUOTA:
            quota.add_metric(_labels(s, with_pid, here), s.values["quota_bytes"])
            if s.values.get("quota_warn_ppm", 0) > 0:
                warn.add_metric(_labels(s, with_pid, here), s.values["quota_warn_ppm"] / WARN_PPM)
    return out + [frag, quota, warn]


def device_families(per_device):
    """Device-wide families from {device: values} (values holding the device_* fields)."""
    out = []
    for name, doc, source in DEVICE_FAMILIES:
        fam = GaugeMetricFamily(name, doc, labels=["device"])
        for device, values in sorted(per_device.items()):
            fam.add_metric([str(device)], values[source])
        out.append(fam)
    return out


def _labels(s, with_pid, here):
    lv = [str(s.device), s.tenant]
    if not with_pid:
        return lv
    pids_here, pidns = here
    return [str(s.pid), s.instance or "", "" if s.uid is None else str(s.uid), str(pids_here.get(s.instance, "")),
            str(pidns.get(s.instance) or "")] + lv
