"""What of a server's output reaches serve's log: a rate per second, a total, and what was dropped.

How this works: a server serve runs may be an attacker's code (an exploit inside it): its
stdout/stderr must neither fill serve's log nor spend serve's CPU. ``OutputLimiter`` is a
token bucket (``lines_per_s``, a burst of ``burst`` lines) with a total of ``total_bytes`` per
process; ``admit(n)`` says whether a line of ``n`` bytes is logged, and counts the dropped ones.
``drops()`` hands out what was dropped since it was last asked (one log line says how much).
The clock is injected (tests step it by hand). process.py reads the pipe in chunks and asks
``room()`` first: with no token left, a chunk's lines are counted without being split.
"""

from __future__ import annotations

import time
from typing import Callable

__all__ = ["OutputLimiter"]


class OutputLimiter:
    """A token bucket of lines per second and a total of bytes (see the module docstring)."""

    def __init__(self, lines_per_s: int, burst: int, total_bytes: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = float(lines_per_s)
        self.burst = float(max(burst, 1 if lines_per_s else 0))
        self.total_bytes = total_bytes
        self.clock = clock
        self.tokens = self.burst
        self.stamp = clock()
        self.logged_bytes = 0
        self.dropped_lines = 0  # since the last drops()
        self.dropped_bytes = 0
        self.dropped_lines_all = 0
        self.dropped_bytes_all = 0
        self.capped = False  # the total was reached: nothing more is logged

    def _refill(self) -> None:
        now = self.clock()
        if now > self.stamp:
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now

    def room(self) -> bool:
        """Whether a line could be logged now (False: count the next lines as dropped)."""
        if self.capped:
            return False
        self._refill()
        return self.tokens >= 1.0

    def admit(self, nbytes: int) -> bool:
        """One line of ``nbytes``: True to log it; False: it is counted as dropped."""
        if not self.capped and self.logged_bytes + nbytes > self.total_bytes:
            self.capped = True
        if self.room():
            self.tokens -= 1.0
            self.logged_bytes += nbytes
            return True
        self.drop(1, nbytes)
        return False

    def drop(self, lines: int, nbytes: int) -> None:
        self.dropped_lines += lines
        self.dropped_bytes += nbytes
        self.dropped_lines_all += lines
        self.dropped_bytes_all += nbytes

    def drops(self) -> tuple[int, int]:
        """(lines, bytes) dropped since the last call."""
        out = (self.dropped_lines, self.dropped_bytes)
        self.dropped_lines = self.dropped_bytes = 0
        return out
