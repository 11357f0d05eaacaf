"""The simulator's profiles (ASCEND_SIM_PROFILE, docs/cann-rules.md): each enforces the documented
rules of one CANN generation or SoC with the runtime's codes, and the pool follows the rules on
every profile. The whole suite runs under the default, strict; here a representative workload of
the pool (stream-ordered reuse, cross-stream frees, expandable segments, device references) runs
once per profile, each in its own process (the profile is read at aclInit).
"""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from sim_fixtures import sim_node  # noqa: E402,F401  (fixture)

PROFILES = ["strict", "cann8.0", "cann8.2", "cann8.3", "310p", "950"]
SOC = {"strict": "Ascend910B1", "cann8.0": "Ascend910B1", "cann8.2": "Ascend910B1", "cann8.3": "Ascend910B1",
       "310p": "Ascend310P3", "950": "Ascend950PR"}


@pytest.mark.parametrize("profile", PROFILES)
def test_pool_workload_under_each_profile(sim_node, profile):  # noqa: F811
    out = sim_node.run_json("""
        import ascend_pool as ap
        MiB = 1 << 20
        p = ap.Pool(0, backend="sim")
        refs0 = sim.stats(0)["device_refs"]
        s1, s2 = p.create_stream(), p.create_stream()
        blocks = []
        for i in range(200):                       # cross-stream frees: events each time
            a = p.malloc(4096 + i, stream=s1)
            sim.launch_fill(s1, a, 4096, 7)
            p.record_stream(a, s2)
            p.free(a, stream=s1)
            blocks.append(p.malloc(MiB, stream=s2))
        for b in blocks:
            p.free(b, stream=s2)
        p.synchronize(s1); p.synchronize(s2)
        p.empty_cache()
        assert p.memory_stats()["allocated_bytes.all.current"] == 0
        p.destroy_stream(s1); p.destroy_stream(s2)
        e = ap.Pool(0, backend="sim", expandable_segments=True)
        x = e.malloc(3 * MiB); y = e.malloc(5 * MiB)
        e.free(x); e.free(y); e.empty_cache()
        e.close()
        p.close()
        lib.ascendsim_profile.restype = lib.aclrtGetSocName.restype = C.c_char_p
        print(json.dumps({"profile": lib.ascendsim_profile().decode(),
                          "soc": lib.aclrtGetSocName().decode(),
                          "soc_backend": ap.Pool(0, backend="sim").backend.soc_name,
                          "refs_in_use": refs0, "refs_after": sim.stats(0)["device_refs"],
                          "held": sim.stats(0)["bytes_held"]}))
    """, ASCEND_SIM_PROFILE=profile)
    assert out["profile"] == profile
    assert out["soc"] == out["soc_backend"] == SOC[profile]
    assert out["refs_in_use"] >= 1 and out["refs_after"] == out["refs_in_use"] - 1
    assert out["held"] == 0


def test_unknown_profile_fails_init_naming_the_variable(sim_node):  # noqa: F811
    sim_node.run("""
        rc = code("aclInit", None)
        assert rc == 100000, rc
        assert "ASCEND_SIM_PROFILE='cann7'" in errmsg(), errmsg()
    """, ASCEND_SIM_PROFILE="cann7")


VMM = """
    init(0)
    MiB = 1 << 20
    class Prop(C.Structure):
        _fields_ = [("handleType", C.c_int), ("allocationType", C.c_int), ("memAttr", C.c_int),
                    ("id", C.c_uint32), ("type", C.c_int), ("reserve", C.c_uint64)]
    for n, a in {"aclrtReserveMemAddress": [C.POINTER(C.c_void_p), C.c_size_t, C.c_size_t, C.c_void_p, C.c_uint64],
                 "aclrtMallocPhysical": [C.POINTER(C.c_void_p), C.c_size_t, C.c_void_p, C.c_uint64],
                 "aclrtMapMem": [C.c_void_p, C.c_size_t, C.c_size_t, C.c_void_p, C.c_uint64],
                 "aclrtUnmapMem": [C.c_void_p], "aclrtFreePhysical": [C.c_void_p],
                 "aclrtReleaseMemAddress": [C.c_void_p]}.items():
        getattr(lib, n).argtypes = a
    def reserve(flags):
        va = C.c_void_p(); ok("aclrtReserveMemAddress", C.byref(va), 2 * MiB, 0, None, flags)
        return va.value
    def physical(attr):
        h = C.c_void_p(); ok("aclrtMallocPhysical", C.byref(h), 2 * MiB, C.byref(Prop(0, 0, attr, 0, 1, 0)), 0)
        return h.value
    HUGE, NORMAL = 4, 5   # ACL_HBM_MEM_HUGE, ACL_HBM_MEM_NORMAL
    results = {}
    for flags, attr in [(0, HUGE), (1, HUGE), (0, NORMAL), (1, NORMAL)]:
        va, h = reserve(flags), physical(attr)
        rc = code("aclrtMapMem", va, 2 * MiB, 0, h, 0)
        results[f"{flags},{attr}"] = [rc, errmsg() if rc else ""]
        if rc == 0:
            ok("aclrtUnmapMem", va)
        ok("aclrtFreePhysical", h); ok("aclrtReleaseMemAddress", va)
    import ascend_pool as ap
    e = ap.Pool(0, backend="sim", expandable_segments=True)
    x = e.malloc(6 * MiB)
    sim.launch_fill(None, x, 6 * MiB, 5); ok("aclrtSynchronizeStream", None)
    assert sim.read(x + 6 * MiB - 4, 4) == b"\\x05" * 4
    e.free(x); e.close()
    print(json.dumps(results))
"""


def test_cann80_reserve_flags_must_match_the_page_type(sim_node):  # noqa: F811
    # CANN 8.0.0, aclrtReserveMemAddress: "the flag must be the same as the memory type of
    # aclrtMallocPhysical" (0 normal, 1 huge pages). docs/cann-rules.md R1 cites the code.
    out = sim_node.run_json(VMM, ASCEND_SIM_PROFILE="cann8.0")
    assert out["0,4"][0] == 107000 and "flags" in out["0,4"][1] and "cann8.0" in out["0,4"][1]
    assert out["1,5"][0] == 107000
    assert out["1,4"][0] == 0 and out["0,5"][0] == 0


def test_current_cann_accepts_either_reserve_flag(sim_node):  # noqa: F811
    out = sim_node.run_json(VMM, ASCEND_SIM_PROFILE="cann8.3")
    assert {k: v[0] for k, v in out.items()} == {"0,4": 0, "1,4": 0, "0,5": 0, "1,5": 0}


@pytest.mark.parametrize("profile,pad", [("strict", 32), ("310p", 32), ("950", 0)])
def test_malloc_padding_per_soc(sim_node, profile, pad):  # noqa: F811
    # aclrtMalloc rounds to 32 bytes and adds 32, except on Ascend 950 and for 1 GiB pages;
    # aclrtMallocAlign32 only rounds. The backend's fallback to aclrtMalloc (the legacy build)
    # accounts what the SoC really takes.
    out = sim_node.run_json("""
        init(0)
        p = malloc(100); held = sim.stats(0)["bytes_held"]; free(p)
        q = malloc(100, policy=6); held1g = sim.stats(0)["bytes_held"]; free(q)
        from ascend_pool._core import Backend
        b = Backend("sim", sim.library_path(legacy=True))
        print(json.dumps({"held": held, "held1g": held1g, "backend": b.device_size(100),
                          "soc": b.soc_name}))
    """, ASCEND_SIM_PROFILE=profile, SIM_LIB=None)
    assert out["held"] == 128 + pad
    assert out["held1g"] == 128
    assert out["backend"] == 128 + pad and out["soc"] == SOC[profile]


@pytest.mark.parametrize("profile", ["strict", "310p", "950"])
def test_a_segment_takes_whole_huge_pages_and_no_more_without_malloc_align32(sim_node, profile):  # noqa: F811
    # Huge pages are taken whole (aclrtMemAttr: ACL_HBM_MEM_HUGE's granularity is 2 MiB), so the
    # fallback's aclrtMalloc(2 MiB) took 2 MiB + 32 bytes of padding, 4 MiB of the device, for each
    # small segment (a 20 MiB one took 22 MiB). The backend asks 32 bytes less for a whole number
    # of pages: the padded total is the segment. The legacy build lacks aclrtMallocAlign32.
    out = sim_node.run_json("""
        import ascend_pool as ap
        p = ap.Pool(0, backend="sim")
        assert not p.backend.has_malloc_align32
        a = p.malloc(512)                          # a small segment: 2 MiB
        small = [sim.stats(0)["bytes_held"], p.memory_stats()["reserved_bytes.all.current"]]
        b = p.malloc(5 << 20)                      # a large one: 20 MiB
        large = sim.stats(0)["bytes_held"] - small[0]
        for seg in p.snapshot()["segments"]:      # each segment's last bytes are the device's
            sim.launch_fill(None, seg["address"] + seg["total_size"] - 64, 64, 7)
        p.synchronize()
        p.free(a); p.free(b); p.empty_cache()
        print(json.dumps({"small": small, "large": large, "end": sim.stats(0)["bytes_held"]}))
        p.close()
    """, ASCEND_SIM_PROFILE=profile, SIM_LIB=_legacy_lib())
    MiB = 1 << 20
    assert out == {"small": [2 * MiB, 2 * MiB], "large": 20 * MiB, "end": 0}, out


def _legacy_lib():
    from ascend_pool.backend import sim_library_path
    return sim_library_path(legacy=True)


@pytest.mark.parametrize("profile,soc,pad", [
    ("950", "Ascend950PR_9599", 0), ("950", "Ascend910_9599", 0), ("950", "Ascend910_957b", 0),
    ("950", "Ascend910_950z", 0), ("strict", "Ascend910_9391", 32), ("310p", "Ascend310P1", 32)])
def test_the_backend_knows_a_socs_padding_by_each_of_its_names(sim_node, profile, soc, pad):  # noqa: F811
    # One SoC has several names across CANN versions: an Ascend 950 answers aclrtGetSocName with
    # "Ascend910_95xx" in the versions that named it after the 910 (HCCL's SOC_VER_CONVERT maps
    # Ascend910_9591/9599/9589/958a/958b/957b/957d/950z to DEV_TYPE_950), "Ascend950PR_95xx" in
    # later ones; an Atlas A3 is "Ascend910_93xx". ASCEND_SIM_SOC_NAME makes the simulator answer it.
    out = sim_node.run_json("""
        init(0)
        p = malloc(100); held = sim.stats(0)["bytes_held"]; free(p)
        from ascend_pool._core import Backend
        b = Backend("sim", sim.library_path(legacy=True))
        print(json.dumps({"held": held, "backend": b.device_size(100), "soc": b.soc_name}))
    """, ASCEND_SIM_PROFILE=profile, ASCEND_SIM_SOC_NAME=soc, SIM_LIB=None)
    assert out["soc"] == soc
    assert out["held"] == 128 + pad
    assert out["backend"] == 128 + pad


@pytest.mark.parametrize("name", ["Ascend 950", "A" * 32, "Ascend/950"])
def test_simulator_refuses_a_soc_name_that_is_no_name(sim_node, name):  # noqa: F811
    sim_node.run("""
        rc = code("aclInit", None)
        assert rc == 100000, rc
        assert "ASCEND_SIM_SOC_NAME=" in errmsg(), errmsg()
    """, ASCEND_SIM_SOC_NAME=name)


@pytest.mark.parametrize("profile", ["strict", "310p"])
def test_mem_info_answers_the_devices_memory_type(sim_node, profile):  # noqa: F811
    # CANN's aclrtGetMemInfo page: an attribute the hardware lacks answers 0 of 0; Atlas inference
    # (310P) and 200I/500 A2 devices have DDR and no HBM, and convert an HBM query to the DDR one.
    out = sim_node.run_json("""
        init(0)
        p = malloc(4 << 20)
        print(json.dumps({a: list(meminfo(a)) for a in (0, 1, 2, 4)}))
        free(p)
    """, ASCEND_SIM_PROFILE=profile)
    hbm = out["1"]
    assert hbm[1] > 0 and hbm[0] <= hbm[1] - (4 << 20)
    assert out["4"] == hbm
    if profile == "310p":
        assert out["0"] == out["2"] == hbm
    else:
        assert out["0"] == out["2"] == [0, 0]
