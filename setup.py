"""Build of rpcguard: the per-frame hot path of the protocol core compiled by mypyc, or pure Python.

How this works: ``pip install`` (also ``pip install -e .``) runs this file through the setuptools
backend. It asks mypyc (shipped in the mypy wheel, a build requirement in pyproject.toml) to turn
the modules of ``HOT_MODULES`` into C extension modules built with the machine's C compiler. The
same sources stay the pure-Python fallback: when ``RPCGUARD_PURE_PYTHON=1`` is set, when mypyc
cannot be imported, or when the C compile fails, the package is installed pure and one line says
why. ``rpcguard.protocol.compiled()`` (and ``rpcguard --version``) tell at run time which one is
in use.
"""

from __future__ import annotations

import functools
import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# The modules every frame goes through (framing, the session's per-frame step, the firewall's
# checks, tensor head decode, the caches and counters, the graph walk and per-op checks), chosen by
# measurement (docs/performance.md, "Compiled core"). Compiling also the rule tables (oprules,
# versions, ggml) or the per-read lifecycle (lifecycle, linkstate, endings, settings) gave no gain
# beyond the noise, so they stay Python. cost and workbuf (the compute estimate and the planner's
# work buffer of every node the graph walk has not seen yet) cut a cold 77-node graph's validation
# by ~12 % (docs/performance.md, "Round of 2026-12-02"); checks is the firewall's per-command half.
HOT_MODULES = ("framing", "session", "commands", "checks", "firewall", "tensor", "state", "stats", "graph", "opcheck", "cost",
               "workbuf")
PURE_ENV = "RPCGUARD_PURE_PYTHON"
GROUP = "rpcguard_core"  # mypyc's shared library of the compiled modules: rpcguard_core__mypyc
PLACEHOLDER = "rpcguard_core__placeholder"
BUILD_COMMANDS = {"editable_wheel", "bdist_wheel", "build", "build_ext", "install", "develop"}
HERE = os.path.dirname(os.path.abspath(__file__))


def say(msg: str) -> None:
    print(f"rpcguard build: {msg}", file=sys.stderr, flush=True)


def remove_stale() -> None:
    """Delete compiled modules an earlier (editable, in-place) build left in the source tree: an
    extension module is imported before the .py of the same name."""
    for folder, prefix in ((HERE, GROUP), (os.path.join(HERE, "rpcguard", "protocol"), "")):
        for name in os.listdir(folder):
            if name.startswith(prefix) and name.endswith((".so", ".pyd")):
                os.remove(os.path.join(folder, name))


class OptionalBuildExt(build_ext):
    """build_ext that falls back to the pure-Python package when the C compile fails: all the
    compiled modules or none (a shim without its group library would not import)."""

    def finalize_options(self) -> None:
        # mypyc runs here, not when setup.py is loaded, and only in the process that builds: pip
        # also loads setup.py for the build requirements and the metadata (egg_info, dist_info).
        if any(ext.name == PLACEHOLDER for ext in self.distribution.ext_modules or ()):
            building = bool(BUILD_COMMANDS & set(sys.argv))
            self.distribution.ext_modules = ext_modules() if building else []
        super().finalize_options()

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # compiler missing or failing: the Python sources are the package
            say(f"compiling the protocol core failed ({exc}); installing pure Python")
            for path in self.get_outputs():
                if os.path.exists(path):
                    os.remove(path)
            self.extensions = []
        else:
            if self.extensions:
                say(f"compiled protocol core: {len(self.extensions) - 1} modules with mypyc")


@functools.cache  # setuptools may finalize build_ext more than once per process
def ext_modules() -> list:
    if os.environ.get(PURE_ENV, "") not in ("", "0"):
        say(f"{PURE_ENV} is set: installing pure Python")
        return []
    try:
        from mypyc.build import mypycify
    except ImportError as exc:
        say(f"mypyc is not available ({exc}); installing pure Python")
        return []
    paths = [os.path.join("rpcguard", "protocol", f"{m}.py") for m in HOT_MODULES]
    try:
        # mypyc type-checks with the project's mypy settings; warn_unused_ignores would turn an
        # ignore that only the full run needs into an error here.
        return mypycify(["--config-file=pyproject.toml", "--no-warn-unused-ignores", *paths],
                        opt_level="3", group_name=GROUP)
    except (Exception, SystemExit) as exc:  # a mypyc error must not stop the install
        say(f"mypyc could not compile the protocol core ({exc!r}); installing pure Python")
        return []


# An in-place build (pip install -e ., setup.py develop / build_ext --inplace) replaces what the
# last one put into the source tree, before anything is compiled: a module dropped from
# HOT_MODULES, or a pure build, must not leave its extension module behind to be imported.
if {"editable_wheel", "develop", "--inplace", "-i"} & set(sys.argv):
    remove_stale()

# A placeholder: it makes setuptools run build_ext, which swaps in mypyc's extensions (or none).
setup(ext_modules=[Extension(PLACEHOLDER, sources=[])], cmdclass={"build_ext": OptionalBuildExt})
