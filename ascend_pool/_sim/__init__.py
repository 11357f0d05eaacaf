"""The bundled simulated NPU: its libascendcl.so lives in this directory (built by setup.py)."""

import os


def library_path(legacy=False):
    """Path of the bundled simulator's libascendcl.so. legacy=True gives the build that lacks
    aclrtMallocAlign32 and aclrtQueryEventStatus (to exercise the acl backend's fallbacks)."""
    parts = ["legacy", "libascendcl.so"] if legacy else ["libascendcl.so"]
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), *parts)
