"""Prometheus metrics: lock-free counters, a custom collector, process metrics, fast exposition.

Stays whole (over 400 lines): every family is declared once here and written by the fast
exposition from the same table; splitting them would let the two drift apart.

How this works: client_python's ``Counter.labels(...).inc()`` looks the child up in a dict
and takes a lock on every call; at tens of thousands of frames per second that is real cost
on the single proxy thread. So the hot path only bumps plain ints in
:class:`~rpcguard.protocol.stats.SessionStats` lists and in :class:`ListenerTraffic` dicts,
and a custom collector (registered on an injectable ``CollectorRegistry``) turns them into
metric families at scrape time: for each listener it sums the folded totals of finished
sessions and the live counters of running ones. Every known label value (reasons from
``rpcguard.reasons``, firewall modes, session results, the listener's commands) is exported
at 0 from the start, so a series exists before its first event. prometheus_client's
``ProcessCollector`` and ``PlatformCollector`` sit on the same registry (``process_*``: CPU,
RSS, fds, start time), read from /proc at scrape time only.

The exposition is written by ``_render`` (byte-identical to ``generate_latest`` for the
families used here, with the label text cached) because the zero-initialised series made
``generate_latest`` cost ~10x more per scrape on the event-loop thread. The HTTP endpoint
(TLS, basic auth, /refusals, health) is ``rpcguard.observe.http``; ``start_http`` is
re-exported here. The config default is loopback (``127.0.0.1:9450`` for serve,
``127.0.0.1:9451`` for connect) because the metrics name peers and listeners.

Reading the exposition back (``rpcguard status``, tests):
``prometheus_client.parser.text_string_to_metric_families``.
"""

from __future__ import annotations

import platform
import time
from collections import deque
from collections.abc import Iterator, Mapping
from typing import TypedDict, cast

from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.utils import floatToGoString

from rpcguard import __version__
from rpcguard.observe.downgrades import NOT_ENFORCING, SWITCHED_OFF
from rpcguard.protocol import compiled
from rpcguard.observe.http import HTTP_REASONS, MAX_HEADER_BYTES, MAX_HTTP_CONNECTIONS, READ_TIMEOUT_S, start_http
from rpcguard.reasons import FIREWALL_REASONS, REFUSAL_REASONS, TLS_REASONS
from rpcguard.observe.webconfig import AUTH_REASONS
from rpcguard.protocol.settings import MODES
from rpcguard.protocol.stats import (
    DEFAULT_COMMAND_NAMES,
    LATENCY_BUCKETS_S,
    N_COMMANDS,
    SessionStats,
    command_name,
)

__all__ = [
    "ROLES",
    "SESSION_RESULTS",
    "RELOAD_RESULTS",
    "CERTIFICATES",
    "FIREWALL_MODES",
    "CHECKED_BY",
    "WEB_REFUSAL_REASONS",
    "ListenerTraffic",
    "Metrics",
    "start_http",
    "MAX_HEADER_BYTES",
    "READ_TIMEOUT_S",
    "MAX_HTTP_CONNECTIONS",
]

ROLES = ("serve", "connect")
# "probe": a connection that said it is a probe (rpcguard check, connect's /readyz: tls.ALPN_PROBES);
# "no_hello": a client that left before its first frame (a port check). Neither is a session.
SESSION_RESULTS = ("ok", "refused", "error", "probe", "no_hello")
RELOAD_RESULTS = ("ok", "error")
CERTIFICATES = ("cert", "ca", "crl")  # crl: its nextUpdate (tls.crl)
FIREWALL_MODES = MODES  # protocol/settings.py: the values of SessionPolicy.mode
CHECKED_BY = ("proxy", "node")  # who validates a session's requests (request_checks_sessions_total)
# Reasons a refused request to the metrics endpoint is counted under (web_refusals_total).
WEB_REFUSAL_REASONS = tuple(dict.fromkeys(TLS_REASONS + AUTH_REASONS + HTTP_REASONS))

_CORE = "compiled" if compiled() else "pure"  # label of rpcguard_build_info
_LE = tuple(floatToGoString(b) for b in LATENCY_BUCKETS_S) + ("+Inf",)
_NS_PER_S = 1_000_000_000


class ListenerTraffic:
    """Counters of one listener (serve) or tunnel (connect). Event-loop thread only."""

    __slots__ = (
        "role", "listener", "command_names", "totals", "live", "sessions_total",
        "refusals", "tls_failures", "firewall_violations", "queue_depth", "upstream",
        "upstream_version", "upstream_up", "unverified_ops", "profile_sessions", "request_checks",
    )

    def __init__(self, role: str, listener: str, *, upstream: str = "",
                 command_names: Mapping[int, str] = DEFAULT_COMMAND_NAMES) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, not {role!r}")
        self.role = role
        self.listener = listener
        self.command_names = command_names
        self.totals = SessionStats()  # finished sessions, folded in by session_ended()
        self.live: set[SessionStats] = set()  # running sessions, read at scrape time
        self.sessions_total: dict[str, int] = dict.fromkeys(SESSION_RESULTS, 0)
        # Every known label value starts at 0 (a dashboard shows 0, not "No data"; increase()
        # sees the first event); unknown ones still count, added on first use.
        self.refusals: dict[str, int] = dict.fromkeys(REFUSAL_REASONS, 0)
        self.tls_failures: dict[str, int] = dict.fromkeys(TLS_REASONS, 0)
        self.firewall_violations: dict[tuple[str, str], int] = {
            (r, mode): 0 for r in FIREWALL_REASONS for mode in FIREWALL_MODES}
        self.queue_depth = 0  # sessions waiting for the upstream (upstream_queue_depth)
        self.upstream = upstream  # upstream address, label of upstream_protocol_info
        self.upstream_version: str | None = None  # "3.0.0" once the upstream answered HELLO
        self.upstream_up: bool | None = None  # last seen reachable / not; None = not known yet
        # graph nodes forwarded under policy.allow_unverified_ops, by op (folded in at session end)
        self.unverified_ops: dict[str, int] = {}
        # sessions admitted under each profile (names come from the config: a bounded label)
        self.profile_sessions: dict[str, int] = {}  # serve: the Runtime adds its profiles at 0
        # sessions connected to their upstream, by who runs the request firewall on them
        self.request_checks: dict[str, int] = dict.fromkeys(CHECKED_BY, 0)

    def session_started(self, stats: SessionStats) -> None:
        """Make a running session's counters visible to scrapes."""
        self.live.add(stats)

    def session_ended(self, stats: SessionStats, result: str) -> None:
        """Fold a finished session into the totals and count it under ``result``.

        Call exactly once per session (a second call would count it twice).
        """
        if result not in self.sessions_total:
            raise ValueError(f"result must be one of {SESSION_RESULTS}, not {result!r}")
        self.live.discard(stats)
        stats.add_into(self.totals)
        self.sessions_total[result] += 1

    def profile_admitted(self, profile: str) -> None:
        """Count a session whose identity was admitted under ``profile`` (``profile_sessions_total``)."""
        self.profile_sessions[profile] = self.profile_sessions.get(profile, 0) + 1

    def requests_checked(self, by: str) -> None:
        """Count a session connected to its upstream under who validates its requests
        (``request_checks_sessions_total{checked_by}``): ``proxy`` (this process) or ``node`` (connect,
        toward an rpcguard serve: ``policy.validate_requests: auto``)."""
        if by not in self.request_checks:
            raise ValueError(f"checked_by must be one of {CHECKED_BY}, not {by!r}")
        self.request_checks[by] += 1

    def refusal(self, reason: str) -> None:
        """Count a refused session (``refusals_total{reason}``)."""
        self.refusals[reason] = self.refusals.get(reason, 0) + 1

    def tls_failure(self, reason: str) -> None:
        """Count a failed TLS handshake or identity check (``tls_handshake_failures_total``)."""
        self.tls_failures[reason] = self.tls_failures.get(reason, 0) + 1

    def firewall_violation(self, reason: str, mode: str) -> None:
        """Count a firewall rule violation; ``mode`` is ``enforce`` or ``monitor``."""
        key = (reason, mode)
        self.firewall_violations[key] = self.firewall_violations.get(key, 0) + 1

    def snapshot(self) -> SessionStats:
        """Return a new SessionStats holding finished + running sessions' counters."""
        agg = SessionStats()
        self.totals.add_into(agg)
        for stats in tuple(self.live):
            stats.add_into(agg)
        return agg


# The kind of every family, so that each ``add_metric`` call is checked against its own signature.
_C = CounterMetricFamily
_G = GaugeMetricFamily
_H = HistogramMetricFamily
_Families = TypedDict("_Families", {
    "frames": _C, "bytes": _C, "sessions": _C, "refusals": _C, "tls": _C, "reload": _C, "web": _C,
    "alloc": _C, "upload": _C, "firewall": _C, "unverified": _C, "rdma": _C, "profile": _C, "checks": _C,
    "hash_local": _C,
    "active": _G, "upstream": _G, "up": _G, "build": _G, "cert": _G, "certwarn": _G, "reload_ok": _G,
    "reload_time": _G, "queue": _G, "reload_kept": _G, "enforcing": _G, "switched_off": _G, "unprotected": _G, "certfile": _G,
    "duration": _H,
})


def _families() -> _Families:
    """One empty family per metric of the design table, in table order."""
    rl = ["role", "listener"]
    c, g = CounterMetricFamily, GaugeMetricFamily
    return {
        "frames": c("rpcguard_frames", "Frames relayed.", labels=rl + ["direction", "command"]),
        "bytes": c("rpcguard_bytes", "Wire bytes relayed, headers included.",
                   labels=rl + ["direction", "command"]),
        "duration": HistogramMetricFamily(
            "rpcguard_command_duration_seconds",
            "Time from request fully sent to response header received.",
            labels=rl + ["command"]),
        "sessions": c("rpcguard_sessions", "Finished sessions.", labels=rl + ["result"]),
        "active": g("rpcguard_sessions_active", "Running sessions.", labels=rl),
        "refusals": c("rpcguard_refusals", "Refused sessions.", labels=rl + ["reason"]),
        "tls": c("rpcguard_tls_handshake_failures", "Failed TLS handshakes.", labels=rl + ["reason"]),
        "upstream": g("rpcguard_upstream_protocol_info", "RPC protocol version of the upstream.",
                      labels=rl + ["upstream", "version"]),
        "up": g("rpcguard_upstream_up", "1 if the upstream (serve: ggml-rpc-server; connect: the node) "
                "answered the last connection or probe, 0 if not.", labels=rl),
        "build": g("rpcguard_build_info", "rpcguard build; core: the protocol core that runs ('compiled' "
                   "mypyc extension modules or 'pure' Python).", labels=["role", "version", "python", "core"]),
        "enforcing": g("rpcguard_listener_enforcing", "1 when every session of the listener (tunnel), whatever "
                       "its profile, runs every firewall check in enforce mode; 0 when something is switched off "
                       "(rpcguard_listener_switched_off says what).", labels=rl),
        "switched_off": g("rpcguard_listener_switched_off", "1 while a profile of the listener (tunnel) "
                          "switches this off: monitor_mode, check_<name>, unverified_ops.", labels=rl + ["what"]),
        "unprotected": g("rpcguard_metrics_unprotected", "1 when the metrics endpoint is served beyond loopback "
                         "without TLS and authentication (metrics.unsafe_public).", labels=["role"]),
        "cert": g("rpcguard_certificate_expiry_timestamp_seconds",
                  "notAfter of the loaded certificates (cert, ca) and nextUpdate of the CRL (crl), Unix time.",
                  labels=["role", "certificate"]),
        "certfile": g("rpcguard_certificate_file_info", "The file each loaded certificate was read from.",
                      labels=["role", "certificate", "file"]),
        "certwarn": g("rpcguard_certificate_warning", "1 while the loaded certificate has this problem.",
                      labels=["role", "kind"]),
        "reload": c("rpcguard_reload", "Configuration / certificate reloads.", labels=["role", "result"]),
        "reload_ok": g("rpcguard_reload_last_successful", "1 if the last load of configuration and "
                       "certificates (start or reload) worked, 0 if it failed.", labels=["role"]),
        "reload_time": g("rpcguard_reload_last_success_timestamp_seconds",
                         "Unix time of the last successful load (start or reload).", labels=["role"]),
        "reload_kept": g("rpcguard_reload_kept_keys", "Changed config keys the last successful reload could "
                         "not apply live (old value kept until a restart; named in its log line).",
                         labels=["role"]),
        "profile": c("rpcguard_profile_sessions", "Sessions admitted, by the profile their identity got "
                     "(allow-list entry; 'default' for the listener's own settings).", labels=rl + ["profile"]),
        "checks": c("rpcguard_request_checks_sessions", "Sessions connected to their upstream, by who runs "
                    "the request firewall on them: 'proxy' (this process) or 'node' (connect toward an "
                    "rpcguard serve, policy.validate_requests: auto).", labels=rl + ["checked_by"]),
        "web": c("rpcguard_web_refusals", "Requests refused by the metrics endpoint (TLS, client "
                 "certificate, basic auth).", labels=["role", "reason"]),
        "queue": g("rpcguard_upstream_queue_depth", "Sessions waiting for the upstream.", labels=rl),
        "alloc": c("rpcguard_alloc_bytes", "ALLOC_BUFFER sizes granted.", labels=rl),
        "upload": c("rpcguard_upload_bytes", "Tensor bytes uploaded.", labels=rl + ["kind"]),
        "firewall": c("rpcguard_firewall_violations", "Firewall rule violations.",
                      labels=rl + ["reason", "mode"]),
        "unverified": c("rpcguard_unverified_op_nodes", "Graph nodes forwarded without a verified op rule "
                        "(policy.allow_unverified_ops).", labels=rl + ["op"]),
        "hash_local": c("rpcguard_hash_answered_by_proxy", "SET_TENSOR_HASH answered 'not cached' by the proxy "
                        "(the server's cache is not the identity's own).", labels=rl),
        "rdma": c("rpcguard_rdma_caps_zeroed", "RDMA capability fields zeroed.",
                  labels=rl + ["direction"]),
    }


def _all(f: _Families) -> Iterator[Metric]:
    # a TypedDict's values() is typed as object; every value here is a family (a Metric)
    return iter(cast("list[Metric]", list(f.values())))


class _Collector:
    """Builds the metric families from a :class:`Metrics` at scrape time."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def describe(self) -> Iterator[Metric]:
        # Lets the registry reject a second collector exporting the same names.
        return _all(_families())

    def collect(self) -> Iterator[Metric]:
        m = self._metrics
        f = _families()
        for lt in tuple(m._listeners.values()):
            self._listener(f, lt)
        f["build"].add_metric([m.role, __version__, platform.python_version(), _CORE], 1)
        for (role, listener), off in m.enforcement.items():
            f["enforcing"].add_metric([role, listener], 0 if off & NOT_ENFORCING else 1)
            for what in SWITCHED_OFF:
                f["switched_off"].add_metric([role, listener, what], 1 if what in off else 0)
        f["unprotected"].add_metric([m.role], 1 if m.metrics_unprotected else 0)
        for (role, cert), epoch_s in m._cert_expiry.items():
            f["cert"].add_metric([role, cert], epoch_s)
        for (role, cert), file in m._cert_files.items():
            f["certfile"].add_metric([role, cert, file], 1)
        for (role, kind), on in m.cert_warnings.items():
            f["certwarn"].add_metric([role, kind], on)
        for result, n in m._reloads.items():
            f["reload"].add_metric([m.role, result], n)
        f["reload_ok"].add_metric([m.role], 1 if m.reload_last_ok else 0)
        f["reload_time"].add_metric([m.role], m.reload_last_success_s)
        f["reload_kept"].add_metric([m.role], m.reload_kept_keys)
        for reason, n in m.web_refusals.items():
            f["web"].add_metric([m.role, reason], n)
        return _all(f)

    @staticmethod
    def _listener(f: _Families, lt: ListenerTraffic) -> None:
        agg = lt.snapshot()
        rl = [lt.role, lt.listener]
        known = lt.command_names
        for cmd in range(N_COMMANDS):
            name = None
            for direction, frames, nbytes in (("request", agg.req_frames[cmd], agg.req_bytes[cmd]),
                                              ("response", agg.rsp_frames[cmd], agg.rsp_bytes[cmd])):
                if frames or nbytes or cmd in known:  # every command of the version, 0 included
                    name = name or command_name(known, cmd)
                    f["frames"].add_metric(rl + [direction, name], frames)
                    f["bytes"].add_metric(rl + [direction, name], nbytes)
            if agg.lat_count[cmd]:
                cumulative, buckets = 0, []
                for le, n in zip(_LE, agg.lat_buckets[cmd]):
                    cumulative += n
                    buckets.append((le, cumulative))
                f["duration"].add_metric(rl + [command_name(lt.command_names, cmd)], buckets,
                                         agg.lat_sum_ns[cmd] / _NS_PER_S)
        for result, n in lt.sessions_total.items():
            f["sessions"].add_metric(rl + [result], n)
        f["active"].add_metric(rl, len(lt.live))
        for reason, n in lt.refusals.items():
            f["refusals"].add_metric(rl + [reason], n)
        for reason, n in lt.tls_failures.items():
            f["tls"].add_metric(rl + [reason], n)
        if lt.upstream_version is not None:
            f["upstream"].add_metric(rl + [lt.upstream, lt.upstream_version], 1)
        if lt.upstream_up is not None:
            f["up"].add_metric(rl, 1 if lt.upstream_up else 0)
        f["queue"].add_metric(rl, lt.queue_depth)
        f["alloc"].add_metric(rl, agg.alloc_bytes)
        f["upload"].add_metric(rl + ["set_tensor"], agg.upload_bytes_set)
        f["upload"].add_metric(rl + ["hash_hit"], agg.upload_bytes_hash_hit)
        for (reason, mode), n in lt.firewall_violations.items():
            f["firewall"].add_metric(rl + [reason, mode], n)
        for profile, n in lt.profile_sessions.items():
            f["profile"].add_metric(rl + [profile], n)
        for by, n in lt.request_checks.items():
            f["checks"].add_metric(rl + [by], n)
        for op, n in lt.unverified_ops.items():
            f["unverified"].add_metric(rl + [op], n)
        f["hash_local"].add_metric(rl, agg.hash_answered_by_proxy)
        f["rdma"].add_metric(rl + ["request"], agg.rdma_caps_zeroed_req)
        f["rdma"].add_metric(rl + ["response"], agg.rdma_caps_zeroed_rsp)


class Metrics:
    """All rpcguard metrics of one process, exported through ``self.registry``."""

    def __init__(self, registry: CollectorRegistry | None = None, role: str = "") -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.role = role  # label of the process-level series; the Runtime sets it
        self._listeners: dict[tuple[str, str], ListenerTraffic] = {}
        self._cert_expiry: dict[tuple[str, str], float] = {}
        self._cert_files: dict[tuple[str, str], str] = {}
        self._reloads: dict[str, int] = dict.fromkeys(RELOAD_RESULTS, 0)
        self.cert_warnings: dict[tuple[str, str], float] = {}  # (role, kind) -> 0/1, set by server.Runtime
        # The configuration was loaded once before this object exists: that counts as a success.
        self.reload_last_ok = True
        self.reload_last_success_s = time.time()
        self.reload_kept_keys = 0  # keys the last successful reload kept at their old value
        self.web_refusals: dict[str, int] = dict.fromkeys(WEB_REFUSAL_REASONS, 0)
        # (role, listener) -> what its profiles switch off (downgrades.report, at start and reload)
        self.enforcement: dict[tuple[str, str], frozenset[str]] = {}
        self.metrics_unprotected = False
        # The last refusals with their peer, for a person at a terminal (GET /refusals,
        # `rpcguard status`); bounded, and never a metric label (peers are unbounded).
        self.recent_refusals: deque[dict] = deque(maxlen=RECENT_REFUSALS)
        self.registry.register(_Collector(self))
        # process_* (CPU, RSS, fds, start time) and python_info: read from /proc at scrape
        # time only, so the hot path is untouched.
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)

    def note_refusal(self, **fields: object) -> None:
        """Remember one refusal (time, role, listener, peer, identity, reason, detail)."""
        self.recent_refusals.append({"time": round(time.time(), 3), **fields})

    def listener(self, role: str, listener: str, *, upstream: str = "",
                 command_names: Mapping[int, str] | None = None) -> ListenerTraffic:
        """Return the counters of ``(role, listener)``, creating them on first use.

        Counters survive a reload that keeps the name; a non-empty ``upstream`` or a given
        ``command_names`` updates an existing entry.
        """
        key = (role, listener)
        lt = self._listeners.get(key)
        if lt is None:
            lt = ListenerTraffic(role, listener, upstream=upstream,
                                 command_names=command_names or DEFAULT_COMMAND_NAMES)
            self._listeners[key] = lt
        else:
            if upstream:
                lt.upstream = upstream
            if command_names is not None:
                lt.command_names = command_names
        return lt

    def set_certificate_expiry(self, role: str, certificate: str, epoch_s: float, file: str | None = None) -> None:
        """Record the notAfter (Unix seconds) of the loaded ``cert`` or ``ca`` (and the file it came from)."""
        if role not in ROLES or certificate not in CERTIFICATES:
            raise ValueError(f"bad role/certificate {role!r}/{certificate!r}")
        self._cert_expiry[(role, certificate)] = float(epoch_s)
        if file is not None:
            self._cert_files[(role, certificate)] = file

    def reload(self, result: str) -> None:
        """Count a reload attempt; ``result`` is ``ok`` or ``error`` (also the last-result gauges)."""
        if result not in self._reloads:
            raise ValueError(f"result must be one of {RELOAD_RESULTS}, not {result!r}")
        self._reloads[result] += 1
        self.reload_last_ok = result == "ok"
        if self.reload_last_ok:
            self.reload_last_success_s = time.time()

    def web_refusal(self, reason: str) -> None:
        """Count a request the metrics endpoint refused (``web_refusals_total{reason}``)."""
        self.web_refusals[reason] = self.web_refusals.get(reason, 0) + 1

    def exposition(self) -> bytes:
        """The text exposition of the registry (what GET /metrics returns); see ``_render``."""
        try:
            return _render(self.registry.collect())
        except _Unsupported:
            return generate_latest(self.registry)


class _Unsupported(Exception):
    """A family or sample ``_render`` does not write; ``generate_latest`` does it all instead."""


_TYPES = {"counter": "counter", "gauge": "gauge", "histogram": "histogram"}
_LABELS: dict[tuple, str] = {}  # label items -> rendered "{k="v",...}" (bounded, see _label_text)
_MAX_LABEL_CACHE = 50_000
_ESCAPES = str.maketrans({"\\": "\\\\", "\n": "\\n", '"': '\\"'})  # label values, as client_python


def _label_text(items: tuple) -> str:
    text = _LABELS.get(items)
    if text is None:
        if len(_LABELS) > _MAX_LABEL_CACHE:
            _LABELS.clear()
        text = "{" + ",".join(f'{k}="{v.translate(_ESCAPES)}"' for k, v in sorted(items)) + "}" if items else ""
        _LABELS[items] = text
    return text


def _render(families) -> bytes:
    """Text format 0.0.4, byte for byte what ``generate_latest`` writes for these families.

    The exporter exports every known label value (about 220 series per listener), and
    ``generate_latest`` re-validates and re-escapes every label of every sample on every
    scrape (~10 us per sample on the event-loop thread that also relays frames). The label
    sets repeat from scrape to scrape, so their text is cached. Only counter, gauge and
    histogram families without timestamps or ``_created`` samples are written here.
    """
    out = []
    for f in families:
        mtype = _TYPES.get(f.type)
        if mtype is None:
            raise _Unsupported(f.type)
        mname = f.name + "_total" if mtype == "counter" else f.name
        doc = f.documentation.replace("\\", "\\\\").replace("\n", "\\n")
        out.append(f"# HELP {mname} {doc}\n# TYPE {mname} {mtype}\n")
        for sample in f.samples:
            if sample.timestamp is not None or sample.name.endswith(("_created", "_gsum", "_gcount")):
                raise _Unsupported(sample.name)
            out.append(f"{sample.name}{_label_text(tuple(sample.labels.items()))} {floatToGoString(sample.value)}\n")
    return "".join(out).encode()


RECENT_REFUSALS = 50  # refusals kept for /refusals
