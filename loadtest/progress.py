"""A dependency-free progress line on stderr for long runs.

On a terminal the line is redrawn in place (at most every ``min_interval_s``); otherwise
(logs, CI) a line is printed at every 10 % and at the end.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, total: int, stream: TextIO | None = None, width: int = 30,
                 min_interval_s: float = 0.2) -> None:
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.min_interval_s = min_interval_s
        self.ok = 0
        self.failed = 0
        self._start = time.monotonic()
        self._last_draw = 0.0
        self._last_decile = -1
        self._printed_at = -1
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def update(self, ok: bool) -> None:
        if ok:
            self.ok += 1
        else:
            self.failed += 1
        self._draw(final=False)

    def close(self) -> None:
        self._draw(final=True)
        if self._tty:
            self.stream.write("\n")
        self.stream.flush()

    def line(self) -> str:
        done = self.ok + self.failed
        filled = self.width * done // self.total if self.total else self.width
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = time.monotonic() - self._start
        return (f"{done:>{len(str(self.total))}}/{self.total} [{bar}] ok {self.ok} "
                f"failed {self.failed} {elapsed:.1f}s")

    def _draw(self, final: bool) -> None:
        now = time.monotonic()
        if self._tty:
            if final or now - self._last_draw >= self.min_interval_s:
                self._last_draw = now
                self.stream.write("\r" + self.line())
                self.stream.flush()
            return
        done = self.ok + self.failed
        decile = 10 * done // self.total if self.total else 10
        if (final and done != self._printed_at) or decile > self._last_decile:
            self._last_decile, self._printed_at = decile, done
            self.stream.write(self.line() + "\n")
            self.stream.flush()
