"""Availability under a hostile tenant (issue 21): no certificate holder keeps others off a node,
and nobody blinds its probes. Real processes: the real ggml-rpc-server, rpcguard serve/connect as
processes, the real llama.cpp client (llama-cpp-python) as the tenant who must be served, and
hand-written hostile clients for what llama.cpp never does.

Each attack is one a session found on main (ac2a74f) with default settings; each test fails
there: the trickled frame held the node's only upstream slot forever, an idle session kept a
second tenant waiting until it was refused, one certificate's silent connections took every
session of the listener, 64 silent TCP connections reset the health probes, and a flood of small
frames stalled every other tenant's handshake.
"""

from __future__ import annotations

import re
import socket
import ssl
import struct
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from rpcguard.protocol import encode
from rpcguard.protocol.encode import TensorSpec, pack_tensor
from tests.support import llamatools as lt
from tests.support import procinfo, realpeer
from tests.support.floods import FrameFlood, GraphFlood
from tests.support.guard import Guard, Pki, start_guard, start_pair
from tests.support.rawclient import RawClient, mtls_context
from tests.support.waiting import wait_for, wait_until

N_TOKENS = 8


@pytest.fixture
def guards():
    started: list[Guard] = []
    yield started
    for g in reversed(started):
        g.stop()


def config(workdir: Path, text: str) -> list[str]:
    path = workdir / "limits.yaml"
    path.write_text(text)
    return ["--config", str(path)]


def tls_client(pki: Pki, port: int, name: str | None = None, source: str = "127.0.0.1") -> ssl.SSLSocket:
    """An mTLS connection to serve, handshake done, as ``name`` (default: the client1 certificate)."""
    ctx = mtls_context(pki)
    if name is not None:
        cert, key = pki.issue(name, server=False)
        ctx.load_cert_chain(cert, key)
    raw = socket.create_connection(("127.0.0.1", port), timeout=30, source_address=(source, 0))
    return ctx.wrap_socket(raw, server_hostname=pki.node)


def closed_within(sock: socket.socket, seconds: float) -> float | None:
    """Seconds until the peer closes ``sock`` (reading and dropping what comes), None if it did not."""
    t0 = time.monotonic()
    sock.settimeout(0.2)
    while time.monotonic() - t0 < seconds:
        try:
            if sock.recv(65536) == b"":
                return time.monotonic() - t0
        except (TimeoutError, socket.timeout, ssl.SSLWantReadError):
            continue
        except (ConnectionError, ssl.SSLError, OSError):
            return time.monotonic() - t0
    return None


class Tenant(threading.Thread):
    """The real llama.cpp client through connect, in the background."""

    def __init__(self, endpoint: str, model: Path) -> None:
        super().__init__(daemon=True)
        self.endpoint, self.model = endpoint, model
        self.run_: realpeer.ClientRun | None = None

    def run(self) -> None:
        self.run_ = realpeer.run_client(self.endpoint, self.model, n=N_TOKENS, timeout=180)


def set_tensor_head(t: TensorSpec, data_len: int) -> bytes:
    head = pack_tensor(t) + b"\x00" + struct.pack("<Q", 0)
    return encode.request("SET_TENSOR", head, length=len(head) + data_len)


# ----------------------------------------------------------------------------- 1. deadlines by age
def test_a_trickled_frame_is_cut_by_its_age_and_the_waiting_tenant_is_served(pki, rpc_server, workdir, models,
                                                                              guards):
    # One byte every 0.5 s, four times faster than frame_timeout_s: the old timeout counted from
    # the last byte and never fired, holding the node's only upstream slot.
    extra = config(workdir, "limits:\n  frame_timeout_s: 2\n  queue_timeout_s: 40\n")
    connect, serve = start_pair(workdir, pki, rpc_server, guards, extra, [])
    attacker = RawClient.session(tls_client(pki, serve.port))
    t = attacker.alloc(1 << 20)
    attacker.sock.sendall(set_tensor_head(t, 1 << 20))
    tenant = Tenant(connect.endpoint, models["tiny"])
    tenant.start()  # queues behind the attacker's session
    t0 = time.monotonic()
    cut = None
    attacker.sock.settimeout(0.5)
    while cut is None and time.monotonic() - t0 < 20:
        try:
            attacker.sock.sendall(b"\0")
            if attacker.sock.recv(1) == b"":
                cut = time.monotonic() - t0
        except (TimeoutError, socket.timeout):
            continue
        except (ConnectionError, ssl.SSLError, OSError):
            cut = time.monotonic() - t0
    assert cut is not None, "the trickled frame was never cut"
    assert cut < 2 + 1 + 3  # frame_timeout_s, the tick that first saw the frame, timer slack
    tenant.join(180)
    assert tenant.run_ is not None and tenant.run_.ok, tenant.run_.output[-2000:] if tenant.run_ else None
    assert serve.wait_value("rpcguard_refusals_total", 1, reason="frame_timeout") == 1
    assert serve.logged("the minimum is 16384 B/s after 2 s")
    procinfo.record("trickled_frame", cut_s=round(cut, 3), tenant_total_s=round(time.monotonic() - t0, 3))


def test_a_slow_frame_at_the_minimum_rate_is_not_cut(pki, rpc_server, workdir, guards):
    # 96 KiB at ~24 KiB/s takes 4 s, twice frame_timeout_s: its size buys the time. Alone on the
    # node, the fair slot charges nothing (issue 28: a large upload over a slow link passes alone).
    serve = start_guard("serve", workdir, ["--upstream", f"127.0.0.1:{rpc_server}", *pki.serve_args(),
                                           *config(workdir, "limits:\n  frame_timeout_s: 2\n  hold_while_waiting_s: 1\n"
                                                            "  idle_while_waiting_s: 1\n")])
    guards.append(serve)
    c = RawClient.session(tls_client(pki, serve.port))
    t = c.alloc(96 << 10)
    c.sock.sendall(set_tensor_head(t, 96 << 10))
    for _ in range(16):
        c.sock.sendall(bytes(6 << 10))
        time.sleep(0.25)
    # the frame went through whole: the session answers the next request
    assert len(c.call("GET_ALIGNMENT", struct.pack("<I", 0))) == 8
    c.close()
    assert serve.value("rpcguard_refusals_total", reason="frame_timeout") == 0


# ----------------------------------------------------------------------------- 2. the fair slot
LONGCLIENT = Path(__file__).resolve().parents[1] / "support" / "longclient.py"


def longclient(workdir: Path, endpoint: str, model: Path, wait: Path) -> realpeer.Proc:
    return realpeer.start([realpeer.realpeer_python(), str(LONGCLIENT), endpoint, "-m", str(model), "-n",
                           str(N_TOKENS), "--wait", str(wait), "--wait-timeout", "120"],
                          workdir / f"longclient-{time.monotonic_ns()}.log", "longclient")


def test_the_real_client_idling_alone_is_never_ended(pki, rpc_server, workdir, models, guards):
    extra = config(workdir, "limits:\n  idle_while_waiting_s: 1\n")
    connect, serve = start_pair(workdir, pki, rpc_server, guards, extra, [])
    go = workdir / "go"
    client = longclient(workdir, connect.endpoint, models["tiny"], go)
    assert wait_for(lambda: "WAITING 1" in client.output() or not client.alive(), 120), client.output()
    time.sleep(6)  # six times idle_while_waiting_s, alone on the node
    go.touch()
    assert wait_for(lambda: "LONGCLIENT_OK" in client.output() or not client.alive(), 120), client.output()
    out = client.output()
    assert "LONGCLIENT_OK" in out and out.count("token ids:") == 2, out[-2000:]
    assert serve.value("rpcguard_refusals_total", reason="idle_while_waiting") == 0


def direct_completion(t: lt.Tools, workdir: Path, model: Path, port: int) -> list[int]:
    """The tokens of lt.PROMPT completed by a real llama-server straight to the server on ``port``."""
    direct = lt.start_llama_server(t, workdir, model, [f"127.0.0.1:{port}"], [*lt.SERVER], "direct")
    try:
        return direct.complete(lt.PROMPT, 8, cache_prompt=False)
    finally:
        direct.stop()


def test_the_real_llama_server_idling_alone_is_never_ended(pki, workdir, models, guards):
    """llama-server keeps its model connection open between HTTP requests: idle 4x
    idle_while_waiting_s alone on the node, then the same completion again, tokens as direct."""
    t = lt.tools()
    server, port = lt.start_rpc_server(t, workdir)
    try:
        extra = config(workdir, "limits:\n  idle_while_waiting_s: 1\n")
        connect, serve = start_pair(workdir, pki, port, guards, extra, [])
        model = realpeer.make_model(workdir / "tiny.gguf", "--preset", "tiny")
        want = direct_completion(t, workdir, model, port)
        guarded = lt.start_llama_server(t, workdir, model, [connect.endpoint], [*lt.SERVER], "guarded")
        try:
            first = guarded.complete(lt.PROMPT, 8, cache_prompt=False)
            time.sleep(4)  # alone on the node: 4x idle_while_waiting_s without a request
            second = guarded.complete(lt.PROMPT, 8, cache_prompt=False)
        finally:
            rc = guarded.stop()
        assert first == second == want and want, (first, second, want)
        assert serve.value("rpcguard_refusals_total", reason="idle_while_waiting") == 0
        assert rc in (0, -15), rc
    finally:
        server.stop()


def test_an_idle_session_makes_way_for_a_waiting_tenant(pki, rpc_server, workdir, models, guards):
    # The first real client loads, generates and idles holding the node's server; a second one
    # used to wait queue_timeout_s and be refused (0.0.6 upstream_busy).
    extra = config(workdir, "limits:\n  idle_while_waiting_s: 2\n  queue_timeout_s: 25\n")
    connect, serve = start_pair(workdir, pki, rpc_server, guards, extra, [])
    idle = longclient(workdir, connect.endpoint, models["tiny"], workdir / "never")
    assert wait_for(lambda: "WAITING 1" in idle.output() or not idle.alive(), 120), idle.output()
    t0 = time.monotonic()
    second = realpeer.run_client(connect.endpoint, models["tiny"], n=N_TOKENS, timeout=120)
    waited = time.monotonic() - t0
    assert second.ok, second.output[-2000:]
    assert serve.wait_value("rpcguard_refusals_total", 1, reason="idle_while_waiting") == 1
    assert serve.logged("reason=idle_while_waiting")
    assert waited < 20, waited  # served within idle_while_waiting_s + the drain, not at queue_timeout_s
    procinfo.record("idle_makes_way", second_tenant_s=round(waited, 3))
    idle.stop()  # (its next request would find the session gone: llama.cpp aborts)


# ----------------------------------------------------------------------------- 3. caps per identity and source
@pytest.mark.parametrize("who", ["identity", "source"])
def test_one_certificate_or_one_host_cannot_take_the_listener(pki, rpc_server, workdir, models, guards, who):
    # 12 authenticated connections that never say HELLO, with max_sessions 8: every other tenant
    # was refused 0.0.7 too_many_sessions for as long as they stayed.
    limits = "limits:\n  max_sessions: 8\n  hello_timeout_s: 60\n" + (
        "  max_pending_per_source: 3\n" if who == "source" else "")
    connect, serve = start_pair(workdir, pki, rpc_server, guards, config(workdir, limits), [])
    if who == "identity":
        silent = [tls_client(pki, serve.port, "mallory") for _ in range(12)]
    else:
        silent = [tls_client(pki, serve.port, f"host2-{i}", source="127.0.0.2") for i in range(12)]
    reason = "too_many_pending_per_identity" if who == "identity" else "too_many_pending_per_source"
    cap = 4 if who == "identity" else 3
    # every silent connection admitted or refused by serve before the tenant comes: each one got
    # its profile (counted in the same step as the cap decision; a refusal is counted only when
    # the refused connection ends)
    assert serve.wait_value("rpcguard_profile_sessions_total", 12, timeout=60) == 12
    run = realpeer.run_client(connect.endpoint, models["tiny"], n=N_TOKENS, timeout=120)
    assert run.ok, run.output[-2000:]
    for s in silent:
        s.close()
    assert serve.wait_value("rpcguard_refusals_total", 12 - cap, reason=reason) == 12 - cap


def test_one_host_cannot_take_the_listener_with_tls_handshakes(pki, rpc_server, workdir, models, guards):
    # Unauthenticated: 300 TCP connections from one address that never finish their handshake
    # (each a socket for handshake_timeout_s, re-opened by the attacker) would exhaust the fds.
    connect, serve = start_pair(workdir, pki, rpc_server, guards)
    flood = [socket.create_connection(("127.0.0.1", serve.port), source_address=("127.0.0.9", 0))
             for _ in range(300)]
    run = realpeer.run_client(connect.endpoint, models["tiny"], n=N_TOKENS, timeout=120)
    assert run.ok, run.output[-2000:]
    assert serve.wait_value("rpcguard_refusals_total", 300 - 64, reason="too_many_handshakes_per_source") >= 300 - 64
    closed = sum(closed_within(s, 0.01) is not None for s in flood)
    assert closed >= 300 - 64  # closed at accept, before any TLS
    for s in flood:
        s.close()


# ----------------------------------------------------------------------------- 4. probes cannot be starved
def test_silent_connections_cannot_reset_the_health_probes(pki, rpc_server, workdir, guards):
    serve = start_guard("serve", workdir, ["--upstream", f"127.0.0.1:{rpc_server}", *pki.serve_args()])
    guards.append(serve)
    flood = [socket.create_connection(("127.0.0.1", serve.metrics_port), source_address=(f"127.0.0.{2 + i % 20}", 0))
             for i in range(200)]
    # the flood taken in by serve before the probes come: its metrics listener has accepted them all
    wait_until(lambda: realpeer.accept_queue(serve.metrics_port) == 0, 60, "serve accepting the 200 connections")
    for path in ("/healthz", "/readyz"):
        t0 = time.monotonic()
        with urllib.request.urlopen(f"http://127.0.0.1:{serve.metrics_port}{path}", timeout=5) as rsp:
            assert rsp.status == 200
        req = urllib.request.Request(f"http://127.0.0.1:{serve.metrics_port}{path}", method="HEAD")
        with urllib.request.urlopen(req, timeout=5) as rsp:
            assert rsp.status == 200 and rsp.read() == b""
        assert time.monotonic() - t0 < 3
    for s in flood:
        s.close()
    assert serve.value("rpcguard_web_refusals_total", reason="evicted") >= 1


# ----------------------------------------------------------------------------- 5. loop fairness
@pytest.mark.parametrize("flood", [FrameFlood, GraphFlood], ids=["small_frames", "costly_graphs"])
def test_a_flood_does_not_stall_other_tenants(pki, rpc_server, workdir, guards, flood):
    """small_frames: GET_ALIGNMENT pipelined (main ac2a74f: a handshake took 0.64 s in the issue,
    3.6 s on a loaded 2-core VM). costly_graphs: 12,000-node graphs, each ~0.35 s of validation
    CPU, renamed every time so none is cached (validated on the loop, every handshake waited for
    one)."""
    serve = start_guard("serve", workdir, ["--upstream", f"127.0.0.1:{rpc_server}", *pki.serve_args()])
    guards.append(serve)

    def handshake_s() -> float:
        t0 = time.perf_counter()
        tls_client(pki, serve.port).close()
        return time.perf_counter() - t0

    quiet = sorted(handshake_s() for _ in range(10))[5]
    attacker = flood(lambda: tls_client(pki, serve.port))
    attacker.start()
    try:
        assert wait_for(lambda: attacker.answered > 0, timeout=60), "the flood never got an answer"
        start, samples = attacker.answered, []
        while len(samples) < 10 or attacker.answered < start + 3:  # over several of its graphs
            samples.append(handshake_s())
            assert len(samples) < 2000, "the flood stopped"
        busy = sorted(samples)[len(samples) // 2]
        answered = attacker.answered - start
    finally:
        attacker.close()
    assert busy < max(0.25, 8 * quiet), (quiet, busy)
    procinfo.record(f"flood_handshake_{flood.__name__}", quiet_ms=round(quiet * 1e3, 2),
                    flood_ms=round(busy * 1e3, 2), max_ms=round(max(samples) * 1e3, 2),
                    samples=len(samples), flood_answered=answered, reconnects=attacker.reconnects)
    assert serve.proc.alive()


# ----------------------------------------------------------------------------- 6. busy holders (issue 28), side by side (issue 31)
BUSY_S = 3  # hold_while_waiting_s in these tests
# idle_while_waiting_s 0: no preemption of idle holders, so only the holder's busy ticks count
FAIR = ("limits:\n  hold_while_waiting_s: 3\n  idle_while_waiting_s: 0\n  queue_timeout_s: 40\n")


class Holder(threading.Thread):
    """A hand-written client holding serve's upstream: ``step()`` every 0.25 s until serve closes it."""

    def __init__(self, client: RawClient, step) -> None:
        super().__init__(daemon=True)
        self.client, self.step = client, step
        self.closed_at: float | None = None

    def run(self) -> None:
        sock = self.client.sock
        sock.settimeout(0.25)
        t0 = time.monotonic()
        while self.closed_at is None and time.monotonic() - t0 < 120:
            try:
                self.step()
                if sock.recv(1) == b"":
                    self.closed_at = time.monotonic()
            except (TimeoutError, socket.timeout, ssl.SSLWantReadError):
                continue
            except (ConnectionError, ssl.SSLError, OSError):
                self.closed_at = time.monotonic()


def served_behind(serve: Guard, holder: Holder, connect: Guard, model: Path) -> tuple[float, Tenant]:
    """Start the real client behind ``holder``; seconds from its wait (serve's log line) to the holder's end."""
    holder.start()
    tenant = Tenant(connect.endpoint, model)
    tenant.start()
    assert serve.wait_value("rpcguard_upstream_queue_depth", 1, timeout=60) >= 1  # the real client waits
    waiting_since = time.monotonic()
    holder.join(60)
    assert holder.closed_at is not None, "the holder kept the upstream while the real client waited"
    tenant.join(180)
    assert tenant.run_ is not None and tenant.run_.ok, tenant.run_.output[-2000:] if tenant.run_ else None
    assert serve.logged("waits for the upstream of listener")  # who holds the node, since when (issue 31)
    return holder.closed_at - waiting_since, tenant


def test_a_frame_trickled_just_over_the_minimum_rate_makes_way_for_a_waiting_tenant(pki, rpc_server, workdir,
                                                                                    models, guards):
    # issue 28: 4 MiB at 17.6 KB/s (over min_data_rate_bps, so its frame deadline grows faster than
    # it ages) held the node's only upstream slot for 4 minutes, as long as the attacker liked with
    # a larger frame; idle_while_waiting_s (off here: the operator's preemption of idle holders)
    # counted a trickle as work.
    connect, serve = start_pair(workdir, pki, rpc_server, guards, config(workdir, FAIR), [])
    attacker = RawClient.session(tls_client(pki, serve.port))
    t = attacker.alloc(4 << 20)
    attacker.sock.sendall(set_tensor_head(t, 4 << 20))
    chunk = bytes(4400)  # every 0.25 s
    cut_s, _ = served_behind(serve, Holder(attacker, lambda: attacker.sock.sendall(chunk)), connect, models["tiny"])
    assert cut_s < BUSY_S + 1 + 3, cut_s  # the tick that starts the clock, BUSY_S busy ticks, slack
    assert serve.wait_value("rpcguard_refusals_total", 1, reason="hold_while_waiting") == 1
    assert serve.value("rpcguard_refusals_total", reason="frame_timeout") == 0
    assert serve.logged("node busy, held by session")
    procinfo.record("trickle_hold_while_waiting", cut_after_wait_s=round(cut_s, 3))


def recompute_flood(pki: Pki, port: int) -> tuple[RawClient, bytes]:
    """A session of the ``flood`` identity that stored a 1024x1024 F32 matrix product: (client, RECOMPUTE)."""
    c = RawClient.session(tls_client(pki, port, "flood"))
    n = 1024
    t = c.alloc(3 * 4 * n * n)
    from rpcguard.protocol.ggml import op_table
    mul_mat = op_table((7, 0, 0)).ids["MUL_MAT"]  # type: ignore[union-attr]
    a = TensorSpec(id=0x10, buffer=t.buffer, data=t.data, ne=(n, n, 1, 1))
    b = TensorSpec(id=0x11, buffer=t.buffer, data=t.data + 4 * n * n, ne=(n, n, 1, 1))
    d = TensorSpec(id=0x20, buffer=t.buffer, data=t.data + 8 * n * n, ne=(n, n, 1, 1), op=mul_mat, src=(0x10, 0x11))
    c.sock.sendall(encode.request("GRAPH_COMPUTE", encode.graph_payload([d.id], [a, b, d])))
    assert len(c.call("GET_ALIGNMENT", struct.pack("<I", 0))) == 8  # the graph went through (no answer of its own)
    return c, encode.request("GRAPH_RECOMPUTE", struct.pack("<I", 0))


def test_a_recompute_flood_is_charged_and_makes_way_for_a_waiting_tenant(pki, rpc_server, workdir, models, guards):
    # issue 28: GRAPH_RECOMPUTE (4 bytes, no answer) runs the stored graph again. The flood's
    # identity is priced as a slow node (node_gflops 1: 2.1 s per product, the real server takes
    # ~0.1 s), so its share is its estimated compute, not its ticks: one every 0.25 s is 8 s/s.
    cfg = FAIR + ("profiles:\n  flood:\n    policy: {node_gflops: 1}\n"
                  "allow:\n  - {cn: [flood], profile: flood}\n  - {cn: [client1]}\n")
    connect, serve = start_pair(workdir, pki, rpc_server, guards, config(workdir, cfg), [])
    attacker, again = recompute_flood(pki, serve.port)
    cut_s, _ = served_behind(serve, Holder(attacker, lambda: attacker.sock.sendall(again)), connect, models["tiny"])
    assert cut_s < BUSY_S + 1 + 3, cut_s
    assert serve.wait_value("rpcguard_refusals_total", 1, reason="hold_while_waiting") == 1
    line = next(ln for ln in serve.output().splitlines() if "reason=hold_while_waiting" in ln)
    found = re.search(r"\(busy (\d+) s, ([\d.]+) s of estimated compute\)", line)
    assert found is not None, line
    busy, compute = (float(x) for x in found.groups())
    assert compute > BUSY_S >= busy, line  # ended for its compute, not for its ticks
    procinfo.record("recompute_hold_while_waiting", cut_after_wait_s=round(cut_s, 3), compute_s=compute)


def contained_pair(pki: Pki, workdir: Path, guards: list[Guard], server: str, limits: str) -> tuple[Guard, Guard]:
    """connect -> serve -- SERVER (a sandboxed process per session, the upstream.exec defaults)."""
    serve = start_guard("serve", workdir, [*pki.serve_args(), *config(workdir, limits), "--", server])
    guards.append(serve)
    connect = start_guard("connect", workdir, ["--server", serve.endpoint, "--server-name", pki.node,
                                               *pki.connect_args()])
    guards.append(connect)
    return connect, serve


def test_a_contained_serve_never_cuts_an_idle_client_for_another_tenant(pki, workdir, models, guards):
    """issue 31: the real llama.cpp client loads, generates and idles holding its buffers; a second
    real client loads and generates through the same contained node meanwhile (both fair-slot
    limits at 1 s). Nothing is ended and nobody waits: each session has its own process. On main
    the second queued for the listener's single slot and the first was ended idle_while_waiting."""
    connect, serve = contained_pair(pki, workdir, guards, str(realpeer.rpc_server_binary()),
                                    "limits:\n  idle_while_waiting_s: 1\n  hold_while_waiting_s: 1\n")
    go = workdir / "go"
    first = longclient(workdir, connect.endpoint, models["tiny"], go)
    assert wait_for(lambda: "WAITING 1" in first.output() or not first.alive(), 120), first.output()
    second = realpeer.run_client(connect.endpoint, models["tiny"], n=N_TOKENS, timeout=120)
    assert second.ok, second.output[-2000:]
    go.touch()
    assert wait_for(lambda: "LONGCLIENT_OK" in first.output() or not first.alive(), 120), first.output()
    out = first.output()
    assert "LONGCLIENT_OK" in out and out.count("token ids:") == 2, out[-2000:]
    for reason in ("idle_while_waiting", "hold_while_waiting", "upstream_busy"):
        assert serve.value("rpcguard_refusals_total", reason=reason) == 0, reason
    assert "waits for the upstream" not in serve.output()


def test_with_upstream_busy_refuse_the_second_client_is_told_and_the_first_keeps_its_session(pki, rpc_server,
                                                                                            workdir, models, guards):
    """issue 31, --upstream (one server, one session at a time): ``upstream_busy: refuse`` never
    ends a holder; the second real client is refused at once (0.0.6) with who holds the node and
    since when, and the first one's next round works."""
    connect, serve = start_pair(workdir, pki, rpc_server, guards, config(workdir, "limits:\n  upstream_busy: refuse\n"),
                                [])
    go = workdir / "go"
    first = longclient(workdir, connect.endpoint, models["tiny"], go)
    assert wait_for(lambda: "WAITING 1" in first.output() or not first.alive(), 120), first.output()
    second = realpeer.run_client(connect.endpoint, models["tiny"], n=N_TOKENS, timeout=120)
    assert not second.ok
    assert serve.wait_value("rpcguard_refusals_total", 1, reason="upstream_busy") >= 1
    assert serve.logged("node busy: held by session")
    go.touch()
    assert wait_for(lambda: "LONGCLIENT_OK" in first.output() or not first.alive(), 120), first.output()
    out = first.output()
    assert "LONGCLIENT_OK" in out and out.count("token ids:") == 2, out[-2000:]
    assert serve.value("rpcguard_refusals_total", reason="idle_while_waiting") == 0


def test_a_contained_serve_never_cuts_a_live_llama_server_for_another_tenant(pki, workdir, guards):
    """issue 31: under serve -- ggml-rpc-server each session has its own process, so a second
    tenant does not wait for the first: llama-server A idles between two completions holding its
    buffers while llama-server B loads and generates; nothing is ended (with both fair-slot limits
    at 1 s), nobody waits, and A's second completion gives the tokens of direct. On main B's
    sessions queued for the listener's single slot and A was ended after idle_while_waiting_s."""
    t = lt.tools()
    server, port = lt.start_rpc_server(t, workdir)
    try:
        model = realpeer.make_model(workdir / "tiny.gguf", "--preset", "tiny")
        want = direct_completion(t, workdir, model, port)
        connect, serve = contained_pair(pki, workdir, guards, str(t.rpc_server),
                                        "limits:\n  idle_while_waiting_s: 1\n  hold_while_waiting_s: 1\n")
        a = lt.start_llama_server(t, workdir, model, [connect.endpoint], [*lt.SERVER], "a")
        try:
            first = a.complete(lt.PROMPT, 8, cache_prompt=False)
            b = lt.start_llama_server(t, workdir, model, [connect.endpoint], [*lt.SERVER], "b")
            try:
                other = b.complete(lt.PROMPT, 8, cache_prompt=False)
            finally:
                b.stop()
            second = a.complete(lt.PROMPT, 8, cache_prompt=False)
        finally:
            rc = a.stop()
        assert first == second == other == want and want, (first, second, other, want)
        assert rc in (0, -15), rc
        for reason in ("idle_while_waiting", "hold_while_waiting", "upstream_busy"):
            assert serve.value("rpcguard_refusals_total", reason=reason) == 0, reason
        assert "waits for the upstream" not in serve.output()
    finally:
        server.stop()


def test_when_serve_ends_a_live_session_connect_logs_why_next_to_the_client(pki, rpc_server, workdir, models, guards):
    """issue 31.3: the real client holds its session past the node's max_session_s; serve ends it
    (session_lifetime) and, both ends knowing the end notice (ALPN +notice), tells connect why:
    connect's log line and its node_ended count name the node's reason, where the llama.cpp user
    looks. Before, connect saw a bare close and logged only 'upstream closed'."""
    connect, serve = start_pair(workdir, pki, rpc_server, guards, config(workdir, "limits:\n  max_session_s: 4\n"), [])
    go = workdir / "go"
    client = longclient(workdir, connect.endpoint, models["tiny"], go)
    assert serve.wait_value("rpcguard_refusals_total", 1, timeout=60, reason="session_lifetime") == 1
    assert connect.wait_value("rpcguard_refusals_total", 1, timeout=20, reason="node_ended") == 1
    assert connect.logged("the node ended the session: session_lifetime")
    assert connect.value("rpcguard_sessions_total", reason="upstream_closed") == 0
    go.touch()
    assert wait_for(lambda: not client.alive(), 120), client.output()
    assert "LONGCLIENT_OK" not in client.output()
