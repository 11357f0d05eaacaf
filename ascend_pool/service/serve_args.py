"""Command-line values the node service and `ascend-pool ps` share."""

import grp


def group_ids(values):
    """gids of the groups named in values (names or numbers); ValueError naming an unknown one."""
    out = set()
    for v in values or ():
        v = str(v).strip()
        if v.isdigit():
            out.add(int(v))
            continue
        try:
            out.add(grp.getgrnam(v).gr_gid)
        except KeyError:
            raise ValueError(f"{v!r} is not a group on this system") from None
    return out
