"""A tenants file mounted from a Kubernetes ConfigMap changes the way the kubelet changes it: the
new contents go into a fresh timestamped directory, then the `..data` symlink is swapped to it
atomically and the old directory removed; the file name the process reads
(`tenants.toml` -> `..data/tenants.toml`) never changes. A process watching its tenants file
(ASCEND_POOL_CONFIG_RELOAD=watch, as deploy/example-tenant.yaml sets) must apply the new quota."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from quota_fixtures import MiB, base, large, ledger_dir  # noqa: E402,F401  (pytest fixtures)

from ascend_pool.tenants import watch_config  # noqa: E402


class KubeletVolume:
    """A ConfigMap volume laid out and updated as the kubelet's atomic writer does."""

    def __init__(self, root, key):
        self.root, self.key, self.n = root, key, 0
        self.current = None

    def publish(self, text):
        self.n += 1
        stamp = self.root / f"..2026_11_30_00_00_{self.n:02d}.000000000"
        stamp.mkdir()
        (stamp / self.key).write_text(text)
        tmp = self.root / "..data_tmp"
        os.symlink(stamp.name, tmp)
        os.rename(tmp, self.root / "..data")  # the atomic swap
        link = self.root / self.key
        if not link.is_symlink():
            os.symlink(f"..data/{self.key}", link)
        if self.current is not None:
            for f in self.current.iterdir():
                f.unlink()
            self.current.rmdir()
        self.current = stamp
        return link


def test_configmap_symlink_swap_reloads_the_quota(base, tmp_path):
    volume = KubeletVolume(tmp_path, "tenants.toml")
    path = volume.publish('[tenants.online]\nquota = "16MiB"\n')
    online = base.context("online", quota=16 * MiB)
    watcher = watch_config(str(path), interval=3600)  # checked by hand below, not by its thread
    try:
        live = [online.malloc(large(4)) for _ in range(2)]
        assert not watcher.check()  # nothing changed yet
        allocated = online.memory_stats()["allocated_bytes.all.current"]

        volume.publish('[tenants.online]\nquota = "10MiB"\n')
        assert watcher.check(), "the ..data swap was not seen as a change of the tenants file"
        assert online.quota == 10 * MiB
        assert online.memory_stats()["allocated_bytes.all.current"] == allocated  # nothing lost

        volume.publish('[tenants.online]\nquota = "32MiB"\n')
        assert watcher.check()
        assert online.quota == 32 * MiB
        live += [online.malloc(large(4)) for _ in range(4)]  # grew past the old quota
        for p in live:
            online.free(p)
    finally:
        watcher.stop()
        online.close()
