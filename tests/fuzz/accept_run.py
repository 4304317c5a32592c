"""Acceptance-region fuzz: every graph an op rule accepts, run on the ASan+UBSan ggml-rpc-server.

    python -m tests.fuzz.accept_run [--ops ADD,CLAMP|work] [--count 50] [--seed 1] [--minutes 30]
                                    [--threads 1,2,3,4,8] [--old-rules]
                                    [--report /work/reports/acceptance-findings.md] [--json out.json]
    python -m tests.fuzz.accept_run --replay tests/fuzz/findings/accept-*.json

How this works: accept_gen.py yields, per op, cases that rpcguard's firewall accepts. Each case
runs on the sanitizer server (tests/realpeer/sanitizer.sh, started by tests/fuzz/sanserver.py)
through a **gate**: an in-process ``rpcguard.protocol.session.Session`` with the default policy
(``FirewallPolicy(contained=True)`` for the ops only a contained serve forwards, SSM_SCAN), the
same object ``serve`` runs per connection. Every frame goes through ``client_data`` (a
refusal would be a finding of the generator, not of the server: counted as ``gate_refused``),
every server answer through ``server_data``, and whatever the session injects (DEVICE_COUNT,
GET_DEVICE_MEMORY, the BUFFER_CLEAR of every new buffer) reaches the server as it would from
serve. Per case: ALLOC_BUFFER + BUFFER_GET_BASE for each of its buffers; then twice, with two
different canary bytes: SET_TENSOR of every whole buffer (canary everywhere, the sources' data
over their spans, the fresh node pre-filled), GRAPH_COMPUTE, GET_TENSOR of every whole buffer;
FREE_BUFFER. Oracles:

* the server: an AddressSanitizer or UndefinedBehaviorSanitizer report, a ggml abort, a crash
  (the connection drops; ``SanServer.verdict`` reads the report), or the compute taking longer
  than ``--budget`` seconds (the GET_TENSOR after GRAPH_COMPUTE not answered in time);
* write canary: every byte of every buffer outside the computed nodes' spans must come back as
  it was sent (a kernel that writes outside its destination tensor, inside a buffer of ours:
  ASan cannot see that);
* read canary: the nodes' bytes must be equal in both runs, whose only difference is the canary
  around the sources (a kernel that reads outside its sources' spans: another tensor's bytes,
  or anything else of the buffer, reaches GET_TENSOR).

A finding restarts the server, is replayed alone on the fresh server (a finding that does not
reproduce is reported as such), shrunk (no data, then the first run only) and written to
``tests/fuzz/findings/accept-<kind>-<hash>.json`` in the sanitizer fuzzer's format
(tests/fuzz/findings/README.md; sanitizer findings carry the session, so
tests/integration/test_sanitizer_fuzz.py replays them through a real serve; canary findings
carry only the case, replayed by ``--replay``). One reproducer per location (kind + where).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import signal
import socket
import struct
import sys
import tempfile
import time
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from rpcguard.errors import Refusal  # noqa: E402
from rpcguard.protocol import encode  # noqa: E402
from rpcguard.protocol.ggml import TYPES  # noqa: E402
from rpcguard.protocol.session import Session, SessionPolicy  # noqa: E402
from rpcguard.protocol.settings import FirewallPolicy  # noqa: E402
from rpcguard.protocol.state import UpstreamFacts  # noqa: E402
from rpcguard.protocol.versions import COMMAND_IDS  # noqa: E402
from tests.fuzz import accept_gen as gen  # noqa: E402
from tests.fuzz.sanserver import SanServer, Verdict, classify_log  # noqa: E402
from tests.fuzz.wire import Frame, encode_frames  # noqa: E402

__all__ = ["Runner", "Outcome", "main", "classify", "FINDINGS_DIR", "write_report"]

FINDINGS_DIR = Path(__file__).resolve().parent / "findings"
CMD = COMMAND_IDS
# outcomes that are not findings (counted and reported): clean; the span notes of the canaries
# (inside the buffers the node and its sources live in, which the project's invariant allows)
NOT_FINDINGS = frozenset({"clean", "span_read", "span_write", "gate_refused", "skipped", "server_closed",
                          "nondeterministic"})
I8 = 24
BUDGET_S = 10.0
IO_TIMEOUT_S = 30.0
MAX_CASE_BYTES = 64 << 20  # a case whose buffers need more is skipped (the machine is shared)


class GateRefused(Exception):
    def __init__(self, reason: str, detail: str, command: str) -> None:
        super().__init__(f"{command}: {reason}: {detail}")
        self.reason, self.detail, self.command = reason, detail, command


class ServerGone(Exception):
    pass


class Budget(Exception):
    pass


class Gate:
    """One connection to the server through an in-process rpcguard Session (what serve runs)."""

    def __init__(self, port: int, upstream: UpstreamFacts, timeout_s: float = IO_TIMEOUT_S,
                 contained: bool = False) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.timeout_s = timeout_s
        # contained: what serve sets when its upstream is a fresh sandboxed process per session (the
        # only serve that forwards oprules.needs_containment ops, SSM_SCAN)
        self.contained = contained
        self.sess = Session(SessionPolicy(firewall=FirewallPolicy(contained=True)) if contained else SessionPolicy(),
                            upstream)
        self.replies: deque[bytes] = deque()
        self._cbuf = bytearray()
        self.frames: list[Frame] = []  # what the client sent, with answers (for reproducers)
        self.buffers: dict[int, tuple[int, int]] = {}  # live handle -> (base, size)
        self._request(CMD["HELLO"], bytes(24), True)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def _recv(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            try:
                chunk = self.sock.recv(min(n - len(out), 1 << 20))
            except (socket.timeout, TimeoutError):
                raise Budget() from None
            except OSError as e:
                raise ServerGone(str(e)) from None
            if not chunk:
                raise ServerGone(f"closed after {len(out)} of {n} bytes")
            out += chunk
        return bytes(out)

    def _flush(self) -> None:
        out = self.sess.out
        try:
            for b in out.to_server:
                self.sock.sendall(b)
        except OSError as e:
            out.clear()
            raise ServerGone(str(e)) from None
        for b in out.to_client:  # a streamed answer comes in pieces: reassemble the frames
            self._cbuf += b
        out.clear()
        while len(self._cbuf) >= 8:
            (n,) = struct.unpack_from("<Q", self._cbuf)
            if len(self._cbuf) < 8 + n:
                break
            self.replies.append(bytes(self._cbuf[8 : 8 + n]))
            del self._cbuf[: 8 + n]

    def _pump(self) -> None:
        while not self.sess.idle:
            head = self._recv(8)
            (n,) = struct.unpack("<Q", head)
            body = self._recv(n)
            self.sess.server_data(memoryview(head + body))
            self._flush()

    def _request(self, cmd: int, payload: bytes, answer: bool) -> bytes | None:
        frame = encode.request(cmd, payload)
        try:
            self.sess.client_data(memoryview(frame))
        except Refusal as e:
            self.sess.out.clear()
            raise GateRefused(e.reason, e.detail, self.sess.command_name) from None
        self._flush()
        self._pump()
        reply = self.replies.popleft() if answer else None
        self.frames.append(Frame(cmd, payload, reply))
        return reply

    # commands --------------------------------------------------------------------------------
    def alloc(self, size: int) -> tuple[int, int, int]:
        reply = self._request(CMD["ALLOC_BUFFER"], struct.pack("<IQ", 0, size), True)
        handle, got = struct.unpack("<QQ", reply)  # type: ignore[arg-type]
        if not handle:
            raise ServerGone(f"ALLOC_BUFFER of {size} bytes returned no buffer")
        (base,) = struct.unpack("<Q", self._request(CMD["BUFFER_GET_BASE"], struct.pack("<Q", handle), True))  # type: ignore[arg-type]
        self.buffers[handle] = (base, got)
        return handle, base, got

    def free(self, handle: int) -> None:
        self._request(CMD["FREE_BUFFER"], struct.pack("<Q", handle), False)

    @staticmethod
    def whole(handle: int, base: int, size: int) -> bytes:
        return encode.pack_tensor(encode.TensorSpec(id=0xB0 + (handle & 0xFF), type=I8, buffer=handle, data=base,
                                                    ne=(size, 1, 1, 1), nb=(1, size, size, size), type_size=1))

    def set_buffer(self, handle: int, base: int, data: bytes) -> None:
        self._request(CMD["SET_TENSOR"], self.whole(handle, base, len(data)) + b"\0" + struct.pack("<Q", 0) + data,
                      False)

    def get_buffer(self, handle: int, base: int, size: int) -> bytes:
        return self._request(CMD["GET_TENSOR"], self.whole(handle, base, size) + struct.pack("<QQ", 0, size),
                             True)  # type: ignore[return-value]

    def compute(self, payload: bytes) -> None:
        self._request(CMD["GRAPH_COMPUTE"], payload, False)


# -- data --------------------------------------------------------------------------------------

def _table(allowed: bytes) -> bytes:
    return bytes(allowed[b % len(allowed)] for b in range(256))


# the byte that carries sign and exponent, mapped to values of magnitude [1/8, 8)
_HI32 = _table(bytes([0x3E, 0x3F, 0x40, 0xBE, 0xBF, 0xC0]))
_HI16 = _table(bytes([0x30, 0x34, 0x38, 0x3C, 0x40, 0xB0, 0xB4, 0xB8, 0xBC, 0xC0]))
_QUANT = bytes(b & 0x3B for b in range(256))


def fill_bytes(rng: random.Random, type_: int, n: int, how: str) -> bytes:
    """``n`` bytes of small values of ``type_`` (zero for integer types: indices stay valid)."""
    if how == "zero" or n == 0 or type_ in (24, 25, 26, 27):  # i8 i16 i32 i64: zero
        return bytes(n)
    b = bytearray(rng.randbytes(n))
    if type_ == 0:
        b[3::4] = bytes(b[3::4]).translate(_HI32)
    elif type_ == 30:  # bf16: the high byte of an f32
        b[1::2] = bytes(b[1::2]).translate(_HI32)
    elif type_ == 1:
        b[1::2] = bytes(b[1::2]).translate(_HI16)
    elif type_ == 28:  # f64
        b[7::8] = bytes(b[7::8]).translate(_HI32)
    else:
        b = bytearray(bytes(b).translate(_QUANT))
    return bytes(b)


def _diff(a: bytes | bytearray, b: bytes, chunk: int = 4096) -> list[int]:
    """Offsets where ``a`` and ``b`` differ (compared a chunk at a time: buffers reach MiBs)."""
    out = []
    for at in range(0, len(a), chunk):
        x, y = a[at : at + chunk], b[at : at + chunk]
        if x != y:
            out.extend(at + k for k in range(len(x)) if x[k] != y[k])
    return out


def _overlaps(ne: tuple[int, ...], nb: tuple[int, ...], elem: int) -> bool:
    """Whether two elements of this layout share bytes (dims of size 1 never count)."""
    dims = sorted((nb[i], ne[i]) for i in range(len(ne)) if ne[i] > 1)
    reach = elem
    for stride, n in dims:
        if stride < reach:
            return True
        reach = stride * (n - 1) + reach
    return False


def aliased(case: gen.Case) -> bool:
    """The computed node writes some bytes more than once: ACC/SET with overlapping param strides,
    an in-place result whose own layout overlaps. Threads may then race, so a result that differs
    between the two canary runs says nothing about reads."""
    for t in case.tensors:
        if t.id not in case.nodes or t.buf < 0:
            continue
        name = gen.TABLE.names[t.op]
        if name in ("ACC", "SET"):
            b = case.by_id(t.src[1])
            if _overlaps(b.ne, (4, t.params[0], t.params[1], t.params[2]), 4):
                return True
        if name == "SET_ROWS":  # indices drawn zero (accept_gen.p_set_rows): every source row of a slice
            rows, idx = case.by_id(t.src[0]), case.by_id(t.src[1])  # lands on one destination row, and the
            if rows.ne[1] > 1 and idx.fill == "zero":  # threads that split the rows race on it
                return True
        if t.view_src and name not in gen.VIEW_OPS and _overlaps(t.ne, t.nb, TYPES[t.type].type_size):
            return True
    return False


# -- outcomes ------------------------------------------------------------------------------------


@dataclass
class Outcome:
    kind: str  # clean, asan, ubsan, ggml_abort, crash, rss_limit, timeout, write_canary, read_canary,
    #            gate_refused, skipped, server_closed, nondeterministic
    summary: str = ""
    log: str = ""
    seconds: float = 0.0  # compute time of the first run
    frames: list[Frame] = field(default_factory=list)
    buffers: dict[int, tuple[int, int]] = field(default_factory=dict)
    spans: list[bytes] = field(default_factory=list)  # the first run's bytes of gen.output_spans(case)

    @property
    def finding(self) -> bool:
        return self.kind not in NOT_FINDINGS


# Locations read in the kernels (0.3.36) whose hole is known, most specific first.
KNOWN_LOCATIONS = (
    ("dup_bytes", "new (dup_bytes copies ne00*type_size bytes per row of a block type, ops.cpp:375)"),
    ("ggml-cpu.c:1903", "new (a NULL kernel pointer: SET_ROWS into a type without from_float)"),
    ("diag_mask", "1 (planes flattened through the nb2 of a size-1 dimension)"),
    ("pad_f32<true>", "new (circular PAD with a pad larger than the dimension: ggml_wrap_around < 0)"),
    ("ops.cpp:8028", "new (POOL_2D's window area k0*k1 in an int: overflows past 2^31)"),
    ("ssm_scan_f32", "1 (SSM_SCAN: the K > 1 snapshot copies nb2 bytes per head, the stride of a size-1 dim 2)"),
    ("ops.cpp:1934", "new (CONCAT: an empty source with data NULL is memcpy'd from, 0 bytes a row)"),
    ("ggml-quants.c", "new (quantizing copy of rows that are not a whole number of blocks)"),
    ("allocator is out of memory", "3 (planner work size: within rpcguard's cap, over the oracle's 2 GiB)"),
    ("ggml_backend_cpu_graph_compute", "3 (planner work size: within rpcguard's cap, over the oracle's 2 GiB)"),
)


def classify(case: gen.Case, out: Outcome) -> str:
    """The issue's hole class a finding most likely belongs to (a heuristic, stated as such)."""
    s = out.summary
    for where, hole in KNOWN_LOCATIONS:
        if where in s:
            return hole
    if "empty" in case.variant.split("+"):  # the node (not "empty-src": an empty source)
        return "2 (empty node: planner reads its sources)"
    if out.kind == "timeout":
        return "5 (compute time)"
    if case.op == "MUL_MAT_ID" and out.kind in ("ggml_abort", "crash", "rss_limit") or "bad_alloc" in s \
            or "allocation-size-too-big" in s or "out-of-memory" in s:
        return "3 (work size from dims of different tensors)"
    if case.op == "ARANGE" or "nelements" in s:
        return "4 (shape arithmetic: float vs double)"
    if out.kind in ("write_canary", "read_canary") or "size1" in case.variant or "overflow" in s:
        return "1 (rows flattened through a stride the rules ignore)"
    return "new"


def location(case: gen.Case, out: Outcome) -> str:
    """What one reproducer stands for: the kind, the op, and where the report points."""
    if out.kind in ("write_canary", "read_canary", "timeout"):
        return f"{out.kind}|{case.op}"
    return f"{out.kind}|{case.op}|{out.summary[:160]}"


class Runner:
    """The sanitizer server and one gate connection, reused across cases until something breaks."""

    def __init__(self, workdir: Path, *, budget_s: float = BUDGET_S, threads: int = 2, log=print) -> None:
        self.workdir = workdir
        self.budget_s = budget_s
        self.server = SanServer(workdir, threads=threads)
        self.server.start()
        self.upstream = UpstreamFacts()
        self.gate: Gate | None = None
        self.log = log
        self._free_failed = False

    def close(self) -> None:
        if self.gate:
            self.gate.close()
        self.server.stop()

    def _gate(self, contained: bool = False) -> Gate:
        if self.gate is not None and self.gate.contained != contained:
            self._drop()  # another policy: a new session (connection) on the same server
        if self.gate is None:
            if not self.server.alive():
                self.server.restart()
            self.gate = Gate(self.server.port, self.upstream, contained=contained)
        return self.gate

    def _drop(self) -> None:
        if self.gate is not None:
            self.gate.close()
            self.gate = None

    def run(self, case: gen.Case, *, data: bool = True, second: bool = True, fresh: bool = False) -> Outcome:
        """Run ``case``; any finding leaves a restarted server behind."""
        if sum(case.buffers) > MAX_CASE_BYTES:
            return Outcome("skipped", f"{sum(case.buffers)} bytes of buffers")
        if fresh:
            self._drop()
            self.server.restart()
        self.server.mark()
        contained = case.op in gen.CONTAINED_OPS
        try:
            g = self._gate(contained)
        except (ServerGone, Budget, OSError):
            # the server went away between cases: not this case's doing; a fresh server, once
            self._drop()
            self.server.restart()
            self.server.mark()
            try:
                g = self._gate(contained)
            except (ServerGone, Budget, OSError) as e:
                v = self.server.verdict()
                self._drop()
                self.server.restart()
                return Outcome(v.kind if v.finding else "crash", f"no session on a fresh server: "
                               f"{v.summary if v.finding else e}", v.log)
        g.frames.clear()  # one case's frames (the reproducer), not the whole connection's
        mark = 0
        self._free_failed = False
        try:
            out = self._run(g, case, data, second)
            if self._free_failed and out.kind == "clean":
                out = Outcome("crash", "the server went away while the case's buffers were freed", seconds=out.seconds)
        except GateRefused as e:
            self._drop()
            return Outcome("gate_refused", f"{e.command} {e.reason}: {e.detail}")
        except Budget:
            out = Outcome("timeout", f"no answer within {self.budget_s:.0f} s of GRAPH_COMPUTE")
        except ServerGone as e:
            out = Outcome("crash", str(e))
        if out.kind in ("crash", "timeout"):
            v = self.server.verdict()
            if v.finding:
                out = Outcome(v.kind, v.summary, v.log, out.seconds)
            elif out.kind == "crash" and self.server.alive():
                # the server's own deserialisation refused the graph and closed the connection:
                # not a finding (nothing broke), but rpcguard forwarded what the server refuses
                out = Outcome("server_closed", out.summary)
        out.frames = [Frame(CMD["HELLO"], bytes(24))] + g.frames[mark:]
        out.buffers = dict(g.buffers)
        if out.finding:
            self._drop()
            self.server.restart()
        elif out.kind == "server_closed":
            self._drop()  # the server frees the session's buffers now: does it survive that?
            # (answered: it served that session to its end and took the next connection)
            if not self.server.answers_hello() or classify_log(self.server.since_mark()):
                v = self.server.verdict()
                out = Outcome(v.kind if v.finding else "crash",
                              f"after the server closed the connection: {v.summary or 'died'}", v.log,
                              out.seconds, out.frames, out.buffers)
                self.server.restart()
        return out

    def _run(self, g: Gate, case: gen.Case, data: bool, second: bool) -> Outcome:
        live, sizes = [], []
        for size in case.buffers:
            h, base, got = g.alloc(size)
            live.append((h, base))
            sizes.append(got)
        try:
            return self._compute_twice(g, case, live, sizes, data, second)
        finally:
            if g is self.gate and self.server.alive():
                g.sock.settimeout(IO_TIMEOUT_S)
                for h, _ in live:
                    try:
                        g.free(h)
                    except (ServerGone, Budget, GateRefused):
                        self._free_failed = True
                        break
                if not self._free_failed:
                    try:  # the frees have no answer: a probe tells whether the server survived them
                        g._request(CMD["GET_ALIGNMENT"], struct.pack("<I", 0), True)
                    except (ServerGone, Budget, GateRefused):
                        self._free_failed = True
                for h, _ in live:
                    g.buffers.pop(h, None)

    def _compute_twice(self, g: Gate, case: gen.Case, live, sizes, data: bool, second: bool) -> Outcome:
        """Run the graph with canary A everywhere, then B (see the module docstring). The project's
        invariant is per buffer (every address a kernel forms from a tensor lies in that tensor's
        buffer): bytes changed or read outside the nodes' spans but inside a buffer the node or its
        sources live in are noted (``span_write`` / ``span_read``, not findings); anything that
        reaches another buffer is a finding."""
        payload = gen.payload_of(case, live)
        rng = random.Random(f"{case.seed}:{case.op}:{case.index}:data")
        fills = {}
        for t in case.tensors:
            if t.buf >= 0 and t.fill != "none" and data:
                fills[t.id] = fill_bytes(rng, t.type, gen.span(t), "zero" if t.fill == "zero" else "rand")
        node_spans = gen.output_spans(case)  # the nodes (and sources written in place: OPT_STEP_ADAMW's m, v)
        node_bufs = {b for b, _, _ in node_spans}
        own = set(node_bufs)
        for t in case.tensors:
            if t.id in case.nodes:
                for i in [*t.src, t.view_src]:
                    if i:
                        src = case.by_id(i)
                        own.add(src.buf)
                        if src.view_src:
                            own.add(case.by_id(src.view_src).buf)
        own.discard(-1)
        note = ""
        seconds = 0.0

        def one(run: int, canaries: list[str]) -> list[bytes] | Outcome:
            nonlocal note, seconds
            # random canary bytes (a constant would hide reads through order-only kernels: ARGSORT)
            images = [bytearray(random.Random(f"canary:{c}:{i}").randbytes(size))
                      for i, (c, size) in enumerate(zip(canaries, sizes))]
            for t in case.tensors:  # leaves, then the pre-filled fresh nodes, in list order
                if t.id in fills:
                    images[t.buf][t.offs : t.offs + len(fills[t.id])] = fills[t.id]
            for (h, base), img in zip(live, images):
                g.set_buffer(h, base, bytes(img))
            g.compute(payload)
            g.sock.settimeout(self.budget_s)
            t0 = time.monotonic()
            got = []
            for i, ((h, base), size) in enumerate(zip(live, sizes)):
                got.append(g.get_buffer(h, base, size))
                if i == 0:
                    if run == 0:
                        seconds = time.monotonic() - t0
                    g.sock.settimeout(IO_TIMEOUT_S)
            for i, (img, back) in enumerate(zip(images, got)):  # write canary
                if img == back:
                    continue
                allowed = bytearray(len(img))
                for b, offs, n in node_spans:
                    if b == i:
                        allowed[offs : offs + n] = b"\1" * n
                bad = [k for k in _diff(img, back) if not allowed[k]]
                if bad:
                    what = (f"buffer {i}: {len(bad)} bytes outside the node spans changed, first at offset {bad[0]} "
                            f"(size {len(img)})")
                    if i not in node_bufs:
                        return Outcome("write_canary", what + ", a buffer no node lives in", seconds=seconds)
                    note = note or "span_write|" + what
            return [bytes(got[b][offs : offs + n]) for b, offs, n in node_spans]

        n_buf = len(sizes)
        first = one(0, ["A"] * n_buf)
        if isinstance(first, Outcome) or not second:
            return first if isinstance(first, Outcome) else self._noted(note, seconds, first)
        other = one(1, ["B"] * n_buf)
        if isinstance(other, Outcome):
            return other
        if other != first:
            again = one(2, ["A"] * n_buf)  # the first canary again: is the kernel deterministic at all?
            if isinstance(again, Outcome):
                return again
            if again != first:
                return Outcome("nondeterministic", "same input, different result (threads race on aliased rows)",
                               seconds=seconds)
            if aliased(case):
                return Outcome("nondeterministic", "the node writes some elements more than once (aliased "
                               "destination): threads may race, no read oracle", seconds=seconds)
            k = next(i for i in range(len(node_spans)) if first[i] != other[i])
            at = next(i for i in range(len(first[k])) if first[k][i] != other[k][i])
            what = (f"node span {k} (buffer {node_spans[k][0]}+{node_spans[k][1]}, {node_spans[k][2]} bytes) differs "
                    f"between canaries from byte {at}")
            mixed = one(3, ["A" if i in own else "B" for i in range(n_buf)])  # only the other buffers changed
            if isinstance(mixed, Outcome):
                return mixed
            if mixed != first:
                return Outcome("read_canary", what + ": read from a buffer neither the node nor its sources live in",
                               seconds=seconds)
            note = note or "span_read|" + what + " (bytes of its own buffers, outside the spans)"
        return self._noted(note, seconds, first)

    @staticmethod
    def _noted(note: str, seconds: float, spans: list[bytes]) -> Outcome:
        if note:
            kind, what = note.split("|", 1)
            return Outcome(kind, what, seconds=seconds, spans=spans)
        return Outcome("clean", seconds=seconds, spans=spans)


# -- findings ------------------------------------------------------------------------------------


@dataclass
class Finding:
    case: gen.Case
    outcome: Outcome
    location: str
    hole: str
    reproduced: bool
    count: int = 1
    path: str = ""


def shrink(runner: Runner, case: gen.Case, out: Outcome) -> tuple[Outcome, bool]:
    """The smallest replay that still gives the same kind: no data, then one run; and whether it
    reproduced at all on a fresh server."""
    best, reproduced = out, False
    # without data an index tensor holds canary bytes: out-of-range indices, the known
    # content-indexed hole (SSM_SCAN's state slots, ...) instead of the finding's own
    indexed = any(t.fill == "zero" for t in case.tensors)
    for data, second in ((True, True), (False, False), (True, False)):
        if out.kind == "read_canary" and not second or indexed and not data:
            continue
        o = runner.run(case, data=data, second=second, fresh=True)
        if o.kind == out.kind:
            reproduced = True
            if len(o.frames) <= len(best.frames) or not data:
                best = o
            if not data or not second:
                break
    return best, reproduced






def write_finding(f: Finding, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256(f.location.encode()).hexdigest()[:10]
    path = directory / f"accept-{f.outcome.kind}-{h}.json"
    o = f.outcome
    note = (f"{f.case.op}: acceptance fuzz case {f.case.op}#{f.case.index} seed {f.case.seed} [{f.case.variant}] "
            f"-> {o.summary}; rpcguard: forwarded (in-process Session, "
            f"{'contained=True: in production a fresh per-session process' if f.case.op in gen.CONTAINED_OPS else 'default policy'}); "
            f"class {f.hole}")
    obj = {
        "note": note,
        "signature": f"{o.kind}|{f.case.op}|{o.summary[:160]}",
        "location": f.location,
        "status": "open",
        "verdict": o.kind if o.kind not in ("write_canary", "read_canary", "timeout") else "clean",
        "summary": o.summary,
        "rpcguard": "forwarded:server_closed" if o.kind not in ("write_canary", "read_canary") else "forwarded:ok",
        "mutation": None,
        "hole_class": f.hole,
        "reproduced_alone": f.reproduced,
        "server_log": o.log[:3000],
        "case": f.case.to_json(),
        "case_text": f.case.describe(),
    }
    if o.kind not in ("write_canary", "read_canary", "timeout"):  # sanitizer findings: serve replays them
        obj["session"] = encode_frames(o.frames, o.buffers)
    else:
        obj["session_dropped"] = "no sanitizer report: replayed by python -m tests.fuzz.accept_run --replay"
    path.write_text(json.dumps(obj, indent=1) + "\n")
    return path


# -- the loop ------------------------------------------------------------------------------------


@dataclass
class OpStats:
    accepted: int = 0
    ran: int = 0
    clean: int = 0
    no_candidate: int = 0
    outcomes: Counter = field(default_factory=Counter)
    refused: Counter = field(default_factory=Counter)
    variants: Counter = field(default_factory=Counter)
    types: set = field(default_factory=set)
    seconds: float = 0.0
    max_compute_s: float = 0.0


class Campaign:
    def __init__(self, runner: Runner, *, findings_dir: Path | None, report: Path | None, log=print,
                 shrink: bool = True, stop_on_finding: bool = False) -> None:
        self.runner = runner
        self.shrink = shrink
        self.stop_on_finding = stop_on_finding
        self.findings_dir = findings_dir
        self.report = report
        self.stats: dict[str, OpStats] = defaultdict(OpStats)
        self.found: dict[str, Finding] = {}
        self.log = log
        self.t0 = time.monotonic()
        self._last_report = 0.0

    def run_op(self, op: str, seed: int, count: int, deadline: float | None = None) -> OpStats:
        return self.run_some(op, gen.generate(op, seed, count), count, deadline)[0]

    def run_some(self, op: str, cases, n: int, deadline: float | None = None) -> tuple[OpStats, bool]:
        """Up to ``n`` cases from the iterator ``cases``; (stats, whether the iterator ran dry)."""
        st = self.stats[op]
        t0 = time.monotonic()
        done = 0
        for case, refused in cases:
            st.refused.update(refused)
            if deadline and time.monotonic() > deadline:
                break
            if case is None:
                st.no_candidate += 1
                continue
            st.accepted += 1
            st.variants.update(case.variant.split("+"))
            st.types.add(tuple(TYPES[t.type].name for t in case.tensors if t.id not in case.nodes))
            out = self.runner.run(case)
            st.outcomes[out.kind] += 1
            if out.kind != "skipped":
                st.ran += 1
            if out.kind == "clean":
                st.clean += 1
                st.max_compute_s = max(st.max_compute_s, out.seconds)
            elif out.finding:
                self.record(case, out)
                if self.stop_on_finding:
                    break
            elif out.kind == "gate_refused":
                self.log(f"[accept] gate refused a case the generator accepted: {op}#{case.index}: {out.summary}")
            done += 1
            if done >= n:
                st.seconds += time.monotonic() - t0
                return st, False
        st.seconds += time.monotonic() - t0
        return st, True

    def record(self, case: gen.Case, out: Outcome) -> None:
        loc = location(case, out)
        self.log(f"[accept] FINDING {case.op}#{case.index} [{case.variant}]: {out.kind} {out.summary}")
        if loc in self.found:
            self.found[loc].count += 1
            return
        small, reproduced = shrink(self.runner, case, out) if self.shrink else (out, True)
        if small.kind != out.kind:
            small = out
        f = Finding(case, small, loc, classify(case, out), reproduced)
        self.found[loc] = f
        if self.findings_dir is not None:
            f.path = str(write_finding(f, self.findings_dir))
        self.write_report(force=True)

    def write_report(self, force: bool = False) -> None:
        if self.report is None or (not force and time.monotonic() - self._last_report < 60):
            return
        self._last_report = time.monotonic()
        write_report(self.report, self.stats, self.found, time.monotonic() - self.t0)


def write_report(path: Path, stats: dict[str, OpStats], found: dict[str, Finding], seconds: float) -> None:
    lines = ["# Acceptance-region fuzz: findings (issue 20, item 2)", "",
             f"Written by `python -m tests.fuzz.accept_run` (branch accept-fuzz) at "
             f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, {seconds:.0f} s into the run. "
             "Every case below is a graph rpcguard's firewall (default policy, protocol 7.0.0) forwards, run on "
             "the ASan+UBSan ggml-rpc-server; canary = bytes outside the tensors' spans written or read.",
             f"Cases of {', '.join(sorted(gen.CONTAINED_OPS))} are judged and gated with FirewallPolicy(contained=True) "
             "(the default policy refuses them op_needs_containment): in production they reach only a fresh "
             "sandboxed ggml-rpc-server per session, here the shared sanitizer server.", ""]
    total = sum(s.ran for s in stats.values())
    nf = sum(f.count for f in found.values())
    lines += [f"**{total} cases run over {len(stats)} ops, {nf} failing cases at {len(found)} locations.**", "",
              "## Findings", "",
              "| op | class | kind | where / what | case (shape, strides, params) | reproduced alone | cases | file |",
              "|---|---|---|---|---|---|---|---|"]
    for f in sorted(found.values(), key=lambda f: (f.case.op, f.location)):
        desc = f.case.describe().replace("|", "/")
        lines.append(f"| {f.case.op} | {f.hole} | {f.outcome.kind} | {f.outcome.summary.replace('|', '/')[:200]} | "
                     f"{desc[:900]} | {'yes' if f.reproduced else 'NO'} | {f.count} | "
                     f"{Path(f.path).name if f.path else '-'} |")
    lines += ["", "## Cases per op", "",
              "| op | accepted | run | clean | findings | span notes (read/write) | other (not findings) | "
              "max clean compute s | variants |",
              "|---|---|---|---|---|---|---|---|---|"]
    for op, s in sorted(stats.items()):
        bad = sum(n for k, n in s.outcomes.items() if k not in NOT_FINDINGS)
        other = {k: n for k, n in s.outcomes.items() if k in NOT_FINDINGS - {"clean", "span_read", "span_write"}}
        var = ", ".join(f"{k} {n}" for k, n in s.variants.most_common(8))
        lines.append(f"| {op} | {s.accepted} | {s.ran} | {s.clean} | {bad} | {s.outcomes['span_read']}/"
                     f"{s.outcomes['span_write']} | {other or ''} | {s.max_compute_s:.2f} | {var} |")
    lines += ["", "Span notes: a kernel read or wrote bytes outside its tensors' spans but inside the buffers the "
              "node and its sources live in, which the stated invariant (per buffer) allows. Not findings: "
              "gate_refused (the in-process Session refused a case the generator's firewall check accepted), "
              "skipped (buffers over the size cap), server_closed (the server's own deserialisation refused the "
              "graph and closed the connection, alive), nondeterministic (the same input gave two results: threads "
              "racing on aliased rows, so no read oracle)."]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)


def replay(runner: Runner, paths: list[str]) -> int:
    bad = 0
    for p in paths:
        obj = json.loads(Path(p).read_text())
        case = gen.Case.from_json(obj["case"])
        refused = gen.accepts(case)
        if refused:
            print(f"{p}: refused by rpcguard now ({refused})")
            continue
        out = runner.run(case, fresh=True)
        bad += out.finding
        print(f"{p}: {out.kind} {out.summary}")
    return 1 if bad else 0


def old_rules() -> None:
    """The firewall as it was before issue 28 item 1, in this process only: no comparison of the
    kernels' work-buffer use with the planner's reservation (protocol/workuse.py), so that a run
    shows what that check refuses (``--old-rules``)."""
    import rpcguard.protocol.graph as graph

    graph.check_work_use = lambda *a, **k: None  # type: ignore[assignment]


def _campaign(runner: Runner, a: argparse.Namespace, names: list[str], report: Path | None) -> Campaign:
    camp = Campaign(runner, findings_dir=Path(a.findings) if a.findings else None, report=report)
    deadline = time.monotonic() + 60 * a.minutes if a.minutes else None
    # round robin, a few cases per op at a time: a deadline leaves every op with cases
    iters = {op: gen.generate(op, a.seed, a.count) for op in names}
    rounds = 0
    while iters and not (deadline and time.monotonic() > deadline):
        rounds += 1
        for op in list(iters):
            st, dry = camp.run_some(op, iters[op], 5, deadline)
            if dry:
                del iters[op]
                print(f"[accept] -t {runner.server.threads} {op}: {st.ran} run, {st.clean} clean, "
                      f"{dict(st.outcomes)} in {st.seconds:.1f} s", flush=True)
            camp.write_report()
        print(f"[accept] round {rounds}: {sum(s.ran for s in camp.stats.values())} cases run", flush=True)
    camp.write_report(force=True)
    return camp


def _counts(camp: Campaign) -> dict:
    return {op: {"accepted": s.accepted, "ran": s.ran, "clean": s.clean, "outcomes": dict(s.outcomes),
                 "no_candidate": s.no_candidate, "seconds": round(s.seconds, 1),
                 "refused_on_the_way": dict(s.refused)} for op, s in camp.stats.items()} | {
        "_findings": {loc: {"op": f.case.op, "class": f.hole, "kind": f.outcome.kind, "summary": f.outcome.summary,
                            "count": f.count, "file": f.path, "reproduced": f.reproduced}
                      for loc, f in camp.found.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", help="comma-separated op names (default: every op with a 7.0.0 rule; 'work': "
                                  "accept_gen.WORK_OPS, the ops whose kernel uses the planner's work buffer)")
    ap.add_argument("--count", type=int, default=50, help="accepted cases per op")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--minutes", type=float, help="stop after this long (per thread count)")
    ap.add_argument("--threads", default="2", help="comma-separated server thread counts (-t); the whole run "
                                                   "once per count, on a fresh server")
    ap.add_argument("--old-rules", action="store_true", help="without the work-buffer use check (issue 28.1): "
                                                             "what it refuses is forwarded")
    ap.add_argument("--budget", type=float, default=BUDGET_S, help="seconds a graph may compute")
    ap.add_argument("--findings", default=str(FINDINGS_DIR), help="where reproducers go ('' = nowhere)")
    ap.add_argument("--report", help="markdown summary, rewritten as the run goes (-tN added per thread count)")
    ap.add_argument("--json", help="write per-op counts here (per thread count: {\"t=N\": ...})")
    ap.add_argument("--replay", nargs="*", help="replay accept-*.json files instead")
    a = ap.parse_args(argv)
    if a.old_rules:
        old_rules()
    threads = [int(x) for x in a.threads.split(",")]
    names = list(gen.WORK_OPS) if a.ops == "work" else a.ops.split(",") if a.ops else gen.ops()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the finally below stops the server
    results: dict[str, dict] = {}
    failed = False
    for t in threads:
        with tempfile.TemporaryDirectory(prefix="acceptfuzz-") as tmp:
            runner = Runner(Path(tmp), budget_s=a.budget, threads=t)
            try:
                if a.replay is not None:
                    failed |= replay(runner, a.replay) != 0
                    continue
                report = Path(a.report) if a.report else None
                if report is not None and len(threads) > 1:
                    report = report.with_name(f"{report.stem}-t{t}{report.suffix}")
                camp = _campaign(runner, a, names, report)
                results[f"t={t}"] = _counts(camp)
                failed |= bool(camp.found)
            finally:
                runner.close()
    if a.json and results:
        Path(a.json).write_text(json.dumps(results if len(threads) > 1 else results[f"t={threads[0]}"], indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
