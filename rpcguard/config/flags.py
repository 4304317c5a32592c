"""Every command-line flag of serve, connect and check, declared once.

How this works: one ``Flag`` row per flag says which subcommands take it, which config key it
sets (``tls.min_version`` for the whole config, or a key of the single listener/tunnel such as
``listen``), how argparse reads it and its help text. A help text's default is never written by
hand: ``{default}`` in it is filled from the config dataclass that holds that default
(``TlsConfig.min_version``, ``DEFAULT_METRICS``, ``SessionPolicy.mode``...). From this table
the CLI builds its parsers (``cli.py``), collects what was given (``flag_values``), and the config
layer lays flags over the file (``build_config``, through ``GLOBAL`` and ``ITEM``). A flag's key
is a row of its section's key table (``KEY_TABLES``), and its choices are that row's.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping

from rpcguard.config.model import DEFAULT_METRICS, LOGGER, ROLES, Config, LogConfig, TlsConfig, read_yaml, parse_config
from rpcguard.config.process import LOG_KEYS, METRICS_KEYS, TLS_KEYS
from rpcguard.config.read import FromFlag, Reader, choice, show
from rpcguard.config.sections import LIMIT_READERS, POLICY_READERS, PROFILE_ONLY_TOP_LIMITS
from rpcguard.protocol.side import SIDES
from rpcguard.errors import ConfigError
from rpcguard.protocol.settings import SessionPolicy

__all__ = ["KEY_TABLES", "Flag", "FLAGS", "GLOBAL", "ITEM", "flags_for", "flag_values", "help_text", "build_config", "log_warnings"]

Kind = Literal["value", "switch", "append", "float"]

#: section -> its key table: what a "section.key" flag may set (and where its choices come from)
KEY_TABLES: Mapping[str, Mapping[str, Reader]] = {
    "tls": TLS_KEYS, "metrics": METRICS_KEYS, "log": LOG_KEYS, "policy": POLICY_READERS, "limits": LIMIT_READERS,
}
# sections a listener/tunnel and a profile set again for themselves: a flag beats their values too
_LAYERED = ("policy", "limits")


@dataclass(frozen=True)
class Flag:
    name: str  # --name on the command line
    roles: frozenset[str]  # the subcommands that take it: serve, connect, check
    key: str | None  # "section.key" of the whole config, "key" of the single listener/tunnel, None: not config
    help: str  # may hold {default}
    kind: Kind = "value"
    metavar: str | None = None
    default: Callable[[str], str] | None = None  # role -> the default shown in the help

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")

    @property
    def scope(self) -> Literal["global", "item", "none"]:
        return "none" if self.key is None else "global" if "." in self.key else "item"

    @property
    def choices(self) -> tuple[str, ...] | None:
        """The allowed values, from the key's row in its section's table (None: not a choice)."""
        if self.scope != "global":
            return None
        section, key = self.key.split(".")  # type: ignore[union-attr]
        read = KEY_TABLES[section][key]
        return read.choices if isinstance(read, choice) else None


def _field_default(cls: type, name: str) -> Callable[[str], str]:
    value = next(f.default for f in dataclasses.fields(cls) if f.name == name)
    return lambda role: str(value)


def _metrics_default(role: str) -> str:
    if role in DEFAULT_METRICS:
        return str(DEFAULT_METRICS[role])
    return f"{DEFAULT_METRICS['serve']} for serve, {DEFAULT_METRICS['connect']} for connect"


_SC = frozenset({"serve", "connect"})
_ALL = frozenset({"serve", "connect", "check"})
_SERVE = frozenset({"serve"})
_CONNECT = frozenset({"connect"})
_PEER = frozenset({"connect", "check"})

FLAGS: tuple[Flag, ...] = (
    Flag("config", _ALL, None, "YAML config file (flags override it)"),
    Flag("cert", _ALL, "tls.cert", "this side's certificate (PEM)"),
    Flag("key", _ALL, "tls.key", "this side's private key (PEM, mode 0600)"),
    Flag("ca", _ALL, "tls.ca", "the private CA that signs the peers' certificates"),
    Flag("tls-min-version", _ALL, "tls.min_version", "lowest TLS version accepted (default {default})",
         default=_field_default(TlsConfig, "min_version")),
    Flag("crl", _SC, "tls.crl", "a CRL of --ca (PEM or DER): revoked peer certificates are refused at the handshake "
         "and their live sessions ended at reload (rpcguard certs revoke writes one)"),
    Flag("tls-reload-interval-s", _SC, "tls.reload_interval_s",
         "also reload when the certificate files change, polled this often (default {default}: SIGHUP only)",
         kind="float", metavar="SECONDS", default=_field_default(TlsConfig, "reload_interval_s")),
    Flag("metrics", _SC, "metrics.listen", "HOST:PORT of /metrics, /healthz, /readyz ('' = off; default {default})",
         default=_metrics_default),
    Flag("metrics-unsafe-public", _SC, "metrics.unsafe_public",
         "allow a non-loopback --metrics address (metrics name peers and listeners)", kind="switch"),
    Flag("web-config", _SC, "metrics.web_config",
         "TLS, client certificates and basic auth of the metrics endpoint (Prometheus exporter-toolkit web "
         "config format)", metavar="FILE"),
    Flag("mode", _SC, "policy.mode", "firewall mode (default {default})",
         default=_field_default(SessionPolicy, "mode")),
    Flag("allow-unverified-op", _SC, "policy.allow_unverified_ops",
         "forward graph nodes of this ggml op although it has no verified rule (default deny; repeatable; "
         "* = every op; counted per use)", kind="append", metavar="OP"),
    Flag("log-format", _SC, "log.format", "default {default}", default=_field_default(LogConfig, "format")),
    Flag("log-level", _ALL, "log.level", "default {default}", default=_field_default(LogConfig, "level")),
    # serve's listener
    Flag("listen", _SERVE, "listen", "HOST:PORT to accept mTLS on"),
    Flag("upstream", _SERVE, "upstream", "HOST:PORT of the ggml-rpc-server (loopback)"),
    Flag("unsafe-upstream", _SERVE, "unsafe_upstream", "allow a non-loopback upstream", kind="switch"),
    Flag("allow-cn", _SERVE, "allow_cn", "allow clients whose certificate has this CN (repeatable)", kind="append",
         metavar="X"),
    Flag("allow-dns", _SERVE, "allow_dns", "allow clients whose certificate has this DNS (repeatable)",
         kind="append", metavar="X"),
    Flag("allow-uri", _SERVE, "allow_uri", "allow clients whose certificate has this URI (repeatable)",
         kind="append", metavar="X"),
    Flag("allow-ip", _SERVE, "allow_ip", "allow clients whose certificate has this IP (repeatable)", kind="append",
         metavar="X"),
    Flag("allow-all", _SERVE, "allow_all",
         "allow any client certificate signed by --ca (required when no --allow-* is given)", kind="switch"),
    # connect's tunnel, and the node check runs against
    Flag("listen", _CONNECT, "listen", "loopback HOST:PORT for llama.cpp's --rpc"),
    Flag("server", _PEER, "server", "HOST:PORT of the node's rpcguard serve", metavar="HOST:PORT"),
    Flag("server-name", _PEER, "server_name", "name expected in the node's certificate (default: the host)"),
    Flag("unsafe-listen", _CONNECT, "unsafe_listen", "allow a non-loopback listen address", kind="switch"),
    Flag("no-check", _CONNECT, None, "skip the start-up TLS + HELLO check of each node", kind="switch"),
)

# flag dest -> (section, key) for the flags that set a key of the whole config
GLOBAL: Mapping[str, tuple[str, str]] = {
    f.dest: (f.key.split(".")[0], f.key.split(".")[1]) for f in FLAGS if f.key is not None and f.scope == "global"
}
# role -> the flags that set a key of its single listener / tunnel (allow_* go to its `allow`)
ITEM: Mapping[str, tuple[str, ...]] = {
    role: tuple(dict.fromkeys(f.dest for f in FLAGS if f.scope == "item" and role in f.roles))
    for role in ("serve", "connect")
}


def flags_for(role: str) -> tuple[Flag, ...]:
    """The flags of one subcommand, in table order."""
    return tuple(f for f in FLAGS if role in f.roles)


def help_text(flag: Flag, role: str) -> str:
    return flag.help.format(default=flag.default(role)) if flag.default is not None else flag.help


def flag_values(role: str, values: Any) -> dict[str, Any]:
    """The config-setting flags of ``role`` found on an argparse namespace (None/False/[] = not given)."""
    return {f.dest: getattr(values, f.dest) for f in flags_for(role) if f.key is not None and hasattr(values, f.dest)}


def _set_own(body: Any, sec: str, key: str, value: Any) -> Any:
    """``body`` (a listener, tunnel or profile) with ``value`` for ``sec.key`` where it sets that key itself."""
    if isinstance(body, dict) and isinstance(body.get(sec), dict) and key in body[sec]:
        return {**body, sec: {**body[sec], key: value}}
    return body


def _copy(d: Any) -> Any:
    return {} if d is None else dict(d) if isinstance(d, dict) else d


def build_config(role: str, *, file: str | None = None, overrides: Mapping[str, Any] | None = None) -> Config:
    """Config for ``rpcguard serve|connect``: the optional ``file`` with CLI ``overrides`` on top.

    Override values of None, False or an empty list mean "flag not given". A flag for a key of a
    section (``tls``, ``metrics``, ``log``, ``policy``, ``limits``: ``KEY_TABLES``) sets it at the top
    level, and a ``policy``/``limits`` flag also replaces the value a listener, tunnel or profile
    sets for itself: a flag beats the file everywhere. Listener flags (``listen``, ``upstream``, ``server``,
    ``allow_cn``...; ``allow_*`` replace that kind only) need at most one listener/tunnel in the
    file. Errors about a flag's value name the flag (``--upstream: ...``); relative paths given by
    flags are relative to the cwd.
    """
    if role not in ROLES:
        raise ConfigError("role", f"must be serve or connect, got {show(role)}")
    # the table's item flags, serve's command after --, and a listener's name (callers that build one)
    item_keys = {"serve": ITEM["serve"] + ("upstream_exec", "name"), "connect": ITEM["connect"] + ("name",)}
    data, source = (read_yaml(file), file) if file is not None else ({}, "<flags>")
    if not isinstance(data, dict):
        return parse_config(data, role, source=source)  # raises the top-level error
    flag = lambda k: "--" + k.replace("_", "-")  # noqa: E731
    given = {k: v for k, v in (overrides or {}).items() if v is not None and v is not False and v not in ([], ())}
    other = SIDES[role].other
    for k in given:
        if k not in GLOBAL and k not in item_keys[role]:
            raise ConfigError(flag(k), f"only valid for rpcguard {other}" if k in item_keys[other] else "unknown option")
    # every section a given flag sets (absent in the file: created), copied before it is changed
    data = {**data, **{sec: _copy(data.get(sec)) for sec in ("tls", *(GLOBAL[k][0] for k in given if k in GLOBAL))}}
    for k, (sec, key) in GLOBAL.items():
        if k in given and isinstance(data[sec], dict):
            data[sec][key] = FromFlag(given[k], flag(k))
    for k in ("cert", "key", "ca"):
        if isinstance(data["tls"], dict) and data["tls"].get(k) is None:
            raise ConfigError(flag(k), f"required (or tls.{k} in the config file)")
    items_key, word = SIDES[role].items, SIDES[role].item
    # a policy or limits flag beats the file everywhere: the listeners' (tunnels') and profiles' own value too
    for k, (sec, key) in GLOBAL.items():
        if k in given and sec in _LAYERED and isinstance(data[sec], dict):
            value = data[sec][key]
            if isinstance(data.get(items_key), list):
                data[items_key] = [_set_own(it, sec, key, value) for it in data[items_key]]
            if isinstance(data.get("profiles"), dict):
                if not (sec == "limits" and key in PROFILE_ONLY_TOP_LIMITS):  # (that error names the file's key)
                    data["profiles"] = {n: _set_own(p, sec, key, value) for n, p in data["profiles"].items()}
    items = data.get(items_key)
    item_flags = [k for k in item_keys[role] if k in given]
    if item_flags and (items is None or items == []):
        for k in ("listen", SIDES[role].target):
            if k not in given and not (k == "upstream" and "upstream_exec" in given):
                raise ConfigError(flag(k), f"required (no {word} in a config file)")
        items = [{}]
    if item_flags and isinstance(items, list) and len(items) > 1:
        raise ConfigError(flag(item_flags[0]), f"the config file defines {len(items)} {items_key}; "
                                               f"this flag can only configure a single {word}")
    if item_flags and isinstance(items, list) and isinstance(items[0], dict):
        item = dict(items[0])
        if any(k.startswith("allow_") for k in item_flags):  # the item's ACL, else the top-level one
            item["allow"] = _copy(data.get("allow") if item.get("allow") is None else item["allow"])
        for k in item_flags:
            if k.startswith("allow_") and isinstance(item["allow"], list):
                raise ConfigError(flag(k), "the config file's allow-list is a list of entries (profiles); "
                                           "put this identity in the file instead")
            if k.startswith("allow_"):
                if isinstance(item["allow"], dict):
                    v = given[k]
                    item["allow"][k[6:]] = FromFlag(v if k == "allow_all" else [v] if isinstance(v, str) else list(v),
                                                 flag(k))
            elif k == "upstream_exec":  # serve [options] -- COMMAND: the file's upstream mapping, this exec
                if "upstream" in given:
                    raise ConfigError("--upstream", "and a server command after -- exclude each other")
                up = item.get("upstream")
                item["upstream"] = {**up, "exec": given[k]} if isinstance(up, dict) else FromFlag(list(given[k]),
                                                                                             "serve -- COMMAND")
            else:
                item[k] = FromFlag(given[k], flag(k))
        data[items_key] = [item]
    return parse_config(data, role, source=source, base_dir=os.path.dirname(os.path.abspath(file)) if file else None)


def log_warnings(cfg: Config) -> None:
    """Log what ``cfg`` warns about (serve/connect at start and at each reload)."""
    log = logging.getLogger(LOGGER)
    for text in cfg.warnings:
        log.warning("%s", text)
