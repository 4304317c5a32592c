"""What a benchmark result needs to be read later: the machine, its load, and every version.

How this works: ``environment()`` is called once at the start of a run and gives the machine
(host, CPU model and count, kernel), the 1/5/15-minute load averages, and the versions of
everything on the measured path: llama-cpp-python and the ggml RPC protocol of the real peer
(``RPC_PROTO_*_VERSION`` from the ``ggml-rpc.h`` its wheel installs), stunnel, HAProxy,
OpenSSL, the harness's Python and uvloop. ``loadavg()`` is read again at the end of the run.
bench/report.py prints all of it in the report header.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import arms as armlib
from tests.support import realpeer

__all__ = ["environment", "loadavg", "peer_versions"]

_PEER_CODE = ("import importlib.metadata as m, importlib.util as u, os;"
              "s = u.find_spec('llama_cpp'); d = list(s.submodule_search_locations)[0];"
              "print(m.version('llama_cpp_python'));"
              "print(os.path.join(os.path.dirname(d), 'include', 'ggml-rpc.h'))")


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def peer_versions() -> dict[str, str]:
    """llama-cpp-python's version and the ggml RPC protocol version of the real peer."""
    try:
        out = subprocess.run([realpeer.realpeer_python(), "-c", _PEER_CODE], capture_output=True, text=True,
                             timeout=60, check=True).stdout.split("\n")
        version, header = out[0].strip(), Path(out[1].strip())
        parts = dict(re.findall(r"#define RPC_PROTO_(MAJOR|MINOR|PATCH)_VERSION\s+(\d+)", header.read_text()))
        proto = ".".join(parts.get(k, "?") for k in ("MAJOR", "MINOR", "PATCH"))
        return {"llama_cpp_python": version, "ggml_rpc_protocol": proto}
    except (OSError, IndexError, subprocess.SubprocessError, realpeer.MissingPeer) as exc:
        return {"llama_cpp_python": f"unknown ({exc!s:.80})", "ggml_rpc_protocol": "unknown"}


def _dist_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "missing"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def environment() -> tuple[dict, dict]:
    """(machine, versions) for the results header."""
    uname = platform.uname()
    machine = {"host": uname.node, "kernel": uname.release, "cpus": os.cpu_count(), "cpu_model": _cpu_model(),
               "python": platform.python_version(), "loadavg_start": loadavg()}
    versions = {**peer_versions(), **armlib.tool_versions(), "python": platform.python_version(),
                "uvloop": _dist_version("uvloop"), "rpcguard_core": _core()}
    return machine, versions


def _core() -> str:
    """Which protocol core the working tree's rpcguard runs (a ``--baseline`` tree is pure)."""
    out = subprocess.run([sys.executable, "-c", "from rpcguard.protocol import core_description as d; print(d())"],
                         capture_output=True, text=True, timeout=60)
    return out.stdout.strip() or f"unknown ({out.stderr.strip()[-80:]})"
