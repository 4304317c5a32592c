"""The sans-IO ggml-rpc protocol core: framing, session, firewall.

How this works: the per-frame hot path (the modules setup.py names in ``HOT_MODULES``) is compiled
to C extension modules by mypyc at ``pip install`` when a C compiler is there; otherwise, or with
``RPCGUARD_PURE_PYTHON=1`` at install time, the same sources run as pure Python. ``compiled()``
says which one this process imported.
"""

from __future__ import annotations

from importlib.machinery import EXTENSION_SUFFIXES

__all__ = ["compiled", "core_description"]


def compiled() -> bool:
    """True when the protocol core's hot path runs compiled (mypyc extension modules)."""
    from rpcguard.protocol import session

    return (session.__file__ or "").endswith(tuple(EXTENSION_SUFFIXES))


def core_description() -> str:
    """One line for ``--version`` and the start-up log: which protocol core is in use."""
    if compiled():
        return "protocol core: compiled (mypyc)"
    return "protocol core: pure Python"
