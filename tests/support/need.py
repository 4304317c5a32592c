"""A tool or module the suite needs and this machine lacks: a failure under CI, a skip elsewhere.

How this works: ``missing(what, install)`` fails the test when the environment variable ``CI`` is
set (``.ci/run`` sets it) and skips it otherwise; either way the message names the install step,
so nothing is skipped silently. ``module(name, install)`` imports ``name`` or calls ``missing``.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import NoReturn

import pytest

__all__ = ["missing", "module", "under_ci"]


def under_ci() -> bool:
    return bool(os.environ.get("CI"))


def missing(what: str, install: str) -> NoReturn:
    msg = f"{what} is missing: {install}"
    if under_ci():
        pytest.fail(msg + " (CI must not skip it)", pytrace=False)
    pytest.skip(msg)


def module(name: str, install: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        missing(f"the Python module {name} ({exc})", install)
