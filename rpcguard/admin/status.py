"""``rpcguard status``: read running instances' metrics endpoints and summarise them for a person.

How this works: ``Access`` says how to reach an endpoint: plain HTTP, or HTTPS verified against a
CA (``--ca``) with an optional client certificate (``--cert``/``--key``, for a web config with
``RequireAndVerifyClientCert``) and basic auth (``--user``, the password from
``RPCGUARD_METRICS_PASSWORD`` or ``--password-file``, never the command line). ``from_config``
takes the address and the scheme from a serve/connect config and its web config. ``read`` fetches
``/metrics``, ``/refusals`` and ``/readyz``; ``summary`` turns them into lines (the CLI prints
them). Every way an endpoint can fail to answer is one line naming what to pass
(``StatusError``): TLS on a plain URL, a certificate not verified, a client certificate or a
password required.
"""

from __future__ import annotations

import base64
import datetime as dt
import http.client
import json
import os
import ssl
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from urllib.parse import urlsplit

from rpcguard.errors import ConfigError, RpcGuardError

__all__ = ["Access", "StatusError", "Instance", "metrics_url", "read", "summary", "RECENT_SHOWN",
           "PASSWORD_ENV"]

RECENT_SHOWN = 10  # recent refusals printed
READ_TIMEOUT_S = 5.0
PASSWORD_ENV = "RPCGUARD_METRICS_PASSWORD"
RENEW_SOON_DAYS = 7


class StatusError(RpcGuardError):
    """An endpoint did not give its metrics; the message says what to pass instead."""


@dataclass(frozen=True)
class Access:
    """How to reach the endpoints: TLS material, the name in their certificate, basic auth."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    server_name: str | None = None
    user: str | None = None
    password: str | None = None

    def context(self) -> ssl.SSLContext | None:
        if self.ca is None and self.cert is None:
            return None
        ctx = ssl.create_default_context(cafile=self.ca) if self.ca else ssl.create_default_context()
        if self.cert:
            try:
                ctx.load_cert_chain(self.cert, self.key)
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError("--cert", f"{self.cert}, {self.key}: cannot load certificate and key: {exc}") from None
        return ctx

    def headers(self) -> dict[str, str]:
        if self.user is None:
            return {}
        token = base64.b64encode(f"{self.user}:{self.password or ''}".encode()).decode()
        return {"Authorization": f"Basic {token}"}


def password_from(file: str | None) -> str | None:
    """``--password-file`` (first line), else ``$RPCGUARD_METRICS_PASSWORD``, else None."""
    if file is not None:
        try:
            with open(file, encoding="utf-8") as f:
                return f.readline().rstrip("\r\n")
        except OSError as exc:
            raise ConfigError("--password-file", f"{file}: {exc.strerror or exc}") from None
    return os.environ.get(PASSWORD_ENV)


def metrics_url(text: str) -> str:
    """``HOST:PORT``, ``http(s)://HOST:PORT`` with or without a path -> the /metrics URL."""
    if "://" not in text:
        text = "http://" + text
    try:
        u = urlsplit(text)
        port = u.port
    except ValueError as exc:
        raise ConfigError("--metrics", f"{text!r}: {exc}") from None
    if u.scheme not in ("http", "https") or not u.hostname or port is None and "://" not in text:
        raise ConfigError("--metrics", f"{text!r}: expected HOST:PORT or http(s)://HOST:PORT[/metrics]")
    path = u.path.rstrip("/")
    if not path.endswith("/metrics"):
        path += "/metrics"
    return f"{u.scheme}://{u.netloc}{path}"


def from_config(path: str) -> tuple[str, Access]:
    """The metrics URL of a serve/connect config and how to read it (its web config's TLS, its CA)."""
    from rpcguard.config.model import load_config
    from rpcguard.observe.webconfig import load_web_config

    cfg = load_config(path)
    listen = cfg.metrics.listen
    if listen is None:
        raise ConfigError("metrics.listen", f"{path}: the metrics endpoint is off (metrics.listen: '')")
    web = load_web_config(cfg.metrics.web_config) if cfg.metrics.web_config else None
    host = "127.0.0.1" if listen.host in ("0.0.0.0", "") else "::1" if listen.host == "::" else listen.host
    where = f"[{host}]:{listen.port}" if ":" in host else f"{host}:{listen.port}"
    if web is None or not web.tls:
        return f"http://{where}/metrics", Access()
    # The metrics certificate is normally issued by the fleet's CA (deploy/README.md).
    return f"https://{where}/metrics", Access(ca=cfg.tls.ca)


@dataclass
class Instance:
    """What one endpoint said."""

    url: str
    families: dict
    refusals: list
    ready: tuple[int, str] | None  # (HTTP status, body) of /readyz, None if it did not answer


def _open(url: str, access: Access, ctx: ssl.SSLContext | None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers=access.headers())
    handlers: list = [urllib.request.HTTPSHandler(context=ctx)] if ctx is not None else []
    if access.server_name is not None and ctx is not None:
        handlers = [_NamedHTTPSHandler(ctx, access.server_name)]
    opener = urllib.request.build_opener(*handlers)
    try:
        with opener.open(req, timeout=READ_TIMEOUT_S) as rsp:
            return rsp.status, rsp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


class _NamedHTTPSHandler(urllib.request.HTTPSHandler):
    """HTTPS to an address whose certificate names another host (``--server-name``)."""

    def __init__(self, ctx: ssl.SSLContext, name: str) -> None:
        super().__init__(context=ctx)
        self._ctx, self._name = ctx, name

    def https_open(self, req):
        ctx, name = self._ctx, self._name

        class Conn(http.client.HTTPSConnection):
            def connect(self) -> None:
                http.client.HTTPConnection.connect(self)
                self.sock = ctx.wrap_socket(self.sock, server_hostname=name)  # the name is checked here

        return self.do_open(lambda host, **kw: Conn(host, timeout=kw.get("timeout", READ_TIMEOUT_S)), req)


def _why(url: str, exc: BaseException, access: Access) -> str:
    """One line: why ``url`` did not answer, and what to pass."""
    inner = getattr(exc, "reason", None) or exc
    text = str(inner)
    if isinstance(inner, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in text:
        what = getattr(inner, "verify_message", None) or text
        hint = ("pass --ca FILE, the CA that signed the metrics certificate" if access.ca is None
                else "--server-name NAME if it names another host")
        return f"cannot verify the TLS certificate of {url} ({what}): {hint}"
    hung_up = isinstance(inner, (http.client.RemoteDisconnected, http.client.BadStatusLine, ConnectionResetError))
    if (isinstance(inner, ssl.SSLError) and ("CERTIFICATE_REQUIRED" in text or "certificate required" in text)) \
            or (hung_up and url.startswith("https://") and access.cert is None):
        # TLS 1.3: a server that requires a client certificate often just closes after the handshake
        return f"{url} requires a client certificate: pass --cert FILE --key FILE (one its web config's CA signed)"
    if isinstance(inner, ssl.SSLError) and "WRONG_VERSION_NUMBER" in text.upper():
        return f"{url}: the endpoint does not speak TLS: use http://"
    if hung_up and url.startswith("http://"):
        return (f"{url}: the endpoint hung up on plain HTTP; it probably serves TLS (a web config): use "
                "https://HOST:PORT with --ca (and --cert/--key, --user if its web config asks), or --config FILE")
    return f"cannot read {url}: {text or type(inner).__name__}"


def _get(url: str, access: Access, ctx: ssl.SSLContext | None) -> tuple[int, bytes]:
    try:
        return _open(url, access, ctx)
    except (OSError, http.client.HTTPException, ssl.SSLError) as exc:  # URLError is an OSError
        raise StatusError(_why(url, exc, access)) from None


def read(url: str, access: Access) -> Instance:
    """/metrics, /refusals and /readyz of one endpoint; raises ``StatusError`` (or ConfigError)."""
    ctx = access.context() if url.startswith("https://") else None
    code, body = _get(url, access, ctx)
    if code == 401:
        raise StatusError(f"{url}: 401 unauthorized: pass --user USER and the password in ${PASSWORD_ENV} "
                          "or --password-file FILE" if access.user is None else
                          f"{url}: 401 unauthorized: wrong user or password")
    if code == 400 and url.startswith("http://"):  # a TLS port answering plain HTTP
        raise StatusError(f"{url}: the endpoint refused plain HTTP (400); it probably serves TLS (a web config): "
                          "use https://HOST:PORT with --ca (and --cert/--key, --user if its web config asks), "
                          "or --config FILE")
    if code != 200:
        raise StatusError(f"cannot read {url}: HTTP {code}")
    try:
        fam = _families(body.decode("utf-8", "replace"))
    except ValueError as exc:
        raise StatusError(f"cannot read {url}: {exc}") from None
    base = url.rsplit("/metrics", 1)[0]
    try:
        code, raw = _get(base + "/refusals", access, ctx)
        refusals = json.loads(raw.decode()) if code == 200 else []
    except (StatusError, ValueError):
        refusals = []
    try:
        code, raw = _get(base + "/readyz", access, ctx)
        ready: tuple[int, str] | None = (code, raw.decode("utf-8", "replace").strip())
    except StatusError:
        ready = None
    return Instance(url, fam, refusals if isinstance(refusals, list) else [], ready)


def _families(text: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    try:
        fam = {f.name: f for f in text_string_to_metric_families(text)}
    except ValueError as exc:
        raise ValueError(f"not an rpcguard metrics page ({exc})") from None
    if not any(name.startswith("rpcguard_") for name in fam):
        raise ValueError("not an rpcguard metrics page")
    return fam


def _date(epoch: float) -> str:
    return dt.datetime.fromtimestamp(epoch, dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def summary(inst: Instance, now: float | None = None) -> list[str]:
    """The lines ``rpcguard status`` prints for one instance."""
    now = time.time() if now is None else now
    fam = inst.families

    def samples(name: str):
        return fam[name].samples if name in fam else []

    out = [f"rpcguard instance at {inst.url}"]
    for s in samples("rpcguard_build_info"):
        out.append(f"  {s.labels.get('role')} {s.labels.get('version')}, python {s.labels.get('python')}, "
                   f"protocol core: {s.labels.get('core', 'unknown')}")
    if inst.ready is None:
        out.append("  ready: unknown (/readyz did not answer)")
    else:
        code, body = inst.ready
        out.append(f"  ready: {'yes' if code == 200 else f'NO ({code})'}" + (f" - {body}" if body else ""))
    not_sessions = ("probe", "no_hello")
    for s in samples("rpcguard_sessions_active"):
        done = {x.labels["result"]: int(x.value) for x in samples("rpcguard_sessions")
                if x.name == "rpcguard_sessions_total" and x.labels.get("listener") == s.labels["listener"]}
        others = ", ".join(f"{k} {done.pop(k)}" for k in not_sessions if k in done and done[k]) or ""
        for k in not_sessions:
            done.pop(k, None)
        enforcing = [x.value for x in samples("rpcguard_listener_enforcing")
                     if x.labels.get("listener") == s.labels["listener"] and x.labels.get("role") == s.labels["role"]]
        off = [x.labels["what"] for x in samples("rpcguard_listener_switched_off")
               if x.value and x.labels.get("listener") == s.labels["listener"] and x.labels.get("role") == s.labels["role"]]
        mode = "" if not enforcing or enforcing[0] else "  NOT ENFORCING (" + ", ".join(off) + ")"
        out.append(f"  {s.labels['role']} {s.labels['listener']}: {int(s.value)} active, "
                   + ", ".join(f"{k} {v}" for k, v in sorted(done.items()))
                   + (f" (not sessions: {others})" if others else "") + mode)
    for s in samples("rpcguard_upstream_protocol_info"):
        out.append(f"  upstream {s.labels['upstream']} speaks protocol {s.labels['version']}")
    refusals = [s for s in samples("rpcguard_refusals") if s.name == "rpcguard_refusals_total" and s.value]
    out.append("  refusals since start: " + (", ".join(f"{s.labels['reason']}={int(s.value)} ({s.labels['listener']})"
                                                      for s in refusals) or "none"))
    for r in inst.refusals[-RECENT_SHOWN:]:
        if not isinstance(r, dict):
            continue
        ago = now - float(r.get("time", 0) or 0)
        out.append(f"    {ago:7.0f} s ago  {r.get('role')} {r.get('listener')}  {r.get('reason')}"
                   f"  peer={r.get('peer')} identity={r.get('identity') or '-'}"
                   + (f" command={r['command']}" if r.get("command") else "") + f"  {r.get('detail') or ''}")
    files = {(s.labels.get("role"), s.labels.get("certificate")): s.labels.get("file")
             for s in samples("rpcguard_certificate_file_info")}
    for s in samples("rpcguard_certificate_expiry_timestamp_seconds"):
        days = (s.value - now) / 86400
        warn = "  <-- renew soon" if days < RENEW_SOON_DAYS else ""
        where = files.get((s.labels.get("role"), s.labels["certificate"]))
        out.append(f"  certificate {s.labels['certificate']}" + (f" {where}" if where else "")
                   + f" expires {_date(s.value)}, in {days:.1f} days{warn}")
    for s in samples("rpcguard_certificate_warning"):
        if s.value:
            out.append(f"  certificate warning: {s.labels['kind']} (see the instance's log)")
    for s in samples("rpcguard_metrics_unprotected"):
        if s.value:
            out.append("  WARNING metrics endpoint served beyond loopback without TLS and authentication")
    return out
