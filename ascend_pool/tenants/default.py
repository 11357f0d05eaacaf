"""The process's default pools when it runs as a tenant ($ASCEND_POOL_TENANT).

ascend_pool.api._create_default asks here first: with $ASCEND_POOL_TENANT set, the default pool of
a device is that tenant's Context, with the quota and warn ratio of the tenants file
($ASCEND_POOL_CONFIG) when there is one. Module-level ascend_pool.malloc and the C ABI then
allocate under the tenant's quota without any code change in the application.
"""

import logging

from ..errors import ConfigError
from . import config as _config
from .context import Context
from .reload import start_from_env

log = logging.getLogger("ascend_pool.tenants")


def default_tenant_pool(device):
    """The default pool of device for this process's tenant, or None when $ASCEND_POOL_TENANT is
    not set. ConfigError when the tenant is not in the tenants file or not on this device."""
    tenant = _config.process_tenant()
    if tenant is None:
        return None
    cfg = _config.load()
    t = None
    if cfg is not None:
        t = cfg.tenant(tenant)
        if not t.applies_to(device):
            raise ConfigError(f"{cfg.path}: tenant {tenant!r} ({_config.TENANT_ENV}) is not configured for device "
                              f"{device} (devices = {list(t.devices)})")
    # before the context opens: a bad $ASCEND_POOL_CONFIG_RELOAD left it open, in no one's hands
    start_from_env(cfg.path if cfg else None)
    ctx = Context(tenant, device, quota=t.quota if t else None, warn=t.warn if t else None)
    if t is not None:
        if t.quota is None:
            ctx.set_quota(None, warn=t.warn)  # the file says "no quota": that is authoritative
        for line in cfg.overcommit_warnings(ctx.device_total_bytes):
            log.warning("%s", line)
    return ctx
