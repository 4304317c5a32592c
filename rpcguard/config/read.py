"""The value readers and the section walker of the config modules.

How this works: a reader is ``(value, key path) -> value``; it returns the checked (and
converted) value or raises ``ConfigError(path, message)``, so every error is one line naming the
key (``listeners[1].upstream: must be HOST:PORT ([IPv6]:PORT), got 'foo'``). ``Section`` walks one
mapping: it refuses unknown keys, knows its path, and unwraps values that came from a CLI flag
(``FromFlag``) so their errors name the flag. The public value parsers (``parse_address``,
``parse_size``) raise ``ValueError`` and are used by the CLI too. The ``_``-names are internal to
``config.py`` and ``rpcguard/config/sections.py``.
"""

from __future__ import annotations

import difflib

import ipaddress
import os
import re
from dataclasses import dataclass
from fractions import Fraction
from types import MappingProxyType
from typing import Any, Callable, Mapping

from rpcguard.protocol.ggml import OP_TABLES
from rpcguard.protocol.versions import CATEGORIES as _CATEGORIES
from rpcguard.protocol.versions import COMMAND_NAMES, KNOWN_VERSIONS, format_version

from rpcguard.errors import ConfigError

__all__ = ["CATEGORIES", "KIB", "MIB", "GIB", "Address", "Reader", "parse_address", "parse_size", "unknown_key"]

_OP_NAMES = frozenset(name for table in OP_TABLES.values() for name in table.ids)
KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30

#: ggml-rpc command names (index = wire id) and the ``allow_commands`` categories (``"@name"``),
#: both from the one command table in ``protocol.versions``.
CATEGORIES: Mapping[str, tuple[str, ...]] = MappingProxyType({"@" + k: v for k, v in _CATEGORIES.items()})


@dataclass(frozen=True, slots=True)
class Address:
    """A TCP endpoint; ``host`` is a name, an IPv4 address or a bare IPv6 address."""
    host: str
    port: int

    def is_loopback(self) -> bool:
        """True for ``localhost``, 127.0.0.0/8 and ::1 (also as ::ffff:127.x.y.z)."""
        if self.host.lower() == "localhost":
            return True
        ip = ipaddress.ip_address(self.host) if is_ip(self.host) else None
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return ip is not None and ip.is_loopback

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


# ---------------------------------------------------------------- public value parsers

_ADDR_RE = re.compile(r"\[([0-9A-Fa-f:.]+)\]:(\d{1,5})|([A-Za-z0-9_.-]+):(\d{1,5})")
_HOST_RE = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]{0,251}[A-Za-z0-9_])?")
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*")
_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": KIB, "mib": MIB, "gib": GIB, "tib": 1 << 40}


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _host_ok(host: Any) -> bool:
    """An IP address, or a host name (a numeric-looking name must be a real IPv4 address)."""
    return isinstance(host, str) and (is_ip(host) or (
        not re.fullmatch(r"[\d.]+", host) and _HOST_RE.fullmatch(host) is not None))


def parse_address(text: object, *, allow_port_zero: bool = False) -> Address:
    """Parse ``HOST:PORT`` or ``[IPv6]:PORT``; raises ``ValueError`` with a one-line message."""
    m = _ADDR_RE.fullmatch(text) if isinstance(text, str) else None
    if m is None:
        raise ValueError(f"must be HOST:PORT ([IPv6]:PORT), got {show(text)}")
    v6, host, port = m.group(1) is not None, m.group(1) or m.group(3), int(m.group(2) or m.group(4))
    if not (":" in host and is_ip(host) if v6 else _host_ok(host)):
        raise ValueError(f"bad {'IPv6 address' if v6 else 'host'} in {text!r}")
    if not (0 if allow_port_zero else 1) <= port <= 65535:
        raise ValueError(f"port must be {0 if allow_port_zero else 1}..65535, got {text!r}")
    return Address(str(ipaddress.IPv6Address(host)) if v6 else host, port)


def parse_size(value: object, *, allow_zero: bool = True) -> int:
    """Bytes from an int or a string like ``"64MiB"``/``"1.5GiB"``/``"10MB"``, computed exactly."""
    m = _SIZE_RE.fullmatch(value) if isinstance(value, str) else None
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    elif m and m.group(2).lower() in _SIZE_UNITS:
        exact = Fraction(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]
        if exact.denominator != 1:
            raise ValueError(f"must be a whole number of bytes, got {value!r}")
        n = int(exact)
    else:
        raise ValueError(f"must be a size in bytes (integer, or like '64MiB'), got {show(value)}")
    if n < 0 or (n == 0 and not allow_zero):
        raise ValueError(f"must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return n


# ---------------------------------------------------------------- readers: (value, path) -> value

Reader = Callable[[Any, str], Any]


def show(v: object) -> str:
    """A short one-line rendering of a bad value for an error message."""
    try:
        s = "a mapping" if isinstance(v, dict) else "a list" if isinstance(v, list) else repr(v)
    except ValueError:  # an int beyond sys.get_int_max_str_digits()
        s = f"a huge {type(v).__name__}"
    return s if len(s) <= 60 else s[:57] + "..."


def reader(ok: Callable[[Any], Any], want: str, conv: Callable[[Any], Any] = lambda v: v) -> Reader:
    """A reader accepting values where ``ok(v)``; otherwise ``"<path>: must be <want>, got <v>"``."""
    def read(v: Any, path: str) -> Any:
        if not ok(v):
            raise ConfigError(path, f"must be {want}, got {show(v)}")
        return conv(v)
    return read


def via(parse: Callable[..., Any], **kw: Any) -> Reader:
    """A reader from a public parser that raises ``ValueError``."""
    def read(v: Any, path: str) -> Any:
        try:
            return parse(v, **kw)
        except ValueError as e:
            raise ConfigError(path, str(e)) from None
    return read


def list_of(item: Reader) -> Reader:
    def read(v: Any, path: str) -> tuple:
        if not isinstance(v, list):
            raise ConfigError(path, f"must be a list, got {show(v)}")
        return tuple(item(x, f"{path}[{i}]") for i, x in enumerate(v))
    return read


def _re(pattern: str) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, str) and re.fullmatch(pattern, v) is not None


class choice:
    """A reader of one of ``choices``; flags take their argparse choices from it (config/flags.py).

    A float is read as text: YAML makes ``min_version: 1.3`` a float."""

    def __init__(self, *choices: str) -> None:
        self.choices = choices

    def __call__(self, v: Any, path: str) -> str:
        t = str(v) if isinstance(v, float) else v
        if t not in self.choices:
            raise ConfigError(path, f"must be one of {', '.join(self.choices)}, got {show(v)}")
        return t


def duration(zero_is_off: bool = False) -> Reader:
    def ok(v: Any) -> bool:  # abs(v) < 1e15 also refuses nan and inf
        return isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) < 1e15 and (
            v > 0 or (zero_is_off and v == 0))
    return reader(ok,
                   "a number of seconds " + (">= 0 (0 = off)" if zero_is_off else "> 0"), float)


def ip_text(v: Any, path: str) -> str:
    try:
        return str(ipaddress.ip_network(v if isinstance(v, str) else ""))
    except ValueError:
        raise ConfigError(path, f"must be an IP address or network, got {show(v)}") from None


text = reader(lambda v: isinstance(v, str) and v.strip() != "", "a non-empty string")
boolean = reader(lambda v: isinstance(v, bool), "true or false")
count = reader(lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0, "an integer > 0")
count_or_off = reader(lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 62,
                        "an integer >= 0 (0 = off)")
name_text = reader(_re(r"[A-Za-z0-9_.-]+"), "a name of letters, digits, '_', '.', '-'")
# Only versions rpcguard has a command table for: any other would refuse every session at HELLO.
_KNOWN_TEXT = tuple(format_version(v) for v in KNOWN_VERSIONS)
version_text = reader(lambda v: isinstance(v, str) and v.strip() in _KNOWN_TEXT,
                   "a protocol version rpcguard knows (" + ", ".join(_KNOWN_TEXT) + ")", str.strip)
uri_text = reader(_re(r"[A-Za-z][A-Za-z0-9+.-]*:\S+"), "a URI like 'spiffe://domain/workload'")
server_name_text = reader(_host_ok, "a host name or IP address")
command_name = reader(lambda v: isinstance(v, str) and (v in COMMAND_NAMES or v in CATEGORIES),
                   f"a command name like SET_TENSOR or a category ({', '.join(CATEGORIES)})")
op_name = reader(lambda v: isinstance(v, str) and v in _OP_NAMES,
              "a ggml op name like SSM_SCAN or GATED_DELTA_NET (see rpcguard/protocol/ggml.py)")
op_name_or_all = reader(lambda v: isinstance(v, str) and (v in _OP_NAMES or v == "*"),
                     "a ggml op name like IM2COL, or * for every op")
listen_address, connect_address = via(parse_address, allow_port_zero=True), via(parse_address)  # listen :0 = any port


def file_path(base_dir: str | None) -> Reader:
    """A readable regular file; relative to ``base_dir`` (the config's dir), or the cwd for flags."""
    def read(v: Any, path: str) -> str:
        p = os.path.expanduser(text(v, path))
        p = os.path.normpath(os.path.join(os.getcwd() if path.startswith("--") or base_dir is None
                                          else base_dir, p))
        if not os.path.isfile(p):
            raise ConfigError(path, f"{'not a regular file' if os.path.exists(p) else 'no such file'}: {p}")
        try:
            open(p, "rb").close()
        except OSError as e:
            raise ConfigError(path, f"cannot read {p}: {e.strerror}") from None
        return p
    return read


# ---------------------------------------------------------------- sections


@dataclass(frozen=True, slots=True)
class FromFlag:
    """A value set by a CLI flag: errors about it name the flag instead of the key path."""
    value: Any
    flag: str


_MISSING = object()


def unknown_key(key: Any, path: str, keys: set[str] | frozenset[str]) -> ConfigError:
    """The error for a key no reader knows: names the closest known key when one is near."""
    k = key if isinstance(key, str) and key.isprintable() else repr(key)
    near = difflib.get_close_matches(k, sorted(keys), n=1, cutoff=0.6)
    hint = f"did you mean {near[0]!r}? " if near else ""
    return ConfigError(f"{path}.{k}" if path else k, f"unknown key ({hint}expected one of: {', '.join(sorted(keys))})")


class Section:
    """One mapping being read: knows its path, rejects unknown keys, reads keys by reader."""

    def __init__(self, data: Any, path: str, keys: set[str] | frozenset[str]) -> None:
        data = {} if data is None else data
        if not isinstance(data, dict):
            raise ConfigError(path, f"must be a mapping, got {show(data)}")
        for k in data:
            if k not in keys:
                raise unknown_key(k, path, keys)
        self.data, self.path = data, path

    def raw(self, key: str) -> tuple[Any, str]:
        """(value, path-or-flag) with a ``FromFlag`` unwrapped; value None when absent."""
        v = self.data.get(key)
        return (v.value, v.flag) if isinstance(v, FromFlag) else (v, f"{self.path}.{key}" if self.path else key)

    def get(self, key: str, read: Reader, default: Any = _MISSING) -> Any:
        """Read ``key`` (absent or null -> ``default``; no default -> "required")."""
        v, path = self.raw(key)
        if v is None and default is _MISSING:
            raise ConfigError(path, "required")
        return default if v is None else read(v, path)

    def read_all(self, readers: Mapping[str, Reader]) -> dict[str, Any]:
        """Every key of ``readers`` that is set (not null), read."""
        return {k: self.get(k, r) for k, r in readers.items() if self.raw(k)[0] is not None}


def then(read: Reader, conv: Callable[[Any], Any]) -> Reader:
    return lambda v, path: conv(read(v, path))
