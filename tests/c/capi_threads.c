/* A C program that uses ascend_pool the way a framework does: it embeds Python (the library is a
 * Python extension), imports ascend_pool, dlopen()s ascend_pool.library_path(), resolves the C ABI
 * by name and runs malloc/free loops on several pthreads.
 *
 *   capi_threads PYTHON_EXECUTABLE NTHREADS ITERS
 *
 * Phase 1: nobody holds the GIL; a pthread's first malloc on device 1 creates that device's
 *          default pool (the rare path that takes the GIL).
 * Phase 2: the main thread holds the GIL throughout; the workers' hot path must not need it.
 * Phase 3: bad calls return NULL / are ignored, with the last error set.
 * Prints "ok ..." and exits 0, or prints what failed and exits nonzero.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>

#include "hammer.h"

typedef void (*init_fn)(int device);
typedef int (*code_fn)(void);
typedef const char *(*msg_fn)(void);
typedef void (*clear_fn)(void);

static hm_malloc_fn c_malloc;
static hm_free_fn c_free;
static init_fn c_init;
static code_fn c_code;
static msg_fn c_msg;
static clear_fn c_clear;

static int fail(const char *what) {
    fprintf(stderr, "FAIL: %s (last error %d: %s)\n", what, c_code ? c_code() : -1, c_msg ? c_msg() : "");
    return 1;
}

static void *first_malloc(void *arg) {
    (void)arg;
    void *p = c_malloc(1000, 1, NULL);
    if (p) c_free(p, 1000, 1, NULL);
    return p;
}

static long py_allocated(PyObject *mod, int device) {
    PyObject *stats = PyObject_CallMethod(mod, "memory_stats", "i", device);
    PyObject *v = stats ? PyDict_GetItemString(stats, "allocated_bytes.all.current") : NULL;
    long n = v ? PyLong_AsLong(v) : -1;
    Py_XDECREF(stats);
    return n;
}

int main(int argc, char **argv) {
    PyConfig config;
    PyStatus status;
    char why[256] = "";
    long allocs = 0;
    void *got = NULL;
    pthread_t t;

    if (argc != 4) {
        fprintf(stderr, "usage: %s PYTHON_EXECUTABLE NTHREADS ITERS\n", argv[0]);
        return 2;
    }
    int nthreads = atoi(argv[2]), iters = atoi(argv[3]);

    /* Python computes its paths (stdlib, site-packages, a venv) as if it were that executable. */
    PyConfig_InitPythonConfig(&config);
    status = PyConfig_SetBytesString(&config, &config.program_name, argv[1]);
    if (!PyStatus_Exception(status)) status = Py_InitializeFromConfig(&config);
    PyConfig_Clear(&config);
    if (PyStatus_Exception(status)) Py_ExitStatusException(status);

    PyObject *mod = PyImport_ImportModule("ascend_pool");
    PyObject *path = mod ? PyObject_CallMethod(mod, "library_path", NULL) : NULL;
    if (!path) {
        PyErr_Print();
        return 3;
    }
    void *lib = dlopen(PyUnicode_AsUTF8(path), RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        fprintf(stderr, "FAIL: dlopen: %s\n", dlerror());
        return 3;
    }
    c_malloc = (hm_malloc_fn)dlsym(lib, "ascend_pool_malloc");
    c_free = (hm_free_fn)dlsym(lib, "ascend_pool_free");
    c_init = (init_fn)dlsym(lib, "ascend_pool_init");
    c_code = (code_fn)dlsym(lib, "ascend_pool_last_error_code");
    c_msg = (msg_fn)dlsym(lib, "ascend_pool_last_error");
    c_clear = (clear_fn)dlsym(lib, "ascend_pool_clear_last_error");
    if (!c_malloc || !c_free || !c_init || !c_code || !c_msg || !c_clear) return fail("dlsym of the C ABI");

    /* Phase 1: the GIL is free; a non-Python thread creates device 1's pool on its first malloc. */
    PyThreadState *saved = PyEval_SaveThread();
    pthread_create(&t, NULL, first_malloc, NULL);
    pthread_join(t, &got);
    PyEval_RestoreThread(saved);
    if (!got) return fail("first malloc on device 1 from a pthread");

    /* Phase 2: this thread holds the GIL from here on. */
    c_init(0);
    if (c_code() != 0) return fail("ascend_pool_init(0)");
    int rc = hm_run(c_malloc, c_free, 0, nthreads, iters, 30, &allocs, why, sizeof why);
    if (rc != 0) {
        fprintf(stderr, "FAIL: workers with the GIL held by main: %s\n", why);
        return 4;
    }

    /* Phase 3: bad calls. */
    c_clear();
    if (c_malloc(0, 0, NULL) || c_code() != 3) return fail("malloc(0) must fail with INVALID_SIZE");
    if (c_malloc(-1, 0, NULL) || c_code() != 3) return fail("malloc(-1) must fail with INVALID_SIZE");
    if (c_malloc(64, 999, NULL) || c_code() != 100) return fail("malloc on device 999 must fail");
    c_clear();
    c_free((void *)(uintptr_t)0x1000, 64, 0, NULL);
    if (c_code() != 4) return fail("free of an unknown pointer must be refused");

    long left0 = py_allocated(mod, 0), left1 = py_allocated(mod, 1);
    if (left0 != 0 || left1 != 0) {
        fprintf(stderr, "FAIL: bytes still allocated after the run: device 0 %ld, device 1 %ld\n", left0, left1);
        return 5;
    }
    printf("ok threads=%d allocs=%ld\n", nthreads, allocs);
    Py_DECREF(path);
    Py_DECREF(mod);
    return Py_FinalizeEx() < 0 ? 6 : 0;
}
