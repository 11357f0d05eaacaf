"""The two-stream ping-pong benchmark: stream-ordered reuse holds less memory than blocks tied to
their stream (PyTorch's policy), with no event created per allocation."""

import importlib.util
import os

spec = importlib.util.spec_from_file_location(
    "stream_pingpong", os.path.join(os.path.dirname(__file__), "..", "bench", "stream_pingpong.py"))
pingpong = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pingpong)


def test_borrowing_holds_less_memory_than_tied_blocks():
    borrow, tied = pingpong.main(["--steps", "30", "--size-mib", "4", "--produce-ms", "0.2",
                                  "--consume-ms", "0.5", "--json"])
    assert borrow["peak_reserved_bytes"] < tied["peak_reserved_bytes"]
    assert borrow["device_mallocs"] == 1
    assert borrow["events_created"] <= 2
