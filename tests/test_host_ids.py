"""identity.host_uid() and friends on given uid/gid maps (no namespace needed): the host's ids
that shared files are named by, and the translation of a file's owner (docs/containers.md, "Across
user namespaces"). The behaviour across a real namespace is tests/test_sim_userns.py's."""
import os

import pytest

from ascend_pool import identity


@pytest.fixture
def maps(monkeypatch):
    def set_maps(uid_rows, gid_rows=None, overflow=65534):
        monkeypatch.setattr(identity, "_maps", {identity._UID_MAP_PATH: uid_rows,
                                                identity._GID_MAP_PATH: gid_rows if gid_rows is not None else uid_rows,
                                                ("overflow", identity._OVERFLOW_UID_PATH): overflow,
                                                ("overflow", identity._OVERFLOW_GID_PATH): overflow})
    return set_maps


def test_the_initial_namespace_translates_nothing(maps):
    maps([(0, 0, 4294967295)])
    me = os.geteuid()
    assert identity.host_uid() == me and identity.user_namespace() is None and not identity.in_namespace()
    assert identity.owner_host_uid(65534) == 65534 and identity.host_gid(5) == 5 and identity.gid_here(5) == 5


def test_a_rootless_containers_map_names_by_the_uid_outside(maps):
    me = os.geteuid()
    maps([(me, 100000 + me, 1), (me + 1, 200000, 70000)])
    assert identity.host_uid() == 100000 + me
    assert identity.user_namespace() == (f"{me} {100000 + me} 1; {me + 1} 200000 70000", 100000 + me)
    assert identity.owner_host_uid(me) == 100000 + me           # this user's own file
    assert identity.owned_by(me, 100000 + me) and not identity.owned_by(me + 1, 100000 + me)
    assert identity.owner_host_uid(me + 2) == 200001             # another mapped user's
    assert identity.owned_by(me + 2, 200001)
    if me + 1 <= 65534 < me + 70001:
        assert identity.owner_host_uid(65534) is None            # the overflow uid: never translated
    assert identity.owner_host_uid(me + 80000) is None           # not in the map


def test_a_map_that_leaves_the_euid_out_falls_back_to_it(maps):
    me = os.geteuid()
    maps([])                                                     # `unshare --user` with no map written
    assert identity.host_uid() == me
    assert identity.user_namespace() == ("", None)
    maps([(me + 1, 100000, 1)])
    assert identity.host_uid() == me and identity.user_namespace()[1] is None


def test_gids_translate_through_the_gid_map(maps):
    maps([(0, 0, 4294967295)], [(0, 100000, 65536)])
    assert identity.host_gid(10) == 100010 and identity.gid_here(100010) == 10
    assert identity.host_gid(70000) == 70000 and identity.gid_here(5) is None  # left out: itself / None
    assert identity.owner_host_gid(65534) is None and identity.owner_host_gid(10) == 100010


def test_the_maps_are_read_once_and_forgotten_in_a_forked_child():
    identity._maps.clear()
    identity.host_uid()
    assert identity._UID_MAP_PATH in identity._maps
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(w, b"1" if not identity._maps else b"0")
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(r, 1) == b"1"
    os.close(r)
    os.close(w)


def test_a_sharing_group_the_gid_map_leaves_out_is_refused_naming_the_map(maps, monkeypatch):
    # host_gid() takes an unmapped gid for the host's own number: ASCEND_POOL_LEDGER_GROUP or
    # --allow-group given as the host's gid inside a namespace named another group's directory
    # and failed later with EINVAL (fchown) or "belongs to group N".
    from ascend_pool.errors import LedgerError
    from ascend_pool.service.serve_args import group_ids
    from ascend_pool.tenants.ledger import ledger_group

    maps([(0, 0, 4294967295)], [(0, 100000, 65536)])
    assert ledger_group("10") == 10 and group_ids(["10"]) == {10}
    with pytest.raises(LedgerError, match=r"gid 100010 is not a group of this user namespace.*'0 100000 65536'"):
        ledger_group("100010")
    monkeypatch.setenv("ASCEND_POOL_LEDGER_GROUP", "100010")
    with pytest.raises(LedgerError, match="ASCEND_POOL_LEDGER_GROUP='100010'"):
        ledger_group()
    with pytest.raises(ValueError, match="gid 100010 is not a group of this user namespace"):
        group_ids(["100010"])
    maps([(0, 0, 4294967295)])
    assert ledger_group("100010") == 100010 and group_ids(["100010"]) == {100010}  # no namespace: any gid
