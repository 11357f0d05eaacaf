"""A one-line progress display on stderr for long benchmark runs.

``Progress(total, enabled)``; ``step(label)`` starts the next step, ``note(text)`` adds a detail to
the current one, ``done()`` ends the line. While a step runs, a background thread redraws the
line every half second with the step's elapsed time (replays run in C with the GIL released, so
the line keeps moving during a 25-second direct replay). Disabled, every call is a no-op.
"""
from __future__ import annotations

import sys
import threading
import time

__all__ = ["Progress"]


class Progress:
    def __init__(self, total: int, enabled: bool = True, stream=None, interval: float = 0.5):
        self.total = max(int(total), 1)
        self.enabled = bool(enabled)
        self.stream = stream if stream is not None else sys.stderr
        self.interval = interval
        self.index = 0
        self.label = ""
        self.detail = ""
        self.t_step = self.t_start = time.monotonic()
        self._width = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticking = threading.Event()
        self._thread = None
        if self.enabled:
            self._thread = threading.Thread(target=self._tick, name="ascend-pool-bench-progress", daemon=True)
            self._thread.start()

    def _tick(self):
        while not self._stop.wait(self.interval):
            if self._ticking.is_set():
                self._draw()

    def _draw(self):
        with self._lock:
            now = time.monotonic()
            bar_w = 20
            filled = int(bar_w * min(self.index - 1, self.total) / self.total) if self.index else 0
            bar = "#" * filled + "-" * (bar_w - filled)
            text = (f"[{bar}] {self.index}/{self.total} {self.label}"
                    f"{' ' + self.detail if self.detail else ''}  {now - self.t_step:5.1f} s"
                    f" (total {now - self.t_start:.0f} s)")
            pad = max(self._width - len(text), 0)
            self._width = len(text)
            try:
                self.stream.write("\r" + text + " " * pad)
                self.stream.flush()
            except (OSError, ValueError):
                pass

    def step(self, label: str, tick: bool = True) -> None:
        """Starts the next step. tick=False: no redraws while it runs (microbenchmarks)."""
        if not self.enabled:
            return
        self.index += 1
        self.label = label
        self.detail = ""
        self.t_step = time.monotonic()
        if tick:
            self._ticking.set()
        else:
            self._ticking.clear()
        self._draw()

    def note(self, text: str) -> None:
        if not self.enabled:
            return
        self.detail = text
        if not self._ticking.is_set():
            self._draw()

    def done(self) -> None:
        if not self.enabled:
            return
        self._ticking.clear()
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            try:
                self.stream.write("\r" + " " * self._width + "\r")
                self.stream.flush()
            except (OSError, ValueError):
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.done()
        return False
