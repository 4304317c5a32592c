"""The per-connection ggml-rpc state machine: framing + session rules + firewall + counters.

Stays whole (over 400 lines): it is the compiled per-frame path of one class, planning and
handling each direction's frames over the same fields; the per-command work is apart already
(commands.py, checks.py, firewall.py), so is framing (framing.py).

How this works: one ``Session`` sits between one llama.cpp client and one server. The link's
lifecycle hands it the bytes read from either side (``client_data`` / ``server_data``); each
call returns the session's ``Output``: the frames to send each way (``to_server`` /
``to_client``: the frames it accepted, unchanged as memoryviews into the relay's buffer, or
rewritten, e.g. HELLO with its RDMA caps zeroed, plus frames the proxy injects itself) and the
events of that call (the client's HELLO, the session active, a node's refusal, a monitor-mode
violation). The caller sends and clears them. A frame that breaks a rule raises a ``Refusal``;
nothing of that frame has been queued.

Per command, the command table (``commands.ROWS``) gives the firewall check, the request's
effect on session state (which also decodes what the response will need) and the response's
learner; the session indexes ``commands.EFFECTS`` / ``LEARNERS`` by command id. A request the
proxy answers itself (``commands.ANSWERS``: a SET_TENSOR_HASH on a cache other tenants share, a
supports_op query for an op never forwarded) is not forwarded: its answer goes to the client in
the order the client asked, after the answers the server still owes (an ``Expect`` carrying the
answer waits in the FIFO and goes out when it reaches the front, after a streamed body ends).

Requests are planned from the command table of the version the server announced in its HELLO
reply (``versions.ProtocolSpec``); until then only HELLO is accepted. Responses carry no
command id: each response-bearing request pushes an ``Expect`` entry on a FIFO and the next
response header is matched against it (size checked exactly), which is also where latency is
measured and where the session learns buffer handles, bases and device facts for the firewall.

The session keeps no phase of its own (the link's state is the one, protocol/linkstate.py): it
knows the HELLO's length once the client sent it (``hello_request_len``) and the server's
version once its reply is in (``greeted``), and reports both as events. ``refusal_answer()``
builds the HELLO reply the client-facing side sends when a session is refused before that.
"""

from __future__ import annotations

import struct
import zlib
from collections import deque
from dataclasses import dataclass, replace
from typing import Any, Final, Generic, NamedTuple, TypeVar, Union

from rpcguard.errors import FirewallRefusal, PolicyRefusal, ProtocolRefusal
from rpcguard.protocol import encode
from rpcguard.protocol.commands import ANSWERS, BATCH, BATCH_MAX_BYTES, EFFECTS, LEARNERS
from rpcguard.protocol.firewall import Firewall
from rpcguard.protocol.settings import CHECK_NAMES, SessionPolicy
from rpcguard.protocol.framing import FrameReader
from rpcguard.protocol.notice import NOTICE_HEAD, NOTICE_SIZE, decode_notice
from rpcguard.protocol.state import SessionState, UpstreamFacts
from rpcguard.protocol.stats import SessionStats
from rpcguard.protocol.versions import (
    COMMAND_IDS,
    COMMAND_NAMES,
    FIXED,
    HELLO,
    HELLO_REQUEST_SIZES,
    KNOWN_VERSIONS,
    NO_RESPONSE,
    REFUSAL_CODES,
    REFUSAL_REASONS,
    SIZED_BY_REQUEST,
    STREAM,
    TENSOR_BYTES,
    CommandRule,
    ProtocolSpec,
    Version,
    format_version,
    not_accepted_detail,
    spec_for,
)

# Post-mortem (serve runs the server, docs/containment.md; off unless ``record_recent()``): the
# last request heads kept (command, payload length: no tensor data) and the last graph's digest.
RECENT_REQUESTS: Final = 16
_GRAPH_COMPUTE: Final = COMMAND_IDS["GRAPH_COMPUTE"]
_SET_TENSOR: Final = COMMAND_IDS["SET_TENSOR"]
# 7.0.0 SET_TENSOR head (rpc_tensor, cache_flag, offset) and its cache_flag's index in the raw frame
_SET_TENSOR_CACHE_HEAD: Final = TENSOR_BYTES + 9
_CACHE_FLAG_AT: Final = 9 + TENSOR_BYTES

__all__ = [
    "SessionPolicy", "Session", "Output", "Violation", "Hello", "Active", "NodeRefused", "NodeEnded", "Deferred",
    "SessionEvent", "DEFER_GRAPH_BYTES",
]  # fmt: skip


# A GRAPH_COMPUTE of at least this many payload bytes is validated by ``validate_deferred`` when
# the owner allows it (``defer_graphs``): the I/O layer runs that off the event loop. Validation
# costs ~30 us per tensor cold, so a crafted 5 MB graph takes the whole ``max_graph_cpu_s``
# (500 ms) and would stall every other session, handshake and probe of the process meanwhile.
# Below this size (~110 tensors) a graph costs a few ms at most and stays on the loop. llama.cpp
# sends a full graph only when it changes (GRAPH_RECOMPUTE otherwise): the tiny test model's
# decode graph is 31 KiB (inline), the ~105 MB one's 59 KiB (deferred), a 16-layer one's ~350 KiB.
DEFER_GRAPH_BYTES: Final = 32 * 1024
_NEVER: Final = 1 << 62

_REQ_HEADER: Final = struct.Struct("<BQ")
_RSP_HEADER: Final = struct.Struct("<Q")
_U32: Final = struct.Struct("<I")
_U64: Final = struct.Struct("<Q")
_ZERO_CAPS: Final = bytes(24)

# GET_TENSOR: rpc_tensor, u64 offset, u64 size -> the response is `size` bytes.
_GET_TENSOR_SIZE_AT: Final = TENSOR_BYTES + 8
_CMD: Final = COMMAND_IDS
_GET_DEVICE_MEMORY: Final = _CMD["GET_DEVICE_MEMORY"]
_GET_ALIGNMENT: Final = _CMD["GET_ALIGNMENT"]
# Devices whose memory the session asks for itself (a server answering DEVICE_COUNT with 2^32 must
# not make the proxy send 2^32 frames); beyond it a device has no default quota.
MEMORY_PROBES_MAX: Final = 16


@dataclass(frozen=True, slots=True)
class Violation:
    """A firewall rule that failed in monitor mode (the frame was forwarded anyway)."""

    reason: str
    detail: str
    command: str


# What happened while feeding: the entries of ``Output.events``, one class each (rare: the data
# path appends nothing, so the caller tests one list per read instead of polling attributes).
# They are link events too: the lifecycle dispatches them by class (protocol/linkstate.py).
class Hello(NamedTuple):
    """The client's HELLO was accepted (and forwarded)."""

    length: int  # its payload length: 0 (pre-4.0.0 client) or 24


class Active(NamedTuple):
    """The server's HELLO reply was accepted: frames flow."""

    version: Version


class NodeRefused(NamedTuple):
    """Another rpcguard (the node's serve) answered 0.0.N: the answer goes to the client as is."""

    reason: str


class NodeEnded(NamedTuple):
    """connect: the node's serve ended the session and said why (its end notice, protocol/notice.py)."""

    reason: str
    detail: str


class Deferred(NamedTuple):
    """A large graph waits for ``validate_deferred`` (``defer_graphs``)."""

    nbytes: int  # its payload bytes


# ``Violation`` (monitor mode: a rule failed, the frame was forwarded) is an event as it is.
SessionEvent = Union[Hello, Active, NodeRefused, NodeEnded, Violation, Deferred]


class Output:
    """What one ``client_data`` / ``server_data`` call produced: frames to send each way and
    events. One object per session, reused: the caller sends and clears the lists.

    ``urgent`` is False only when every frame this ``client_data`` call put in ``to_server`` is
    one the server answers with nothing and that starts no work (``commands.BATCH``: SET_TENSOR),
    and no larger than ``commands.BATCH_MAX_BYTES`` (a model load's tensors stream as before).
    The caller may then hold those bytes and send them with the next urgent ones: the client
    cannot observe the difference, since it learns nothing until a request that needs an answer,
    and that request is urgent. A decode step of llama.cpp is ~6 SET_TENSORs and one GRAPH_COMPUTE
    or GET_TENSOR: one TLS record and one wake-up of the node instead of ~9 (proxy/link.py).
    """

    __slots__ = ("to_server", "to_client", "events", "urgent")

    def __init__(self) -> None:
        self.to_server: list[bytes | memoryview] = []
        self.to_client: list[bytes | memoryview] = []
        self.events: list[SessionEvent] = []
        self.urgent = True

    def clear(self) -> None:
        self.to_server.clear()
        self.to_client.clear()
        self.events.clear()


C = TypeVar("C")  # what a request leaves for its response's learner: its type per command in commands.ROWS


class Expect(Generic[C]):
    """A response the server owes: for which command, its exact payload size, and what the
    request left for the response's learner. A plain class: the session makes one per request."""

    __slots__ = ("cmd", "length", "streamed", "swallow", "t_ns", "ctx", "answer")

    def __init__(self, cmd: int, length: int, streamed: bool, swallow: bool, t_ns: int, ctx: C,
                 answer: bytes | None = None) -> None:
        self.cmd = cmd
        self.length = length  # exact response payload size
        self.streamed = streamed  # payload streamed as body (GET_TENSOR) instead of read as head
        self.swallow = swallow  # injected by the proxy: do not forward the response
        self.t_ns = t_ns
        self.ctx = ctx
        self.answer = answer  # the proxy's own answer (a whole frame): the server owes nothing


class Session:
    """One client<->server ggml-rpc connection as seen by the proxy."""

    def __init__(
        self,
        policy: SessionPolicy | None = None,
        upstream: UpstreamFacts | None = None,
        stats: SessionStats | None = None,
    ) -> None:
        self.policy = policy or SessionPolicy()
        # what the server says about itself is this session's (state.py): learnt into a copy
        self.state = SessionState((upstream if upstream is not None else UpstreamFacts()).for_session())
        self.stats = stats if stats is not None else SessionStats()
        self.firewall = Firewall(self.state, self.policy.firewall)
        self.multi_device = False  # the server's version has device indexes (set with its HELLO reply)
        self.hello_request_len: int | None = None  # 0 (pre-4.0 client) or 24
        self.version: Version | None = None
        self.node_refusal: str | None = None  # reason decoded from a 0.0.N reply
        self.notices = False  # connect: the node may send an end notice (expect_notices)
        self.command: int | None = None  # command of the frame being handled (named in refusals)
        self.requests_checked_by = "proxy"  # or "node" (leave_requests_to_node)
        self._record = False  # record_recent(): the post-mortem ring and graph digest
        self.recent: deque[tuple[int, int]] = deque(maxlen=RECENT_REQUESTS)
        self.last_graph: tuple[int, int] | None = None  # (payload bytes, CRC-32) of the last GRAPH_COMPUTE
        self._check_requests = True
        # SET_TENSOR_HASH goes to the server only where its cache is this identity's own: a
        # contained serve (a cache directory per identity, upstream/pool.py), or connect toward a
        # node's serve that decides (leave_requests_to_node); else the proxy answers "not cached"
        self.hash_forwarded = self.policy.firewall.contained
        self._answers_pending = 0  # the proxy's answers waiting in the FIFO behind the server's
        self.out = Output()
        self.to_server = self.out.to_server
        self.to_client = self.out.to_client
        self._events = self.out.events
        self._enforce = self.policy.mode == "enforce"
        # Read per frame: kept as this (compiled) object's own attributes, the command rules of the
        # server's version as a tuple once its HELLO reply is in (_on_hello_reply).
        self._allowed = self.policy.allowed_commands
        self._max_request = self.policy.max_request_bytes
        self._max_graph = self.policy.max_graph_bytes
        self._rules: tuple[CommandRule | None, ...] = ()
        self._expect: deque[Expect[Any]] = deque()
        self._req = FrameReader(_REQ_HEADER, self._plan_request, self._on_request, self.to_server.append)
        self._rsp = FrameReader(_RSP_HEADER, self._plan_response, self._on_response, self._on_response_body)
        self._now = 0
        self._defer_from = _NEVER  # graphs at least this large wait for validate_deferred()
        self._deferred: tuple[CommandRule, memoryview, int] | None = None  # (rule, raw frame, body length)
        self._deferred_refusal: FirewallRefusal | None = None

    # ----------------------------------------------------------------------------- properties
    @property
    def spec(self) -> ProtocolSpec | None:
        return self.state.spec

    @property
    def greeted(self) -> bool:
        """The server's HELLO reply was accepted (the link is ACTIVE from the ``Active`` event)."""
        return self.version is not None

    @property
    def command_name(self) -> str:
        """Name of the command being handled, for refusal logs ("-" before the first frame)."""
        return "-" if self.command is None else _name(self.command)

    @property
    def idle(self) -> bool:
        """True between frames in both directions with no response outstanding."""
        return not self._expect and self._req.at_boundary and self._rsp.at_boundary

    def record_recent(self) -> None:
        """Keep the last request heads and the last graph's digest (``post_mortem``): a few
        instructions per frame and a CRC-32 of each graph (serve runs the server)."""
        self._record = True

    def post_mortem(self) -> dict[str, object]:
        """What the audit record of a session that crashed its server carries."""
        return {"last_requests": [[_name(cmd), n] for cmd, n in self.recent],
                "last_graph": None if self.last_graph is None else
                {"bytes": self.last_graph[0], "crc32": f"{self.last_graph[1]:08x}"}}

    @property
    def owed_since_ns(self) -> int:
        """When the oldest response the server still owes was asked for (0: none owed)."""
        return self._expect[0].t_ns if self._expect else 0

    @property
    def last_feed_ns(self) -> int:
        """The ``now_ns`` of the last ``client_data`` / ``server_data`` call."""
        return self._now

    @property
    def violations(self) -> list[Violation]:
        """Monitor-mode violations among the events not yet cleared."""
        return [v for v in self._events if isinstance(v, Violation)]

    @property
    def mid_frame(self) -> bool:
        """True while a request frame is partially received or streaming."""
        return not self._req.at_boundary

    @property
    def at_response_boundary(self) -> bool:
        """True between responses: what the client got so far ends with a whole frame (serve may
        put its end notice here, protocol/notice.py)."""
        return self._rsp.at_boundary

    def expect_notices(self) -> None:
        """connect: the node negotiated the end notice (pki/tls.py ``ALPN_NOTICES``)."""
        self.notices = True

    # ----------------------------------------------------------------------------- requests
    def client_data(self, data: memoryview, now_ns: int = 0) -> Output:
        """Bytes from the client; accepted frames go to ``out.to_server`` (returned)."""
        self._now = now_ns
        out = self.out
        if self._req.at_boundary:
            # Mid-frame, the frame in progress keeps the urgency it was planned with.
            out.urgent = False
        self._req.feed(data)
        return out

    def _plan_request(self, header: tuple[int, int]) -> tuple[int, int]:
        cmd, length = header
        self.command = cmd
        if cmd >= len(BATCH) or not BATCH[cmd] or length > BATCH_MAX_BYTES:
            self.out.urgent = True
        if not self._rules:  # not greeted yet (set with the server's HELLO reply)
            if self.hello_request_len is not None:
                raise ProtocolRefusal("data_before_hello_reply", "client sent data before the HELLO reply")
            if cmd != HELLO:
                raise ProtocolRefusal("first_frame_not_hello", f"first command is {_name(cmd)}, not HELLO")
            if length not in HELLO_REQUEST_SIZES:
                raise ProtocolRefusal("hello_bad_size", f"HELLO with {length} payload bytes")
            return length, 0
        if cmd == HELLO:
            raise ProtocolRefusal("hello_repeated", "second HELLO in one session")
        rules = self._rules
        rule = rules[cmd] if cmd < len(rules) else None
        if rule is None:
            raise ProtocolRefusal("command_unknown", f"command {cmd} does not exist in {self._vtext()}")
        if rule.name not in self._allowed:
            if self._enforce:
                raise PolicyRefusal("command_not_allowed", f"{rule.name} is not on the allow-list")
            self._events.append(Violation("command_not_allowed", "not on the allow-list", rule.name))
        stats = self.stats
        stats.req_frames[cmd] += 1
        stats.req_bytes[cmd] += 9 + length
        if self._record:
            self.recent.append((cmd, length))
        if rule.layout == FIXED:
            if length != rule.request:
                raise ProtocolRefusal(
                    "frame_size_invalid", f"{rule.name} len {length}, expected {rule.request} in {self._vtext()}"
                )
            return length, 0
        if length < rule.request:
            raise ProtocolRefusal("frame_size_invalid", f"{rule.name} len {length} < {rule.request}")
        if rule.layout == STREAM:
            if length > self._max_request:
                raise ProtocolRefusal("request_too_large", f"{rule.name} len {length} > cap {self._max_request}")
            return rule.request, length - rule.request
        if length > self._max_graph:
            raise ProtocolRefusal("request_too_large", f"{rule.name} len {length} > cap {self._max_graph}")
        return length, 0

    def _on_request(self, header: tuple[int, int], head: memoryview, raw: memoryview) -> None:
        cmd = header[0]
        if cmd == HELLO:
            self._on_hello_request(head, raw, self.to_server)
            return
        rule: CommandRule = self._rules[cmd]  # type: ignore[assignment]  # planned: it exists
        body_len = self._req.body_remaining
        if self._check_requests:
            if cmd == _GRAPH_COMPUTE and len(head) >= self._defer_from:
                self._defer(rule, raw, body_len)
                return
            try:
                self.firewall.check_request(rule, head, body_len)
            except FirewallRefusal as refusal:
                self.violated(refusal, rule.name)
            answer = ANSWERS[cmd]
            if answer is not None:
                payload = answer(self, head)
                if payload is not None:
                    self._answer(encode.response(payload))
                    return
        self._forward(cmd, rule, head, raw, body_len)

    def _answer(self, frame: bytes) -> None:
        """The proxy's own answer to the request being handled: now, or when the server has sent
        every answer it owes for earlier requests."""
        if not self._expect and not self._rsp.body_remaining:
            # (a header the server started unasked stays unexpected: response_unexpected when whole)
            self.to_client.append(frame)
            return
        self._expect.append(Expect(-1, len(frame), False, True, self._now, None, frame))
        self._answers_pending += 1

    def _drain_answers(self) -> None:
        expect = self._expect
        while expect and expect[0].answer is not None:
            self.to_client.append(expect.popleft().answer)  # type: ignore[arg-type]
            self._answers_pending -= 1

    def _forward(self, cmd: int, rule: CommandRule, head: memoryview, raw: memoryview, body_len: int) -> None:
        """A request that passed the firewall: its effect, the response it is owed, and out."""
        out = self.to_server
        if self._record and cmd == _GRAPH_COMPUTE:
            self.last_graph = (len(head), zlib.crc32(head))
        if cmd == _SET_TENSOR and head[TENSOR_BYTES] and len(head) == _SET_TENSOR_CACHE_HEAD \
                and not self.hash_forwarded:  # (a flag of 0, the data path's, costs two tests)
            # the proxy answered the hash (commands.hash_local): the tensor stays out of a cache
            # that other identities' SET_TENSOR_HASH would read
            frame = bytearray(raw)
            frame[_CACHE_FLAG_AT] = 0
            raw = memoryview(bytes(frame))
        # The request's effect on the session state (the command table's effect column); it
        # returns what the response's learner needs.
        effect = EFFECTS[cmd]
        ctx = effect(self, head, body_len) if effect is not None else None
        response = rule.response
        if response != NO_RESPONSE:
            if response == SIZED_BY_REQUEST:
                size = _U64.unpack_from(head, _GET_TENSOR_SIZE_AT)[0]
                exp = Expect(cmd, size, True, False, self._now, None)
            else:
                exp = Expect(cmd, response, False, False, self._now, ctx)
            self._expect.append(exp)
        out.append(raw)

    def _on_hello_request(self, head: memoryview, raw: memoryview, out: list[bytes | memoryview]) -> None:
        self.hello_request_len = len(head)
        self.stats.req_frames[HELLO] += 1
        self.stats.req_bytes[HELLO] += len(raw)
        if len(head) == 24 and head != _ZERO_CAPS:
            # RDMA transport offer: zero it, or tensor traffic could leave the tunnel (spec §4.4).
            self.stats.rdma_caps_zeroed_req += 1
            raw = memoryview(encode.request(HELLO, _ZERO_CAPS))
        self._expect.append(Expect(HELLO, 28 if len(head) == 24 else 3, False, False, self._now, None))
        self._events.append(Hello(len(head)))
        out.append(raw)

    # ----------------------------------------------------------------------------- responses
    def server_data(self, data: memoryview, now_ns: int = 0) -> Output:
        """Bytes from the server; accepted frames go to ``out.to_client`` (returned)."""
        self._now = now_ns
        self._rsp.feed(data)
        return self.out

    def _plan_response(self, header: tuple[int]) -> tuple[int, int]:
        length = header[0]
        if length == NOTICE_SIZE and self.notices:  # the node's end notice, in place of a response
            return NOTICE_HEAD, 0
        if not self._expect:
            raise ProtocolRefusal("response_unexpected", f"server sent {length} bytes nobody asked for")
        exp = self._expect[0]
        self.command = exp.cmd
        if length != exp.length and not (exp.cmd == HELLO and length in (3, 28)):
            raise ProtocolRefusal(
                "response_size_invalid", f"{_name(exp.cmd)} response len {length}, expected {exp.length}"
            )
        stats = self.stats
        stats.rsp_frames[exp.cmd] += 1
        stats.rsp_bytes[exp.cmd] += 8 + length
        if not exp.swallow:
            stats.observe_latency(exp.cmd, self._now - exp.t_ns)
        return (0, length) if exp.streamed else (length, 0)

    def _on_response(self, header: tuple[int], head: memoryview, raw: memoryview) -> None:
        if header[0] == NOTICE_SIZE:  # planned as one only when notices were negotiated
            self._events.append(NodeEnded(*decode_notice(head)))
            self._rsp.pause()  # the last thing the node sends: nothing after it is read
            return
        out = self.to_client
        exp = self._expect.popleft()
        self.state.inflight_flops = 0  # the server answered: everything before it has run
        if exp.cmd == HELLO:
            raw = self._on_hello_reply(head, raw)
        else:
            learn = LEARNERS[exp.cmd]
            if learn is not None:
                rewritten = learn(self, exp, head)
                if rewritten is not None:  # the client gets the proxy's answer (commands.memory_answer)
                    raw = memoryview(rewritten)
        if not exp.swallow:
            out.append(raw)
        if self._answers_pending and not self._rsp.body_remaining:
            self._drain_answers()

    def _on_response_body(self, chunk: memoryview) -> None:
        self.to_client.append(chunk)
        if self._answers_pending and not self._rsp.body_remaining:
            self._drain_answers()  # a streamed answer (GET_TENSOR) ended: the proxy's may follow

    def _on_hello_reply(self, head: memoryview, raw: memoryview) -> memoryview:
        version = (head[0], head[1], head[2])
        if version[0] == 0:
            # Another rpcguard (the node's `serve`) refused the session: pass its answer on.
            self.node_refusal = REFUSAL_REASONS.get(version[2], "refused")
            self._events.append(NodeRefused(self.node_refusal))
            return memoryview(self.refusal_answer(self.node_refusal))
        if (len(head) == 28) != (self.hello_request_len == 24):
            raise PolicyRefusal(
                "version_not_accepted", f"server {format_version(version)} answered a HELLO of another era"
            )
        spec = spec_for(version)
        if spec is None or version not in self.policy.accepted_versions:
            raise PolicyRefusal("version_not_accepted", not_accepted_detail(version, spec is not None))
        self.version = version
        self.state.spec = spec
        self._rules = spec.commands
        self.multi_device = spec.multi_device
        self.state.upstream.learn_version(version)
        self._events.append(Active(version))
        if len(head) == 28 and head[4:] != _ZERO_CAPS:
            self.stats.rdma_caps_zeroed_rsp += 1
            raw = memoryview(encode.hello_response(version, new_layout=True))
        if spec.multi_device and self.state.upstream.device_count is None:
            # Learn the device count for the device-index checks without bothering the client.
            self.inject(_CMD["DEVICE_COUNT"], b"", 4)
        else:
            self.learn_memory()
        return raw

    # ----------------------------------------------------------------------------- large graphs
    def defer_graphs(self, from_bytes: int = DEFER_GRAPH_BYTES) -> None:
        """Let a GRAPH_COMPUTE of ``from_bytes`` or more wait for ``validate_deferred``: the
        request reader stops after it (what follows is kept) and ``Deferred`` is reported."""
        self._defer_from = from_bytes

    @property
    def deferred(self) -> bool:
        """A graph waits for ``validate_deferred`` and ``resume_deferred``."""
        return self._deferred is not None

    def _defer(self, rule: CommandRule, raw: memoryview, body_len: int) -> None:
        if not isinstance(raw.obj, bytes):  # a view into the caller's read buffer: keep a copy
            raw = memoryview(bytes(raw))
        self._deferred = (rule, raw, body_len)
        self._req.pause()
        self._events.append(Deferred(len(raw) - _REQ_HEADER.size))

    def validate_deferred(self) -> None:
        """The firewall's check of the deferred graph. May run on another thread, provided nothing
        else touches this session until ``resume_deferred``."""
        assert self._deferred is not None
        rule, raw, body_len = self._deferred
        try:
            self.firewall.check_request(rule, raw[_REQ_HEADER.size:], body_len)
        except FirewallRefusal as refusal:
            self._deferred_refusal = refusal

    def resume_deferred(self, now_ns: int = 0) -> Output:
        """After ``validate_deferred``: the graph is refused (raises, as ``client_data`` would) or
        goes out, then the bytes that followed it are fed; returns the ``Output`` of both."""
        assert self._deferred is not None
        self._now = now_ns
        rule, raw, body_len = self._deferred
        refusal, self._deferred, self._deferred_refusal = self._deferred_refusal, None, None
        self.out.urgent = True
        if refusal is not None:
            self.violated(refusal, rule.name)
        self._forward(_GRAPH_COMPUTE, rule, raw[_REQ_HEADER.size:], raw, body_len)
        rest = self._req.resume()
        if rest:
            self._req.feed(memoryview(rest))
        return self.out

    def leave_requests_to_node(self) -> None:
        """connect, toward a node that is rpcguard (``SessionPolicy.validate_requests`` "auto"):
        the node's serve runs the request firewall, so this session's firewall runs no check.
        Framing, sizes, versions, the allow-list, the response checks and counting stay."""
        self.firewall = Firewall(self.state, replace(self.policy.firewall, disabled_checks=frozenset(CHECK_NAMES)))
        self._check_requests = False
        self.hash_forwarded = True  # the node's serve answers or forwards it
        self.requests_checked_by = "node"

    def violated(self, refusal: FirewallRefusal, command: str) -> None:
        """A firewall rule failed: refuse (enforce), or note it and go on (monitor)."""
        if self._enforce:
            raise refusal
        self._events.append(Violation(refusal.reason, refusal.detail, command))

    def rule(self, cmd: int) -> CommandRule:
        """The rule of ``cmd`` in the server's version (the session is greeted, ``cmd`` exists in it)."""
        rule = self._rules[cmd]
        assert rule is not None, cmd
        return rule

    def inject(self, cmd: int, payload: bytes, response: int, ctx: object = None) -> None:
        self.out.urgent = True
        self.stats.req_frames[cmd] += 1
        self.stats.req_bytes[cmd] += 9 + len(payload)
        self.to_server.append(encode.request(cmd, payload))
        if response != NO_RESPONSE:
            self._expect.append(Expect(cmd, response, False, True, 0, ctx))

    def learn_memory(self) -> None:
        """Ask for the memory of devices whose total is unknown: it is the default allocation
        quota (real clients ask for it on an earlier connection, so this rarely sends anything)."""
        if self.firewall.policy.max_session_alloc_bytes or "buffer_bounds" in self.firewall.policy.disabled_checks:
            return
        multi = self.multi_device
        memory = self.state.upstream.memory
        for device in range(min(self.state.device_count(), MEMORY_PROBES_MAX) if multi else 1):
            if device not in memory:
                self.inject(_GET_DEVICE_MEMORY, _U32.pack(device) if multi else b"", 16, ctx=device)

    def learn_alignment(self) -> None:
        """Ask each device's alignment, which tells its backend (protocol/backend.py detect:
        32 CPU, 128 CUDA), when the policy leaves the backend to detection. The session learns it
        itself: what another session's server said is not this one's (state.py), and the real
        client may have asked it on an earlier connection."""
        if self.firewall.policy.backend != "auto":
            return
        multi = self.multi_device
        alignment = self.state.upstream.alignment
        for device in range(min(self.state.device_count(), MEMORY_PROBES_MAX) if multi else 1):
            if device not in alignment:
                self.inject(_GET_ALIGNMENT, _U32.pack(device) if multi else b"", 8, ctx=device)

    # ----------------------------------------------------------------------------- refusals
    def refusal_answer(self, reason: str) -> bytes:
        """The HELLO reply that refuses this session: version 0.0.N, N = the refusal code."""
        code = REFUSAL_CODES.get(reason, REFUSAL_CODES["refused"])
        new_layout = self.hello_request_len != 0
        return encode.hello_response((0, 0, code), new_layout=new_layout)

    def _vtext(self) -> str:
        return "protocol " + format_version(self.version) if self.version else "this session"


def _name(cmd: int) -> str:
    return COMMAND_NAMES[cmd] if cmd < len(COMMAND_NAMES) else f"command {cmd}"
