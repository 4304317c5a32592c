"""Faults rpcguard must survive (issue 6): one scenario per test, against REAL processes.

Each scenario runs the real ggml-rpc-server, the real llama.cpp client (or a hand-written
ggml-rpc client for what llama.cpp never does on purpose) and rpcguard serve/connect as
processes on loopback, bounded in time and traffic. Each ends with the same questions:

* does the proxy still serve? A real session afterwards gives the tokens of a direct session;
* was the reason counted? (metrics, and the session-end log line for cut sessions);
* was anything leaked? File descriptors, TCP sockets, running sessions and the upstream queue
  go back to their baseline and RSS stays within a few MiB (tests/support/procinfo.py; rpcguard
  has no debug endpoint, so asyncio tasks are accounted for through the sockets they hold).

Short limits come from a config file written by the test. With
``RPCGUARD_RESILIENCE_REPORT=FILE`` every scenario appends its measured numbers as a JSON line
(docs/resilience.md is made from them).
"""

from __future__ import annotations

import fcntl
import os
import select
import signal
import socket
import ssl
import struct
import termios
import threading
import time
from pathlib import Path

import pytest

from rpcguard.protocol import encode
from rpcguard.protocol.encode import TensorSpec, pack_tensor
from rpcguard.protocol.versions import REFUSAL_CODES
from tests.support import procinfo, realpeer
from tests.support.guard import start_pair
from tests.support.rawclient import V7, RawClient, mtls_context
from tests.support.waiting import wait_for, wait_until

MiB = 1 << 20
N_TOKENS = 12
# Short limits so that every timeout of a scenario fires within a few seconds.
SHORT_LIMITS = """\
limits:
  handshake_timeout_s: 1
  hello_timeout_s: 1
  frame_timeout_s: 2
  drain_timeout_s: 1
"""
RELEASE_S = 2.0  # the upstream slot must be free again this soon after a client vanishes


# ----------------------------------------------------------------------------- fixtures, helpers
@pytest.fixture(scope="module")
def direct(models, tmp_path_factory) -> dict[str, list[int]]:
    """Greedy tokens of each model, straight from a real server (no proxy)."""
    proc, port = realpeer.start_rpc_server(tmp_path_factory.mktemp("direct"))
    try:
        out = {}
        for name in ("tiny", "bench"):
            run = realpeer.run_client(f"127.0.0.1:{port}", models[name], n=N_TOKENS)
            assert run.ok, run.output[-2000:]
            out[name] = run.tokens
        return out
    finally:
        proc.stop()


@pytest.fixture
def upstreams(workdir, peer_python):
    """Start real ggml-rpc-servers this test may kill and restart; all are stopped at the end."""
    procs: list[realpeer.Proc] = []
    ports: set[int] = set()

    def start(port: int | None = None) -> tuple[realpeer.Proc, int]:
        proc, port = realpeer.start_rpc_server(workdir, port=port)
        procs.append(proc)
        ports.add(port)
        return proc, port

    yield start
    for p in procs:
        p.stop(signal.SIGKILL)
    for port in ports:
        realpeer.release_port(port)


@pytest.fixture
def guards(workdir, pki):
    """serve -> upstream port, connect -> serve, with optional extra flags; stopped at the end."""
    started = []

    def make(upstream_port: int, *, config: str | None = None):
        extra = []
        if config is not None:
            path = workdir / "limits.yaml"
            path.write_text(config)
            extra = ["--config", str(path)]
        return start_pair(workdir, pki, upstream_port, started, extra, extra)

    yield make
    for g in reversed(started):
        g.stop()


_SPAWNED: list[realpeer.Proc] = []


@pytest.fixture(autouse=True)
def _reap_clients():
    """Background clients never outlive their test."""
    yield
    while _SPAWNED:
        _SPAWNED.pop().stop(signal.SIGKILL)


def spawn_client(workdir: Path, endpoint: str, model: Path, n: int) -> realpeer.Proc:
    """The real llama.cpp client in the background (to be killed, or to run during a fault)."""
    cmd = [realpeer.realpeer_python(), str(realpeer.REALPEER_DIR / "rpc_client_smoke.py"), endpoint,
           "-m", str(model), "-n", str(n), "--no-precheck"]
    proc = realpeer.start(cmd, workdir / f"client-{time.monotonic_ns()}.log", "llama.cpp client")
    _SPAWNED.append(proc)
    return proc


def same_tokens(endpoint: str, model: Path, want: list[int]) -> float:
    """A real session through ``endpoint`` gives the direct tokens; returns its duration (s)."""
    t0 = time.monotonic()
    run = realpeer.run_client(endpoint, model, n=N_TOKENS, timeout=120)
    assert run.ok, run.output[-3000:]
    assert run.tokens == want
    return time.monotonic() - t0


def computes(guard, **labels) -> float:
    """Graph computations relayed (llama.cpp sends a graph once, then GRAPH_RECOMPUTE)."""
    return sum(guard.value("rpcguard_frames_total", command=cmd, direction="request", **labels)
               for cmd in ("GRAPH_COMPUTE", "GRAPH_RECOMPUTE"))


def mismatch(run: realpeer.ClientRun, reason: str) -> None:
    """The real client was refused at HELLO with the 0.0.N answer of ``reason``."""
    assert not run.ok
    assert f"RPC server version mismatch: 0.0.{REFUSAL_CODES[reason]}" in run.output, run.output[-3000:]


def slot_free_after(port: int, t0: float) -> float:
    """Seconds from ``t0`` until a new session's HELLO is answered by the real server through the
    pair (so the upstream slot was released: a held slot would leave the HELLO queued)."""
    c = RawClient(port)
    try:
        assert c.hello() == V7
        return time.monotonic() - t0
    finally:
        c.close()


class StallingRelay:
    """A loopback TCP relay to ``port`` that stops reading from its clients once ``stall_after``
    bytes went upstream on one connection (``stalled`` is set); ``cut()`` then closes every
    upstream connection with SO_LINGER 0."""

    def __init__(self, port: int, stall_after: int) -> None:
        self.port_to, self.stall_after = port, stall_after
        self.stalled = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.upstreams: list[socket.socket] = []
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return
            up = socket.create_connection(("127.0.0.1", self.port_to))
            self.upstreams.append(up)
            threading.Thread(target=self._pump, args=(down, up, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, down, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, upload: bool) -> None:
        sent = 0
        try:
            while not (upload and sent >= self.stall_after):
                chunk = src.recv(1 << 16)
                if not chunk:
                    dst.shutdown(socket.SHUT_WR)
                    return
                dst.sendall(chunk)
                sent += len(chunk)
            self.stalled.set()
        except OSError:
            pass

    def cut(self) -> None:
        while self.upstreams:
            up = self.upstreams.pop()
            up.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            try:  # wakes the pump blocked in recv (a bare close would wait for it)
                up.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            up.close()

    def __enter__(self) -> "StallingRelay":
        return self

    def __exit__(self, *exc: object) -> None:
        self.closed = True
        self.listener.close()
        self.cut()


def set_tensor_head(t: TensorSpec, data_len: int) -> bytes:
    """A 7.0.0 SET_TENSOR frame header + head announcing ``data_len`` payload bytes."""
    head = pack_tensor(t) + b"\x00" + struct.pack("<Q", 0)
    return encode.request("SET_TENSOR", head, length=len(head) + data_len)


def get_tensor(t: TensorSpec, size: int) -> bytes:
    return encode.request("GET_TENSOR", pack_tensor(t) + struct.pack("<QQ", 0, size))


def read_direct(port: int, size: int) -> float:
    """Seconds to GET_TENSOR ``size`` bytes straight from the server on ``port`` (no proxy)."""
    c = RawClient.session(port)
    try:
        c.sock.sendall(get_tensor(c.alloc(size), size))
        t0 = time.monotonic()
        buf = bytearray(MiB)
        left = 8 + size
        while left:
            n = c.sock.recv_into(buf, min(left, MiB))
            assert n, "server closed during the response"
            left -= n
        return time.monotonic() - t0
    finally:
        c.close()


# ----------------------------------------------------------------------------- upstream faults
@pytest.mark.parametrize("phase", ["model_load", "generation"])
def test_upstream_killed_mid_session_then_restarted(workdir, upstreams, guards, models, direct, phase):
    server, port = upstreams()
    connect, serve = guards(port)
    track = procinfo.Tracker(serve=serve, connect=connect)
    track.baseline()

    for attempt in range(3):
        client = spawn_client(workdir, connect.endpoint, models["bench"], n=200)
        if phase == "model_load":  # part of the ~100 MB of weights is through: kill at once
            base = serve.value("rpcguard_upload_bytes_total", kind="set_tensor")
            reached = wait_for(lambda: serve.value("rpcguard_upload_bytes_total", kind="set_tensor") >= base + 4 * MiB, 60)
        else:  # the model is loaded and tokens are being computed
            reached = wait_for(lambda: "load:" in client.output() and computes(serve) >= 10, 60)
        assert reached, client.output()
        t_kill = time.monotonic()
        server.stop(signal.SIGKILL)
        client.popen.wait(30)
        if phase == "generation" or "load:" not in client.output():
            break
        # The whole model got through between the scrape that saw 4 MiB and the kill (a loaded
        # machine: the load takes ~0.6 s): not the case this tests; again with a fresh server.
        server, port = upstreams(port)
        assert wait_for(lambda: serve.value("rpcguard_sessions_active") == 0, 30)
    else:
        raise AssertionError("three kills in a row came after the model had loaded")

    # The client loses its session (llama.cpp aborts), the proxies end theirs and say why.
    assert client.popen.wait(30) != 0 and "RPC_CLIENT_OK" not in client.output()
    client_gone_s = time.monotonic() - t_kill
    assert wait_for(lambda: serve.value("rpcguard_sessions_active") == 0, 5)
    assert serve.wait_value("rpcguard_sessions_total", 1, result="error") >= 1
    assert serve.logged("reason=upstream_closed")
    assert wait_for(lambda: connect.value("rpcguard_sessions_active") == 0, 5)

    # While the upstream is down, sessions are refused at HELLO and counted.
    mismatch(realpeer.run_client(connect.endpoint, models["tiny"], n=4, timeout=60), "upstream_unavailable")
    assert serve.wait_value("rpcguard_refusals_total", 1, reason="upstream_unavailable") >= 1

    # Restarted on the same port: the same proxies carry the next session.
    upstreams(port)
    session_s = same_tokens(connect.endpoint, models["tiny"], direct["tiny"])
    after = track.check()
    procinfo.record(f"upstream_killed_{phase}", client_gone_s=round(client_gone_s, 3),
                    next_session_s=round(session_s, 3), **_numbers(track, after))


# ----------------------------------------------------------------------------- client faults
@pytest.mark.parametrize("how", ["close", "reset"])
def test_client_gone_mid_set_tensor_releases_the_upstream(rpc_server, guards, models, direct, how):
    connect, serve = guards(rpc_server)
    track = procinfo.Tracker(serve=serve, connect=connect)
    track.baseline()

    c = RawClient(connect.port)
    assert c.hello() == V7
    t = c.alloc(64 * MiB)
    c.sock.sendall(set_tensor_head(t, 48 * MiB))
    c.sock.sendall(bytes(4 * MiB))  # then nothing: 44 MiB of the payload never come
    assert wait_for(lambda: serve.value("rpcguard_upload_bytes_total", kind="set_tensor") >= 48 * MiB, 10)
    assert serve.value("rpcguard_sessions_active") == 1
    t0 = time.monotonic()
    c.close(reset=how == "reset")

    released_s = slot_free_after(connect.port, t0)
    assert released_s < RELEASE_S, f"upstream slot released after {released_s:.2f} s"
    for g in (serve, connect):
        assert g.wait_value("rpcguard_sessions_total", 1, result="error") >= 1
        assert g.logged("reason=client_closed_mid_frame")
    same_tokens(connect.endpoint, models["tiny"], direct["tiny"])
    after = track.check()
    procinfo.record(f"client_gone_mid_set_tensor_{how}", released_s=round(released_s, 3), **_numbers(track, after))


def unread(sock) -> int:
    """Bytes waiting unread in ``sock``'s receive queue."""
    return struct.unpack("i", fcntl.ioctl(sock, termios.FIONREAD, b"\0\0\0\0"))[0]


@pytest.mark.parametrize("how", ["close", "reset"])
def test_client_gone_while_the_server_prepares_a_response(upstreams, guards, models, direct, how):
    """ggml-rpc-server dies of SIGPIPE when it writes a response to a connection closed under it
    (it does not ignore the signal): a client that asks for 256 MiB and hangs up while the server
    copies them killed the server every time. serve half-closes and drains the upstream instead."""
    server, port = upstreams()
    size = 256 * MiB
    # The release waits for the server to finish writing what it was asked and serve to drain it:
    # the bound scales with how fast this machine moves 256 MiB from that server right now.
    direct_s = read_direct(port, size)
    bound_s = max(RELEASE_S, 4 * direct_s)
    connect, serve = guards(port)
    track = procinfo.Tracker(serve=serve, connect=connect)
    track.baseline()
    for _ in range(2):
        c = RawClient(connect.port)
        assert c.hello() == V7
        c.sock.sendall(get_tensor(c.alloc(size), size))
        # the server is writing the response: its first bytes have come through both proxies
        wait_until(lambda: unread(c.sock) > 0, 60, "the first bytes of the 256 MiB response")
        t0 = time.monotonic()
        c.close(reset=how == "reset")
        released_s = slot_free_after(connect.port, t0)
        assert server.alive(), f"ggml-rpc-server died: {server.popen.returncode}"
        assert released_s < bound_s, f"upstream slot released after {released_s:.2f} s (direct read {direct_s:.2f} s)"
    same_tokens(connect.endpoint, models["tiny"], direct["tiny"])
    assert server.alive()
    after = track.check()
    procinfo.record(f"client_gone_during_response_{how}", released_s=round(released_s, 3),
                    direct_read_s=round(direct_s, 3), **_numbers(track, after))


def test_llama_client_killed_during_model_load(workdir, rpc_server, guards, models, direct):
    connect, serve = guards(rpc_server)
    track = procinfo.Tracker(serve=serve, connect=connect)
    track.baseline()

    # A 105 MB load takes well under a second on a fast machine: too quick to catch by polling.
    # The client talks to connect through a relay that stops reading from it after 16 MiB, so the
    # kill lands mid-load every time; when the client dies the relay resets its connections, as
    # the kernel does for a killed process with unread data.
    with StallingRelay(connect.port, stall_after=16 * MiB) as relay:
        client = spawn_client(workdir, f"127.0.0.1:{relay.port}", models["bench"], n=N_TOKENS)
        assert relay.stalled.wait(60) and "load:" not in client.output(), client.output()
        assert wait_for(lambda: serve.value("rpcguard_upload_bytes_total", kind="set_tensor") >= 8 * MiB, 10)
        t0 = time.monotonic()
        client.popen.send_signal(signal.SIGKILL)
        client.popen.wait(10)
        relay.cut()

    released_s = slot_free_after(connect.port, t0)
    assert released_s < RELEASE_S, f"upstream slot released after {released_s:.2f} s"
    # The kill lands inside a SET_TENSOR payload most of the time (then the session is counted
    # as an error, reason client_closed_mid_frame), else between two frames (a clean close).
    mid_frame = serve.value("rpcguard_sessions_total", result="error") >= 1
    assert not mid_frame or serve.logged("reason=client_closed_mid_frame")
    same_tokens(connect.endpoint, models["bench"], direct["bench"])
    after = track.check()
    procinfo.record("llama_client_killed_during_load", released_s=round(released_s, 3), mid_frame=mid_frame,
                    **_numbers(track, after))


def test_client_that_stops_reading_stays_bounded(rpc_server, guards, models, direct):
    connect, serve = guards(rpc_server)
    track = procinfo.Tracker(serve=serve, connect=connect)
    base = track.baseline()

    size = 256 * MiB
    c = RawClient(connect.port)
    assert c.hello() == V7
    t = c.alloc(size)
    for _ in range(4):  # 1 GiB of responses asked for, none of it read
        c.sock.sendall(get_tensor(t, size))
    peak = dict.fromkeys(base, 0)
    # Sample the RSS for 3 s, and on until responses wait unread at the client (a loaded machine
    # may take longer to start them): the window ends on that event, bounded at 60 s.
    start = time.monotonic()
    while True:
        for name, g in (("serve", serve), ("connect", connect)):
            peak[name] = max(peak[name], procinfo.snapshot(g.proc.popen.pid).rss_kib)
        waiting = unread(c.sock)
        elapsed = time.monotonic() - start
        if (elapsed >= 3.0 and waiting > 0) or elapsed > 60:
            break
        time.sleep(0.1)
    grown = {name: procinfo.mib(peak[name] - base[name].rss_kib) for name in peak}
    # Flow control: each proxy holds at most its write high-water marks plus a read buffer,
    # whatever the client leaves unread (1 GiB here); the rest waits in the server's socket.
    assert waiting > 0
    for name, mib in grown.items():
        assert mib < 16, f"{name} grew {mib:.1f} MiB while the client did not read"

    t0 = time.monotonic()
    c.close()
    assert wait_for(lambda: serve.value("rpcguard_sessions_active") == 0
                    and connect.value("rpcguard_sessions_active") == 0, 5)
    ended_s = time.monotonic() - t0
    same_tokens(connect.endpoint, models["tiny"], direct["tiny"])
    after = track.check()
    procinfo.record("client_stops_reading", requested_mib=4 * size // MiB, unread_at_client_kib=waiting // 1024,
                    serve_peak_growth_mib=round(grown["serve"], 1), connect_peak_growth_mib=round(grown["connect"], 1),
                    session_end_s=round(ended_s, 3), **_numbers(track, after))


def test_client_that_never_reads_is_cut_and_frees_the_upstream(rpc_server, guards, models, direct):
    """A stalled reader would hold the single upstream slot for ever: once its write buffer has
    been full for frame_timeout_s (2 s here) the session is cut, counted, and the slot freed."""
    connect, serve = guards(rpc_server, config=SHORT_LIMITS)
    c = RawClient(connect.port)
    assert c.hello() == V7
    t = c.alloc(256 * MiB)
    c.sock.sendall(get_tensor(t, 256 * MiB))  # never read
    t0 = time.monotonic()
    # Both proxies see a reader that stopped (connect's client, serve's peer connect): whichever
    # times out first cuts the session.
    def cut() -> float:
        return sum(g.value("rpcguard_refusals_total", reason="frame_timeout") for g in (connect, serve))
    assert wait_for(lambda: cut() >= 1, 10, 0.1), connect.output()[-2000:] + serve.output()[-2000:]
    cut_s = time.monotonic() - t0
    assert 2 <= cut_s < 6, cut_s
    assert "has not read its responses" in connect.output() + serve.output()
    same_tokens(connect.endpoint, models["tiny"], direct["tiny"])  # the upstream is free again
    c.close()


# ----------------------------------------------------------------------------- node restart
@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_serve_restarted_under_idle_and_active_sessions(workdir, pki, upstreams, models, direct, how):
    procs_ports = [upstreams() for _ in range(2)]
    ups = [port for _, port in procs_ports]
    serve, connect, serve_cfg = procinfo.start_config_pair(workdir, pki, ups, extra=SHORT_LIMITS,
                                                           restartable=True)
    sports, cports = serve.extra["ports"], connect.extra["ports"]
    serve2 = None
    try:
        track = procinfo.Tracker(connect=connect)
        track.baseline()
        idle = RawClient(cports[0])  # tunnel gpu0: a session that loaded a buffer and went quiet
        assert idle.hello() == V7
        idle.alloc(MiB)
        active = spawn_client(workdir, f"127.0.0.1:{cports[1]}", models["bench"], n=200)  # tunnel gpu1
        assert wait_for(lambda: "load:" in active.output() and computes(serve, listener="gpu1") >= 10, 60)
        assert connect.value("rpcguard_sessions_active") == 2

        t0 = time.monotonic()
        rc = serve.stop(sig=signal.SIGTERM if how == "sigterm" else signal.SIGKILL)
        stopped_s = time.monotonic() - t0
        # Both of connect's sessions end: the idle client sees its connection closed, the active
        # llama.cpp client loses its session (or finishes within the drain).
        idle.sock.settimeout(10)
        try:
            assert idle.sock.recv(1) == b""
        except ConnectionResetError:
            pass
        idle.close()
        active_rc = active.popen.wait(30)
        if how == "sigterm":
            assert rc == 0 and stopped_s < 5, (rc, stopped_s)
            assert serve.logged("reason=shutdown")
        else:
            assert active_rc != 0
        assert wait_for(lambda: connect.value("rpcguard_sessions_active") == 0, 5)
        ended = sum(connect.value("rpcguard_sessions_total", result=r) for r in ("error", "refused"))
        assert ended >= 1 + (active_rc != 0)
        if how == "sigterm":  # serve said why (its end notice): the idle session at least
            assert connect.logged("reason=node_ended") and connect.logged("the node ended the session: shutdown")
        else:  # a killed serve says nothing: a bare close
            assert connect.logged("reason=upstream_closed")

        # connect keeps serving: while the node is down the session is refused and counted...
        mismatch(realpeer.run_client(f"127.0.0.1:{cports[0]}", models["tiny"], n=4, timeout=60), "node_unreachable")
        assert connect.wait_value("rpcguard_refusals_total", 1, reason="node_unreachable") >= 1
        # ggml-rpc-server dies of SIGPIPE when the connection it is answering on is closed under
        # it. A drain (SIGTERM) half-closes and waits for the server, so no upstream dies; a killed
        # serve leaves that to the kernel, and the server being answered may die: its supervisor
        # (e.g. systemd Restart=on-failure) restarts it on the same port.
        died = [(proc, port) for proc, port in procs_ports if not proc.alive()]
        if how == "sigterm":
            assert not died, [proc.popen.returncode for proc, _ in died]
        for proc, port in died:
            assert proc.popen.returncode == -signal.SIGPIPE, proc.output()[-2000:]
            upstreams(port)
        # ...and once it is back on the same ports, both tunnels carry sessions again.
        serve2 = procinfo.start_config_guard("serve", workdir, serve_cfg, sports, tag="-restarted")
        for port in cports:
            same_tokens(f"127.0.0.1:{port}", models["tiny"], direct["tiny"])
        after = track.check()
        procinfo.record(f"serve_restarted_{how}", serve_stop_s=round(stopped_s, 3), active_client_rc=active_rc,
                        upstreams_died_of_sigpipe=len(died),
                        **_numbers(track, after))
    finally:
        for g in (connect, serve, serve2):
            if g is not None:
                g.stop()


# ----------------------------------------------------------------------------- hostile sockets
def _client_hello() -> bytes:
    """The first flight of a TLS client (its ClientHello), to dribble a byte at a time."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_hostname="node1")
    try:
        obj.do_handshake()
    except ssl.SSLWantReadError:
        pass
    return outgoing.read()


class Attack(threading.Thread):
    """Sockets that misbehave toward one port, each until the proxy closes it or ``hold_s`` ends.

    ``first`` is sent at once (garbage), ``dribble`` a byte per second (slowloris), ``setup``
    runs on the connected socket first (e.g. an mTLS handshake). Records how many sockets the
    proxy closed and after how long.
    """

    def __init__(self, name: str, port: int, count: int, *, hold_s: float, first: bytes = b"",
                 dribble: bytes = b"", setup=None, source: str = "127.0.0.1") -> None:
        super().__init__(name=name, daemon=True)
        self.port, self.count, self.hold_s, self.source = port, count, hold_s, source
        self.first, self.dribble, self.setup = first, dribble, setup
        self.closed_after: list[float] = []
        self.opened = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # reported by the test
            self.error = exc

    def _run(self) -> None:
        socks: dict[socket.socket, float] = {}
        for _ in range(self.count):
            s = socket.create_connection(("127.0.0.1", self.port), timeout=10, source_address=(self.source, 0))
            if self.setup is not None:
                s = self.setup(s)
            if self.first:
                s.sendall(self.first)
            s.setblocking(False)
            socks[s] = time.monotonic()
            self.opened += 1
        sent = 0
        next_byte = time.monotonic() + 1.0
        deadline = time.monotonic() + self.hold_s
        while socks and time.monotonic() < deadline:
            readable, _, _ = select.select(list(socks), [], [], 0.05)
            for s in readable:
                try:
                    data = s.recv(65536)
                except (ssl.SSLWantReadError, BlockingIOError):
                    continue
                except (ConnectionError, ssl.SSLError, OSError):
                    data = b""
                if not data:
                    self.closed_after.append(time.monotonic() - socks.pop(s))
                    s.close()
            if self.dribble and time.monotonic() >= next_byte and sent < len(self.dribble):
                for s in list(socks):
                    try:
                        s.send(self.dribble[sent:sent + 1])
                    except (ssl.SSLWantWriteError, BlockingIOError):
                        pass
                    except (ConnectionError, ssl.SSLError, OSError):
                        self.closed_after.append(time.monotonic() - socks.pop(s))
                        s.close()
                sent += 1
                next_byte += 1.0
        for s in socks:
            s.close()


def test_flood_slowloris_garbage_while_a_real_session_runs(pki, rpc_server, guards, models, direct):
    connect, serve = guards(rpc_server, config=SHORT_LIMITS)
    track = procinfo.Tracker(serve=serve, connect=connect)
    track.baseline()

    # The authenticated attacks come from another tenant's certificate: one identity past its own
    # share of the listener is refused by design (limits.max_pending_per_identity, issue 21), and
    # the legitimate sessions below are client1's.
    cert, key = pki.issue("attacker", server=False)
    attacker = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    attacker.load_verify_locations(pki.path("ca"))
    attacker.load_cert_chain(cert, key)

    def mtls(s: socket.socket) -> socket.socket:
        return attacker.wrap_socket(s, server_hostname=pki.node)

    def stalled_frame(s: socket.socket) -> socket.socket:
        s = mtls(s)
        s.sendall(encode.hello_request())
        assert tuple(s.recv(36)[8:11]) == V7
        return s

    garbage = bytes([0x47]) + os.urandom(1023)  # never a TLS record (0x14-0x17 would be)
    # Each kind from its own address (the legitimate sessions come from 127.0.0.1): serve holds
    # at most max_handshakes_per_source (64) handshakes per address and closes the rest at once.
    attacks = [
        Attack("handshake flood", serve.port, 200, hold_s=5, source="127.0.0.2"),  # connect, send nothing
        Attack("TLS slowloris", serve.port, 40, hold_s=5, dribble=_client_hello(), source="127.0.0.3"),
        Attack("garbage", serve.port, 40, hold_s=5, first=garbage, source="127.0.0.4"),
        Attack("HTTP on the TLS port", serve.port, 10, hold_s=5, first=b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
               source="127.0.0.5"),
        # authenticated, then a HELLO a byte a second (serve), or the same through connect
        Attack("mTLS slowloris", serve.port, 2, hold_s=5, setup=mtls, dribble=encode.hello_request()),
        Attack("connect slowloris", connect.port, 2, hold_s=5, dribble=encode.hello_request()),
        # HELLO done, then a request frame that stops half-way
        Attack("stalled frame", serve.port, 1, hold_s=6, setup=stalled_frame, first=encode.request("ALLOC_BUFFER")[:5]),
    ]
    for a in attacks:
        a.start()
    # Meanwhile a legitimate llama.cpp session after another, all through the attacked listener.
    t0 = time.monotonic()
    durations = [same_tokens(connect.endpoint, models["bench"], direct["bench"])]
    while any(a.is_alive() for a in attacks) or len(durations) < 2:
        durations.append(same_tokens(connect.endpoint, models["tiny"], direct["tiny"]))
    for a in attacks:
        a.join(10)
        assert a.error is None, f"{a.name}: {a.error!r}"
        # every hostile socket was cut by the proxy, none waited for the test to give up
        assert len(a.closed_after) == a.opened == a.count, (a.name, a.opened, len(a.closed_after))
    by = {a.name: a for a in attacks}
    assert max(by["handshake flood"].closed_after) < 1 + 2  # handshake_timeout_s + timer slack
    assert max(by["garbage"].closed_after) < 3  # refused at once (the accept queue may be long)
    tls = lambda reason: serve.value("rpcguard_tls_handshake_failures_total", reason=reason)  # noqa: E731
    past_cap = serve.value("rpcguard_refusals_total", reason="too_many_handshakes_per_source")
    # the flood's sockets past the cap, closed at accept (how many depends on how fast they come:
    # each held one is cut after handshake_timeout_s, 1 s here)
    assert 0 < past_cap <= 200 - 64
    assert tls("tls_handshake_timeout") + past_cap >= 240
    assert tls("tls_not_tls") + tls("tls_handshake_failed") >= 50
    assert serve.wait_value("rpcguard_refusals_total", 2, reason="hello_timeout") >= 2
    assert connect.wait_value("rpcguard_refusals_total", 2, reason="hello_timeout") >= 2
    assert serve.wait_value("rpcguard_refusals_total", 1, reason="frame_timeout") >= 1
    assert serve.proc.alive() and connect.proc.alive()
    after = track.check(rss_slack_mib=32)
    procinfo.record("flood_slowloris_garbage", hostile_sockets=sum(a.count for a in attacks),
                    legit_sessions=len(durations), legit_first_s=round(durations[0], 3),
                    attack_s=round(time.monotonic() - t0, 3),
                    flood_cut_max_s=round(max(by["handshake flood"].closed_after), 3),
                    slowloris_cut_max_s=round(max(by["TLS slowloris"].closed_after), 3),
                    garbage_cut_max_s=round(max(by["garbage"].closed_after), 3),
                    serve_peak_mib=round(after["serve"].hwm_mib, 1), **_numbers(track, after))


def _numbers(track: procinfo.Tracker, after: dict) -> dict:
    out = {}
    for name, snap in after.items():
        base = track.base[name]
        out[name] = {"fds": [base.fds, snap.fds], "rss_mib": [round(base.rss_mib, 1), round(snap.rss_mib, 1)],
                     "hwm_mib": round(snap.hwm_mib, 1)}
    return out
