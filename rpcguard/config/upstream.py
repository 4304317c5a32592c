"""``upstream: {exec: [...], isolation: ..., sandbox: {...}, quarantine: {...}}`` of a serve listener.

How this works: ``parse_upstream(data, path)`` reads the mapping form of a listener's
``upstream`` (the string form ``HOST:PORT`` is a server someone else runs, read by config.py)
into ``UpstreamSettings``; errors are ``ConfigError`` naming the key path (or the flag: the
``serve -- COMMAND`` form arrives as a ``FromFlag``). rpcguard adds ``-H 127.0.0.1 -p PORT``
itself, so a command that sets a host or a port is an error.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

from rpcguard.config.read import FromFlag, Section, boolean, choice, duration, list_of, parse_size, reader, show
from rpcguard.errors import ConfigError
from rpcguard.upstream import gpu
from rpcguard.upstream.pool import HOST_OPTIONS, ISOLATIONS, UpstreamSettings
from rpcguard.upstream.sandbox import SANDBOX_MODES, SandboxSettings

__all__ = ["parse_upstream"]

# Sizes in bytes up to 2^63 - 1 (an off_t, an rlimit), as an integer or like "100GiB" (was a
# 31-bit count: 2 GiB and more, the documented 100 GiB cache quota included, failed check-config).
MAX_SIZE = (1 << 63) - 1
_KEYS = {"exec", "isolation", "spare", "start_timeout_s", "sandbox", "quarantine"}
_SANDBOX_KEYS = {"mode", "uid_base", "uid_count", "cache_root", "data_bytes", "nofile", "ro_paths", "cache_bytes",
                 "memory_bytes", "pids", "tmp_bytes", "log_lines_per_s", "log_burst", "log_bytes"}
_QUARANTINE_KEYS = {"crashes", "window_s", "duration_s"}

_text = reader(lambda v: isinstance(v, str) and v != "" and "\0" not in v, "a non-empty string")
_count = reader(lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**31, "an integer >= 0")
_uid = reader(lambda v: isinstance(v, int) and not isinstance(v, bool) and 1000 <= v < 2**31 - 2**20,
               "a uid >= 1000")


def _size(v: Any, path: str) -> int:
    try:
        n = parse_size(v)
    except ValueError as exc:
        raise ConfigError(path, str(exc)) from None
    if n > MAX_SIZE:
        raise ConfigError(path, f"must be at most 2^63 - 1 bytes, got {show(v)}")
    return n


_path = reader(lambda v: isinstance(v, str) and os.path.isabs(v), "an absolute path")


def _mode(v: Any, path: str) -> str:
    # YAML 1.1 reads a bare `off` as false
    return "off" if v is False else choice(*SANDBOX_MODES)(v, path)


def _command(v: Any, path: str) -> tuple[str, ...]:
    argv = list_of(_text)(v, path)
    if not argv:
        raise ConfigError(path, "must name the server's command (ggml-rpc-server [ARGS])")
    for arg in argv[1:]:
        if arg.split("=", 1)[0] in HOST_OPTIONS:
            raise ConfigError(path, f"sets {arg.split('=', 1)[0]}: rpcguard adds -H 127.0.0.1 -p PORT itself "
                                    f"(the server listens on loopback only, on a port it picks)")
    exe = argv[0] if os.path.isabs(argv[0]) else shutil.which(argv[0])
    if exe is None or not os.access(exe, os.X_OK):
        raise ConfigError(path, f"{argv[0]}: no such executable")
    return (os.path.realpath(exe), *argv[1:])


def parse_upstream(data: Any, path: str) -> UpstreamSettings:
    """The mapping form of ``upstream`` (see the module docstring)."""
    if isinstance(data, FromFlag):
        data = {"exec": data}  # errors about it name the flag (Section.raw unwraps it)
    if not isinstance(data, dict):
        raise ConfigError(path, f"must be HOST:PORT or a mapping with exec, got {show(data)}")
    s = Section(data, path, _KEYS)
    argv = s.get("exec", _command)
    kw: dict[str, Any] = {}
    if s.raw("isolation")[0] is not None:
        kw["isolation"] = s.get("isolation", choice(*ISOLATIONS))
    if s.raw("spare")[0] is not None:
        kw["spare"] = s.get("spare", boolean)
    if s.raw("start_timeout_s")[0] is not None:
        kw["start_timeout_s"] = s.get("start_timeout_s", duration())
    sb = Section(s.data.get("sandbox"), f"{path}.sandbox", _SANDBOX_KEYS)
    sbkw = sb.read_all({"mode": _mode, "uid_base": _uid, "uid_count": _count,
                        "cache_root": _path, "data_bytes": _size, "nofile": _count, "ro_paths": list_of(_path),
                        "cache_bytes": _size, "memory_bytes": _size, "pids": _count, "tmp_bytes": _size,
                        "log_lines_per_s": _count, "log_burst": _count, "log_bytes": _size})
    q = Section(s.data.get("quarantine"), f"{path}.quarantine", _QUARANTINE_KEYS)
    qkw = q.read_all({"crashes": _count, "window_s": duration(), "duration_s": duration(zero_is_off=True)})
    for key, attr in (("crashes", "quarantine_crashes"), ("window_s", "quarantine_window_s"),
                      ("duration_s", "quarantine_s")):
        if key in qkw:
            kw[attr] = qkw[key]
    # a GPU listener keeps the default isolation, one sandboxed process per session: content-indexed
    # ops reach device memory unchecked on CUDA (docs/gpu.md); another is said loudly at start
    return UpstreamSettings(exec=argv, sandbox=SandboxSettings(**sbkw), gpu=gpu.uses_gpu(argv), **kw)
