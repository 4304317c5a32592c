"""tests/support/capture.py: the recording relay forwards, records, and never resets a side.

The real ggml-rpc-server dies of SIGPIPE when it writes into a reset connection. Through the
old relay (shutdown of both sides on the client's EOF) that happened when rpcguard's own
GET_DEVICE_MEMORY was still being answered as the client's probe session closed, and the next
session was refused upstream_unavailable (test_models_real, issue 10). A stand-in server here
answers only after the client has gone, in two writes like ggml-rpc's send_msg (size, then data).
"""

from __future__ import annotations

import socket
import threading
import time

from tests.support.capture import C2S, S2C, CaptureRelay
from tests.support.realpeer import reserve_port
from tests.support.waiting import wait_until

ANSWER = (16).to_bytes(8, "little") + bytes(range(16))


def _late_server(ls: socket.socket, result: dict[str, object], relay: list[CaptureRelay]) -> None:
    conn, _ = ls.accept()
    with conn:
        result["request"] = conn.recv(64)
        assert conn.recv(64) == b""  # the relay passed the client's EOF on
        # the relay is done with the client's end (where the old one shut both sides): events,
        # not windows; a relay that reset us never reads the first write, and the wait fails
        wait_until(lambda: relay[0].conns[0].ended >= 1, 5, "the relay's end of the client direction")
        try:
            conn.sendall(ANSWER[:8])
            wait_until(lambda: relay[0].conns[0].s2c >= 8, 5, "the relay reading the first write")
            conn.sendall(ANSWER[8:])
            result["sent"] = True
        except (OSError, AssertionError) as exc:
            result["sent"] = exc


def test_the_server_can_still_answer_after_the_client_left():
    ls = socket.create_server(("127.0.0.1", 0))
    result: dict[str, object] = {}
    relay = CaptureRelay(ls.getsockname()[1])
    t = threading.Thread(target=_late_server, args=(ls, result, [relay]), daemon=True)
    t.start()
    try:
        c = socket.create_connection(("127.0.0.1", relay.port), timeout=5)
        c.sendall(b"\x0f" + bytes(8))  # a DEVICE_COUNT request, then gone without reading
        c.close()
        t.join(5)
        assert result.get("sent") is True, result
        assert result["request"] == b"\x0f" + bytes(8)
        deadline = time.monotonic() + 5
        while relay.conns[0].ended < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        conn = relay.conns[0]
        assert conn.ended == 2 and conn.c2s == 9 and conn.s2c == len(ANSWER)
        assert conn.stream(C2S) == b"\x0f" + bytes(8) and conn.stream(S2C) == ANSWER
    finally:
        relay.close()
        ls.close()


def _echo_once(ls: socket.socket) -> None:
    conn, _ = ls.accept()
    with conn:
        while data := conn.recv(64):
            conn.sendall(data.upper())


def test_records_both_directions_in_order_or_one_only():
    with socket.create_server(("127.0.0.1", 0)) as ls:
        for directions, want in (((C2S, S2C), [(C2S, b"ab"), (S2C, b"AB")]), ((C2S,), [(C2S, b"ab")])):
            echo = threading.Thread(target=_echo_once, args=(ls,), daemon=True)
            echo.start()
            relay = CaptureRelay(ls.getsockname()[1], directions)
            try:
                with socket.create_connection(("127.0.0.1", relay.port), timeout=5) as c:
                    c.sendall(b"ab")
                    assert c.recv(64) == b"AB"
                echo.join(5)
                deadline = time.monotonic() + 5
                while relay.conns[0].ended < 2 and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert relay.conns[0].chunks == want and relay.conns[0].s2c == 2
            finally:
                relay.close()


def test_a_refused_target_closes_the_client_side():
    port = reserve_port()
    relay = CaptureRelay(port)  # nothing listens there
    try:
        with socket.create_connection(("127.0.0.1", relay.port), timeout=5) as c:
            assert c.recv(1) == b""
        assert relay.conns == []
    finally:
        relay.close()
