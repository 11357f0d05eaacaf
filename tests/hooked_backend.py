"""A backend whose stream_device answer is followed, once, by a hook: lets a child of
test_stream_lifecycle.py act in the window where register_stream has asked the runtime a stream's
device with the GIL released (tests/sim_fixtures puts this directory on the child's path)."""
from ascend_pool._core import Backend


class HookedBackend(Backend):
    hook = None  # called once, after the next stream_device answer

    def stream_device(self, stream):
        dev = super().stream_device(stream)
        if self.hook:
            h, self.hook = self.hook, None
            h()
        return dev
