"""``tls``, ``metrics`` and ``log``: the process-wide sections, one table row per key.

How this works: as for ``policy`` and ``limits`` (config/sections.py), each YAML key is one row
of ``TLS_KEYS`` / ``METRICS_KEYS`` / ``LOG_KEYS`` naming the reader that checks and converts it;
the dataclass field of the same name holds its default. The allowed values of a choice come from
the one place that defines them (``pki/tlsversion.py`` for ``min_version``, the ``Literal`` types
below for the log settings), so a default or a list of allowed values is written once, and the
CLI flags take their choices from these rows (config/flags.py). A file path is read relative to
the config file's directory: its rows hold ``FILE``, bound to that directory per parse.
``KEY_TABLES`` names every section's table: a flag may set a key of any of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal, Mapping, get_args

from rpcguard.config.read import (
    Address, Reader, Section, boolean, choice, duration, file_path, listen_address,
)
from rpcguard.errors import ConfigError
from rpcguard.pki.tlsversion import DEFAULT_MIN_VERSION, TLS_MIN_VERSIONS, TlsVersion

__all__ = ["TlsConfig", "MetricsConfig", "LogConfig", "DEFAULT_METRICS", "TLS_KEYS", "METRICS_KEYS", "LOG_KEYS",
           "FILE", "parse_tls", "parse_metrics", "parse_log"]

LogFormat = Literal["text", "json"]
LogLevel = Literal["debug", "info", "warning", "error"]


@dataclass(frozen=True, slots=True)
class TlsConfig:
    cert: str  # absolute paths, checked readable at load time
    key: str
    ca: str
    min_version: TlsVersion = DEFAULT_MIN_VERSION
    reload_interval_s: float = 0.0  # 0 = reload on SIGHUP only; > 0 also polls the files' mtimes
    crl: str | None = None  # a CRL (PEM or DER) of the CA, checked at every handshake (pki/crl.py)


@dataclass(frozen=True, slots=True)
class MetricsConfig:
    listen: Address | None = None  # None = metrics HTTP endpoint disabled
    unsafe_public: bool = False
    web_config: str | None = None  # exporter-toolkit web config file (TLS, basic auth), absolute


@dataclass(frozen=True, slots=True)
class LogConfig:
    format: LogFormat = "text"
    level: LogLevel = "info"


# metrics.listen when the file does not say (loopback: the metrics name peers and listeners)
DEFAULT_METRICS = MappingProxyType({"serve": Address("127.0.0.1", 9450), "connect": Address("127.0.0.1", 9451)})

#: a readable file, relative to the config file's directory (bound per parse by ``_bound``)
FILE: Reader = file_path(None)


def _listen_or_off(v: Any, path: str) -> Address | None:
    return None if v == "" else listen_address(v, path)


# YAML key under `tls:` -> reader (the TlsConfig field has the same name); cert, key, ca required
TLS_KEYS: Mapping[str, Reader] = MappingProxyType({
    "cert": FILE, "key": FILE, "ca": FILE,
    "min_version": choice(*TLS_MIN_VERSIONS),
    "reload_interval_s": duration(zero_is_off=True),
    "crl": FILE,
})
_TLS_REQUIRED = ("cert", "key", "ca")
# YAML key under `metrics:` -> reader ('' or null listen = off; absent = DEFAULT_METRICS of the role)
METRICS_KEYS: Mapping[str, Reader] = MappingProxyType({
    "unsafe_public": boolean, "web_config": FILE, "listen": _listen_or_off,
})
# YAML key under `log:` -> reader
LOG_KEYS: Mapping[str, Reader] = MappingProxyType({
    "format": choice(*get_args(LogFormat)), "level": choice(*get_args(LogLevel)),
})


def _bound(keys: Mapping[str, Reader], base_dir: str | None) -> dict[str, Reader]:
    at = file_path(base_dir)
    return {k: at if r is FILE else r for k, r in keys.items()}


def parse_tls(data: Any, base_dir: str | None) -> TlsConfig:
    if data is None:
        raise ConfigError("tls", "required (cert, key and ca)")
    s = Section(data, "tls", set(TLS_KEYS))
    return TlsConfig(**{k: s.get(k, read) for k, read in _bound(TLS_KEYS, base_dir).items()
                        if k in _TLS_REQUIRED or s.raw(k)[0] is not None})  # get: "required" when absent


def parse_metrics(data: Any, role: str, base_dir: str | None) -> tuple[MetricsConfig, str]:
    """The metrics endpoint, and the key path (or flag) of its ``listen`` for clash errors."""
    from rpcguard.observe.webconfig import load_web_config

    s = Section(data, "metrics", set(METRICS_KEYS))
    values = s.read_all(_bound(METRICS_KEYS, base_dir))
    if "listen" not in s.data:
        values["listen"] = DEFAULT_METRICS[role]
    cfg = MetricsConfig(**values)
    web = load_web_config(cfg.web_config) if cfg.web_config else None
    path = s.raw("listen")[1]
    # Beyond loopback the endpoint must authenticate (TLS plus a verified client certificate
    # or a password), or the operator says unsafe_public: /refusals names peers and identities.
    if cfg.listen is not None and not cfg.listen.is_loopback() and not cfg.unsafe_public and not (
            web and web.tls and web.authenticates):
        why = ("its web config must enable TLS and require RequireAndVerifyClientCert or basic_auth_users"
               if web else "set metrics.web_config (TLS + client certificates or basic auth)")
        how = "pass --metrics-unsafe-public" if path.startswith("--") else "set metrics.unsafe_public: true"
        raise ConfigError(path, f"{cfg.listen} is not loopback; {why}, or {how} to serve metrics beyond this host "
                                "unprotected")
    return cfg, path


def parse_log(data: Any) -> LogConfig:
    return LogConfig(**Section(data, "log", set(LOG_KEYS)).read_all(LOG_KEYS))
