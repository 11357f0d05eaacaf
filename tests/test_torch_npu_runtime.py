"""torch_npu integration that leaves the runtime to the framework (issue 18 points 9-10), with a
fake torch_npu (the real one needs an NPU): install() must not load or initialise the ACL runtime
(torch_npu's own aclInit with its JSON config must come first), and torch.npu.memory_stats() and
its friends must answer from ascend_pool instead of the pluggable allocator's missing hook."""

import sys
import types

import pytest

import ascend_pool as ap
from ascend_pool import backend as ap_backend
from ascend_pool import _core


def _ub(*args, **kwargs):
    raise AssertionError("reached NPUPluggableAllocator::getDeviceStats (undefined behaviour)")


@pytest.fixture
def fake_torch_npu(monkeypatch):
    changed = []
    npu = types.ModuleType("torch_npu.npu")
    memory = types.ModuleType("torch_npu.npu.memory")

    class Pluggable:
        def __init__(self, path, alloc, free):
            self.path = path

        def allocator(self):
            return types.SimpleNamespace(set_init_fn=lambda fn: None, set_reset_fn=lambda fn: None)

    memory.NPUPluggableAllocator = Pluggable
    memory.change_current_allocator = changed.append
    for mod in (memory, npu):
        for name in ("memory_stats", "memory_stats_as_nested_dict", "reset_peak_memory_stats", "reset_accumulated_memory_stats", "_snapshot",
                     "memory_snapshot", "_record_memory_history", "_dump_snapshot", "get_per_process_memory_fraction",
                     "_set_memory_metadata", "_get_memory_metadata", "_set_allocator_settings",
                     "_allocation_traceback"):
            setattr(mod, name, _ub)
    npu.current_device = lambda: 0
    top = types.ModuleType("torch_npu")
    top.npu = npu
    for name, mod in (("torch_npu", top), ("torch_npu.npu", npu), ("torch_npu.npu.memory", memory)):
        monkeypatch.setitem(sys.modules, name, mod)
    if "torch" not in sys.modules:
        monkeypatch.setitem(sys.modules, "torch", types.ModuleType("torch"))
    memory.changed = changed
    return memory


def test_install_leaves_the_runtime_to_torch_npu(fake_torch_npu, monkeypatch):
    from ascend_pool.integrations import torch_npu as ap_npu

    opened = []
    monkeypatch.delenv("ASCEND_POOL_BACKEND", raising=False)
    def open_backend(*args, **kwargs):
        opened.append(args)
        raise AssertionError(f"install() opened the backend {args} (aclInit before torch_npu's own)")

    monkeypatch.setattr(ap_backend, "open_backend", open_backend)
    monkeypatch.setattr(_core, "capi_default_backend", lambda device: None)  # as in a fresh process
    alloc = ap_npu.install()
    assert fake_torch_npu.changed == [alloc]
    assert opened == [], "install() must not load or aclInit the runtime before torch_npu does"
    import os
    assert os.environ["ASCEND_POOL_BACKEND"] == "acl", "the first allocation opens the acl backend"


def test_install_makes_pools_take_the_users_pytorch_npu_alloc_conf(fake_torch_npu, monkeypatch):
    """A torch_npu user who switches to ascend_pool keeps their PYTORCH_NPU_ALLOC_CONF: without
    $ASCEND_POOL_CONF, pools read it (before: silently ignored); $ASCEND_POOL_CONF, when set, wins;
    a mistake in it is a ConfigError that names that variable."""
    from ascend_pool import config
    from ascend_pool.integrations import torch_npu as ap_npu

    monkeypatch.setattr(config, "_framework_vars", [])
    monkeypatch.setattr(_core, "capi_default_backend", lambda device: None)
    monkeypatch.setenv("ASCEND_POOL_BACKEND", "acl")
    monkeypatch.delenv("ASCEND_POOL_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_NPU_ALLOC_CONF", "max_split_size_mb:64,garbage_collection_threshold:0.6")

    def max_split():
        pool = ap.Pool(0, backend="sim")
        try:
            return pool.memory_stats()["max_split_size"]
        finally:
            pool.close()

    assert max_split() == -1  # not installed: the framework's variable is not ours to read
    ap_npu.install(patch_stats=False)
    assert max_split() == 64 << 20
    monkeypatch.setenv("ASCEND_POOL_CONF", "max_split_size_mb:32")
    assert max_split() == 32 << 20
    monkeypatch.setenv("ASCEND_POOL_CONF", " ")  # blank: as unset (a blank framework variable is too)
    assert max_split() == 64 << 20
    monkeypatch.delenv("ASCEND_POOL_CONF")
    monkeypatch.setenv("PYTORCH_NPU_ALLOC_CONF", "max_split_size_mb:1")
    with pytest.raises(ap.ConfigError, match="^PYTORCH_NPU_ALLOC_CONF='max_split_size_mb:1': max_split_size_mb"):
        ap.Pool(0, backend="sim")


def test_torch_npu_memory_functions_answer_from_ascend_pool(fake_torch_npu, tmp_path):
    from ascend_pool.integrations import torch_npu as ap_npu

    npu = sys.modules["torch_npu.npu"]
    done = ap_npu.patch_memory_functions(fake_torch_npu, npu)
    assert done == [list(ap_npu.PATCHED)] * 2
    ptr = ap.malloc(3 << 20, device=0)
    try:
        for mod in (fake_torch_npu, npu):
            fn = mod.memory_stats
            st = fn(0)
            assert st["allocated_bytes.all.current"] == ap.memory_stats(0)["allocated_bytes.all.current"] >= 3 << 20
            assert fn("npu:0")["allocated_bytes.all.current"] == st["allocated_bytes.all.current"]
            assert fn()["allocated_bytes.all.current"] == st["allocated_bytes.all.current"]
            tree = mod.memory_stats_as_nested_dict("npu:0")  # torch_npu's own memory_stats is built on it
            assert tree["allocated_bytes"]["all"]["current"] == st["allocated_bytes.all.current"]
            assert tree["num_ooms"] == st["num_ooms"] and set(tree["allocation"]) == {"all", "small_pool", "large_pool"}
        npu.reset_peak_memory_stats(0)
        assert npu.memory_stats(0)["allocated_bytes.all.peak"] == npu.memory_stats(0)["allocated_bytes.all.current"]
        npu.reset_accumulated_memory_stats(0)
        assert npu.memory_stats(0)["num_ooms"] == 0
        assert any(s["total_size"] >= 3 << 20 for s in npu.memory_snapshot())
        npu._record_memory_history(max_entries=100)
        traced = ap.malloc(1000, device=0)
        assert npu._allocation_traceback(traced)[0]["name"] == "test_torch_npu_memory_functions_answer_from_ascend_pool"
        ap.free(traced, device=0)
        npu._set_memory_metadata("npu-step")  # torch_npu's would tag its own, idle allocator's trace
        ap.free(ap.malloc(1000, device=0), device=0)
        assert npu._get_memory_metadata() == ap.get_memory_metadata() == "npu-step"
        npu._set_memory_metadata("")
        npu._dump_snapshot(str(tmp_path / "s.pickle"))
        assert any(e["action"] == "alloc" and e["size"] == 1000 and e["user_metadata"] == "npu-step"
                   for e in npu._snapshot(0)["device_traces"][0])
        npu._record_memory_history(enabled=None)
    finally:
        ap.set_memory_metadata("")
        ap.free(ptr, device=0)


def test_torch_npu_memory_functions_without_a_device_read_torch_npus_current_device(fake_torch_npu):
    """torch.npu.memory_stats() with no device is torch_npu's current device of the calling thread
    (torch.npu.set_device(1) on a framework thread), whose tensors the C ABI allocates on device 1;
    it read ascend_pool's own current device (ap.set_device, default 0) instead: 0 bytes, and
    device 0's pool opened to read them. "npu" without an index is the same device."""
    import threading
    from ascend_pool.integrations import torch_npu as ap_npu

    npu = sys.modules["torch_npu.npu"]
    local = threading.local()
    npu.current_device = lambda: getattr(local, "device", 0)  # per thread, as torch_npu's
    ap_npu.patch_memory_functions(fake_torch_npu, npu)
    out = {}

    def framework_thread():
        local.device = 1
        ptr = ap.malloc(5 << 20, device=1)
        try:
            out["mine"] = ap.memory_stats(1)["allocated_bytes.all.current"]
            out["none"] = npu.memory_stats()["allocated_bytes.all.current"]
            out["npu"] = fake_torch_npu.memory_stats("npu")["allocated_bytes.all.current"]
            out["nested"] = npu.memory_stats_as_nested_dict()["allocated_bytes"]["all"]["current"]
            npu.reset_peak_memory_stats()
        finally:
            ap.free(ptr, device=1)
        out["peak"] = ap.memory_stats(1)["allocated_bytes.all.peak"]

    t = threading.Thread(target=framework_thread)
    t.start()
    t.join()
    assert out["mine"] >= 5 << 20
    assert (out["none"], out["npu"], out["nested"]) == (out["mine"],) * 3, out
    assert out["peak"] == out["mine"], "reset_peak_memory_stats() reset device 1's peak"


def test_torch_npus_mem_get_info_answers_a_tenants_quota_as_hami_does(fake_torch_npu, tmp_path, monkeypatch):
    # A framework sizes its cache from torch.npu.mem_get_info() (vLLM: gpu_memory_utilization *
    # total): under a tenant's quota it gave the device's figures, so the framework asked for
    # more than the quota and was refused. HAMi's limited cudaMemGetInfo reports the limit.
    from ascend_pool.integrations import torch_npu as ap_npu

    monkeypatch.setenv("ASCEND_POOL_LEDGER_DIR", str(tmp_path))
    npu = sys.modules["torch_npu.npu"]
    runtime = []

    def runtime_mem_get_info(device=None):  # torch_npu's own: aclrtGetMemInfo
        runtime.append(device)
        return 7 << 30, 32 << 30

    fake_torch_npu.mem_get_info = npu.mem_get_info = runtime_mem_get_info
    ap_npu.patch_memory_functions(fake_torch_npu, npu)
    done = ap_npu.patch_memory_functions(fake_torch_npu, npu)  # twice: still torch_npu's function underneath
    ctx = ap.Pool(0, backend="sim").context("kv", quota="64MiB")
    try:
        assert npu.mem_get_info(0) == (7 << 30, 32 << 30) and runtime == [0]  # no context: the runtime's
        ptr = ctx.malloc(10 << 20)
        with ctx:
            for mod in (fake_torch_npu, npu):
                assert mod.mem_get_info() == mod.mem_get_info("npu:0") == ctx.mem_get_info()
                free, total = mod.mem_get_info(0)
                assert total == 64 << 20 and free == total - ctx.held  # before: 7 GiB of 32
        assert runtime == [0]
        ctx.free(ptr)
        ctx.set_quota(None)
        with ctx:
            assert npu.mem_get_info(0) == (7 << 30, 32 << 30)  # no quota: the runtime's, as torch_npu's
        assert all("mem_get_info" in names for names in done)
    finally:
        ctx.close()


def test_torch_npus_device_properties_say_a_tenants_quota_as_its_mem_get_info(fake_torch_npu, tmp_path, monkeypatch):
    # torch.npu.get_device_properties(d).total_memory gave the device's memory under a tenant's
    # quota where torch.npu.mem_get_info() gave the quota: a framework sizing from total_memory
    # (DeepSpeed's accelerator total_memory(), Megatron's) asked for the device. HAMi's limited
    # cuDeviceTotalMem reports the limit there too.
    from ascend_pool.integrations import torch_npu as ap_npu

    monkeypatch.setenv("ASCEND_POOL_LEDGER_DIR", str(tmp_path))
    npu = sys.modules["torch_npu.npu"]

    class Props:  # torch_npu's _NPUDeviceProperties: read-only attributes
        name, total_memory = "Ascend910B", 32 << 30

        def __repr__(self):
            return f"_NPUDeviceProperties(name='{self.name}', total_memory={self.total_memory // (1 << 20)}MB)"

    npu.get_device_properties = lambda device_name=None: Props()
    npu.mem_get_info = lambda device=None: (7 << 30, 32 << 30)
    ap_npu.patch_memory_functions(fake_torch_npu, npu)
    ap_npu.patch_memory_functions(fake_torch_npu, npu)  # twice: still torch_npu's function underneath
    ctx = ap.Pool(0, backend="sim").context("kv-props", quota="64MiB")
    try:
        assert npu.get_device_properties(0).total_memory == 32 << 30  # no context: the device's
        with ctx:
            props = npu.get_device_properties()
            assert props.total_memory == npu.get_device_properties("npu:0").total_memory == 64 << 20
            assert props.total_memory == npu.mem_get_info(0)[1] and props.name == "Ascend910B"
            assert repr(props) == "_NPUDeviceProperties(name='Ascend910B', total_memory=64MB)"
        ctx.set_quota(None)
        with ctx:
            assert npu.get_device_properties(0).total_memory == 32 << 30  # no quota: the device's
    finally:
        ctx.close()


DEVICE_PROPERTIES_CHILD = r"""
import sys, types
npu = types.ModuleType("torch_npu.npu"); memory = types.ModuleType("torch_npu.npu.memory")
top = types.ModuleType("torch_npu"); top.npu = npu
npu.current_device = lambda: 0
class Props:
    name, total_memory = "Ascend910B", 64 << 30  # the simulated device's
npu.get_device_properties = lambda device_name=None: Props()
npu.mem_get_info = lambda device=None: (7 << 30, 64 << 30)
sys.modules.update({"torch_npu": top, "torch_npu.npu": npu, "torch_npu.npu.memory": memory})
sys.modules.setdefault("torch", types.ModuleType("torch"))
from ascend_pool import api
from ascend_pool.integrations import torch_npu as ap_npu
ap_npu.patch_memory_functions(memory, npu)
first = npu.get_device_properties(0).total_memory
print(first, api.open_pool(0) is not None, npu.mem_get_info(0)[1], npu.get_device_properties(0).total_memory)
"""


@pytest.mark.parametrize("quota, expected", [('"64MiB"', 64 << 20), ('"25%"', 16 << 30), (None, 64 << 30)])
def test_torch_npus_device_properties_say_the_tenants_quota_before_its_pool_opens(tmp_path, quota, expected):
    # Under $ASCEND_POOL_TENANT, get_device_properties(d).total_memory said the device's memory
    # until the first allocation opened the tenant's default context, where mem_get_info() said
    # the quota from its first call: a framework reading total_memory at start-up (DeepSpeed's
    # accelerator total_memory()) sized itself from the device. The operator's file gives the
    # quota without opening anything (a percentage of the device's total_memory).
    import os
    import subprocess

    conf = tmp_path / "tenants.toml"
    conf.write_text("[tenants.kv]\n" + (f"quota = {quota}\n" if quota else "warn = 0.9\n"))
    env = dict(os.environ, ASCEND_POOL_TENANT="kv", ASCEND_POOL_CONFIG=str(conf), ASCEND_POOL_LEDGER_DIR=str(tmp_path),
               ASCEND_POOL_BACKEND="sim", PYTHONPATH=os.path.dirname(os.path.dirname(ap.__file__)))
    out = subprocess.run([sys.executable, "-c", DEVICE_PROPERTIES_CHILD], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    first, opened, info, after = out.stdout.split()
    assert opened == "False"  # read without opening the device's pool
    assert int(first) == int(after) == expected
    if quota:
        assert int(info) == expected


def test_torch_npus_set_allocator_settings_reaches_the_pools(fake_torch_npu):
    # torch.npu.memory._set_allocator_settings re-read torch_npu's own allocator's config, which
    # serves nothing under the pluggable allocator: vLLM's and torch's runtime settings were lost
    from ascend_pool import config
    from ascend_pool.integrations import torch_npu as ap_npu

    saved = config._runtime
    ap_npu.patch_memory_functions(fake_torch_npu)
    try:
        fake_torch_npu._set_allocator_settings("max_split_size_mb:64,garbage_collection_threshold:0.6")
        settings = ap.default_pool(0).snapshot()["allocator_settings"]
        assert settings["max_split_size"] == 64 << 20 and settings["garbage_collection_threshold"] == 0.6
        with pytest.raises(ap.ConfigError, match="expandable_segments"):
            fake_torch_npu._set_allocator_settings("expandable_segments:True")
    finally:
        ap.set_allocator_settings("")
        config._runtime = saved


def test_torch_npus_snapshot_covers_the_process_as_torchs(fake_torch_npu, tmp_path):
    # torch's _snapshot(device) is the whole process's (_cuda_memorySnapshot(None)), what
    # _dump_snapshot pickles: a pool used through use_mem_pool (torch_npu's test_pool_id_in_snapshot)
    # or a tenant context was missing from the patched one, which read one default pool
    import pickle
    from ascend_pool.integrations import torch_npu as ap_npu

    npu = sys.modules["torch_npu.npu"]
    npu.is_initialized = lambda: True
    ap_npu.patch_memory_functions(fake_torch_npu, npu)
    pool = ap.Pool(0)
    try:
        npu._record_memory_history("all")
        with ap.use_mem_pool(pool):
            x = ap.malloc(64, device=0)
        ss = npu._snapshot()
        assert any(seg["segment_pool_id"] == pool.id for seg in ss["segments"]), "no segment tagged with pool.id"
        assert any(te["pool_id"] == pool.id and te["action"] == "alloc" for tr in ss["device_traces"] for te in tr)
        npu._dump_snapshot(str(tmp_path / "s.pickle"))
        dumped = pickle.loads((tmp_path / "s.pickle").read_bytes())
        assert [s["address"] for s in npu._snapshot(0)["segments"]] == [s["address"] for s in dumped["segments"]]
        with pytest.raises(ValueError):
            npu._snapshot("cpu")
        ap.free(x, device=0)
    finally:
        npu._record_memory_history(None)
        pool.close()


def test_stats_before_torch_npu_starts_open_no_pool(fake_torch_npu, monkeypatch, tmp_path):
    """torch.npu.memory_stats(0) (or memory_allocated(0), reset_peak_memory_stats(0) ...) called
    before torch_npu's lazy init must not open device 0's pool: that opens the runtime with
    aclInit(NULL), and torch_npu's own aclInit(acl.json) then fails with 100002, its
    configuration dropped (before: it did). With no pool open they answer {}, as torch_npu does
    then; a pool the program opened already is read (not hidden behind {}); once torch_npu has
    started, they answer from ascend_pool's default pools, a device never served with an empty
    pool's zeros, its pool not opened (before, the test asserted that it was: api.default_pool
    called)."""
    from ascend_pool import api, registry
    from ascend_pool.integrations import torch_npu as ap_npu

    npu = sys.modules["torch_npu.npu"]
    started = []
    npu.is_initialized = lambda: bool(started)
    ap_npu.patch_memory_functions(fake_torch_npu, npu)
    leftover = registry.default_pool(0)                # another test's: this one starts with none
    if leftover is not None:
        leftover.close()
    opened = []
    real_default_pool = api.default_pool
    monkeypatch.setattr(api, "default_pool", lambda device=None: opened.append(device) or real_default_pool(device))
    assert npu.memory_stats(0) == {} and npu.memory_stats_as_nested_dict("npu:0") == {}
    npu.reset_peak_memory_stats(0)
    npu.reset_accumulated_memory_stats(0)
    npu._snapshot(0)
    npu.memory_snapshot()
    npu._dump_snapshot(str(tmp_path / "before.pickle"))
    assert opened == [], f"a stats call before torch_npu's init opened the pools of {opened}"
    pool = ap.Pool(0, backend="sim")                   # the program's own pool, before torch_npu starts
    registry.set_default_pool(0, pool)
    ptr = pool.malloc(3 << 20)
    try:
        assert npu.memory_stats(0)["allocated_bytes.all.current"] == pool.memory_stats()["allocated_bytes.all.current"]
        assert npu.memory_stats_as_nested_dict(0)["allocated_bytes"]["all"]["current"] >= 3 << 20
        assert opened == []
        started.append(True)                           # torch_npu's lazy init has run
        st = npu.memory_stats(0)
        assert st["allocated_bytes.all.current"] == ap.memory_stats(0)["allocated_bytes.all.current"] >= 3 << 20
        # a device never served answers an empty pool's zeros, as torch_npu's allocator, and is
        # not opened for it (before: its default pool was made, a context on that NPU)
        never = next(d for d in range(pool.backend.device_count) if api.open_pool(d) is None)
        assert npu.memory_stats(never)["allocated_bytes.all.current"] == 0
        assert npu.memory_stats_as_nested_dict(never)["reserved_bytes"]["all"]["current"] == 0
        npu.reset_peak_memory_stats(never)
        assert opened == [] and registry.default_pool(never) is None
    finally:
        pool.free(ptr)
        pool.close()


def test_init_hook_doc_says_frameworks_pass_the_device_count():
    from pathlib import Path

    header = (Path(ap.__file__).parent / "include" / "ascend_pool.h").read_text()
    init_doc = header[header.index("/* Prepares the C ABI."):header.index("void ascend_pool_init(int device);")]
    assert "torch_npu passes its current device" not in init_doc
    assert "device count" in init_doc and "torch_npu" in init_doc


def test_patched_functions_refuse_other_device_types_as_torch(request):
    from ascend_pool.integrations import torch_npu as ap_npu

    torch = pytest.importorskip("torch")  # the real one (CPU build), before the fixture stands in for it
    fake_torch_npu = request.getfixturevalue("fake_torch_npu")
    npu = sys.modules["torch_npu.npu"]
    ap_npu.patch_memory_functions(fake_torch_npu, npu)
    for bad in (torch.device("cpu"), "cpu", "cuda:0", torch.device("meta"), 0.5):
        with pytest.raises(ValueError):
            npu.memory_stats(bad)
        with pytest.raises(ValueError):
            npu.reset_peak_memory_stats(bad)
    with pytest.raises(ap.InvalidDeviceError, match="npu device"):
        npu.memory_stats(torch.device("cpu"))
    stand_in = types.SimpleNamespace(type="npu", index=0)  # torch.device("npu", 0) without torch_npu
    assert npu.memory_stats(stand_in)["allocated_bytes.all.current"] == ap.memory_stats(0)["allocated_bytes.all.current"]


def _alloc_here(n):
    return ap.malloc(n, device=0)


def test_record_memory_history_takes_torchs_signatures(fake_torch_npu):
    from ascend_pool.integrations import torch_npu as ap_npu

    npu = sys.modules["torch_npu.npu"]
    ap_npu.patch_memory_functions(fake_torch_npu, npu)
    try:
        npu._record_memory_history("all", max_entries=sys.maxsize)  # torch's default: clamped, not a MemoryError
        ap.free(_alloc_here(1000), device=0)
        trace = npu._snapshot(0)["device_traces"][0]
        assert [e["size"] for e in trace if e["action"] == "alloc"] == [1000]
        npu._record_memory_history(None)
        assert npu._snapshot(0)["device_traces"][0] == []

        # torch's legacy form: a bool first, trace_alloc_* keywords
        npu._record_memory_history(True, trace_alloc_max_entries=4, trace_alloc_record_context=True,
                                   record_context_cpp=False)
        for _ in range(5):
            ap.free(_alloc_here(512), device=0)
        trace = npu._snapshot(0)["device_traces"][0]
        assert len(trace) == 4, "trace_alloc_max_entries bounds the ring"
        allocs = [e for e in trace if e["action"] == "alloc"]
        assert allocs and all(any(f["name"] == "_alloc_here" for f in e["frames"]) for e in allocs)
        npu._record_memory_history(False)
        assert npu._snapshot(0)["device_traces"][0] == []

        npu._record_memory_history("all", context=None)  # no tracebacks
        ap.free(_alloc_here(2048), device=0)
        assert all(e["frames"] == [] for e in npu._snapshot(0)["device_traces"][0])
        with pytest.raises(ap.ConfigError, match="enabled"):
            npu._record_memory_history("everything")

        # torch >= 2.6's skip_actions, in both forms
        npu._record_memory_history("all", skip_actions=["free_requested", "free_completed"])
        ap.free(_alloc_here(3000), device=0)
        assert [e["action"] for e in npu._snapshot(0)["device_traces"][0]][-1] == "alloc"
        npu._record_memory_history(True, trace_alloc_max_entries=50, skip_actions=["alloc"])
        ap.free(_alloc_here(3000), device=0)
        assert [e["action"] for e in npu._snapshot(0)["device_traces"][0]][-2:] == ["free_requested", "free_completed"]
        # this call's alloc was skipped; the earlier events stay (a new max_entries only resizes
        # torch's ring), each _snapshot above filed its own "snapshot" event after its trace
        actions = [e["action"] for e in npu._snapshot(0)["device_traces"][0]]
        assert actions[-4:] == ["snapshot", "free_requested", "free_completed", "snapshot"]
        npu._record_memory_history(None)

        ap.record_memory_history(True, max_entries=sys.maxsize)  # the module-level call clamps too
        ap.free(_alloc_here(4096), device=0)
        assert any(e["size"] == 4096 for e in ap.snapshot(0)["device_traces"][0])
    finally:
        ap.record_memory_history(enabled=None)


def test_torch_accelerator_memory_functions_answer_from_ascend_pool_when_the_npu_is_current(monkeypatch):
    # torch >= 2.9: torch.accelerator.memory_stats reaches the current accelerator's allocator in
    # C (for torch_npu the pluggable allocator's missing stats hook); memory_allocated & co. read it.
    import importlib

    import torch  # the test extras pin torch 2.13, which has torch.accelerator.memory_stats
    from ascend_pool.integrations import torch_npu as ap_npu

    acc = torch.accelerator
    memory = importlib.import_module("torch.accelerator.memory")
    for mod in (acc, memory):  # restored after the test
        for name in ap_npu.ACCELERATOR_PATCHED + ("get_memory_info",):
            monkeypatch.setattr(mod, name, getattr(mod, name))
    before = acc.memory_stats
    if getattr(acc.current_accelerator(), "type", None) != "npu":
        assert ap_npu.patch_accelerator(torch) == [], "another accelerator's functions are left alone"
        assert acc.memory_stats is before
    monkeypatch.setattr(acc, "current_accelerator", lambda *a, **k: types.SimpleNamespace(type="npu", index=0))
    monkeypatch.setitem(sys.modules, "torch_npu", types.SimpleNamespace(npu=types.SimpleNamespace(current_device=lambda: 0)))
    assert ap_npu.patch_accelerator(torch) == list(ap_npu.ACCELERATOR_PATCHED) + ["get_memory_info"]
    ptr = ap.malloc(5 << 20, device=0)
    try:
        mine = ap.memory_stats(0)
        assert acc.memory_stats(0)["allocated_bytes.all.current"] == mine["allocated_bytes.all.current"] >= 5 << 20
        assert acc.memory_allocated(0) == mine["allocated_bytes.all.current"]
        assert acc.memory_allocated() == mine["allocated_bytes.all.current"]  # the current device
        assert acc.memory_reserved("npu:0") == mine["reserved_bytes.all.current"]
        acc.reset_peak_memory_stats(0)
        assert acc.max_memory_allocated(0) == acc.memory_allocated(0)
        acc.reset_accumulated_memory_stats(0)
        assert acc.memory_stats(0)["allocation.all.allocated"] == 0
        with pytest.raises(ValueError):
            acc.memory_stats("cpu")
    finally:
        ap.free(ptr, device=0)


def test_torch_accelerators_get_memory_info_answers_a_tenants_quota_when_the_npu_is_current(monkeypatch, tmp_path):
    # torch >= 2.10's torch.accelerator.get_memory_info is mem_get_info for the current
    # accelerator: under a tenant's quota it gave the device's figures (HAMi's: the limit)
    import importlib

    import torch
    from ascend_pool.integrations import torch_npu as ap_npu

    acc = torch.accelerator
    memory = importlib.import_module("torch.accelerator.memory")
    for mod in (acc, memory):  # restored after the test
        for name in ap_npu.ACCELERATOR_PATCHED + ("get_memory_info",):
            monkeypatch.setattr(mod, name, getattr(mod, name))
    monkeypatch.setenv("ASCEND_POOL_LEDGER_DIR", str(tmp_path))
    runtime = lambda device_index=None: (7 << 30, 32 << 30)  # noqa: E731  torch_npu's: aclrtGetMemInfo
    monkeypatch.setattr(memory, "get_memory_info", runtime)
    monkeypatch.setattr(acc, "get_memory_info", runtime)
    monkeypatch.setattr(acc, "current_accelerator", lambda *a, **k: types.SimpleNamespace(type="npu", index=0))
    monkeypatch.setitem(sys.modules, "torch_npu", types.SimpleNamespace(npu=types.SimpleNamespace(current_device=lambda: 0)))
    ap_npu.patch_accelerator(torch)
    ctx = ap.Pool(0, backend="sim").context("kv-acc", quota="64MiB")
    try:
        assert acc.get_memory_info(0) == (7 << 30, 32 << 30)  # no context: the runtime's
        ptr = ctx.malloc(10 << 20)
        with ctx:
            for fn in (acc.get_memory_info, memory.get_memory_info):
                assert fn(0) == fn() == ctx.mem_get_info() and fn(0)[1] == 64 << 20  # before: 32 GiB
        ctx.free(ptr)
    finally:
        ctx.close()


def test_snapshot_functions_take_torchs_arguments(fake_torch_npu, tmp_path, monkeypatch):
    # torch's memory_snapshot(mempool_id=None, include_traces=True), _snapshot(device=None,
    # augment_with_fx_traces=False) and _dump_snapshot(filename, augment_with_fx_traces=False),
    # which torch.accelerator.memory.snapshot(device, augment_with_fx_traces=...) passes on to
    # the device module: the patched ones took fewer arguments and raised TypeError
    import pickle
    import warnings
    from ascend_pool.integrations import torch_npu as ap_npu

    npu = sys.modules["torch_npu.npu"]
    npu.is_initialized = lambda: True
    monkeypatch.setattr(ap_npu, "_fx_warned", [])
    ap_npu.patch_memory_functions(fake_torch_npu, npu)
    ctx = ap.default_pool(0).context("torch-mempool")
    try:
        with ctx:
            ptr = ap.malloc(1 << 20, device=0)
        mine = npu.memory_snapshot(mempool_id=ctx.pool_id, include_traces=False)
        assert mine and all(s["segment_pool_id"] == ctx.pool_id for s in mine)
        assert len(npu.memory_snapshot(ctx.pool_id)) == len(mine) <= len(npu.memory_snapshot())
        with pytest.raises(ap.ConfigError, match="mempool_id"):
            npu.memory_snapshot(mempool_id="mine")
        assert "segments" in npu._snapshot(0, augment_with_fx_traces=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert "segments" in fake_torch_npu._snapshot("npu:0", augment_with_fx_traces=True)
            npu._dump_snapshot(str(tmp_path / "s.pickle"), augment_with_fx_traces=True)
        assert [str(w.message).count("FX") for w in caught] == [1], "one warning, once"
        assert any(s["segment_pool_id"] == ctx.pool_id for s in pickle.loads((tmp_path / "s.pickle").read_bytes())["segments"])
        ap.free(ptr, device=0)
    finally:
        ctx.close()


def test_get_per_process_memory_fraction_reads_the_cap_the_hook_set(fake_torch_npu):
    # newer torch_npu's get_per_process_memory_fraction asks its C++ allocator, which under the
    # pluggable one never saw the cap set_per_process_memory_fraction handed to the pool's hook
    import ctypes
    from ascend_pool.integrations import torch_npu as ap_npu

    npu = sys.modules["torch_npu.npu"]
    npu.is_initialized = lambda: True
    ap_npu.patch_memory_functions(fake_torch_npu, npu)
    lib = ctypes.CDLL(ap.library_path())
    lib.ascend_pool_set_memory_fraction.argtypes = [ctypes.c_double, ctypes.c_int]
    try:
        lib.ascend_pool_set_memory_fraction(0.25, 0)   # what torch_npu's setter reaches
        assert npu.get_per_process_memory_fraction(0) == 0.25
        assert fake_torch_npu.get_per_process_memory_fraction("npu:0") == 0.25
        lib.ascend_pool_set_memory_fraction(1.0, 0)
        assert npu.get_per_process_memory_fraction() == 1.0
    finally:
        ap.default_pool(0).set_limit(None)


@pytest.mark.parametrize("value,said", [("1", True), ("True", True), ("0", False), ("", False)])
def test_a_users_no_caching_switch_is_said_to_have_no_effect(fake_torch_npu, monkeypatch, caplog, value, said):
    # torch_npu's PYTORCH_NO_NPU_MEMORY_CACHING=1 turns its own caching allocator off, which the
    # pluggable one replaces: ascend_pool caches all the same, and the user debugging with the
    # switch was not told (the allocator swap dropped it silently)
    import logging
    from ascend_pool import config
    from ascend_pool.integrations import torch_npu as ap_npu

    monkeypatch.setattr(config, "_framework_vars", [])
    monkeypatch.setattr(_core, "capi_default_backend", lambda device: None)
    monkeypatch.setenv("ASCEND_POOL_BACKEND", "acl")
    monkeypatch.setenv("PYTORCH_NO_NPU_MEMORY_CACHING", value)
    with caplog.at_level(logging.WARNING, logger="ascend_pool"):
        ap_npu.install(patch_stats=False)
    told = [r.getMessage() for r in caplog.records if "PYTORCH_NO_NPU_MEMORY_CACHING" in r.getMessage()]
    assert bool(told) == said, told
    if said:
        assert "still caches" in told[0] and "empty_cache" in told[0]
