/* Whether the interpreter is finalizing (after the atexit handlers, while modules and their
 * objects are torn down): a pool destroyed then is the process going away, not a program's
 * close(). Py_IsFinalizing is public from Python 3.13, _Py_IsFinalizing before. */
#ifndef AP_PY_FINALIZING_H
#define AP_PY_FINALIZING_H

#include <Python.h>

static inline int ap_py_finalizing(void) {
#if PY_VERSION_HEX >= 0x030D0000
    return Py_IsFinalizing();
#else
    return _Py_IsFinalizing();
#endif
}

#endif
