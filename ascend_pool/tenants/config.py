"""The tenants file (TOML): quotas, warn ratios and devices per tenant.

    [defaults]          # optional: values for tenants that do not set them
    warn = 0.9
    [tenants.online]
    quota = "24GiB"     # bytes, a size with a unit, or "25%" of the device
    warn = 0.8          # in (0, 1]
    devices = [0, 1]    # the node's devices the quota applies on (default: every device); a
                        # container that sees NPU 3 as its device 0 is on device 3 here
    [tenants.batch]
    quota = "25%"

The file is named by $ASCEND_POOL_CONFIG or passed explicitly; $ASCEND_POOL_TENANT names this
process's tenant (then the process's default pools are that tenant's contexts). A quota applies
per device: the tenant's processes together may hold that much on each listed device.

Validation reports every mistake it can find, one line each, naming the file, the line (when it
can be found) or the key, and the problem: unknown key, bad unit, negative or zero quota, warn
outside (0, 1], duplicate tenant, bad tenant name, bad devices, a file that is not TOML, not
UTF-8, or larger than 1 MiB. Quotas that add up to more than a device are allowed (soft quotas
may overcommit) and reported as warnings.
"""

import json
import os
import re
import stat
import tomllib

from ..errors import ConfigError
from ..units import format_bytes
from .quota_spec import QuotaSpec, check_tenant_name, parse_quota, parse_warn
from .toml_lines import AT as _AT
from .toml_lines import Lines as _Lines
from .toml_lines import blank_section as _blank_section

CONFIG_ENV = "ASCEND_POOL_CONFIG"
TENANT_ENV = "ASCEND_POOL_TENANT"
MAX_FILE_BYTES = 1 << 20
TENANT_KEYS = ("quota", "warn", "devices")
TOP_KEYS = ("tenants", "defaults")


class ConfigErrors(ConfigError):
    """A tenants file with mistakes. `errors` is the list of lines (one per mistake); str() is
    them joined by newlines."""

    def __init__(self, errors):
        super().__init__("\n".join(errors))
        self.errors = list(errors)


class TenantConfig:
    """One tenant as understood: name, quota (QuotaSpec or None: no quota), warn (ratio or None),
    devices (tuple of ints, or None: every device), line (where it is declared, or None)."""

    __slots__ = ("name", "quota", "warn", "devices", "line")

    def __init__(self, name, quota=None, warn=None, devices=None, line=None):
        self.name, self.quota, self.warn, self.devices, self.line = name, quota, warn, devices, line

    def applies_to(self, device):
        return self.devices is None or device in self.devices

    def quota_bytes(self, device_total_bytes):
        """Bytes on a device of device_total_bytes, or None (no quota)."""
        return None if self.quota is None else self.quota.resolve(device_total_bytes)

    def as_dict(self):
        q = self.quota
        return {"name": self.name, "quota": None if q is None else q.text,
                "quota_bytes": None if q is None else q.bytes,
                "quota_fraction": None if q is None else q.fraction,
                "warn": self.warn, "devices": None if self.devices is None else list(self.devices)}

    def __repr__(self):
        return f"TenantConfig({self.name!r}, quota={self.quota!r}, warn={self.warn!r}, devices={self.devices!r})"


class TenantsConfig:
    """A valid tenants file: path, tenants ({name: TenantConfig}), defaults (dict of what
    [defaults] set) and notes (non-fatal remarks, e.g. a warn without a quota)."""

    def __init__(self, path, tenants, defaults, notes):
        self.path, self.tenants, self.defaults, self.notes = path, tenants, defaults, notes

    def tenant(self, name):
        """The TenantConfig of name; ConfigError naming the file and the tenants it has."""
        t = self.tenants.get(name)
        if t is None:
            known = ", ".join(sorted(self.tenants)) or "none"
            raise ConfigError(f"{self.path}: no tenant {name!r} (tenants: {known})")
        return t

    def overcommit_warnings(self, device_total_bytes=None):
        """Warning lines for devices whose quotas add up to more than the device. Percentages are
        always comparable; byte quotas only when device_total_bytes is known."""
        limited = [t for t in self.tenants.values() if t.quota is not None]
        explicit = sorted({d for t in limited if t.devices for d in t.devices})
        groups = [(f"device {d}", [t for t in limited if t.applies_to(d)]) for d in explicit]
        if any(t.devices is None for t in limited):
            groups.append(("each other device" if explicit else "each device",
                           [t for t in limited if t.devices is None]))
        out = []
        for where, members in groups:
            fraction = sum(t.quota.fraction for t in members if t.quota.fraction is not None)
            nbytes = sum(t.quota.bytes for t in members if t.quota.bytes is not None)
            if nbytes and device_total_bytes:
                fraction += nbytes / device_total_bytes
            elif nbytes:  # bytes cannot be compared with an unknown device size: percentages only
                members = [t for t in members if t.quota.fraction is not None]
            if fraction > 1.0 + 1e-9:
                names = ", ".join(f"{t.name} {t.quota.text}" for t in members)
                out.append(f"{self.path}: warning: quotas on {where} add up to {fraction * 100:.0f}% of the device "
                           f"({names}): overcommitted, which is allowed (quotas are soft limits)")
        return out

    def describe(self, device_total_bytes=None):
        """What was understood, as readable lines (what `ascend-pool check-config` prints)."""
        lines = [f"{self.path}: {len(self.tenants)} tenant(s)"]
        for t in self.tenants.values():
            if t.quota is None:
                q = "no quota"
            elif t.quota.fraction is not None:
                q = f"quota {t.quota.text} of the device"
                if device_total_bytes:
                    q += f" ({t.quota.resolve(device_total_bytes)} bytes)"
            else:
                q = f"quota {t.quota.bytes} bytes ({format_bytes(t.quota.bytes)})"
            w = f"warn at {t.warn * 100:g}%" if t.warn is not None else "no warn level"
            d = "every device" if t.devices is None else "devices " + ", ".join(map(str, t.devices))
            lines.append(f"  tenant {t.name}: {q}, {w}, on {d}")
        if self.defaults:
            lines.append("  defaults: " + ", ".join(f"{k} = {v!r}" for k, v in self.defaults.items()))
        lines += [f"  note: {n}" for n in self.notes]
        return lines

    def as_dict(self):
        return {"path": self.path, "tenants": {n: t.as_dict() for n, t in self.tenants.items()},
                "defaults": {k: (v.text if isinstance(v, QuotaSpec) else v) for k, v in self.defaults.items()},
                "notes": list(self.notes)}


# -- validation ------------------------------------------------------------------------------------

_BARE = re.compile(r"^[A-Za-z0-9_-]+$")


def _keyname(path):
    """A key path as TOML writes it: tenants."bad name".quota."""
    # a quoted key as TOML writes it (json's escapes are TOML's basic-string ones): a newline in
    # a name stays \n, so each mistake keeps one line
    return ".".join(p if _BARE.match(p) else json.dumps(p, ensure_ascii=False) for p in path)


def parse_text(text, path="<string>"):
    """A TenantsConfig from the file's text; ConfigErrors listing every mistake."""
    errors = []  # (line or None, text): reported in file order

    def err(keypath, problem, line=None):
        line = line if line is not None else lines.line(keypath)
        where = f"{path}:{line}" if line else path
        errors.append((line, f"{where}: {_keyname(keypath)}: {problem}"))

    def fail():
        ordered = sorted(errors, key=lambda e: (e[0] is None, e[0] or 0))
        return ConfigErrors([text for _, text in ordered])

    lines = _Lines(text)
    for dpath, no, first in lines.duplicates():
        if len(dpath) == 2 and dpath[0] == "tenants":
            err(dpath, f"duplicate tenant {dpath[1]!r} (first declared at line {first})", no)
        else:
            err(dpath, f"table [{_keyname(dpath)}] declared twice (first at line {first})", no)
    data = None
    dup_lines = {no for _, no, _ in lines.duplicates()}
    for _ in range(len(dup_lines) + 1):  # each duplicate (already reported) is dropped to check the rest
        try:
            data = tomllib.loads(text)
            break
        except RecursionError:  # tomllib parses nested arrays/tables recursively
            errors.append((None, f"{path}: not valid TOML: values nested too deeply"))
            break
        except tomllib.TOMLDecodeError as e:
            m = _AT.search(str(e))
            line = int(m.group(1)) if m and m.group(1) else None
            if line in dup_lines:
                text = _blank_section(text, line)
                continue
            where = f"{path}:{line}" if line else path
            end = " (at the end of the file)" if m and not m.group(1) else ""
            errors.append((line, f"{where}: not valid TOML: {_AT.sub('', str(e))}{end}"))
            break
    if data is None:
        raise fail()

    for key in data:
        if key not in TOP_KEYS:
            err((key,), "unknown key (expected [tenants.NAME] tables and an optional [defaults] table)")

    defaults = {}
    raw_defaults = data.get("defaults", {})
    if not isinstance(raw_defaults, dict):
        err(("defaults",), "must be a table ([defaults])")
        raw_defaults = {}
    for key, value in raw_defaults.items():
        _check_value(("defaults", key), value, defaults, err)

    tenants = {}
    raw_tenants = data.get("tenants", {})
    if not isinstance(raw_tenants, dict):
        err(("tenants",), "must be a table of tenants ([tenants.NAME])")
        raw_tenants = {}
    notes = []
    for name, body in raw_tenants.items():
        tpath = ("tenants", name)
        try:
            check_tenant_name(name)
        except ConfigError as e:
            err(tpath, str(e))
            continue
        if not isinstance(body, dict):
            err(tpath, f"must be a table ([tenants.{name}]) with quota, warn and devices, got {type(body).__name__}")
            continue
        values = {}
        for key, value in body.items():
            _check_value(tpath + (key,), value, values, err)
        t = TenantConfig(name, values.get("quota", defaults.get("quota")), values.get("warn", defaults.get("warn")),
                         values.get("devices", defaults.get("devices")), lines.line(tpath))
        if t.warn is not None and t.quota is None:
            notes.append(f"tenant {name}: warn has no effect without a quota")
        tenants[name] = t
    if errors:
        raise fail()
    if not tenants:
        notes.append("no tenants are defined")
    return TenantsConfig(path, tenants, defaults, notes)


def _check_value(keypath, value, out, err):
    key = keypath[-1]
    if key not in TENANT_KEYS:
        err(keypath, f"unknown key (known: {', '.join(TENANT_KEYS)})")
        return
    try:
        if key == "quota":
            out[key] = parse_quota(value, "quota")
        elif key == "warn":
            out[key] = parse_warn(value, "warn")
        else:
            out[key] = _parse_devices(value)
    except ConfigError as e:
        msg = str(e)
        err(keypath, msg[len(key) + 2:] if msg.startswith(key + ": ") else msg)


MAX_DEVICES = 64  # the C ABI's per-process device table (cython/core/current.h AP_MAX_DEVICES)


def _parse_devices(value):
    if not isinstance(value, list):
        raise ConfigError(f"devices: expected a list of device indexes like [0, 1], got {type(value).__name__} {value!r}")
    out, seen = [], set()
    for d in value:
        if isinstance(d, bool) or not isinstance(d, int) or not 0 <= d < MAX_DEVICES:
            raise ConfigError(f"devices: {d!r} is not a device index (an int from 0 to {MAX_DEVICES - 1})")
        if d in seen:
            raise ConfigError(f"devices: device {d} is listed twice")
        seen.add(d)
        out.append(d)
    if not out:
        raise ConfigError("devices: the list is empty (omit devices for every device)")
    return tuple(out)


def read_text(path):
    """The file's text; ConfigErrors (one line) when it is missing, too large or not UTF-8."""
    try:
        # O_NONBLOCK: a FIFO at the path must be refused, not waited on (it is ignored for files)
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC), "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise ConfigErrors([f"{path}: cannot read the tenants file: not a regular file"])
            size = st.st_size
            if size > MAX_FILE_BYTES:
                raise ConfigErrors([f"{path}: file is {size} bytes, larger than the {MAX_FILE_BYTES} byte (1 MiB) "
                                    "limit for a tenants file"])
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise ConfigErrors([f"{path}: cannot read the tenants file: {e.strerror or e}"]) from None
    if len(raw) > MAX_FILE_BYTES:  # grew after the size check
        raise ConfigErrors([f"{path}: file is larger than the {MAX_FILE_BYTES} byte (1 MiB) limit for a tenants file"])
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ConfigErrors([f"{path}:{line}: not valid TOML: the file is not UTF-8 text"]) from None
    if text.startswith("\ufeff"):  # invisible in editors: tomllib said only "Invalid statement" at line 1
        raise ConfigErrors([f"{path}:1: not valid TOML: the file starts with a byte order mark (U+FEFF, "
                            "as some Windows editors save UTF-8); save it without one"])
    return text


def load(path=None):
    """The TenantsConfig of path (default $ASCEND_POOL_CONFIG); None when neither is set.
    Raises ConfigErrors (a ConfigError) listing every mistake."""
    path = path if path is not None else os.environ.get(CONFIG_ENV) or None
    if path is None:
        return None
    path = os.fspath(path)
    return parse_text(read_text(path), path)


def process_tenant():
    """This process's tenant from $ASCEND_POOL_TENANT, or None; ConfigError on a bad name."""
    name = os.environ.get(TENANT_ENV, "").strip()
    if not name:
        return None
    return check_tenant_name(name, f"{TENANT_ENV}")


def check_operator_file():
    """Raises ConfigError when $ASCEND_POOL_CONFIG names a tenants file that cannot be used
    (missing, unreadable, or with mistakes: each listed). A tenant context refuses to open then:
    the operator's quotas would otherwise be dropped without a word (operator_quota below counts
    an unusable file as none)."""
    path = os.environ.get(CONFIG_ENV) or None
    if path is None:
        return
    try:
        load(path)
    except ConfigError as e:
        raise ConfigError(f"{CONFIG_ENV}={path}: the operator's tenants file cannot be used, so no tenant "
                          f"context opens until it is fixed (check it with `ascend-pool check-config`): {e}") from None


def operator_quota(tenant, device, device_total_bytes):
    """The quota in bytes that the operator's tenants file ($ASCEND_POOL_CONFIG) sets for tenant on
    device, with its warn ratio and the file's modification time (whole seconds; the ledger lets
    the newer of two disagreeing files win): (bytes, warn, stamp), or None when there is no file, the file does not
    name the tenant on that device, or names it without a quota. A file that cannot be read counts
    as none here (check-config and the reloader report its mistakes). The quota ledger lets this
    quota win over any process's own declaration (one source of truth per tenant on a node).
    device_total_bytes: int, a callable returning it (only called for a percentage), or None
    where the device's total is not read (a device never opened): a percentage is then None."""
    try:
        cfg = load()
    except (ConfigError, OSError):
        return None
    if cfg is None:
        return None
    t = cfg.tenants.get(tenant)
    if t is None or t.quota is None or not t.applies_to(device):
        return None
    if t.quota.bytes is None and device_total_bytes is None:
        return None  # a percentage of a total not read
    total = None if t.quota.bytes is not None else (  # a byte quota needs no device total (nor a context)
        device_total_bytes() if callable(device_total_bytes) else device_total_bytes)
    try:
        stamp = min(int(os.stat(cfg.path).st_mtime), 0xFFFFFFFF)  # a ConfigMap's: when kubelet wrote it
    except (OSError, TypeError):
        stamp = 0
    return t.quota.resolve(total), t.warn, stamp
