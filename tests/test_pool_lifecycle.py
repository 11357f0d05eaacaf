"""One lifecycle for every pool: close() and the object's death (no close) end the same way for a
Pool and a tenant context: device memory back to the device, the tenant's quota booking back to
the ledger, the pool gone from the C ABI, and no thread able to reach it.

Run in fresh processes (sim_node): device accounting is the node's, and a use of a freed pool
would crash the process rather than pytest.
"""
import os
import sys
import textwrap

sys.path.insert(0, os.path.dirname(__file__))
from sim_fixtures import sim_node  # noqa: E402,F401

MiB = 1 << 20


def test_closing_and_dropping_a_pool_or_context_end_the_same_way(sim_node):
    out = sim_node.run_json(textwrap.dedent("""
        import gc
        import ascend_pool as ap
        from ascend_pool import _core
        from ascend_pool.backend import open_backend
        from ascend_pool.tenants.ledger import open_ledger

        be = open_backend("sim")
        ledger = open_ledger(0, be)
        free0 = be.mem_info(0)[0]
        res = {}
        for kind in ("pool", "context"):
            for end in ("close", "drop"):
                pool = ap.Pool(0, backend="sim")
                obj = pool if kind == "pool" else pool.context(f"life{end}", quota="64MiB")
                with obj if kind == "context" else open(os.devnull):
                    ptr = _core.capi_malloc(8 << 20, 0) if kind == "context" else obj.malloc(8 << 20)
                live = obj.malloc(3 << 20)  # never freed: closing returns it too
                held = ledger.tenant(f"life{end}")["held_bytes"] if kind == "context" else None
                if end == "close":
                    obj.close()
                    obj.close()           # twice is harmless
                else:
                    del obj
                if kind == "context":
                    pool.close()
                del pool
                gc.collect()
                try:
                    _core.capi_free(ptr, 0, 0)
                    freed = "freed"
                except ap.PoolError as e:
                    freed = type(e).__name__
                res[f"{kind} {end}"] = {
                    "device_back": be.mem_info(0)[0] == free0,
                    "booking_back": None if held is None else (held >= 11 << 20 and
                                                               ledger.tenant(f"life{end}")["held_bytes"] == 0),
                    "c_abi": freed,
                }
        print(json.dumps(res))
    """))
    for case, got in out.items():
        assert got["device_back"], (case, got)
        assert got["booking_back"] in (None, True), (case, got)
        assert got["c_abi"] == "InvalidPointerError", (case, got)


def test_a_device_reset_behind_the_pool_is_a_device_error_not_out_of_memory(sim_node):
    """A framework that resets device 0 once more than it set it releases the pool's context (CANN
    rule: the last aclrtResetDevice destroys the default context). The pool's next growth used to
    raise OutOfMemoryError ("out of device memory ... 0 free of 0") and count an OOM; it is a
    DeviceError naming the dead context, and once that pool is closed a new pool works."""
    out = sim_node.run_json("""
        import ascend_pool as ap
        from ascend_pool import sim
        acl = C.CDLL(sim.library_path())
        pool = ap.Pool(0, backend="sim")
        keep = pool.malloc(1 << 20)
        acl.aclrtResetDevice(0)            # the pool's own reference: the context goes
        acl.aclrtSetDevice(0)              # a new default context
        try:
            pool.malloc(30 << 20)          # a growth: keep's 20 MiB segment cannot hold it
            err = None
        except ap.PoolError as e:
            err = [type(e).__name__, str(e)]
        ooms = pool.memory_stats()["num_ooms"]
        pool.close()
        fresh = ap.Pool(0, backend="sim")
        fresh.free(fresh.malloc(4096))
        fresh.close()
        print(json.dumps({"err": err, "ooms": ooms}))
    """)
    kind, message = out["err"]
    assert kind == "DeviceError", out
    assert "is not a live context" in message, message
    assert out["ooms"] == 0
