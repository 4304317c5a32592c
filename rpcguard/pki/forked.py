"""Run a check that needs ``cryptography`` in a short-lived child, so that serve and connect never load it.

How this works: ``in_child(fn, *args)`` forks; the child runs ``fn(*args)`` (it imports
``cryptography`` as the check needs), sends the result or the exception it raised back through a
pipe (pickled) and exits with ``os._exit``; the parent returns the result or raises the
exception. The long-running process thus never maps cryptography's library and its OpenSSL
(about 10 MB of its resident memory, docs/performance.md) and keeps only what the ``ssl`` module
already holds. When ``cryptography`` is already imported (``certs`` commands, the tests) or the
platform cannot fork, ``fn`` runs in the process itself: nothing is saved there, so the fork would
only cost time. Used at start and reload only (the TLS file checks, the start-up warnings, the
expiry read, the CRL), never per session or per frame.

The child is a plain fork of the caller: it inherits the caller's state (a test's monkeypatch
included), runs no asyncio code and writes nothing but the pipe; ``os._exit`` skips the caller's
atexit handlers and buffered streams, which belong to the parent.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
from typing import Callable, TypeVar

__all__ = ["in_child", "ChildFailed"]

T = TypeVar("T")
# What the module whose absence is the point is called in sys.modules.
HEAVY_MODULE = "cryptography"


class ChildFailed(RuntimeError):
    """The child died without an answer, or its exception could not be sent back."""


def in_child(fn: Callable[..., T], *args: object, force: bool = False) -> T:
    """``fn(*args)``, computed in a forked child unless ``cryptography`` is loaded here already.

    ``force``: fork whatever is loaded (tests of this module)."""
    if not force and (HEAVY_MODULE in sys.modules or not hasattr(os, "fork")):
        return fn(*args)
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: answer, then leave without running anything of the parent's
        try:
            os.close(read_fd)
            try:
                signal.set_wakeup_fd(-1)  # a signal here must not reach the parent's event loop
            except ValueError:  # forked from a thread other than the main one: none was set there
                pass
            try:
                payload = pickle.dumps((True, fn(*args)))
            except BaseException as exc:  # noqa: BLE001 - every failure goes back to the parent
                payload = _pickled_error(exc)
            with os.fdopen(write_fd, "wb") as f:
                f.write(payload)
        finally:
            os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    if not data:
        raise ChildFailed(f"the check {getattr(fn, '__name__', fn)} ended without an answer (wait status {status})")
    ok, value = pickle.loads(data)
    if ok:
        return value
    raise value


def _pickled_error(exc: BaseException) -> bytes:
    try:
        data = pickle.dumps((False, exc))
        pickle.loads(data)  # an exception whose __init__ takes other arguments fails here, not in the parent
        return data
    except Exception:  # noqa: BLE001
        return pickle.dumps((False, ChildFailed(f"{type(exc).__name__}: {exc}")))
