# The device backend as seen from Cython: the C table from backend.h, and `Backend`, a thin Python
# wrapper that owns one opened table. The pool (core/pool.pxi, included after this file) takes a
# Backend object, keeps a reference to it, and calls through its `b` pointer without the GIL.
#
# Handles (pointers, events, streams) cross into Python as plain ints; 0 / None is the default
# stream. Every failing call raises ascend_pool.errors.DeviceError (or a subclass) carrying the
# runtime's own code and a message built on the failing thread, right after the failure, because
# aclGetRecentErrMsg only remembers the calling thread's latest error.

from libc.stdint cimport uintptr_t, int32_t, uint64_t
from libc.stdlib cimport malloc as _c_malloc, free as _c_free

import os as _os

from ascend_pool.errors import DeviceError, BackendUnavailableError, DeviceTimeoutError, InvalidDeviceError
from ascend_pool._sim import library_path as _sim_library_path

cdef extern from "backend.h" nogil:
    int AP_BACKEND_ACL
    int AP_BACKEND_CUDA
    int AP_ERR_NOT_LOADED
    int AP_ERR_MISSING_SYMBOL
    int AP_ERR_NO_DEVICE
    int AP_ERR_UNKNOWN_STREAM
    int AP_IPC_KEY_MAX
    unsigned AP_IPC_ANY_PROCESS
    unsigned AP_IPC_READ_ONLY

    cdef struct ap_backend:
        int kind
        char name[16]
        char path[1024]
        void *lib
        int has_malloc_align32
        int has_query_event_status
        int has_sync_event_timeout
        int has_sync_stream_timeout
        int device_count
        char soc_name[64]
        size_t (*device_size)(const ap_backend *b, size_t size) noexcept nogil
        int (*set_device)(ap_backend *b, int device) noexcept nogil
        int (*device_retain)(ap_backend *b, int device) noexcept nogil
        int (*device_release)(ap_backend *b, int device) noexcept nogil
        int (*stream_device)(ap_backend *b, void *stream, int *device) noexcept nogil
        void (*shutdown)(ap_backend *b) noexcept nogil
        int (*malloc)(ap_backend *b, int device, void **ptr, size_t size) noexcept nogil
        int (*free)(ap_backend *b, int device, void *ptr) noexcept nogil
        int (*mem_info)(ap_backend *b, int device, size_t *free_bytes, size_t *total_bytes) noexcept nogil
        int (*event_create)(ap_backend *b, int device, void **event) noexcept nogil
        int (*event_record)(ap_backend *b, void *event, void *stream) noexcept nogil
        int (*event_query)(ap_backend *b, void *event, int *complete) noexcept nogil
        int (*event_sync)(ap_backend *b, void *event, int timeout_ms) noexcept nogil
        int (*event_destroy)(ap_backend *b, void *event) noexcept nogil
        int (*stream_wait_event)(ap_backend *b, void *stream, void *event) noexcept nogil
        int (*stream_create)(ap_backend *b, int device, void **stream) noexcept nogil
        int (*stream_sync)(ap_backend *b, void *stream, int timeout_ms) noexcept nogil
        int (*device_sync)(ap_backend *b, int device, int timeout_ms) noexcept nogil
        int (*stream_destroy)(ap_backend *b, void *stream) noexcept nogil
        void (*error_message)(ap_backend *b, int code, char *buf, size_t len) noexcept nogil
        int (*host_malloc)(ap_backend *b, int device, void **ptr, size_t size) noexcept nogil
        int (*host_free)(ap_backend *b, int device, void *ptr) noexcept nogil
        int has_vmm
        int (*vmm_granularity)(ap_backend *b, int device, size_t *granularity) noexcept nogil
        int (*vmm_reserve)(ap_backend *b, int device, size_t size, void **va) noexcept nogil
        int (*vmm_release)(ap_backend *b, int device, void *va, size_t size) noexcept nogil
        int (*vmm_create)(ap_backend *b, int device, size_t size, void **handle) noexcept nogil
        int (*vmm_free)(ap_backend *b, int device, void *handle) noexcept nogil
        int (*vmm_map)(ap_backend *b, int device, void *va, size_t size, void *handle) noexcept nogil
        int (*vmm_unmap)(ap_backend *b, int device, void *va, size_t size) noexcept nogil
        int has_ipc
        int has_ipc_read_only
        int (*ipc_export)(ap_backend *b, int device, void *ptr, size_t size, char *key, size_t keylen,
                          unsigned flags) noexcept nogil
        int (*ipc_set_pids)(ap_backend *b, int device, const char *key, const int32_t *pids, size_t n) noexcept nogil
        int (*ipc_import)(ap_backend *b, int device, const char *key, int peer, void **ptr, size_t *size) noexcept nogil
        int (*ipc_close)(ap_backend *b, int device, const char *key) noexcept nogil
        int (*node_pid)(ap_backend *b, int32_t *pid) noexcept nogil
        int (*physical_device)(ap_backend *b, int device, int *physical) noexcept nogil
        void *impl

    int ap_backend_open_default(ap_backend *b, const char *kind, const char *path, int prefer_loaded,
                                char *err, size_t errlen)
    void ap_backend_close(ap_backend *b)
    const char *ap_backend_symbol(const ap_backend *b, int i)
    uint64_t ap_backend_life(ap_backend *b, int device, int probe)


# Timeout codes of the host waits (acl: stream 507046, event 507047; cuda polls and reports
# cudaErrorNotReady 600), turned into DeviceTimeoutError by the sync methods.
cdef int _ACL_STREAM_SYNC_TIMEOUT = 507046
cdef int _ACL_EVENT_SYNC_TIMEOUT = 507047
cdef int _CUDA_NOT_READY = 600

cdef enum:
    _ERRLEN = 2048


cdef inline void *_handle(object h) except? NULL:
    """An int handle (or None for the default stream) as a C pointer."""
    if h is None:
        return NULL
    return <void *><uintptr_t>h


cdef class Backend:
    """One opened device backend: ``Backend(kind, path=None)``.

    kind is "acl" (libascendcl.so: `path`, else $ASCEND_POOL_ACL_LIB, else the CANN locations,
    else the loader path), "sim" (the acl code loading the simulator's libascendcl.so; path
    defaults to the bundled one) or "cuda" (libcudart). Raises BackendUnavailableError, whose
    message names the libraries tried, when the library does not load, lacks a required symbol
    or reports no device. Sizes are in bytes, timeouts in milliseconds (< 0: wait forever).
    Opening the same library twice is fine (the runtime is shared and initialised once).
    """

    cdef ap_backend *b       # the C table the pool calls through; valid while this object lives
    cdef ap_backend _table   # storage for *b (one allocation with the object)
    cdef bint _opened
    cdef readonly object kind
    cdef readonly object name

    def __cinit__(self, kind, path=None):
        cdef char err[_ERRLEN]
        cdef int rc
        cdef bytes bkind, bpath
        cdef const char *cpath = NULL
        cdef const char *ckind
        self.b = NULL
        self._opened = False
        cdef int prefer_loaded = path is None  # a runtime already loaded wins over a default
        kind = str(kind)
        if kind == "sim" and path is None:
            path = _sim_library_path()
        bkind = kind.encode()
        ckind = bkind
        if path is not None:
            bpath = _os.fsencode(path)
            cpath = bpath
        err[0] = 0
        with nogil:
            rc = ap_backend_open_default(&self._table, ckind, cpath, prefer_loaded, err, _ERRLEN)
        if rc != 0:
            raise BackendUnavailableError(rc, err.decode("utf-8", "replace"))
        self.b = &self._table
        self._opened = True
        self.name = self._table.name.decode()
        self.kind = "cuda" if self._table.kind == AP_BACKEND_CUDA else "acl"

    def __dealloc__(self):
        if self._opened:
            ap_backend_close(&self._table)
            self._opened = False
            self.b = NULL

    def __repr__(self):
        return (f"<ascend_pool Backend name={self.name!r} kind={self.kind!r} "
                f"path={self.path!r} devices={self.device_count}>")

    cdef _fail(self, int code, str what, bint wait=False):
        """Raises DeviceError for `code` from call `what` (DeviceTimeoutError for a host `wait`
        that timed out). Call on the failing thread, at once: see the top of this file."""
        cdef char buf[_ERRLEN]
        if ap_forked_from:  # the runtime's own code would not say why (sim: 100001)
            _raise_forked()
        buf[0] = 0
        with nogil:
            self.b.error_message(self.b, code, buf, _ERRLEN)
        msg = f"{self.name}: {what} failed: " + buf.decode("utf-8", "replace")
        if wait and (code == _ACL_STREAM_SYNC_TIMEOUT or code == _ACL_EVENT_SYNC_TIMEOUT or (
                code == _CUDA_NOT_READY and self._table.kind == AP_BACKEND_CUDA)):
            raise DeviceTimeoutError(code, msg)
        raise DeviceError(code, msg)

    cdef int _device(self, object device) except? -2:
        """device as the C int the runtime takes. One that no int holds (2**31 and past) names no
        device: InvalidDeviceError naming the count, as backend.check_device says it, not the
        conversion's bare OverflowError. Within an int, the runtime answers (107001 and its message)."""
        try:
            return device
        except OverflowError:
            raise InvalidDeviceError(f"device {device!r} does not exist: the {self.name} backend has "
                                     f"{self._table.device_count} device(s)") from None

    # ---- description ---------------------------------------------------------------------

    @property
    def path(self):
        """The library file that was loaded (resolved to an absolute path where possible)."""
        return _os.fsdecode(<bytes>self._table.path)

    @property
    def device_count(self):
        """Devices the runtime reported when the backend was opened (always >= 1)."""
        return self._table.device_count

    @property
    def has_malloc_align32(self):
        """acl: aclrtMallocAlign32 is used (else aclrtMalloc, which pads 32 bytes more)."""
        return bool(self._table.has_malloc_align32)

    @property
    def has_query_event_status(self):
        """acl: aclrtQueryEventStatus is used (else the deprecated aclrtQueryEvent)."""
        return bool(self._table.has_query_event_status)

    @property
    def has_sync_event_timeout(self):
        """acl: aclrtSynchronizeEventWithTimeout is used for timed waits (else polling)."""
        return bool(self._table.has_sync_event_timeout)

    @property
    def has_sync_stream_timeout(self):
        """acl: aclrtSynchronizeStreamWithTimeout is used for timed waits (else polling)."""
        return bool(self._table.has_sync_stream_timeout)

    @property
    def resolved_symbols(self):
        """Names of the runtime functions resolved with dlsym(), in resolution order."""
        cdef int i = 0
        cdef const char *s
        names = []
        while True:
            s = ap_backend_symbol(self.b, i)
            if s == NULL:
                return names
            names.append(s.decode())
            i += 1

    # ---- memory (bytes) ------------------------------------------------------------------

    def device_size(self, size_t size):
        """Bytes the device really reserves for a malloc of `size` bytes."""
        cdef size_t n
        with nogil:
            n = self.b.device_size(self.b, size)
        return n

    def set_device(self, device):
        """Names the device whose context this thread's stream and event calls (which take no
        device) run in. The runtime's current device of the thread is left as it is."""
        cdef int dev = self._device(device)
        cdef int rc
        with nogil:
            rc = self.b.set_device(self.b, dev)
        if rc != 0:
            self._fail(rc, "set_device")

    def device_retain(self, device):
        """Takes one device reference (acl: aclrtSetDevice, without changing the calling
        thread's context), as each pool does from its creation to its close."""
        cdef int dev = self._device(device)
        cdef int rc
        with nogil:
            rc = self.b.device_retain(self.b, dev)
        if rc != 0:
            self._fail(rc, "device_retain")

    def device_release(self, device):
        """Gives back one reference taken with device_retain (acl: aclrtResetDevice)."""
        cdef int dev = self._device(device)
        cdef int rc
        with nogil:
            rc = self.b.device_release(self.b, dev)
        if rc != 0:
            self._fail(rc, "device_release")

    def stream_device(self, stream):
        """The device of `stream` (int handle), or None when the runtime cannot tell: acl
        knows the streams this backend created (CANN has no query for others; the simulator
        answers one), cuda tells nothing."""
        cdef int rc
        cdef int dev = -1
        cdef void *s = _handle(stream)
        with nogil:
            rc = self.b.stream_device(self.b, s, &dev)
        return dev if rc == 0 else None

    @property
    def soc_name(self):
        """The SoC the runtime reports (acl: aclrtGetSocName, e.g. "Ascend910B1"); "" if none."""
        return (<bytes>self._table.soc_name).decode("utf-8", "replace")

    def malloc(self, device, size_t size):
        """Allocates `size` bytes of device memory on `device`; returns the address as an int."""
        cdef int dev = self._device(device)
        cdef int rc
        cdef void *p = NULL
        with nogil:
            rc = self.b.malloc(self.b, dev, &p, size)
        if rc != 0:
            self._fail(rc, f"malloc({size})")
        return <uintptr_t>p

    def free(self, device, ptr):
        """Returns memory from malloc() to the device at once (does not wait for queued work)."""
        cdef int dev = self._device(device)
        cdef int rc
        cdef void *p = _handle(ptr)
        with nogil:
            rc = self.b.free(self.b, dev, p)
        if rc != 0:
            self._fail(rc, "free")

    def mem_info(self, device):
        """(free, total) bytes of the device's memory, as the runtime reports them now."""
        cdef int dev = self._device(device)
        cdef int rc
        cdef size_t free_bytes = 0, total_bytes = 0
        with nogil:
            rc = self.b.mem_info(self.b, dev, &free_bytes, &total_bytes)
        if rc != 0:
            self._fail(rc, "mem_info")
        return free_bytes, total_bytes

    # ---- pinned host memory (bytes) ------------------------------------------------------

    def host_malloc(self, device, size_t size):
        """Allocates `size` bytes of pinned (page-locked) host memory in `device`'s runtime
        context (aclrtMallocHost / cudaHostAlloc); returns the host address as an int."""
        cdef int dev = self._device(device)
        cdef int rc
        cdef void *p = NULL
        with nogil:
            rc = self.b.host_malloc(self.b, dev, &p, size)
        if rc != 0:
            self._fail(rc, f"host_malloc({size})")
        return <uintptr_t>p

    def host_free(self, device, ptr):
        """Returns pinned host memory from host_malloc() to the runtime at once."""
        cdef int dev = self._device(device)
        cdef int rc
        cdef void *p = _handle(ptr)
        with nogil:
            rc = self.b.host_free(self.b, dev, p)
        if rc != 0:
            self._fail(rc, "host_free")

    # ---- virtual memory (bytes; addresses and handles as ints) -----------------------------

    @property
    def has_vmm(self):
        """The runtime has the virtual-memory calls (acl: aclrtReserveMemAddress and the six
        others; cuda: the driver's cuMem* calls from libcuda.so.1). Without them every vmm_*
        method raises DeviceError with code AP_ERR_MISSING_SYMBOL (990002)."""
        return bool(self._table.has_vmm)

    def vmm_granularity(self, device):
        """Bytes that physical allocations, mappings and reservations are multiples of (the
        2 MiB huge page on an NPU)."""
        cdef int dev = self._device(device)
        cdef int rc
        cdef size_t g = 0
        with nogil:
            rc = self.b.vmm_granularity(self.b, dev, &g)
        if rc != 0:
            self._fail(rc, "vmm_granularity")
        return g

    def vmm_reserve(self, device, size_t size):
        """Reserves `size` bytes of inaccessible address space; returns its base as an int. Costs
        no device memory."""
        cdef int dev = self._device(device)
        cdef int rc
        cdef void *va = NULL
        with nogil:
            rc = self.b.vmm_reserve(self.b, dev, size, &va)
        if rc != 0:
            self._fail(rc, f"vmm_reserve({size})")
        return <uintptr_t>va

    def vmm_release(self, device, va, size_t size):
        """Gives back a whole reservation (base and size from vmm_reserve); nothing may be
        mapped in it."""
        cdef int dev = self._device(device)
        cdef int rc
        cdef void *v = _handle(va)
        with nogil:
            rc = self.b.vmm_release(self.b, dev, v, size)
        if rc != 0:
            self._fail(rc, "vmm_release")

    def vmm_create(self, device, size_t size):
        """Allocates `size` bytes of physical device memory (a multiple of the granularity);
        returns the runtime's handle as an int. Counts against the device's capacity."""
        cdef int dev = self._device(device)
        cdef int rc
        cdef void *h = NULL
        with nogil:
            rc = self.b.vmm_create(self.b, dev, size, &h)
        if rc != 0:
            self._fail(rc, f"vmm_create({size})")
        return <uintptr_t>h

    def vmm_free(self, device, handle):
        """Frees physical memory from vmm_create(); it must not be mapped anywhere."""
        cdef int dev = self._device(device)
        cdef int rc
        cdef void *h = _handle(handle)
        with nogil:
            rc = self.b.vmm_free(self.b, dev, h)
        if rc != 0:
            self._fail(rc, "vmm_free")

    def vmm_map(self, device, va, size_t size, handle):
        """Maps the whole of `handle` (`size` = its size) at `va` inside a reservation and
        makes it read-write for the device."""
        cdef int dev = self._device(device)
        cdef int rc
        cdef void *v = _handle(va)
        cdef void *h = _handle(handle)
        with nogil:
            rc = self.b.vmm_map(self.b, dev, v, size, h)
        if rc != 0:
            self._fail(rc, f"vmm_map({size})")

    def vmm_unmap(self, device, va, size_t size):
        """Unmaps the mapping that starts at `va` (`size` bytes); the range is inaccessible
        again, the physical memory stays allocated."""
        cdef int dev = self._device(device)
        cdef int rc
        cdef void *v = _handle(va)
        with nogil:
            rc = self.b.vmm_unmap(self.b, dev, v, size)
        if rc != 0:
            self._fail(rc, "vmm_unmap")

    # ---- sharing between processes (keys as str) -------------------------------------------

    @property
    def has_ipc(self):
        """The runtime can share device memory with other processes (acl: the four
        aclrtIpcMem* calls of CANN 8.x; cuda: cudaIpcGetMemHandle and its two peers). Without
        them every ipc_* method raises DeviceError with code AP_ERR_MISSING_SYMBOL (990002)."""
        return bool(self._table.has_ipc)

    @property
    def has_ipc_read_only(self):
        """The runtime maps imports of a read_only export read-only, refusing writes: only the
        simulator (a simulator extension). CANN's and CUDA's IPC calls have no read-only mode."""
        return bool(self._table.has_ipc_read_only)

    def ipc_export(self, device, ptr, size_t size, bint any_process=False, bint read_only=False):
        """Exports `size` bytes at device address `ptr` (acl: both multiples of the 2 MiB page)
        and returns the key (str) that other processes import it by. Only processes listed with
        ipc_set_pids may import it, unless any_process (acl:
        ACL_RT_IPC_MEM_EXPORT_FLAG_DISABLE_PID_VALIDATION; cuda checks no pids anyway).
        read_only: importers map it read-only where has_ipc_read_only, else no effect."""
        cdef int dev = self._device(device)
        cdef int rc
        cdef char key[256]
        cdef void *p = _handle(ptr)
        cdef unsigned flags = (AP_IPC_ANY_PROCESS if any_process else 0) | (AP_IPC_READ_ONLY if read_only else 0)
        key[0] = 0
        with nogil:
            rc = self.b.ipc_export(self.b, dev, p, size, key, sizeof(key), flags)
        if rc != 0:
            self._fail(rc, f"ipc_export({size})")
        return key.decode("ascii")

    def ipc_set_pids(self, device, key, pids):
        """Exporter: lets the processes `pids` (ints) import `key` (exported on `device`)."""
        cdef int dev = self._device(device)
        cdef int rc
        cdef bytes bkey = str(key).encode("ascii")
        cdef const char *ckey = bkey
        cdef size_t n = len(pids), i
        cdef int32_t *arr = <int32_t *>_c_malloc((n if n > 0 else 1) * sizeof(int32_t))
        if arr == NULL:
            raise MemoryError()
        try:
            for i in range(n):
                arr[i] = <int32_t>int(pids[i])
            with nogil:
                rc = self.b.ipc_set_pids(self.b, dev, ckey, arr, n)
        finally:
            _c_free(arr)
        if rc != 0:
            self._fail(rc, "ipc_set_pids")

    def node_pid(self):
        """This process's node-level id, the one the runtime's IPC pid checks know it by (acl:
        aclrtDeviceGetBareTgid, the host's tgid inside a container; cuda: getpid()). Pass these,
        never os.getpid(), to ipc_set_pids."""
        cdef int rc
        cdef int32_t pid = 0
        with nogil:
            rc = self.b.node_pid(self.b, &pid)
        if rc != 0:
            self._fail(rc, "node_pid")
        return int(pid)

    def runtime_life(self, device, bint probe=False):
        """The runtime's life on `device` as this backend has seen it: a number that changes when
        the runtime released what the process held there (aclFinalize, then perhaps aclInit;
        resets that took the pools' device references). probe: first enter the device's context
        (where a pool holds the device), which finds such a release; no device work. What was
        made in an earlier life (an IPC import, memory) is not to be used or closed again."""
        cdef int dev = self._device(device)
        cdef uint64_t life
        with nogil:
            life = ap_backend_life(self.b, dev, probe)
        return int(life)

    def physical_device(self, device):
        """The node's device behind this process's `device` (int): the same NPU has the same
        number in every process and container of the node (acl: aclrtGetPhyDevIdByLogicDevId, as
        ASCEND_RT_VISIBLE_DEVICES renumbers; else the device itself)."""
        cdef int dev = self._device(device)
        cdef int rc, physical = dev
        with nogil:
            rc = self.b.physical_device(self.b, dev, &physical)
        if rc != 0:
            self._fail(rc, "physical_device")
        return int(physical)

    def ipc_import(self, device, key, exporter_device=None):
        """Maps the memory exported as `key` into this process for `device`. Returns
        (address, size); size is 0 where the runtime does not tell it (acl). exporter_device:
        the device the memory was exported on, as this process numbers it (None: `device`);
        only an import on another device asks for peer access (acl:
        ACL_RT_IPC_MEM_IMPORT_FLAG_ENABLE_PEER_ACCESS, which CANN 8.2.RC1 does not take)."""
        cdef int dev = self._device(device)
        cdef int peer = exporter_device is not None and self._device(exporter_device) != dev
        cdef int rc
        cdef bytes bkey = str(key).encode("ascii")
        cdef const char *ckey = bkey
        cdef void *p = NULL
        cdef size_t size = 0
        with nogil:
            rc = self.b.ipc_import(self.b, dev, ckey, peer, &p, &size)
        if rc != 0:
            self._fail(rc, "ipc_import")
        return <uintptr_t>p, size

    def ipc_close(self, device, key):
        """Importer: unmaps its import of `key`. Exporter: withdraws `key` (acl: after every
        importer closed; the simulator refuses with 507022 before)."""
        cdef int dev = self._device(device)
        cdef int rc
        cdef bytes bkey = str(key).encode("ascii")
        cdef const char *ckey = bkey
        with nogil:
            rc = self.b.ipc_close(self.b, dev, ckey)
        if rc != 0:
            self._fail(rc, "ipc_close")

    # ---- events --------------------------------------------------------------------------

    def event_create(self, device):
        """A new event on `device` (no timing), as an int handle."""
        cdef int dev = self._device(device)
        cdef int rc
        cdef void *ev = NULL
        with nogil:
            rc = self.b.event_create(self.b, dev, &ev)
        if rc != 0:
            self._fail(rc, "event_create")
        return <uintptr_t>ev

    def event_record(self, ev, stream=None):
        """Records `ev` at the current end of `stream` (None: the default stream)."""
        cdef int rc
        cdef void *e = _handle(ev)
        cdef void *s = _handle(stream)
        with nogil:
            rc = self.b.event_record(self.b, e, s)
        if rc != 0:
            self._fail(rc, "event_record")

    def event_query(self, ev):
        """True when all work recorded before `ev` has finished. Never blocks."""
        cdef int rc, complete = 0
        cdef void *e = _handle(ev)
        with nogil:
            rc = self.b.event_query(self.b, e, &complete)
        if rc != 0:
            self._fail(rc, "event_query")
        return bool(complete)

    def event_sync(self, ev, int timeout_ms=-1):
        """Blocks until `ev` completes; DeviceTimeoutError after `timeout_ms` ms (< 0: never)."""
        cdef int rc
        cdef void *e = _handle(ev)
        with nogil:
            rc = self.b.event_sync(self.b, e, timeout_ms)
        if rc != 0:
            self._fail(rc, f"event_sync({timeout_ms} ms)", True)

    def event_destroy(self, ev):
        """Releases `ev` (an event is a limited device resource)."""
        cdef int rc
        cdef void *e = _handle(ev)
        with nogil:
            rc = self.b.event_destroy(self.b, e)
        if rc != 0:
            self._fail(rc, "event_destroy")

    # ---- streams -------------------------------------------------------------------------

    def stream_create(self, device):
        """A new stream on `device`, as an int handle."""
        cdef int dev = self._device(device)
        cdef int rc
        cdef void *s = NULL
        with nogil:
            rc = self.b.stream_create(self.b, dev, &s)
        if rc != 0:
            self._fail(rc, "stream_create")
        return <uintptr_t>s

    def stream_sync(self, stream, int timeout_ms=-1):
        """Blocks until `stream`'s work is done; DeviceTimeoutError after `timeout_ms` ms."""
        cdef int rc
        cdef void *s = _handle(stream)
        with nogil:
            rc = self.b.stream_sync(self.b, s, timeout_ms)
        if rc != 0:
            self._fail(rc, f"stream_sync({timeout_ms} ms)", True)

    def stream_destroy(self, stream):
        """Destroys `stream` (the runtime finishes its queued work first)."""
        cdef int rc
        cdef void *s = _handle(stream)
        with nogil:
            rc = self.b.stream_destroy(self.b, s)
        if rc != 0:
            self._fail(rc, "stream_destroy")

    def stream_wait_event(self, stream, ev):
        """Work queued on `stream` after this call waits for `ev`. The host does not wait."""
        cdef int rc
        cdef void *s = _handle(stream)
        cdef void *e = _handle(ev)
        with nogil:
            rc = self.b.stream_wait_event(self.b, s, e)
        if rc != 0:
            self._fail(rc, "stream_wait_event")
