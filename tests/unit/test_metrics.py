"""Unit tests of rpcguard.metrics: the collector against the design table, and the HTTP endpoint."""

from __future__ import annotations

import asyncio
import gzip
import json
import platform
import re
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

import rpcguard
from rpcguard import metrics as metrics_mod
from rpcguard.metrics import ListenerTraffic, Metrics, start_http
from rpcguard.protocol.stats import LATENCY_BUCKETS_S, SessionStats

SET_TENSOR, GRAPH_COMPUTE, HELLO = 6, 10, 14
DESIGN = Path(__file__).resolve().parents[2] / "docs" / "design.md"


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
    m = Metrics(CollectorRegistry())
    lt = m.listener("serve", "gpu0", upstream="127.0.0.1:50052")
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
    m.set_certificate_expiry("serve", "cert", 1_900_000_000)
    m.reload("ok")
    m.cert_warnings[("serve", "expiring_soon")] = 1.0
    return m, lt


def test_every_design_metric_is_exported_with_its_labels() -> None:
    table = _design_table()
    assert len(table) == 17, "design.md metrics table not found or changed shape"
    m, _ = _populated()
    families = {f.name: f for f in text_string_to_metric_families(m.exposition().decode())}
    for name, (typ, labels) in table.items():
        base = name.removesuffix("_total") if typ == "counter" else name
        assert base in families, name
        fam = families[base]
        assert fam.type == typ, name
        assert fam.samples, f"{name} exported no sample"
        for sample in fam.samples:
            assert set(sample.labels) - {"le"} == labels, (name, sample.labels)
    assert set(families) == {n.removesuffix("_total") if t == "counter" else n for n, (t, _) in table.items()}


def test_sample_values() -> None:
    m, _ = _populated()
    g = m.registry.get_sample_value
    rl = {"role": "serve", "listener": "gpu0"}
    assert g("rpcguard_frames_total", {**rl, "direction": "request", "command": "SET_TENSOR"}) == 2
    assert g("rpcguard_bytes_total", {**rl, "direction": "request", "command": "SET_TENSOR"}) == 300
    assert g("rpcguard_frames_total", {**rl, "direction": "response", "command": "HELLO"}) == 1
    assert g("rpcguard_bytes_total", {**rl, "direction": "response", "command": "HELLO"}) == 11
    # zero series stay out: no SET_TENSOR response, no HELLO request
    assert g("rpcguard_frames_total", {**rl, "direction": "response", "command": "SET_TENSOR"}) is None
    assert g("rpcguard_frames_total", {**rl, "direction": "request", "command": "HELLO"}) is None
    assert g("rpcguard_sessions_active", rl) == 1
    for result in ("ok", "refused", "error"):
        assert g("rpcguard_sessions_total", {**rl, "result": result}) == 0
    assert g("rpcguard_refusals_total", {**rl, "reason": "command_not_allowed"}) == 1
    assert g("rpcguard_tls_handshake_failures_total", {**rl, "reason": "tls_unknown_ca"}) == 1
    assert g("rpcguard_firewall_violations_total",
             {**rl, "reason": "tensor_out_of_buffer", "mode": "monitor"}) == 1
    assert g("rpcguard_upstream_protocol_info",
             {"listener": "gpu0", "upstream": "127.0.0.1:50052", "version": "3.0.0"}) == 1
    assert g("rpcguard_upstream_queue_depth", {"listener": "gpu0"}) == 3
    assert g("rpcguard_alloc_bytes_total", rl) == 4096
    assert g("rpcguard_upload_bytes_total", {**rl, "kind": "set_tensor"}) == 256
    assert g("rpcguard_upload_bytes_total", {**rl, "kind": "hash_hit"}) == 64
    assert g("rpcguard_rdma_caps_zeroed_total", {**rl, "direction": "request"}) == 1
    assert g("rpcguard_rdma_caps_zeroed_total", {**rl, "direction": "response"}) == 2
    assert g("rpcguard_build_info", {"version": rpcguard.__version__, "python": platform.python_version()}) == 1
    assert g("rpcguard_certificate_expiry_timestamp_seconds", {"role": "serve", "certificate": "cert"}) == 1.9e9
    assert g("rpcguard_reload_total", {"result": "ok"}) == 1
    assert g("rpcguard_reload_total", {"result": "error"}) == 0


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
    assert m.registry.get_sample_value("rpcguard_upstream_protocol_info",
                                       {"listener": "a", "upstream": "h:1", "version": ""}) is None
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
    m = Metrics(CollectorRegistry())
    g = m.registry.get_sample_value
    assert g("rpcguard_reload_total", {"result": "error"}) == 0
    assert g("rpcguard_build_info", {"version": rpcguard.__version__, "python": platform.python_version()}) == 1


# --- HTTP endpoint ----------------------------------------------------------------------


def _run(coro: Coroutine[Any, Any, Any], loop_kind: str) -> Any:
    if loop_kind == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(coro)
    return asyncio.run(coro)


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Callable[[Coroutine[Any, Any, Any]], Any]:
    return lambda coro: _run(coro, request.param)


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
        assert status == 405 and headers["allow"] == "GET"
        assert (await _request(port, b"garbage\r\n\r\n"))[0] == 400
        big = _get("/metrics", "X-Pad: " + "a" * (metrics_mod.MAX_HEADER_BYTES + 100) + "\r\n")
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
        # ... while others are served at once and the loop keeps running
        for _ in range(5):
            assert (await _request(port, _get("/healthz")))[0] == 200
        assert time.monotonic() - t0 < 1.0
        # the read timeout closes both without an answer
        assert await asyncio.wait_for(silent_r.read(), 2) == b""
        assert await asyncio.wait_for(slow_r.read(), 2) == b""
        assert time.monotonic() - t0 >= 0.25
        assert ticks >= 10
        tick_task.cancel()
        silent_w.close()
        slow_w.close()

    run(_with_server(body, read_timeout_s=0.3))


def test_http_connection_cap(run, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(metrics_mod, "MAX_HTTP_CONNECTIONS", 2)

    async def body(port: int) -> None:
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        await asyncio.sleep(0.1)
        # over the cap: answered 503 at once, before any request is read (a client that
        # already sent its request may see a reset instead: unread data on close)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert (await asyncio.wait_for(reader.read(), 2)).startswith(b"HTTP/1.1 503 ")
        writer.close()
        for _, w in held:
            w.close()
        await asyncio.sleep(0.1)
        assert (await _request(port, _get("/healthz")))[0] == 200

    run(_with_server(body))


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
