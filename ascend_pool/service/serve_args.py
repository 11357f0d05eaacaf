"""Command-line values the node service and `ascend-pool ps` share."""

import grp

from .. import identity
from ..errors import ConfigError

GID_MAX = 2**32 - 2  # (gid_t)-1 means "no group"


def group_ids(values, option="--allow-group"):
    """gids of the groups named in values (names or numbers, as this user namespace sees them);
    ConfigError (a ValueError) naming the option and an unknown group, a number that is no gid
    (one silently matched no directory), or a gid the namespace's gid map leaves out (taken for
    the host's number, it would trust another group's directory)."""
    out = set()
    for v in values or ():
        v = str(v).strip()
        if v.isdigit():
            gid = int(v)
            if gid > GID_MAX:
                raise ConfigError(f"{option}: expected a group name or a gid from 0 to {GID_MAX}, got {v}")
        else:
            try:
                gid = grp.getgrnam(v).gr_gid
            except KeyError:
                raise ConfigError(f"{option}: {v!r} is not a group on this system") from None
        if not identity.gid_mapped(gid):
            raise ConfigError(f"{option}: {v!r}: gid {gid} is not a group of this user namespace (its gid map "
                              f"'{identity.gid_map_text()}' leaves it out); give the group as this namespace sees it")
        out.add(gid)
    return out
