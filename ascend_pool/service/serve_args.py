"""Command-line values the node service and `ascend-pool ps` share."""

import grp

from .. import identity


def group_ids(values):
    """gids of the groups named in values (names or numbers, as this user namespace sees them);
    ValueError naming an unknown one, or one the namespace's gid map leaves out (taken for the
    host's number, it would trust another group's directory)."""
    out = set()
    for v in values or ():
        v = str(v).strip()
        if v.isdigit():
            gid = int(v)
        else:
            try:
                gid = grp.getgrnam(v).gr_gid
            except KeyError:
                raise ValueError(f"{v!r} is not a group on this system") from None
        if not identity.gid_mapped(gid):
            raise ValueError(f"{v!r}: gid {gid} is not a group of this user namespace (its gid map "
                             f"'{identity.gid_map_text()}' leaves it out); give the group as this namespace sees it")
        out.add(gid)
    return out
