"""The pool on a real NVIDIA GPU (cuda backend): what the simulator cannot show.

Runs only where a CUDA device answers (the device machine: `scripts/gpu_session.sh`); elsewhere
every test skips with the runtime's own reason. Each test checks device memory contents written
by real kernels on real streams, so a missing stream wait, a block handed out while a kernel still
writes it, or a mapping that loses data on growth shows up as wrong bytes:

- a block freed on stream 1 while a kernel on stream 1 still writes it, then requested on
  stream 2, must not be overwritten by that late kernel (stream-ordered reuse);
- record_stream: a block used by a second stream is not reused before that stream is done;
- expandable segments (CUDA virtual memory): data survives the growth of its segment, and
  empty_cache returns the memory to the driver;
- sharing: a block exported with CUDA IPC is read by another process.
"""

import os
import pickle
import subprocess
import sys

import pytest

MiB = 1 << 20
N = 8 * MiB
SLEEP_CYCLES = 400_000_000  # ~0.2 s at H200 clocks: long enough for the host to race ahead


@pytest.fixture(scope="module")
def gpu():
    """(ascend_pool, torch, cupy) with a CUDA device, or a skip naming what is missing."""
    import ascend_pool as ap
    from ascend_pool._core import Backend
    from ascend_pool.errors import BackendUnavailableError

    try:
        Backend("cuda")
    except BackendUnavailableError as exc:
        pytest.skip(reason=f"no usable CUDA device here: {str(exc).splitlines()[0]}")
    torch = pytest.importorskip("torch")
    cupy = pytest.importorskip("cupy")
    if not torch.cuda.is_available():
        pytest.skip(reason="torch sees no CUDA device")
    return ap, torch, cupy


def _view(cupy, ptr, nbytes):
    """A cupy uint8 array over device memory the pool owns."""
    mem = cupy.cuda.UnownedMemory(ptr, nbytes, None)
    return cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))


def _late_fill(torch, cupy, stream, ptr, value):
    """On `stream`: a long sleep kernel, then fill [ptr, ptr+N) with value. Returns at once."""
    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        torch.cuda._sleep(SLEEP_CYCLES)
    with cupy.cuda.ExternalStream(stream):
        _view(cupy, ptr, N).fill(value)


def _fill_now(cupy, stream, ptr, value):
    with cupy.cuda.ExternalStream(stream):
        _view(cupy, ptr, N).fill(value)


def _bytes_at(cupy, ptr, nbytes=N):
    cupy.cuda.runtime.deviceSynchronize()
    return _view(cupy, ptr, nbytes).get()


@pytest.mark.parametrize("expandable", [False, True])
def test_cross_stream_reuse_never_races_a_late_kernel(gpu, expandable):
    ap, torch, cupy = gpu
    pool = ap.Pool(0, backend="cuda", expandable_segments=expandable)
    try:
        s1, s2 = pool.create_stream(), pool.create_stream()
        a = pool.malloc(N, stream=s1)
        _late_fill(torch, cupy, s1, a, 1)  # still queued on s1 when the host frees a
        pool.free(a)                       # ordered on s1, the allocation stream
        b = pool.malloc(N, stream=s2)
        _fill_now(cupy, s2, b, 2)
        host_b = _bytes_at(cupy, b)
        assert (host_b == 2).all(), (
            f"stream 2's block {b:#x} (stream 1's block was {a:#x}) was overwritten by stream 1's late kernel")
        # Once stream 1 is done, its block serves stream 2 without growing the pool.
        pool.free(b)
        reserved = pool.memory_stats()["reserved_bytes.all.current"]
        c = pool.malloc(N, stream=s2)
        assert pool.memory_stats()["reserved_bytes.all.current"] == reserved
        pool.free(c)
        pool.synchronize()
        pool.destroy_stream(s1)
        pool.destroy_stream(s2)
    finally:
        pool.close()


def test_record_stream_keeps_a_block_until_the_other_stream_is_done(gpu):
    ap, torch, cupy = gpu
    pool = ap.Pool(0, backend="cuda")
    try:
        s1, s2 = pool.create_stream(), pool.create_stream()
        a = pool.malloc(N, stream=s1)
        pool.record_stream(a, s2)
        _late_fill(torch, cupy, s2, a, 7)  # the other stream still writes a
        pool.free(a)
        b = pool.malloc(N, stream=s1)
        _fill_now(cupy, s1, b, 9)
        assert (_bytes_at(cupy, b) == 9).all(), f"block {b:#x} reused while stream 2 still wrote {a:#x}"
        pool.free(b)
        pool.synchronize()
        pool.destroy_stream(s1)
        pool.destroy_stream(s2)
    finally:
        pool.close()


def test_expandable_growth_keeps_data_and_empty_cache_returns_memory(gpu):
    ap, torch, cupy = gpu
    pool = ap.Pool(0, backend="cuda", expandable_segments=True)
    try:
        stream = pool.create_stream()
        first = pool.malloc(N, stream=stream)
        _fill_now(cupy, stream, first, 0x5A)
        more = [pool.malloc(N * (i + 1), stream=stream) for i in range(6)]  # grows the mapping
        assert (_bytes_at(cupy, first) == 0x5A).all(), "data lost when its segment grew"
        held = pool.memory_stats()["reserved_bytes.all.current"]
        assert held >= N * 22
        free_before = cupy.cuda.runtime.memGetInfo()[0]
        for p in more + [first]:
            pool.free(p)
        pool.synchronize()
        pool.empty_cache()
        assert pool.memory_stats()["reserved_bytes.all.current"] == 0
        assert cupy.cuda.runtime.memGetInfo()[0] >= free_before + held - 64 * MiB
        pool.destroy_stream(stream)
    finally:
        pool.close()


# The importer: a separate interpreter (not a multiprocessing child, which would have to import this
# test module by name), reading the pickled handle from stdin and printing min, max and size.
_IMPORTER = r"""
import pickle, sys
import cupy
import ascend_pool as ap
handle = pickle.load(sys.stdin.buffer)
pool = ap.Pool(handle.device, backend="cuda")
with ap.open_shared(handle, pool=pool) as w:
    mem = cupy.cuda.UnownedMemory(w.ptr, w.size, None)
    data = cupy.ndarray((w.size,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0)).get()
    print(int(data.min()), int(data.max()), w.size)
pool.close()
"""


def test_shared_block_is_read_by_another_process(gpu):
    ap, torch, cupy = gpu
    pool = ap.Pool(0, backend="cuda")
    try:
        ptr = pool.share_malloc(N)
        stream = pool.create_stream()
        _fill_now(cupy, stream, ptr, 0x3C)
        cupy.cuda.runtime.deviceSynchronize()
        handle = pool.share(ptr, any_process=True)
        env = dict(os.environ, PYTHONSAFEPATH="1")  # the installed package, not a source tree in the cwd
        child = subprocess.run([sys.executable, "-c", _IMPORTER], input=pickle.dumps(handle), env=env,
                               capture_output=True, timeout=180)
        assert child.returncode == 0, child.stderr.decode(errors="replace")[-3000:]
        assert child.stdout.split() == [b"60", b"60", str(N).encode()], child.stdout
        assert pool.share_free(ptr) is True  # the importer has closed it and exited
        pool.destroy_stream(stream)
    finally:
        pool.close()
