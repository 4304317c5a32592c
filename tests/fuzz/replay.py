"""Record a real llama.cpp session, and replay (mutated) sessions through `rpcguard serve`.

How this works: ``record`` runs the real llama.cpp client (tests/realpeer/rpc_client_smoke.py)
through a ``CaptureRelay`` (tests/support/capture.py) in front of a server and keeps the longest
connection (the model session) as a ``wire.Session``. ``Replayer.run`` is an authenticated
attacker: it opens mTLS to ``serve`` (enforce mode, default policy), sends the frames one by
one with recorded handles and pointers translated to the live ones (``wire.Remap``), reads every
answer the protocol has, and ends with a GET_ALIGNMENT probe: the server answers it only once
every graph before it has been computed, so a read that takes longer than ``timeout_s`` is a
hang. Then it reads serve's JSON audit record of that connection (matched by the attacker's
local port) to tell a refusal by rpcguard (result=refused, reason=...) from a connection the
server closed itself (result=error, reason=upstream_closed) or a complete session (result=ok).
A HELLO answered 0.0.6 (upstream_busy) is retried: the server's single slot must come free
within ``slot_wait_s`` after the previous session, else that is a finding too.
"""

from __future__ import annotations

import json
import socket
import ssl
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from rpcguard.protocol.versions import REFUSAL_REASONS
from tests.fuzz.wire import CMD, Frame, Remap, Session, frame_bytes, parse_session
from tests.support import realpeer
from tests.support.capture import CaptureRelay
from tests.support.guard import Guard, Pki
from tests.support.rawclient import read_response

__all__ = ["record", "Replayer", "Ending"]

PROBE = struct.pack("<BQI", CMD["GET_ALIGNMENT"], 4, 0)


def record(server_port: int, model: Path, *, n_tokens: int = 3) -> Session:
    """The model session of one real llama.cpp run against 127.0.0.1:server_port."""
    relay = CaptureRelay(server_port)
    try:
        run = realpeer.run_client(f"127.0.0.1:{relay.port}", model, n=n_tokens, timeout=300)
        if not run.ok:
            raise RuntimeError(f"the real client failed through the capture relay:\n{run.output[-3000:]}")
    finally:
        relay.close()
    conn = max(relay.conns, key=lambda c: c.c2s)
    return parse_session(list(conn.chunks))


@dataclass
class Ending:
    """How one replayed session ended, as the attacker and serve saw it."""

    ending: str  # "ok" (probe answered), "closed", "timeout", "slot_stuck", "hello_refused"
    result: str  # serve's audit result: ok / refused / error / ? (no record)
    reason: str  # serve's audit reason (refusal reason, upstream_closed, ...)
    sent: int  # frames sent after HELLO
    seconds: float

    @property
    def label(self) -> str:
        if self.result == "refused":
            return f"refused:{self.reason}"
        if self.ending == "ok":
            return "forwarded:ok"
        if self.reason == "upstream_closed":
            return "forwarded:server_closed"
        return f"{self.ending}:{self.result}:{self.reason}"


class Replayer:
    """Sessions over mTLS to one running ``rpcguard serve``."""

    def __init__(self, serve: Guard, pki: Pki, *, timeout_s: float = 10.0, slot_wait_s: float = 10.0) -> None:
        self.serve, self.timeout_s, self.slot_wait_s = serve, timeout_s, slot_wait_s
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.load_verify_locations(pki.path("ca"))
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.load_cert_chain(pki.path(pki.client), pki.path(pki.client, "key"))
        self.ctx, self.node = ctx, pki.node
        self._log_pos = serve.proc.log.stat().st_size if serve.proc.log.exists() else 0
        self._records: dict[str, dict] = {}

    # serve's audit records -------------------------------------------------------------------
    def _read_records(self) -> None:
        with open(self.serve.proc.log, "rb") as f:
            f.seek(self._log_pos)
            data = f.read()
        cut = data.rfind(b"\n") + 1
        self._log_pos += cut
        for line in data[:cut].splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("event") == "session_end" and rec.get("peer"):
                self._records[rec["peer"]] = rec

    def _record_of(self, peer: str, wait_s: float = 5.0) -> dict:
        deadline = time.monotonic() + wait_s
        while True:
            self._read_records()
            if peer in self._records:
                return self._records.pop(peer)
            if time.monotonic() > deadline:
                return {}
            time.sleep(0.01)

    # one session -------------------------------------------------------------------------------
    def _connect(self) -> tuple[ssl.SSLSocket, str] | tuple[None, str]:
        """TLS + HELLO; retries while serve answers upstream_busy (the slot is still held)."""
        deadline = time.monotonic() + self.slot_wait_s
        while True:
            raw = socket.create_connection(("127.0.0.1", self.serve.port), timeout=self.timeout_s)
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s = self.ctx.wrap_socket(raw, server_hostname=self.node)
            peer = "%s:%d" % s.getsockname()[:2]
            s.sendall(struct.pack("<BQ", CMD["HELLO"], 24) + bytes(24))
            answer = read_response(s)
            if answer[:2] != b"\x00\x00":
                return s, peer
            s.close()
            why = REFUSAL_REASONS.get(answer[2], "?")
            if why != "upstream_busy" or time.monotonic() > deadline:
                return None, why
            time.sleep(0.05)

    def run(self, frames: list[Frame], buffers: dict[int, tuple[int, int]], *, probe: bool = True) -> Ending:
        """Replay ``frames`` (HELLO first, as recorded) and end with the probe."""
        t0 = time.monotonic()
        s, peer = self._connect()
        if s is None:
            return Ending("slot_stuck" if peer == "upstream_busy" else "hello_refused", "refused", peer, 0,
                          time.monotonic() - t0)
        remap = Remap(buffers)
        sent, ending = 0, "ok"
        try:
            for f in frames[1:]:
                s.sendall(frame_bytes(f, remap.apply(f)))
                sent += 1
                if f.expects_answer():
                    remap.learn(f, f, read_response(s))
            if probe:
                s.sendall(PROBE)
                read_response(s)
        except (socket.timeout, TimeoutError):
            ending = "timeout"
        except (ConnectionError, ssl.SSLError, EOFError, OSError):
            ending = "closed"
        finally:
            try:
                s.close()
            except OSError:
                pass
        rec = self._record_of(peer)
        return Ending(ending, rec.get("result") or "?", rec.get("reason") or "-", sent, time.monotonic() - t0)
