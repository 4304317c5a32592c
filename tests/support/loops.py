"""Running a coroutine on both event loops rpcguard supports (asyncio's and uvloop's).

How this works: ``run_on(coro, kind)`` runs ``coro`` to completion on a fresh loop of ``kind``
(``"asyncio"`` or ``"uvloop"``; without uvloop the uvloop half fails under CI and skips
elsewhere, naming the install step: tests/support/need.py). The ``run``
fixture is parametrised over both kinds: a test module takes it with
``from tests.support.loops import run`` and every test that uses it runs twice.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from tests.support import need

__all__ = ["LOOP_KINDS", "run_on", "run"]

LOOP_KINDS = ("asyncio", "uvloop")
# uvloop is a dependency of rpcguard (pyproject.toml); scripts/_env.sh installs it into the venv
UVLOOP_INSTALL = "scripts/_env.sh installs it (pip install -e '.[test]')"


def run_on(coro: Coroutine[Any, Any, Any], loop_kind: str) -> Any:
    if loop_kind == "uvloop":
        uvloop = need.module("uvloop", UVLOOP_INSTALL)
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(coro)
    return asyncio.run(coro)


@pytest.fixture(params=LOOP_KINDS)
def run(request: pytest.FixtureRequest) -> Callable[[Coroutine[Any, Any, Any]], Any]:
    return lambda coro: run_on(coro, request.param)
