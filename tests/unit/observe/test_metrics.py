"""Unit tests of rpcguard.observe.metrics: the collector against the design table, and the HTTP endpoint."""

from __future__ import annotations

import asyncio
import gzip
import json
import platform
import re
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

import rpcguard
import rpcguard.protocol
from rpcguard.observe import metrics as metrics_mod
from rpcguard.observe import http as http_mod
from rpcguard import reasons
from rpcguard.observe.metrics import ListenerTraffic, Metrics, start_http
from rpcguard.protocol.stats import DEFAULT_COMMAND_NAMES, LATENCY_BUCKETS_S, SessionStats
from tests.support.realpeer import accept_queue
from tests.support.loops import run  # noqa: F401,F811  (a fixture: the endpoint tests run on both loops)

SET_TENSOR, GRAPH_COMPUTE, HELLO = 6, 10, 14
DESIGN = Path(__file__).resolve().parents[3] / "docs" / "design.md"


def _design_table() -> dict[str, tuple[str, set[str]]]:
    """{metric name: (type, label set)} from the normative table in docs/design.md."""
    rows = {}
    for line in DESIGN.read_text(encoding="utf-8").splitlines():
        m = re.match(r"\|\s*(\w+)\s*\|\s*(counter|gauge|histogram)[^|]*\|\s*([^|]*)\|", line)
        if m:
            labels = {w for w in re.findall(r"[a-z_]+", re.sub(r"\([^)]*\)", "", m.group(3)))}
            rows["rpcguard_" + m.group(1)] = (m.group(2), labels)
    return rows


def _populated() -> tuple[Metrics, ListenerTraffic]:
    m = Metrics(CollectorRegistry(), role="serve")
    lt = m.listener("serve", "gpu0", upstream="127.0.0.1:50052")
    lt.upstream_up = True
    lt.unverified_ops["IM2COL"] = 1  # a node forwarded under policy.allow_unverified_ops
    m.web_refusal("auth_failed")
    s = SessionStats()
    lt.session_started(s)
    s.req_frames[SET_TENSOR] += 2
    s.req_bytes[SET_TENSOR] += 300
    s.rsp_frames[HELLO] += 1
    s.rsp_bytes[HELLO] += 11
    s.observe_latency(GRAPH_COMPUTE, 3_000_000)
    s.alloc_bytes += 4096
    s.upload_bytes_set += 256
    s.upload_bytes_hash_hit += 64
    s.rdma_caps_zeroed_req += 1
    s.rdma_caps_zeroed_rsp += 2
    lt.refusal("command_not_allowed")
    lt.tls_failure("tls_unknown_ca")
    lt.firewall_violation("tensor_out_of_buffer", "monitor")
    lt.queue_depth = 3
    lt.upstream_version = "3.0.0"
    lt.profile_admitted("monitor")
    m.set_certificate_expiry("serve", "cert", 1_900_000_000, "/etc/rpcguard/node1.pem")
    m.reload("ok")
    m.cert_warnings[("serve", "expiring_soon")] = 1.0
    m.enforcement[("serve", "gpu0")] = frozenset({"monitor_mode"})  # downgrades.report sets it
    return m, lt


def _pool_exposition() -> bytes:
    """What serve's PoolCollector exports for one listener whose server processes did everything once."""
    from types import SimpleNamespace

    from prometheus_client import generate_latest

    from rpcguard.upstream.pool import PoolCollector

    pool = SimpleNamespace(starts=3, start_failures=1, exits={"killed": 2, "signal SIGSEGV": 1}, start_seconds_sum=0.6,
                           last_start_s=0.2, sessions_by_start={"spare": 2, "cold": 1}, crashes=1, quarantines=1,
                           quarantine={"CN=client9": float("inf")}, missing=frozenset({"seccomp"}),
                           settings=SimpleNamespace(sandbox=SimpleNamespace(mode="required")), sandboxed=True,
                           limits=SimpleNamespace(gauges=(("memory", "cgroup_v1", 1 << 30), ("tasks", "cgroup_v1", 72))))
    reg = CollectorRegistry()
    reg.register(PoolCollector({"gpu0": pool}))  # type: ignore[dict-item]
    return generate_latest(reg)


def test_every_design_metric_is_exported_with_its_labels() -> None:
    table = _design_table()
    # The families the code declares (the collector's table, the pool's collector with no pool):
    # every one must have its row in design.md and every row its family, whatever their number.
    from rpcguard.upstream.pool import PoolCollector
    declared = {f.name: f.type for f in metrics_mod._all(metrics_mod._families())}
    declared.update((f.name, f.type) for f in PoolCollector({}).collect())
    documented = {n.removesuffix("_total") if t == "counter" else n: t for n, (t, _) in table.items()}
    assert declared == documented, ("families declared but not in design.md's table",
                                    sorted(declared.keys() - documented.keys()),
                                    "rows of the table no code declares", sorted(documented.keys() - declared.keys()))
    m, _ = _populated()
    text = m.exposition().decode() + _pool_exposition().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name, (typ, labels) in table.items():
        base = name.removesuffix("_total") if typ == "counter" else name
        assert base in families, name
        fam = families[base]
        assert fam.type == typ, name
        assert fam.samples, f"{name} exported no sample"
        for sample in fam.samples:
            assert set(sample.labels) - {"le"} == labels, (name, sample.labels)
    ours = {n for n in families if n.startswith("rpcguard_")}
    assert ours == {n.removesuffix("_total") if t == "counter" else n for n, (t, _) in table.items()}


def test_sample_values() -> None:
    m, _ = _populated()
    g = m.registry.get_sample_value
    rl = {"role": "serve", "listener": "gpu0"}
    assert g("rpcguard_frames_total", {**rl, "direction": "request", "command": "SET_TENSOR"}) == 2
    assert g("rpcguard_bytes_total", {**rl, "direction": "request", "command": "SET_TENSOR"}) == 300
    assert g("rpcguard_frames_total", {**rl, "direction": "response", "command": "HELLO"}) == 1
    assert g("rpcguard_bytes_total", {**rl, "direction": "response", "command": "HELLO"}) == 11
    # every command of the table is exported, at 0 until it is seen
    assert g("rpcguard_frames_total", {**rl, "direction": "response", "command": "SET_TENSOR"}) == 0
    assert g("rpcguard_frames_total", {**rl, "direction": "request", "command": "HELLO"}) == 0
    assert g("rpcguard_sessions_active", rl) == 1
    for result in ("ok", "refused", "error"):
        assert g("rpcguard_sessions_total", {**rl, "result": result}) == 0
    assert g("rpcguard_refusals_total", {**rl, "reason": "command_not_allowed"}) == 1
    assert g("rpcguard_tls_handshake_failures_total", {**rl, "reason": "tls_unknown_ca"}) == 1
    assert g("rpcguard_firewall_violations_total",
             {**rl, "reason": "tensor_out_of_buffer", "mode": "monitor"}) == 1
    assert g("rpcguard_upstream_protocol_info", {**rl, "upstream": "127.0.0.1:50052", "version": "3.0.0"}) == 1
    assert g("rpcguard_upstream_up", rl) == 1
    assert g("rpcguard_upstream_queue_depth", rl) == 3
    assert g("rpcguard_alloc_bytes_total", rl) == 4096
    assert g("rpcguard_upload_bytes_total", {**rl, "kind": "set_tensor"}) == 256
    assert g("rpcguard_upload_bytes_total", {**rl, "kind": "hash_hit"}) == 64
    assert g("rpcguard_rdma_caps_zeroed_total", {**rl, "direction": "request"}) == 1
    assert g("rpcguard_rdma_caps_zeroed_total", {**rl, "direction": "response"}) == 2
    core = "compiled" if rpcguard.protocol.compiled() else "pure"
    build = {"role": "serve", "version": rpcguard.__version__, "python": platform.python_version(), "core": core}
    assert g("rpcguard_build_info", build) == 1
    assert g("rpcguard_build_info", {**build, "core": "pure" if core == "compiled" else "compiled"}) is None
    # a listener in monitor mode does not enforce, and says what is switched off (each known value at 0)
    assert g("rpcguard_listener_enforcing", rl) == 0
    assert g("rpcguard_listener_switched_off", {**rl, "what": "monitor_mode"}) == 1
    assert g("rpcguard_listener_switched_off", {**rl, "what": "check_tensor"}) == 0
    assert g("rpcguard_metrics_unprotected", {"role": "serve"}) == 0
    assert g("rpcguard_certificate_expiry_timestamp_seconds", {"role": "serve", "certificate": "cert"}) == 1.9e9
    assert g("rpcguard_certificate_file_info", {"role": "serve", "certificate": "cert",
                                                "file": "/etc/rpcguard/node1.pem"}) == 1
    assert g("rpcguard_reload_total", {"role": "serve", "result": "ok"}) == 1
    assert g("rpcguard_reload_total", {"role": "serve", "result": "error"}) == 0
    assert g("rpcguard_reload_last_successful", {"role": "serve"}) == 1
    assert g("rpcguard_web_refusals_total", {"role": "serve", "reason": "auth_failed"}) == 1
    assert g("rpcguard_web_refusals_total", {"role": "serve", "reason": "tls_no_client_cert"}) == 0


def test_histogram_cumulative_buckets() -> None:
    m = Metrics(CollectorRegistry())
    lt = m.listener("connect", "t1")
    s = SessionStats()
    for ns in (100_000, 100_001, 3_000_000, 5_000_000, 60_000_000_000):
        s.observe_latency(GRAPH_COMPUTE, ns)
    lt.session_started(s)
    g = m.registry.get_sample_value
    lab = {"role": "connect", "listener": "t1", "command": "GRAPH_COMPUTE"}
    expected = {0.0001: 1, 0.00025: 2, 0.0025: 2, 0.005: 4, 10.0: 4}
    for le, n in expected.items():
        assert g("rpcguard_command_duration_seconds_bucket", {**lab, "le": str(le)}) == n, le
    assert g("rpcguard_command_duration_seconds_bucket", {**lab, "le": "+Inf"}) == 5
    assert g("rpcguard_command_duration_seconds_count", lab) == 5
    assert g("rpcguard_command_duration_seconds_sum", lab) == pytest.approx(60.008201)
    (fam,) = [f for f in m.registry.collect() if f.name == "rpcguard_command_duration_seconds"]
    les = [smp.labels["le"] for smp in fam.samples if smp.name.endswith("_bucket")]
    assert len(les) == len(LATENCY_BUCKETS_S) + 1
    assert g("rpcguard_command_duration_seconds_count", {**lab, "command": "HELLO"}) is None


def test_live_plus_finished_sessions_are_summed() -> None:
    m = Metrics(CollectorRegistry())
    lt = m.listener("serve", "a")
    g = m.registry.get_sample_value
    lab = {"role": "serve", "listener": "a", "direction": "request", "command": "SET_TENSOR"}
    sessions = [SessionStats() for _ in range(3)]
    for i, s in enumerate(sessions):
        lt.session_started(s)
        s.req_frames[SET_TENSOR] += i + 1
        s.observe_latency(SET_TENSOR, 1000)
    assert g("rpcguard_frames_total", lab) == 6
    assert g("rpcguard_sessions_active", {"role": "serve", "listener": "a"}) == 3
    lt.session_ended(sessions[0], "ok")
    lt.session_ended(sessions[1], "refused")
    sessions[2].req_frames[SET_TENSOR] += 10  # the live one keeps counting
    assert g("rpcguard_frames_total", lab) == 16
    assert g("rpcguard_command_duration_seconds_count",
             {"role": "serve", "listener": "a", "command": "SET_TENSOR"}) == 3
    assert g("rpcguard_sessions_active", {"role": "serve", "listener": "a"}) == 1
    assert g("rpcguard_sessions_total", {"role": "serve", "listener": "a", "result": "ok"}) == 1
    assert g("rpcguard_sessions_total", {"role": "serve", "listener": "a", "result": "refused"}) == 1
    lt.session_ended(sessions[2], "error")
    assert g("rpcguard_frames_total", lab) == 16
    assert g("rpcguard_sessions_active", {"role": "serve", "listener": "a"}) == 0
    with pytest.raises(ValueError):
        lt.session_ended(SessionStats(), "timeout")
    assert sum(lt.sessions_total.values()) == 3


def test_command_names_and_unknown_ids() -> None:
    m = Metrics(CollectorRegistry())
    lt = m.listener("serve", "a", command_names={SET_TENSOR: "SET"})
    s = SessionStats()
    s.req_frames[SET_TENSOR] += 1
    s.req_frames[21] += 1
    lt.session_started(s)
    g = m.registry.get_sample_value
    rl = {"role": "serve", "listener": "a", "direction": "request"}
    assert g("rpcguard_frames_total", {**rl, "command": "SET"}) == 1
    assert g("rpcguard_frames_total", {**rl, "command": "CMD_21"}) == 1


def test_listener_registry_and_validation() -> None:
    m = Metrics(CollectorRegistry())
    a = m.listener("serve", "a")
    assert m.listener("serve", "a", upstream="h:1") is a and a.upstream == "h:1"
    assert m.listener("connect", "a") is not a
    assert not [s for f in m.registry.collect() for s in f.samples
                if s.name in ("rpcguard_upstream_protocol_info", "rpcguard_upstream_up")]  # not known yet
    with pytest.raises(ValueError):
        m.listener("proxy", "x")
    with pytest.raises(ValueError):
        m.reload("maybe")
    with pytest.raises(ValueError):
        m.set_certificate_expiry("serve", "key", 1)
    with pytest.raises(ValueError):  # one Metrics per registry: names are described
        Metrics(m.registry)
    assert isinstance(Metrics().registry, CollectorRegistry)


def test_empty_metrics_still_export_process_level() -> None:
    m = Metrics(CollectorRegistry(), role="connect")
    g = m.registry.get_sample_value
    assert g("rpcguard_reload_total", {"role": "connect", "result": "error"}) == 0
    assert g("rpcguard_build_info", {"role": "connect", "version": rpcguard.__version__,
                                     "python": platform.python_version(),
                                     "core": "compiled" if rpcguard.protocol.compiled() else "pure"}) == 1
    # prometheus_client's process collector, on the same registry (Linux /proc)
    assert g("process_resident_memory_bytes") > 1e6
    assert g("process_open_fds") >= 3
    assert abs(g("process_start_time_seconds") - time.time()) < 24 * 3600
    assert g("process_cpu_seconds_total") > 0


def test_every_known_label_value_starts_at_zero() -> None:
    """Dashboards show 0, not "No data": reasons, modes, results, commands exist before any event."""
    m = Metrics(CollectorRegistry(), role="serve")
    m.listener("serve", "gpu0")
    samples = [s for f in m.registry.collect() for s in f.samples if s.labels.get("listener") == "gpu0"]

    def values(name: str, label: str, **match: str) -> set[str]:
        return {s.labels[label] for s in samples
                if s.name == name and all(s.labels.get(k) == v for k, v in match.items()) and s.value == 0}

    assert values("rpcguard_refusals_total", "reason") == set(reasons.REFUSAL_REASONS)
    assert {"identity_not_allowed", "upstream_unavailable", "graph_op_denied"} <= set(reasons.REFUSAL_REASONS)
    assert values("rpcguard_tls_handshake_failures_total", "reason") == set(reasons.TLS_REASONS)
    assert "identity_not_allowed" not in reasons.TLS_REASONS
    for mode in ("enforce", "monitor"):
        assert values("rpcguard_firewall_violations_total", "reason", mode=mode) == set(reasons.FIREWALL_REASONS)
    assert values("rpcguard_sessions_total", "result") == {"ok", "refused", "error", "probe", "no_hello"}
    for direction in ("request", "response"):
        assert values("rpcguard_frames_total", "command", direction=direction) == set(DEFAULT_COMMAND_NAMES.values())
        assert values("rpcguard_bytes_total", "command", direction=direction) == set(DEFAULT_COMMAND_NAMES.values())


def test_reload_gauges_follow_the_last_attempt(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(metrics_mod.time, "time", lambda: clock[0])
    m = Metrics(CollectorRegistry(), role="serve")
    g = m.registry.get_sample_value
    r = {"role": "serve"}
    assert g("rpcguard_reload_last_successful", r) == 1  # the start-up load
    assert g("rpcguard_reload_last_success_timestamp_seconds", r) == 1000
    clock[0] = 2000.0
    m.reload("error")
    m.reload("error")
    assert g("rpcguard_reload_last_successful", r) == 0  # stays 0 while the fault remains
    assert g("rpcguard_reload_last_success_timestamp_seconds", r) == 1000
    clock[0] = 3000.0
    m.reload("ok")
    assert g("rpcguard_reload_last_successful", r) == 1
    assert g("rpcguard_reload_last_success_timestamp_seconds", r) == 3000
    assert g("rpcguard_reload_total", {**r, "result": "error"}) == 2


# --- HTTP endpoint ----------------------------------------------------------------------


async def _request(port: int, raw: bytes) -> tuple[int, dict[str, str], bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    assert int(headers["content-length"]) == len(body)
    assert headers["connection"] == "close"
    return int(lines[0].split(" ")[1]), headers, body


def _get(path: str, extra: str = "") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: x\r\n{extra}\r\n".encode()


async def _with_server(fn, ready=None, **kw):  # type: ignore[no-untyped-def]
    m, _ = _populated()
    server = await start_http(m, "127.0.0.1", 0, ready=ready, **kw)
    port = server.sockets[0].getsockname()[1]
    try:
        return await fn(port)
    finally:
        server.close()
        await server.wait_closed()


TEXT_HEADERS = {"content-type": "text/plain; charset=utf-8", "content-length": "3", "connection": "close"}


def test_http_metrics_health_and_errors(run) -> None:  # type: ignore[no-untyped-def]
    async def body(port: int) -> None:
        status, headers, text = await _request(port, _get("/metrics"))
        assert status == 200 and headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
        names = {f.name for f in text_string_to_metric_families(text.decode())}
        assert "rpcguard_build_info" in names and "rpcguard_frames" in names
        status, headers, zipped = await _request(port, _get("/metrics?x=1", "Accept-Encoding: gzip\r\n"))
        assert status == 200 and headers["content-encoding"] == "gzip"
        assert b"rpcguard_sessions_active" in gzip.decompress(zipped)
        assert await _request(port, _get("/healthz")) == (200, TEXT_HEADERS, b"ok\n")
        assert (await _request(port, _get("/readyz")))[::2] == (200, b"ready\n")
        assert (await _request(port, _get("/nope")))[0] == 404
        status, headers, _ = await _request(port, b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n")
        assert status == 405 and headers["allow"] == "GET, HEAD"
        assert (await _request(port, b"garbage\r\n\r\n"))[0] == 400
        big = _get("/metrics", "X-Pad: " + "a" * (http_mod.MAX_HEADER_BYTES + 100) + "\r\n")
        assert (await _request(port, big))[0] == 431

    run(_with_server(body))


def test_http_readyz(run) -> None:  # type: ignore[no-untyped-def]
    state = {"ok": False}

    async def ready() -> tuple[bool, str]:
        if state["ok"] is None:
            raise RuntimeError("boom")
        return state["ok"], "upstream 127.0.0.1:50052 down" if not state["ok"] else "ready"

    async def body(port: int) -> None:
        assert (await _request(port, _get("/readyz")))[::2] == (503, b"upstream 127.0.0.1:50052 down\n")
        state["ok"] = True
        assert (await _request(port, _get("/readyz")))[::2] == (200, b"ready\n")
        state["ok"] = None
        status, _, text = await _request(port, _get("/readyz"))
        assert status == 503 and b"RuntimeError" in text

    run(_with_server(body, ready=ready))


def test_http_never_blocks_the_loop(run) -> None:  # type: ignore[no-untyped-def]
    async def body(port: int) -> None:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        tick_task = asyncio.create_task(ticker())
        # a silent client and a half-sent request hold connections open ...
        silent_r, silent_w = await asyncio.open_connection("127.0.0.1", port)
        slow_r, slow_w = await asyncio.open_connection("127.0.0.1", port)
        slow_w.write(b"GET /metrics HTTP/1.1\r\nHost")
        t0 = time.monotonic()
        held = [asyncio.create_task(r.read()) for r in (silent_r, slow_r)]
        # ... while others are served, before the held ones time out (an order, not a wall-clock
        # bound: a busy machine slows both), and the loop keeps running
        for _ in range(5):
            assert (await _request(port, _get("/healthz")))[0] == 200
        assert not any(task.done() for task in held)
        ticks_served = ticks
        # the read timeout answers both 408 (counted) and closes them
        for task in held:
            assert (await asyncio.wait_for(task, 10)).startswith(b"HTTP/1.1 408 ")
        assert time.monotonic() - t0 >= 1.0
        assert ticks > ticks_served  # the loop ran while the held connections waited
        tick_task.cancel()
        silent_w.close()
        slow_w.close()

    run(_with_server(body, read_timeout_s=1.0))


def test_http_connection_cap_per_source(run, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(http_mod, "MAX_HTTP_PER_SOURCE", 2)
    m, _ = _populated()

    async def body() -> None:
        server = await start_http(m, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            held = [await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.2", 0)) for _ in range(2)]
            # (no wait: the accept queue is FIFO and each connection is admitted at its accept, so
            # the two held ones are counted before the next one is looked at)
            # over the source's cap: answered 503 at once, before any request is read
            reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.2", 0))
            assert (await asyncio.wait_for(reader.read(), 2)).startswith(b"HTTP/1.1 503 ")
            writer.close()
            assert m.web_refusals["too_many_connections_per_source"] == 1
            # another address is served meanwhile
            assert (await _request(port, _get("/healthz")))[0] == 200
            for _, w in held:
                w.close()
        finally:
            server.close()
            await server.wait_closed()

    run(body())


async def _accepted(port: int, timeout: float = 30.0) -> None:
    """Wait until the server on ``port`` (this loop's) has accepted, and so admitted or refused,
    every connection made to it so far: its accept queue is empty."""
    deadline = time.monotonic() + timeout
    while accept_queue(port) != 0:
        assert time.monotonic() < deadline, f"connections still queued on port {port} after {timeout} s"
        await asyncio.sleep(0.01)


async def _handlers_done(server, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    """Wait until every connection's handler task has ended: only this test and the accept loop run."""
    deadline = time.monotonic() + timeout
    while {t for t in asyncio.all_tasks() if t is not asyncio.current_task() and t is not server._task}:
        assert time.monotonic() < deadline, f"connection handlers still running after {timeout} s"
        await asyncio.sleep(0.01)


async def _silent(port: int, n: int, sources: int) -> list:
    return [await asyncio.open_connection("127.0.0.1", port, local_addr=(f"127.0.0.{2 + i % sources}", 0))
            for i in range(n)]


def test_a_silent_flood_cannot_keep_the_health_probes_out(run) -> None:  # type: ignore[no-untyped-def]
    # issue 21: 64 silent TCP connections took every slot; /healthz and /readyz were reset.
    m, _ = _populated()

    async def body() -> None:
        server = await start_http(m, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            # one host: its share only; many hosts: the oldest silent connection makes room
            flood = await _silent(port, 64, 1) + await _silent(port, 2 * http_mod.MAX_HTTP_CONNECTIONS, 24)
            await _accepted(port)  # the flood admitted, refused or evicting before the probes come
            t0 = time.monotonic()
            for path in ("/healthz", "/readyz", "/healthz"):
                status, _, _ = await _request(port, _get(path))
                assert status == 200
            assert time.monotonic() - t0 < 1.0
            assert m.web_refusals["too_many_connections_per_source"] >= 64 - http_mod.MAX_HTTP_PER_SOURCE
            assert m.web_refusals["evicted"] >= 1
            for _, w in flood:
                w.close()
        finally:
            server.close()
            await server.wait_closed()

    run(body())


def test_http_head_on_every_path(run) -> None:  # type: ignore[no-untyped-def]
    async def body(port: int) -> None:
        for path, status in (("/healthz", 200), ("/readyz", 200), ("/metrics", 200), ("/nope", 404)):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(f"HEAD {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            data = await asyncio.wait_for(reader.read(), 5)
            writer.close()
            head, _, rest = data.partition(b"\r\n\r\n")
            assert head.startswith(f"HTTP/1.1 {status} ".encode()) and rest == b"", (path, data[:200])
            length = int(dict(ln.split(": ", 1) for ln in head.decode().split("\r\n")[1:])["Content-Length"])
            assert length > 0  # what GET would send

    run(_with_server(body))


def test_every_http_error_is_counted(run) -> None:  # type: ignore[no-untyped-def]
    m, _ = _populated()
    before = sum(m.web_refusals.values())

    async def body() -> None:
        server = await start_http(m, "127.0.0.1", 0, read_timeout_s=0.3)
        port = server.sockets[0].getsockname()[1]
        try:
            assert (await _request(port, b"garbage\r\n\r\n"))[0] == 400
            assert (await _request(port, b"DELETE / HTTP/1.1\r\n\r\n"))[0] == 405
            assert (await _request(port, _get("/x")))[0] == 404
            big = _get("/metrics", "X-Pad: " + "a" * (http_mod.MAX_HEADER_BYTES + 100) + "\r\n")
            assert (await _request(port, big))[0] == 431
            assert (await _request(port, b"GET /metrics HTTP/1.1\r\nHo"))[0] == 408
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(b"GET /")
            w.close()  # closed half-way: nothing to answer, still counted
            r2, w2 = await asyncio.open_connection("127.0.0.1", port)
            w2.close()  # a bare connect and close (a TCP probe) is no error
            await _accepted(port)
            await _handlers_done(server)  # both answered (or not) and counted (or not)
        finally:
            server.close()
            await server.wait_closed()
        for reason in ("bad_request", "method_not_allowed", "not_found", "header_too_large", "request_timeout",
                       "request_incomplete"):
            assert m.web_refusals[reason] == 1, (reason, m.web_refusals)
        assert sum(m.web_refusals.values()) == before + 6

    run(body())


def test_recent_refusals_are_bounded_and_served_as_json(run) -> None:  # type: ignore[no-untyped-def]
    m = Metrics()
    for i in range(metrics_mod.RECENT_REFUSALS + 5):
        m.note_refusal(role="serve", listener="gpu0", peer=f"10.0.0.{i}:1", reason="identity_not_allowed")
    assert len(m.recent_refusals) == metrics_mod.RECENT_REFUSALS
    assert m.recent_refusals[-1]["peer"] == f"10.0.0.{metrics_mod.RECENT_REFUSALS + 4}:1"

    async def body() -> None:
        server = await start_http(m, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            status, headers, text = await _request(port, _get("/refusals"))
        finally:
            server.close()
        assert status == 200 and headers["content-type"] == "application/json"
        got = json.loads(text)
        assert len(got) == metrics_mod.RECENT_REFUSALS and got[0]["reason"] == "identity_not_allowed"

    run(body())


def _without_process(text: bytes) -> list[bytes]:
    """Exposition lines minus the process collector's samples (CPU time moves between two reads)."""
    return [ln for ln in text.split(b"\n") if not ln.startswith(b"process_")]


def test_fast_exposition_is_byte_identical_to_generate_latest() -> None:
    from prometheus_client.exposition import generate_latest

    m, lt = _populated()
    odd = m.listener("serve", 'we"ird\\name\nx')  # escaping of label values
    odd.refusal('odd"reason\\')
    fast = m.exposition()
    assert _without_process(fast) == _without_process(generate_latest(m.registry))
    assert b'listener="we\\"ird\\\\name\\nx"' in fast
    assert sum(ln.startswith(b"process_") for ln in fast.split(b"\n")) >= 5


def test_unsupported_families_fall_back_to_generate_latest() -> None:
    from prometheus_client import Info
    from prometheus_client.exposition import generate_latest

    m = Metrics(CollectorRegistry(), role="serve")
    Info("extra", "an info family the fast path does not write", registry=m.registry).info({"a": "b"})
    text = m.exposition()
    assert b'extra_info{a="b"} 1.0' in text
    assert _without_process(text) == _without_process(generate_latest(m.registry))


def test_upstream_up_follows_probes_and_sessions(tmp_path: Path) -> None:
    """serve's rpcguard_upstream_up: the background HELLO probe (proxy/readiness.py), and what sessions tell."""
    from rpcguard.pki import certs

    from rpcguard.proxy import server
    from rpcguard.config.flags import build_config
    from tests.unit.proxy.test_readiness import fake_server

    certs.init_ca(tmp_path)
    certs.issue(tmp_path, "node", server=True, ips=["127.0.0.1"])
    from tests.support.realpeer import reserve_port

    port = reserve_port()  # nothing listens on `port` yet, and nothing else can take it
    ov = {"cert": str(tmp_path / "node.pem"), "key": str(tmp_path / "node.key"), "ca": str(tmp_path / "ca.pem"),
          "listen": "127.0.0.1:0", "upstream": f"127.0.0.1:{port}", "metrics": "", "allow_all": True}
    rt = server.Runtime(build_config("serve", overrides=ov), metrics=Metrics(CollectorRegistry()))
    g = lambda: rt.metrics.registry.get_sample_value(  # noqa: E731
        "rpcguard_upstream_up", {"role": "serve", "listener": rt.listeners[0].route.name})
    probe = rt.listeners[0].probe
    assert probe is not None and g() is None  # not known before the first probe
    assert asyncio.run(probe.probe_now()).ok is False and g() == 0
    with fake_server(port, bytes([7, 0, 0])):
        assert asyncio.run(probe.probe_now()).ok is True and g() == 1
    name = rt.listeners[0].route.name
    rt.outcomes.session_ended({"role": "serve", "listener": name, "result": "refused", "reason": "upstream_unavailable"})
    assert g() == 0
    rt.outcomes.session_ended({"role": "serve", "listener": name, "result": "refused", "reason": "identity_not_allowed"})
    assert g() == 0  # tells nothing about the upstream
    rt.outcomes.session_ended({"role": "serve", "listener": name, "result": "ok", "reason": "", "version": "7.0.0"})
    assert g() == 1


def test_unverified_op_uses_are_exported():
    m = Metrics(CollectorRegistry())
    lt = m.listener("serve", "gpu0")
    lt.unverified_ops["IM2COL"] = 3
    assert m.registry.get_sample_value(
        "rpcguard_unverified_op_nodes_total", {"role": "serve", "listener": "gpu0", "op": "IM2COL"}) == 3


def test_request_checks_sessions_count_who_validates_each_session_s_requests() -> None:
    m = Metrics(CollectorRegistry())
    lt = m.listener("connect", "gpu0")
    lab = {"role": "connect", "listener": "gpu0"}
    g = m.registry.get_sample_value
    for by in ("proxy", "node"):  # both series exist from the start, at 0
        assert g("rpcguard_request_checks_sessions_total", {**lab, "checked_by": by}) == 0
    lt.requests_checked("node")
    lt.requests_checked("node")
    lt.requests_checked("proxy")
    assert g("rpcguard_request_checks_sessions_total", {**lab, "checked_by": "node"}) == 2
    assert g("rpcguard_request_checks_sessions_total", {**lab, "checked_by": "proxy"}) == 1
    with pytest.raises(ValueError):
        lt.requests_checked("nobody")
