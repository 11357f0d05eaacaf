"""Tenant contexts and soft quotas, enforced node-wide through a shared-memory ledger.

    ctx = pool.context("online", quota="8GiB")          # Context: its own pool, a soft quota
    ascend_pool.tenants.load_config("tenants.toml")     # the tenants file (TOML)
    ascend_pool.tenants.reload_config()                 # apply a changed file to live contexts
    ascend_pool.tenants.watch_config() / install_sighup_reload()
    ascend_pool.tenants.sweep()                         # give back dead processes' shares (node service)

Modules: context (Context), quota_spec (quota values), config (the TOML file), reload (applying it
to live pools), ledger (ledger files), default ($ASCEND_POOL_TENANT default pools), errors.
"""

from .config import ConfigErrors, TenantConfig, TenantsConfig
from .config import load as load_config
from .context import Context, live_contexts, make_context
from .errors import LedgerError
from .ledger import open_ledger, sweep, view
from .quota_spec import parse_quota
from .reload import apply_config, install_sighup_reload, reload_config, watch_config

__all__ = [
    "Context", "make_context", "live_contexts", "load_config", "TenantsConfig", "TenantConfig", "ConfigErrors",
    "reload_config", "apply_config", "watch_config", "install_sighup_reload", "open_ledger", "sweep", "view",
    "parse_quota", "LedgerError",
]
