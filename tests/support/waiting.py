"""Polling helpers for the integration tests: wait for a condition with a deadline.

How this works: ``wait_for`` calls ``predicate`` every ``step`` seconds until it returns
something truthy (returned) or ``timeout`` seconds have passed (``None``); ``wait_until`` is the
same with an AssertionError naming what was awaited instead of ``None``. ``loop_until`` is for
code on the test's own event loop: it lets the loop run (``sleep(0)``, one turn at a time) until
the condition holds, counted in turns, not seconds, so a busy machine cannot make it fail.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable, TypeVar

__all__ = ["wait_for", "wait_until", "loop_until"]

T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout: float, step: float = 0.01) -> T | None:
    """The first truthy value of ``predicate()`` within ``timeout`` seconds, else None."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            return None
        time.sleep(step)


def wait_until(cond: Callable[[], T], timeout: float = 15.0, what: str = "condition", step: float = 0.05) -> T:
    """Like ``wait_for``, but a timeout fails the test with ``what`` in the message."""
    value = wait_for(cond, timeout, step)
    if not value:
        raise AssertionError(f"timed out waiting for {what}")
    return value


async def loop_until(cond: Callable[[], object], what: str = "condition", turns: int = 10_000) -> None:
    """Let the running event loop turn until ``cond()`` is true (at most ``turns`` turns)."""
    for _ in range(turns):
        if cond():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"{what}: not true after {turns} turns of the event loop")
