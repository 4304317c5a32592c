"""Command line: ``rpcguard serve|connect|check|check-config|certs|status``.

The only module that prints or exits. Exit codes: 0 success, 1 runtime failure (a node
refused, a port busy), 2 bad configuration or usage (one line naming the key or flag).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
import urllib.request
from typing import Sequence

from rpcguard import __version__
from rpcguard.audit import setup_logging
from rpcguard.errors import ConfigError, RpcGuardError

__all__ = ["main"]

log = logging.getLogger("rpcguard")

EXIT_OK, EXIT_FAIL, EXIT_CONFIG = 0, 1, 2


def _common_tls(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML config file (flags override it)")
    p.add_argument("--cert", help="this side's certificate (PEM)")
    p.add_argument("--key", help="this side's private key (PEM, mode 0600)")
    p.add_argument("--ca", help="the private CA that signs the peers' certificates")
    p.add_argument("--tls-min-version", choices=["1.2", "1.3"], help="default 1.3")
    p.add_argument("--metrics", help="HOST:PORT of /metrics, /healthz, /readyz ('' = off)")
    p.add_argument("--mode", choices=["enforce", "monitor"], help="firewall mode (default enforce)")
    p.add_argument("--log-format", choices=["text", "json"])
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="rpcguard", description="Mutual-TLS tunnel and frame firewall for ggml-rpc.")
    ap.add_argument("--version", action="version", version=f"rpcguard {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="on a GPU node: mTLS in front of a loopback ggml-rpc-server")
    _common_tls(s)
    s.add_argument("--listen", help="HOST:PORT to accept mTLS on")
    s.add_argument("--upstream", help="HOST:PORT of the ggml-rpc-server (loopback)")
    s.add_argument("--unsafe-upstream", action="store_true", help="allow a non-loopback upstream")
    for kind in ("cn", "dns", "uri", "ip"):
        s.add_argument(f"--allow-{kind}", action="append", default=[], metavar="X",
                       help=f"allow clients whose certificate has this {kind.upper()} (repeatable)")
    s.add_argument("--allow-all", action="store_true",
                   help="allow any client certificate signed by --ca (required when no --allow-* is given)")

    c = sub.add_parser("connect", help="next to llama.cpp: a loopback port tunnelled to a node")
    _common_tls(c)
    c.add_argument("--listen", help="loopback HOST:PORT for llama.cpp's --rpc")
    c.add_argument("--server", help="HOST:PORT of the node's rpcguard serve")
    c.add_argument("--server-name", help="name expected in the node's certificate (default: the host)")
    c.add_argument("--unsafe-listen", action="store_true", help="allow a non-loopback listen address")
    c.add_argument("--no-check", action="store_true", help="skip the start-up TLS + HELLO check of each node")

    k = sub.add_parser("check", help="TLS + HELLO to each node of a connect config; one line per node")
    _common_tls(k)
    k.add_argument("--server")
    k.add_argument("--server-name")

    cc = sub.add_parser("check-config", help="validate a config file without starting")
    cc.add_argument("file")

    ce = sub.add_parser("certs", help="a private CA and leaf certificates")
    csub = ce.add_subparsers(dest="certs_command", required=True)
    ca = csub.add_parser("init-ca", help="create DIR/ca.pem and DIR/ca.key")
    ca.add_argument("dir")
    ca.add_argument("--days", type=int, default=365 * 5)
    ca.add_argument("--force", action="store_true")
    iss = csub.add_parser("issue", help="issue DIR/NAME.pem and DIR/NAME.key")
    iss.add_argument("dir")
    iss.add_argument("name")
    kind = iss.add_mutually_exclusive_group(required=True)
    kind.add_argument("--server", action="store_true")
    kind.add_argument("--client", action="store_true")
    iss.add_argument("--dns", action="append", default=[])
    iss.add_argument("--ip", action="append", default=[])
    iss.add_argument("--uri", action="append", default=[])
    iss.add_argument("--days", type=int, default=30)
    iss.add_argument("--force", action="store_true", help="replace an existing NAME.pem/NAME.key (renewal)")

    st = sub.add_parser("status", help="summarise a running instance from its metrics endpoint")
    st.add_argument("--metrics", default="127.0.0.1:9450", help="HOST:PORT of the instance's metrics")
    return ap


def _overrides(a: argparse.Namespace) -> dict:
    keys = ("cert", "key", "ca", "tls_min_version", "metrics", "mode", "log_format", "log_level", "listen",
            "upstream", "unsafe_upstream", "allow_cn", "allow_dns", "allow_uri", "allow_ip", "allow_all", "server",
            "server_name", "unsafe_listen")
    return {k: getattr(a, k) for k in keys if hasattr(a, k)}


def main(argv: Sequence[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    try:
        if a.command == "check-config":
            return _check_config(a.file)
        if a.command == "certs":
            return _certs(a)
        if a.command == "status":
            return _status(a.metrics)
        from rpcguard.config import build_config

        role = "connect" if a.command == "check" else a.command
        overrides = _overrides(a)
        if a.command == "check" and a.server:
            overrides["listen"] = "127.0.0.1:0"  # check binds nothing; a tunnel needs a listen address
        cfg = build_config(role, file=a.config, overrides=overrides)
    except ConfigError as exc:
        print(f"rpcguard: config error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except RpcGuardError as exc:
        print(f"rpcguard: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    setup_logging(cfg.log.format, cfg.log.level)
    if a.command == "check":
        return _run(_check_nodes(cfg))
    return _run(_serve(cfg, a.config, check=(a.command == "connect" and not a.no_check), overrides=_overrides(a)))


def _run(coro) -> int:
    try:
        import uvloop  # fast event loop where available (uvicorn's loops/auto.py does the same)

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    try:
        return runner(coro)
    except KeyboardInterrupt:
        return EXIT_OK


async def _serve(cfg, config_path: str | None, *, check: bool, overrides: dict | None = None) -> int:
    from rpcguard.server import Runtime
    from rpcguard.tls import TlsConfigError

    try:
        rt = Runtime(cfg, config_path=config_path, overrides=overrides)
    except (TlsConfigError, RpcGuardError) as exc:
        print(f"rpcguard: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        await rt.start()
    except OSError as exc:
        print(f"rpcguard: cannot listen: {exc}", file=sys.stderr)
        return EXIT_FAIL
    rt.install_signals()
    for lst in rt.listeners:
        r = lst.route
        print(f"rpcguard {r.role} {r.name}: listening on {lst.host}:{lst.port} -> {r.upstream_host}:{r.upstream_port}",
              file=sys.stderr, flush=True)
    if check:
        for line, _ok in await _probe_all(cfg, rt.tls.context):
            print(f"rpcguard check: {line}", file=sys.stderr, flush=True)
    print("RPCGUARD_READY", flush=True)
    await rt.stopping.wait()
    log.info("shutting down: draining sessions for up to %gs", cfg.limits.drain_timeout_s)
    cut = await rt.drain(cfg.limits.drain_timeout_s)
    log.info("stopped (%d session(s) cut at the drain timeout)", cut)
    return EXIT_OK


async def _probe_all(cfg, ctx) -> list[tuple[str, bool]]:
    from rpcguard.policy import session_policy
    from rpcguard.probe import probe_node

    results = await asyncio.gather(*(
        probe_node(t.name, t.server.host, t.server.port, ctx, t.server_name, policy=session_policy(t.policy),
                   timeout=cfg.limits.connect_timeout_s + cfg.limits.handshake_timeout_s)
        for t in cfg.tunnels
    ))
    return [(r.line(), r.ok) for r in results]


async def _check_nodes(cfg) -> int:
    from rpcguard.server import TlsMaterial

    tls = TlsMaterial(cfg)
    results = await _probe_all(cfg, tls.context)
    for line, _ok in results:
        print(line)
    return EXIT_OK if all(ok for _, ok in results) else EXIT_FAIL


def _check_config(path: str) -> int:
    from rpcguard.config import check_config, config_summary

    cfg = check_config(path)
    print(f"OK {path}: {cfg.role}")
    for line in config_summary(cfg):
        print("  " + line)
    return EXIT_OK


def _certs(a: argparse.Namespace) -> int:
    from rpcguard import certs

    if a.certs_command == "init-ca":
        files = certs.init_ca(a.dir, days=a.days, force=a.force)
        print(f"wrote {files.cert} and {files.key} (0600)")
    else:
        files = certs.issue(a.dir, a.name, server=a.server, dns=a.dns, ips=a.ip, uris=a.uri, days=a.days,
                            force=a.force)
        print(f"wrote {files.cert} and {files.key} (0600): {certs.describe(files.cert)}")
    return EXIT_OK


RECENT_SHOWN = 10  # recent refusals printed by `rpcguard status`


def _recent_refusals(metrics_url: str) -> list[dict]:
    """The instance's last refusals (GET /refusals next to /metrics); [] if it has none."""
    try:
        with urllib.request.urlopen(metrics_url.rsplit("/metrics", 1)[0] + "/refusals", timeout=5) as rsp:
            return json.loads(rsp.read().decode())
    except (OSError, ValueError):
        return []


def _status(address: str) -> int:
    from prometheus_client.parser import text_string_to_metric_families

    url = address if address.startswith("http") else f"http://{address}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=5) as rsp:
            text = rsp.read().decode()
    except OSError as exc:
        print(f"rpcguard status: cannot read {url}: {exc}", file=sys.stderr)
        return EXIT_FAIL
    fam = {f.name: f for f in text_string_to_metric_families(text)}

    def samples(name: str):
        return fam[name].samples if name in fam else []

    print(f"rpcguard instance at {url}")
    for s in samples("rpcguard_sessions_active"):
        done = {x.labels["result"]: int(x.value) for x in samples("rpcguard_sessions")
                if x.name == "rpcguard_sessions_total" and x.labels.get("listener") == s.labels["listener"]}
        print(f"  {s.labels['role']} {s.labels['listener']}: {int(s.value)} active, "
              + ", ".join(f"{k} {v}" for k, v in sorted(done.items())))
    for s in samples("rpcguard_upstream_protocol_info"):
        print(f"  upstream {s.labels['upstream']} speaks protocol {s.labels['version']}")
    refusals = [s for s in samples("rpcguard_refusals") if s.name == "rpcguard_refusals_total" and s.value]
    print("  refusals since start: " + (", ".join(f"{s.labels['reason']}={int(s.value)} ({s.labels['listener']})"
                                                  for s in refusals) or "none"))
    for r in _recent_refusals(url)[-RECENT_SHOWN:]:
        ago = time.time() - r.get("time", 0)
        print(f"    {ago:7.0f} s ago  {r.get('role')} {r.get('listener')}  {r.get('reason')}"
              f"  peer={r.get('peer')} identity={r.get('identity') or '-'}"
              + (f" command={r['command']}" if r.get("command") else "") + f"  {r.get('detail') or ''}")
    now = time.time()
    for s in samples("rpcguard_certificate_expiry_timestamp_seconds"):
        days = (s.value - now) / 86400
        warn = "  <-- renew soon" if days < 7 else ""
        print(f"  certificate {s.labels['certificate']} expires in {days:.1f} days{warn}")
    return EXIT_OK
