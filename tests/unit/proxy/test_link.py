"""link.Link as glue: the lifecycle's actions carried out on transports, with an injected
dialer (a fake upstream transport) and an injected clock. The client is a loopback socket; the
real-peer behaviour is proven by tests/integration."""

from __future__ import annotations

import asyncio
import socket
import struct
import sys
import threading
from types import SimpleNamespace

import pytest

from rpcguard.errors import Refusal
from rpcguard.observe.metrics import Metrics
from rpcguard.protocol import encode
from rpcguard.protocol.settings import Limits, Profile, SessionPolicy
from rpcguard.protocol.state import UpstreamFacts
from rpcguard.protocol.versions import REFUSAL_CODES
from rpcguard.proxy.endpoint import Dialer
from rpcguard.proxy import link as link_mod
from rpcguard.proxy.link import Link
from rpcguard.proxy.route import Route
from rpcguard.proxy.validators import Validators
from tests.support import vectors as V

GIB = 1 << 30


class FakeUpstream(asyncio.Transport):
    """What the dialer connects the upstream endpoint to: records writes, closes on request."""

    def __init__(self, protocol: asyncio.BufferedProtocol) -> None:
        super().__init__()
        self.protocol = protocol
        self.written = bytearray()
        self.writes = 0  # write() calls: one per TLS record on a real tunnel
        self.closed = self.aborted = self.eof_written = False

    def write(self, data) -> None:
        self.written += bytes(data)
        self.writes += 1

    def writelines(self, chunks) -> None:
        for c in chunks:
            self.write(c)

    def get_write_buffer_size(self) -> int:
        return 0

    def set_write_buffer_limits(self, high=None, low=None) -> None:
        pass

    def get_extra_info(self, name, default=None):
        return default

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def write_eof(self) -> None:
        self.eof_written = True

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self._lost()

    def abort(self) -> None:
        self.aborted = True
        self._lost()

    def _lost(self) -> None:
        if not self.closed:
            self.closed = True
            asyncio.get_running_loop().call_soon(self.protocol.connection_lost, None)

    def send(self, data: bytes) -> None:
        """The server sends ``data``."""
        buf = self.protocol.get_buffer(len(data))
        buf[: len(data)] = data
        self.protocol.buffer_updated(len(data))


class Clock:
    def __init__(self) -> None:
        self.ns = 10**12

    def __call__(self) -> int:
        return self.ns


def fake_dialer() -> tuple[Dialer, list[FakeUpstream]]:
    """A dialer that connects the upstream endpoint to a new FakeUpstream, kept in the list."""
    ups: list[FakeUpstream] = []

    async def dialer(route, factory, limits):
        up = FakeUpstream(factory())
        ups.append(up)
        up.protocol.connection_made(up)

    return dialer, ups


def make_route(records: list) -> Route:
    route = Route(role="connect", name="t", upstream_host="127.0.0.1", upstream_port=9,
                  traffic=Metrics().listener("connect", "t", upstream="127.0.0.1:9"),
                  default=Profile("default", SessionPolicy(), Limits(hello_timeout_s=10)),
                  facts=UpstreamFacts(version=(7, 0, 0), device_count=1, memory={0: (GIB, GIB)}))
    route.on_session_end = records.append
    return route


async def accepted_pair() -> tuple[asyncio.StreamReader, asyncio.StreamWriter, socket.socket]:
    """A loopback connection: the client's reader and writer, and the accepted socket (non-blocking)."""
    lsock = socket.create_server(("127.0.0.1", 0))
    lsock.setblocking(False)
    reader, writer = await asyncio.open_connection(*lsock.getsockname())
    conn, _ = await asyncio.get_running_loop().sock_accept(lsock)
    lsock.close()
    conn.setblocking(False)
    return reader, writer, conn


async def start(route: Route, dialer, clock: Clock):
    """A Link on one accepted loopback socket; returns (link, client reader, client writer)."""
    reader, writer, conn = await accepted_pair()
    link = Link(route, clock_ns=clock, dialer=dialer, check_upstream=lambda route, transport: None)
    await link.run(conn)
    return link, reader, writer


async def until(cond, what: str) -> None:
    for _ in range(200):
        if cond():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}")


def run(coro) -> None:
    asyncio.run(asyncio.wait_for(coro, 10))


class Recorder:
    """A destination transport for ``Link._send``: records each call, holds ``unsent`` bytes."""

    def __init__(self, unsent: int = 0) -> None:
        self.calls: list[tuple[str, list[bytes]]] = []
        self.unsent = unsent

    def write(self, data) -> None:
        self.calls.append(("write", [bytes(data)]))

    def writelines(self, chunks) -> None:
        self.calls.append(("writelines", [bytes(c) for c in chunks]))

    def get_write_buffer_size(self) -> int:
        return self.unsent


@pytest.mark.parametrize("chunks, kind, n", [
    ([b"a" * 10], "write", 1),  # one chunk: as it is
    ([b"a" * 10, memoryview(b"b" * 20), bytearray(b"c")], "write", 1),  # small ones: one record
    ([b"a" * link_mod.JOIN_MAX_BYTES, b"b"], "writelines", 2),  # large: never copied to be joined
])
def test_send_joins_small_chunks_into_one_write_and_leaves_large_ones(chunks, kind, n):
    dest = SimpleNamespace(transport=Recorder(), closed=False)
    sent = list(chunks)
    Link._send(dest, sent, None)  # type: ignore[arg-type]
    assert [c[0] for c in dest.transport.calls] == [kind] and len(dest.transport.calls[0][1]) == n
    assert b"".join(dest.transport.calls[0][1]) == b"".join(bytes(c) for c in chunks) and sent == []


@pytest.mark.parametrize("unsent, fresh", [(0, 0), (1, 1)])
def test_send_gives_the_source_a_fresh_buffer_while_the_destination_keeps_its_views(unsent, fresh):
    source = SimpleNamespace(fresh=0)
    source.fresh_buffer = lambda: setattr(source, "fresh", source.fresh + 1)
    Link._send(SimpleNamespace(transport=Recorder(unsent), closed=False), [b"x"], source)  # type: ignore[arg-type]
    assert source.fresh == fresh


def test_send_to_a_closed_or_missing_destination_drops_the_chunks():
    for dest in (None, SimpleNamespace(transport=Recorder(), closed=True), SimpleNamespace(transport=None, closed=False)):
        chunks = [b"x"]
        Link._send(dest, chunks, None)  # type: ignore[arg-type]
        assert chunks == [] and (dest is None or dest.transport is None or dest.transport.calls == [])


def test_connect_session_through_an_injected_dialer():
    async def main() -> None:
        records: list = []
        dialer, ups = fake_dialer()

        link, reader, writer = await start(make_route(records), dialer, Clock())
        await until(lambda: ups, "the dial")
        up = ups[0]
        writer.write(V.HELLO_REQ_V4)
        await until(lambda: bytes(up.written) == V.HELLO_REQ_V4, "HELLO forwarded")
        up.send(V.HELLO_RSP_700)
        assert await reader.readexactly(len(V.HELLO_RSP_700)) == V.HELLO_RSP_700
        writer.write(V.DEVICE_COUNT_REQ)
        await until(lambda: bytes(up.written).endswith(V.DEVICE_COUNT_REQ), "DEVICE_COUNT forwarded")
        writer.close()
        await until(lambda: records, "the session end")
        assert records[0]["result"] == "ok" and records[0]["version"] == "7.0.0" and records[0]["profile"] == "default"
        assert up.closed and not up.aborted and link.lc.state == "closed" and link not in link.route.links
        assert link.route.traffic.sessions_total["ok"] == 1

    run(main())


@pytest.mark.parametrize("hello,new_layout", [(V.HELLO_REQ_V4, True), (V.HELLO_REQ_V1, False)])
def test_dial_failure_is_answered_at_hello(hello, new_layout):
    async def main() -> None:
        records: list = []

        async def dialer(route, factory, limits):
            raise Refusal("node_unreachable", "cannot reach 127.0.0.1:9: refused")

        _, reader, writer = await start(make_route(records), dialer, Clock())
        writer.write(hello)
        answer = encode.hello_response((0, 0, REFUSAL_CODES["node_unreachable"]), new_layout=new_layout)
        assert await reader.read(100) == answer
        assert await reader.read(100) == b""  # closed after the answer
        await until(lambda: records, "the session end")
        assert records[0]["reason"] == "node_unreachable"

    run(main())


def test_hello_timeout_on_the_injected_clock():
    async def main() -> None:
        records: list = []
        clock = Clock()

        dialer, _ = fake_dialer()

        link, reader, writer = await start(make_route(records), dialer, clock)
        link._tick()
        assert link.lc.state == "greeting"  # 0 s: nothing due
        clock.ns += 11 * 10**9
        link._tick()
        assert await reader.read(100) == b""
        assert records[0]["reason"] == "hello_timeout" and records[0]["duration_s"] == 11
        writer.close()

    run(main())


def test_internal_error_while_parsing_costs_one_session(monkeypatch):
    async def main() -> None:
        records: list = []

        dialer, _ = fake_dialer()

        link, reader, writer = await start(make_route(records), dialer, Clock())

        def broken(data, now_ns):
            raise RuntimeError("a bug")

        link.lc.client_data = broken
        writer.write(V.HELLO_REQ_V4)
        assert await reader.read(100) == b""
        assert records[0]["reason"] == "internal_error" and records[0]["result"] == "error"

    run(main())


def test_node_certificate_refused_by_the_upstream_check():
    async def main() -> None:
        records: list = []
        dialer, ups = fake_dialer()

        def check(route, transport):
            raise Refusal("certificate_usage_invalid", "certificate without serverAuth")

        reader, writer, conn = await accepted_pair()
        route = make_route(records)
        link = Link(route, clock_ns=Clock(), dialer=dialer, check_upstream=check)
        await link.run(conn)
        await until(lambda: ups and ups[0].closed, "the node connection closed")
        writer.write(V.HELLO_REQ_V4)
        assert await reader.read(100) == encode.hello_response(
            (0, 0, REFUSAL_CODES["certificate_usage_invalid"]), new_layout=True)
        assert ups[0].written == b""  # nothing reached a node that failed the check
        await until(lambda: records, "the session end")
        assert records[0]["reason"] == "certificate_usage_invalid"
        assert route.traffic.tls_failures["certificate_usage_invalid"] == 1

    run(main())


class FakeClient(FakeUpstream):
    """The client side of a serve link, without TLS (the test admits the link itself)."""


def test_serve_drains_the_upstream_after_the_client_left_and_keeps_the_slot_until_then():
    """ggml-rpc-server dies of SIGPIPE on a response written to a closed connection: the link
    half-closes the upstream, drops what it still sends and frees the slot only once it hung up."""
    from rpcguard.proxy.route import UpstreamSlot

    async def main() -> None:
        records: list = []
        dialer, ups = fake_dialer()

        route = make_route(records)
        route.role, route.slot = "serve", UpstreamSlot()
        link = Link(route, clock_ns=Clock(), dialer=dialer, check_upstream=lambda route, transport: None)
        route.links.add(link)
        client = FakeClient(link.client)
        link.client.transport = client  # what connection_made does, minus the admission
        link.lc.admit(route.default, "CN=client1")
        link._apply()
        client.send(V.HELLO_REQ_V4)  # the slot is taken at HELLO, then the upstream dialled
        await until(lambda: ups and bytes(ups[0].written) == V.HELLO_REQ_V4, "HELLO forwarded")
        up = ups[0]
        assert route.slot.busy
        up.send(V.HELLO_RSP_700)
        assert bytes(client.written) == V.HELLO_RSP_700
        client.send(V.DEVICE_COUNT_REQ)
        link.eof(link.client)  # the client leaves while the server prepares its answer
        assert client.closed and up.eof_written and not up.closed
        assert route.slot.busy and route.slot.draining and records[0]["result"] == "ok"
        up.send(encode.response(bytes(4)))  # the late answer is read and dropped
        assert bytes(client.written) == V.HELLO_RSP_700
        up.close()  # the server hung up
        await until(lambda: not route.slot.busy, "the slot freed")
        assert link.lc.state == "closed" and not up.aborted

    run(main())


async def active_connect_link(records: list, clock: Clock):
    """A connect link past HELLO with one 1 MiB buffer allocated and its base known; returns
    (link, fake upstream, client reader, client writer, a tensor in that buffer)."""
    dialer, ups = fake_dialer()

    link, reader, writer = await start(make_route(records), dialer, clock)
    await until(lambda: ups, "the dial")
    up = ups[0]
    for request, answer in [(V.HELLO_REQ_V4, V.HELLO_RSP_700), (V.ALLOC_REQ_1MIB, V.ALLOC_RSP),
                            (V.GET_BASE_REQ, V.GET_BASE_RSP)]:
        writer.write(request)
        await until(lambda: bytes(up.written).endswith(request), "the request forwarded")
        up.send(answer)
        assert await reader.readexactly(len(answer)) == answer
    t = encode.pack_tensor(encode.TensorSpec(buffer=V.HANDLE, data=V.BASE, ne=(16, 1, 1, 1)))
    return link, up, reader, writer, t


def set_tensor(t: bytes) -> bytes:
    return encode.request("SET_TENSOR", t + bytes(1) + bytes(8) + bytes(64))


def test_set_tensors_wait_for_the_next_urgent_frame_and_go_out_in_one_write():
    async def main() -> None:
        link, up, reader, writer, t = await active_connect_link([], Clock())
        before, writes = len(up.written), up.writes
        for _ in range(3):  # one client write each, as llama.cpp does per frame
            writer.write(set_tensor(t))
            await writer.drain()
        await until(lambda: len(link._held) == 3 * len(set_tensor(t)), "the SET_TENSORs held")
        assert len(up.written) == before  # nothing sent yet
        get = encode.request("GET_TENSOR", t + struct.pack("<QQ", 0, 64))
        writer.write(get)
        await until(lambda: bytes(up.written).endswith(get), "the GET_TENSOR forwarded")
        assert bytes(up.written[before:]) == set_tensor(t) * 3 + get  # in order, unchanged
        assert up.writes == writes + 1  # one write: one TLS record
        writer.close()

    run(main())


def test_a_frame_reaches_the_upstream_in_two_adapter_calls_each_side_of_the_core():
    """Issue 30's hop count (docs/design.md): from the transport's read callback to the upstream's
    write, the relay's own frames are Endpoint.buffer_updated and Link.data before the sans-IO
    core (Lifecycle.feed), Link._deliver and Link._send after it."""
    async def main() -> None:
        link, up, reader, writer, t = await active_connect_link([], Clock())
        stacks: list[list[str]] = []
        record = up.write

        def write(data) -> None:
            frame, names = sys._getframe(1), []
            while frame is not None:
                names.append(f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_code.co_name}")
                frame = frame.f_back
            stacks.append(names)
            record(data)

        up.write = write  # type: ignore[method-assign]
        get = encode.request("GET_TENSOR", t + struct.pack("<QQ", 0, 64))
        writer.write(get)
        await until(lambda: stacks, "the GET_TENSOR forwarded")
        names = stacks[0][:stacks[0].index("endpoint.py:buffer_updated") + 1]
        assert names[::-1] == ["endpoint.py:buffer_updated", "link.py:data", "link.py:_deliver", "link.py:_send"]
        assert bytes(up.written).endswith(get)
        writer.close()

    run(main())


def test_held_frames_go_out_at_the_tick_and_before_the_half_close():
    async def main() -> None:
        link, up, reader, writer, t = await active_connect_link([], Clock())
        before = len(up.written)
        writer.write(set_tensor(t))
        await until(lambda: link._held, "the SET_TENSOR held")
        link._tick()
        assert bytes(up.written[before:]) == set_tensor(t) and not link._held
        writer.write(set_tensor(t))
        await until(lambda: link._held, "the second SET_TENSOR held")
        writer.close()  # the client's EOF: what is held goes out before the upstream's EOF
        await until(lambda: up.eof_written or up.closed, "the upstream half-closed")
        assert bytes(up.written[before:]) == set_tensor(t) * 2

    run(main())


def test_frames_larger_than_the_hold_limit_are_not_held():
    from rpcguard.proxy.link import HOLD_MAX_BYTES

    async def main() -> None:
        link, up, reader, writer, t = await active_connect_link([], Clock())
        before = len(up.written)
        t = encode.pack_tensor(encode.TensorSpec(buffer=V.HANDLE, data=V.BASE, ne=(HOLD_MAX_BYTES // 4, 1, 1, 1)))
        big = encode.request("SET_TENSOR", t + bytes(1) + bytes(8) + bytes(HOLD_MAX_BYTES))
        writer.write(big)
        # Forwarded whole without an urgent frame behind it, each read as it comes, never copied aside.
        await until(lambda: len(up.written) - before == len(big), "the big SET_TENSOR forwarded")
        assert not link._held
        writer.close()

    run(main())


def test_a_refusal_still_forwards_the_frames_accepted_before_it():
    async def main() -> None:
        records: list = []
        link, up, reader, writer, t = await active_connect_link(records, Clock())
        before = len(up.written)
        writer.write(set_tensor(t))
        await until(lambda: link._held, "the SET_TENSOR held")
        bad = encode.request("SET_TENSOR", t + bytes(1) + struct.pack("<Q", 1 << 20) + bytes(64))  # past the buffer
        writer.write(bad)
        await until(lambda: records, "the session end")
        assert records[0]["reason"] == "range_out_of_buffer"
        assert bytes(up.written[before:]) == set_tensor(t) and up.closed  # the accepted one, then the close
        assert await reader.read(100) == b""

    run(main())


class Ticking(Clock):
    """A clock that moves 2 ms per reading: every read with many frames looks slow."""

    def __call__(self) -> int:
        self.ns += 2_000_000
        return self.ns


def test_a_flood_of_small_frames_is_read_a_little_at_a_time_one_read_per_loop_turn(monkeypatch):
    # issue 21: 2.1 million pipelined GET_ALIGNMENTs delayed another tenant's handshake 100-fold.
    from rpcguard.proxy.endpoint import FAIR_READ_BYTES, Endpoint

    reads: list[tuple[int, int]] = []  # (bytes, loop turn) of each client read
    turn = 0
    original = Endpoint.buffer_updated

    def spy(self, nbytes: int) -> None:
        if self.is_client:
            reads.append((nbytes, turn))
        original(self, nbytes)

    monkeypatch.setattr(Endpoint, "buffer_updated", spy)

    async def main() -> None:
        nonlocal turn
        link, up, reader, writer, t = await active_connect_link([], Ticking())

        async def ticker() -> None:
            nonlocal turn
            while True:
                await asyncio.sleep(0)
                turn += 1

        ticks = asyncio.ensure_future(ticker())
        before = len(up.written)
        reads.clear()
        flood = V.GET_ALIGNMENT_REQ * 20_000  # 260 KB of frames the server answers one by one
        writer.write(flood)
        await writer.drain()
        await until(lambda: len(up.written) - before == len(flood), "the flood forwarded")
        assert link.client.narrowed
        first = next(i for i, (n, _) in enumerate(reads) if n <= FAIR_READ_BYTES)
        small = reads[first:]
        assert first <= 2 and len(small) >= (len(flood) - sum(n for n, _ in reads[:first])) // FAIR_READ_BYTES, reads[:5]
        assert all(n <= FAIR_READ_BYTES for n, _ in small)
        per_turn: dict[int, int] = {}
        for _, at in small:
            per_turn[at] = per_turn.get(at, 0) + 1
        assert max(per_turn.values()) == 1, per_turn  # others ran between any two reads
        # a read of a few frames (llama.cpp's) gives the side its whole buffer back
        writer.write(V.GET_ALIGNMENT_REQ)
        await until(lambda: not link.client.narrowed, "the buffer widened")
        ticks.cancel()
        writer.close()

    run(main())


def test_serve_closes_a_socket_at_accept_past_the_handshakes_of_its_source():
    async def main() -> None:
        records: list = []
        route = Route(role="serve", name="t", upstream_host="127.0.0.1", upstream_port=9,
                      traffic=Metrics().listener("serve", "t", upstream="127.0.0.1:9"),
                      default=Profile("default", SessionPolicy(), Limits(max_handshakes_per_source=3)),
                      ssl_context=lambda: (_ for _ in ()).throw(AssertionError("no TLS for a refused socket")))
        route.on_session_end = records.append
        route.handshaking["127.0.0.1"] = 3  # three handshakes from this address run already
        link, reader, writer = await start(route, fake_dialer()[0], Clock())
        assert await asyncio.wait_for(reader.read(), 2) == b""
        assert records[0]["reason"] == "too_many_handshakes_per_source" and records[0]["party"] == "client"
        assert route.traffic.refusals["too_many_handshakes_per_source"] == 1 and not route.links
        assert route.handshaking == {"127.0.0.1": 3}
        writer.close()

    run(main())


class GatedValidators(Validators):
    """link.VALIDATORS whose validations wait for ``open`` (so a test sees the link meanwhile)."""

    def __init__(self) -> None:
        super().__init__(workers=1)
        self.open = threading.Event()
        self.started = threading.Event()

    def _run(self, job) -> None:
        self.started.set()
        self.open.wait(5)
        job()


def big_graph(base: int = V.BASE) -> bytes:
    from rpcguard.protocol.session import DEFER_GRAPH_BYTES
    from tests.support.floods import chain_graph
    payload, _ = chain_graph(V.HANDLE, base, 500)
    assert len(payload) >= DEFER_GRAPH_BYTES
    return encode.request("GRAPH_COMPUTE", bytes(payload))


def test_a_large_graph_is_validated_off_the_loop_and_the_link_waits_for_it(monkeypatch):
    gate = GatedValidators()
    monkeypatch.setattr(link_mod, "VALIDATORS", gate)

    async def main() -> None:
        records: list = []
        link, up, reader, writer, t = await active_connect_link(records, Clock())
        before = len(up.written)
        graph = big_graph()
        writer.write(set_tensor(t) + V.GET_ALIGNMENT_REQ + graph + V.DEVICE_COUNT_REQ)
        await until(gate.started.is_set, "the validation started")
        await asyncio.sleep(0.05)  # the loop runs on while the graph is validated
        assert link.client.parked and link.upstream.parked and link.lc.state == "validating"
        assert bytes(up.written[before:]) == set_tensor(t) + V.GET_ALIGNMENT_REQ  # what came before went out
        up.send(V.GET_ALIGNMENT_RSP_32)  # the server answers meanwhile: it waits too, in order
        writer.write(V.GET_ALIGNMENT_REQ)
        await asyncio.sleep(0.05)
        link._tick()  # a tick meanwhile is put off, not run against a session in another thread's hands
        gate.open.set()
        await until(lambda: len(up.written) - before == len(set_tensor(t) + V.GET_ALIGNMENT_REQ * 2
                                                             + graph + V.DEVICE_COUNT_REQ), "the rest forwarded")
        assert bytes(up.written[before:]).endswith(graph + V.DEVICE_COUNT_REQ + V.GET_ALIGNMENT_REQ)
        assert await reader.readexactly(len(V.GET_ALIGNMENT_RSP_32)) == V.GET_ALIGNMENT_RSP_32
        assert not link.client.parked and not link.upstream.parked and link.lc.state == "active" and not link._later
        writer.close()
        await until(lambda: records, "the session end")
        assert records[0]["result"] == "ok"

    run(main())


def test_a_large_graph_refused_off_the_loop_ends_the_session_and_sends_nothing_of_it(monkeypatch):
    monkeypatch.setattr(link_mod, "VALIDATORS", GatedValidators())
    link_mod.VALIDATORS.open.set()

    async def main() -> None:
        records: list = []
        link, up, reader, writer, t = await active_connect_link(records, Clock())
        before = len(up.written)
        writer.write(big_graph(base=V.BASE + (1 << 30)) + V.GET_ALIGNMENT_REQ)
        await until(lambda: records, "the session end")
        assert records[0]["reason"] == "tensor_out_of_buffer" and bytes(up.written[before:]) == b""
        assert await reader.read(100) == b""

    run(main())
