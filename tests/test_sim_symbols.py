"""The simulator library exports the ACL runtime API by name (dlsym), the legacy build lacks
exactly the newer symbols (NEWER), and the size parser agrees with its documentation.

These run in the test process: resolving symbols and parsing sizes need no initialised runtime.
"""
import ctypes
import os
import shutil
import subprocess

import pytest

import ascend_pool.sim as sim

ACL = [
    "aclInit", "aclFinalize", "aclFinalizeReference", "aclrtSetDevice", "aclrtGetDevice", "aclrtGetDeviceCount",
    "aclrtResetDevice", "aclrtResetDeviceForce", "aclrtCreateContext", "aclrtSetCurrentContext", "aclrtGetCurrentContext",
    "aclrtDestroyContext", "aclrtMalloc", "aclrtMallocAlign32", "aclrtFree", "aclrtGetMemInfo",
    "aclrtMallocHost", "aclrtFreeHost", "aclrtCreateEvent", "aclrtCreateEventWithFlag", "aclrtCreateEventExWithFlag",
    "aclrtRecordEvent", "aclrtQueryEventStatus", "aclrtQueryEvent", "aclrtSynchronizeEvent",
    "aclrtSynchronizeEventWithTimeout", "aclrtStreamWaitEvent", "aclrtDestroyEvent", "aclrtResetEvent",
    "aclrtCreateStream", "aclrtSynchronizeStream", "aclrtSynchronizeStreamWithTimeout",
    "aclrtSynchronizeDevice", "aclrtSynchronizeDeviceWithTimeout",
    "aclrtDestroyStream", "aclrtDestroyStreamForce", "aclGetRecentErrMsg",
    # virtual memory (vmm.c), in both builds
    "aclrtMemGetAllocationGranularity", "aclrtReserveMemAddress", "aclrtReleaseMemAddress",
    "aclrtMallocPhysical", "aclrtFreePhysical", "aclrtMapMem", "aclrtUnmapMem",
    # sharing between processes (ipc.c), in both builds
    "aclrtIpcMemGetExportKey", "aclrtIpcMemSetImportPid", "aclrtIpcMemImportByKey", "aclrtIpcMemClose",
    # the SoC of the profile (ASCEND_SIM_PROFILE), in both builds
    "aclrtGetSocName",
    "aclrtDeviceGetBareTgid",  # the node-level id importers are listed by (proc.c), in both builds
    # the node's device behind a logical one (ASCEND_RT_VISIBLE_DEVICES), in both builds
    "aclrtGetPhyDevIdByLogicDevId", "aclrtGetLogicDevIdByPhyDevId",
]
NEWER = {"aclrtMallocAlign32", "aclrtQueryEventStatus", "aclrtCreateEventExWithFlag", "aclFinalizeReference",
         "aclrtSynchronizeDeviceWithTimeout"}
CONTROL = [
    "ascendsim_launch_fill", "ascendsim_read", "ascendsim_hang_stream", "ascendsim_release_stream",
    "ascendsim_set_fail_malloc_nth", "ascendsim_set_fail_after_bytes",
    "ascendsim_set_malloc_latency_us", "ascendsim_set_free_latency_us",
    "ascendsim_set_fail_event_create_nth", "ascendsim_set_fail_event_query_nth",
    "ascendsim_reset_faults", "ascendsim_set_poison", "ascendsim_configure",
    "ascendsim_parse_size", "ascendsim_get_stats", "ascendsim_stats_fields",
    "ascendsim_get_ipc_stats", "ascendsim_ipc_export_flag_read_only",
    "ascendsim_stream_device", "ascendsim_profile",
]


def exported(path):
    """Names dlsym() can resolve, by trying each candidate through ctypes."""
    lib = ctypes.CDLL(path)
    return {n for n in ACL + CONTROL if hasattr(lib, n)}


def test_libraries_are_built_where_library_path_says():
    assert os.path.isfile(sim.library_path())
    assert os.path.isfile(sim.library_path(legacy=True))
    assert sim.library_path() != sim.library_path(legacy=True)


def test_every_acl_and_control_symbol_resolves():
    assert exported(sim.library_path()) == set(ACL + CONTROL)


def test_legacy_build_lacks_exactly_the_two_newer_symbols():
    assert set(ACL + CONTROL) - exported(sim.library_path(legacy=True)) == NEWER


@pytest.mark.skipif(not shutil.which("nm"), reason="binutils nm not installed")
def test_nothing_else_is_exported():
    """-fvisibility=hidden: the library's dynamic symbol table holds the API and nothing more."""
    for path, want in [(sim.library_path(), set(ACL + CONTROL)),
                       (sim.library_path(legacy=True), set(ACL + CONTROL) - NEWER)]:
        out = subprocess.run(["nm", "-D", "--defined-only", path], capture_output=True, text=True,
                             check=True).stdout
        names = {line.split()[-1] for line in out.splitlines() if line.strip()}
        names = {n for n in names if not n.startswith("_")}  # _init/_fini and the like
        assert names == want


@pytest.mark.parametrize("text,expected", [
    ("4096", 4096),
    ("64GiB", 64 << 30),
    ("512MiB", 512 << 20),
    ("1.5GB", 1_500_000_000),
    ("1.5GiB", 3 << 29),
    (" 2 k ", 2048),
    ("16g", 16 << 30),
    ("10KB", 10_000),
    ("0.5KiB", 512),
    ("1TiB", 1 << 40),
    ("7B", 7),
    ("0", 0),
])
def test_parse_size_accepts_documented_forms(text, expected):
    assert sim.parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "-1", "1.5.5", "10XB", "GiB", "1 2", "99999999999999999999",
                                  "20000000TiB"])
def test_parse_size_refuses_malformed_text(text):
    with pytest.raises(sim.SimError) as e:
        sim.parse_size(text)
    assert e.value.code == 100000
    assert "not a byte size" in str(e.value)


def test_parse_size_passes_ints_and_refuses_other_types():
    assert sim.parse_size(12345) == 12345
    with pytest.raises(sim.SimError):
        sim.parse_size(-5)
    with pytest.raises(TypeError):
        sim.parse_size(1.5)
