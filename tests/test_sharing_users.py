"""Sharing is per user (docs/sharing.md, "Who may open a handle"): another user's process opening a
handle, even one exported with any_process=True, gets a SharingError saying the block belongs to
another user (not that the exporter released it), and the simulator's import of another user's key
answers ACL_ERROR_RT_NO_PERMISSION (207006) naming that user. Runs a second uid through runuser."""
import os
import pickle
import sys

sys.path.insert(0, os.path.dirname(__file__))
from other_user import OTHER, two_users  # noqa: E402,F401  (pytest fixture)

EXPORTER = """
import pickle
import ascend_pool as ap
pool = ap.Pool(0)
p = pool.share_malloc(4 << 20)
h = pool.share(p, read_only=True, any_process=True)
path = os.path.join(os.environ["ASCEND_SIM_SHM_DIR"], "handle.pkl")
with open(path + ".tmp", "wb") as f:
    pickle.dump(h, f)
os.chmod(path + ".tmp", 0o644)
os.rename(path + ".tmp", path)
print("shared", flush=True)
sys.stdin.readline()
"""


def test_another_users_process_is_told_the_block_belongs_to_another_user(two_users):
    node = two_users
    exporter, _, line = node.spawn(None, EXPORTER)
    assert line == "shared"
    path = os.path.join(node.shm, "handle.pkl")
    out = node.run(OTHER, f"""
        import pickle
        import ascend_pool as ap
        from ascend_pool.sharing import SharingError
        h = pickle.load(open({path!r}, "rb"))
        try:
            ap.open_shared(h)
            raise SystemExit("opened another user's block")
        except SharingError as e:
            msg = str(e)
        assert "another user (uid {os.geteuid()})" in msg and "no longer shared" not in msg, msg
        # The runtime's own answer, for callers of the ACL calls (and handles of earlier versions).
        code("aclInit", None); ok("aclrtSetDevice", 0)        # (the pool initialised it)
        ptr = C.c_void_p()
        rc = code("aclrtIpcMemImportByKey", C.byref(ptr), h.key.encode(), 0)
        assert rc == 207006, (rc, errmsg())
        assert "exported by another user (uid {os.geteuid()})" in errmsg(), errmsg()
        ap.free(ap.malloc(4096))                           # the user's own pool still serves
        print("ok")
    """)
    assert out.split()[-1] == "ok"
    h = pickle.load(open(path, "rb"))
    assert h.exporter_uid == os.geteuid()
    node.run(None, f"""
        import pickle
        import ascend_pool as ap
        h = pickle.load(open({path!r}, "rb"))
        with ap.open_shared(h) as w:                       # the exporter's user opens it
            assert w.size == 4 << 20
    """)
    exporter.communicate("go\n", timeout=30)
    assert exporter.returncode == 0
