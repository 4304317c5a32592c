"""Run what the 7.0.0 op rules accept on a REAL older server: does its kernel abort on it?

The op rows were derived from the 7.0.0 CPU kernels; rpcguard/protocol/oprules/kerneltypes.py
lists what older kernels do not run (found by diffing their sources, scripts/kernel_types.py).
This checks that list against the servers themselves: the acceptance generator
(tests/fuzz/accept_gen.py) draws, per op, graphs at the edges of what the 7.0.0 rules accept; each
is moved to the old version's op ids, judged by rpcguard's firewall *for that version* (the kernel
gaps included), and every graph it forwards is run straight on the version's real
ggml-rpc-server (tests/realpeer/releases.sh, realpeer.release_build). A server that dies on a
forwarded graph is a finding (a gap the table misses); graphs refused
``type_not_supported_by_version`` are counted. Not a sanitizer run: only aborts and crashes show.

    .venv/bin/python -m bench.studies.kernel_gaps_real --versions 6.0.0,4.0.1 --count 4 --seed 1
"""

from __future__ import annotations

import argparse
import random
import socket
import struct
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from rpcguard.errors import FirewallRefusal
from rpcguard.protocol.encode import hello_request
from rpcguard.protocol.firewall import Firewall
from rpcguard.protocol.ggml import op_table
from rpcguard.protocol.graph import op_rules
from rpcguard.protocol.state import SessionState, UpstreamFacts
from rpcguard.protocol.versions import COMMAND_IDS, spec_for
from tests.fuzz import accept_gen as gen
from tests.fuzz.accept_run import fill_bytes
from tests.support import realpeer

Version = tuple[int, int, int]
CMD = COMMAND_IDS
MAX_BUFFERS = 1 << 30  # a case needing more server memory is skipped (limits cases reach 100s of GiB)
BIG_FILL = 16 << 20  # bytes of random leaf data at most per tensor
IO_S = 20.0  # seconds a graph may compute before the case counts as hung (the server is restarted)


def translate(case: gen.Case, version: Version) -> gen.Case | None:
    """``case`` with ``version``'s op ids, or None when one of its ops is not in that version."""
    ids = op_table(version).ids  # type: ignore[union-attr]
    out = []
    for t in case.tensors:
        name = gen.TABLE.names[t.op]  # type: ignore[union-attr]
        if name not in ids:
            return None
        out.append(gen.Tensor(**{**t.__dict__, "op": ids[name]}))
    return gen.Case(**{**case.__dict__, "tensors": out})


FLOATS = {0: 4, 1: 2, 30: 2}  # F32, F16, BF16: element bytes


def retyped(case: gen.Case, to: int) -> gen.Case | None:
    """``case`` with every float tensor (all of one type) made ``to``: strides, offsets and buffers
    scaled by the element sizes; None when the case mixes float types or a stride does not divide."""
    kinds = {t.type for t in case.tensors if t.type in FLOATS}
    if len(kinds) != 1 or any(t.type not in FLOATS and t.buf >= 0 for t in case.tensors):
        return None
    (old,) = kinds
    num, den = FLOATS[to], FLOATS[old]
    out = []
    for t in case.tensors:
        if any(x * num % den for x in (*t.nb, t.offs, t.view_offs)):
            return None
        out.append(gen.Tensor(**{**t.__dict__, "type": to, "nb": tuple(x * num // den for x in t.nb),
                                 "offs": t.offs * num // den, "view_offs": t.view_offs * num // den}))
    buffers = [-(-size * num // den) for size in case.buffers]
    return gen.Case(**{**case.__dict__, "tensors": out, "buffers": buffers, "variant": case.variant + f"|as{to}"})


def judged(case: gen.Case, version: Version) -> str | None:
    """None when rpcguard forwards the case's graph to a ``version`` server, else the reason."""
    spec = spec_for(version)
    assert spec is not None
    st = SessionState(UpstreamFacts(version=version, device_count=1))
    st.spec = spec
    for (h, b), size in zip(gen.handles_fake(case), case.buffers):
        st.add_buffer(h, 0, size)
        st.set_base(h, b)
    fw = Firewall(st, gen.policy_for(case.op))
    rule = spec.commands[CMD["GRAPH_COMPUTE"]]
    try:
        fw.check_request(rule, memoryview(gen.payload_of(case, gen.handles_fake(case))), 0)  # type: ignore[arg-type]
    except FirewallRefusal as e:
        return e.reason
    return None


def _frame(cmd: str, payload: bytes = b"") -> bytes:
    return struct.pack("<BQ", CMD[cmd], len(payload)) + payload


class Server:
    """One real ggml-rpc-server of a release and a plain connection to it."""

    def __init__(self, version: str, workdir: Path) -> None:
        self.version = version
        self.v: Version = tuple(int(x) for x in version.split("."))  # type: ignore[assignment]
        self.bin = realpeer.release_build(version).rpc_server
        self.workdir = workdir
        self.n = 0
        self.proc: realpeer.Proc | None = None
        self.sock: socket.socket | None = None

    def start(self) -> None:
        self.n += 1
        port = realpeer.reserve_port()
        self.log = self.workdir / f"rpc-{self.version}-{self.n}.log"
        self.proc = realpeer.start([str(self.bin), "-H", "127.0.0.1", "-p", str(port), "-t", "2"], self.log,
                                   f"ggml-rpc-server {self.version}")
        realpeer.wait_port(port, proc=self.proc.popen)
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=IO_S)
        self.sock.sendall(hello_request(self.v))
        self._recv()

    def stop(self) -> None:
        if self.sock is not None:
            self.sock.close()
        if self.proc is not None:
            self.proc.stop()

    def _recv(self) -> bytes:
        assert self.sock is not None
        (n,) = struct.unpack("<Q", self._exact(8))
        return self._exact(n)

    def _exact(self, n: int) -> bytes:
        assert self.sock is not None
        out = b""
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            if not chunk:
                raise ConnectionError("closed")
            out += chunk
        return out

    def call(self, cmd: str, payload: bytes) -> bytes:
        assert self.sock is not None
        self.sock.sendall(_frame(cmd, payload))
        return self._recv()

    def run(self, case: gen.Case, rng: random.Random) -> str:
        """"ok", "died: <last log line>" or "hung"."""
        assert self.sock is not None and self.proc is not None
        try:
            live = []
            for size in case.buffers:
                h, _ = struct.unpack("<QQ", self.call("ALLOC_BUFFER", struct.pack("<IQ", 0, size)))
                (b,) = struct.unpack("<Q", self.call("BUFFER_GET_BASE", struct.pack("<Q", h)))
                live.append((h, b))
            images = [bytearray(size) for size in case.buffers]
            for t in case.tensors:
                if t.buf >= 0 and t.fill != "none" and t.id not in case.nodes:
                    n = min(gen.span(t), case.buffers[t.buf] - t.offs)
                    how = "zero" if t.fill == "zero" or n > BIG_FILL else "rand"  # zeros past BIG_FILL: fast
                    images[t.buf][t.offs : t.offs + n] = fill_bytes(rng, t.type, n, how)
            for (h, b), img in zip(live, images):  # one SET_TENSOR per buffer: an i8 tensor over it
                t = gen.Tensor(id=1, type=24, ne=(len(img), 1, 1, 1), nb=(1, len(img), len(img), len(img)), buf=0)
                self.sock.sendall(_frame("SET_TENSOR", gen._pack(t, h, b) + struct.pack("<Q", 0) + bytes(img)))
            self.sock.sendall(_frame("GRAPH_COMPUTE", gen.payload_of(case, live)))
            self.call("GET_ALIGNMENT", struct.pack("<I", 0))  # answered after the graph ran
            for h, _ in live:
                self.sock.sendall(_frame("FREE_BUFFER", struct.pack("<Q", h)))
                if self.v < (6, 0, 0):  # FREE_BUFFER answered an empty frame until 6.0.0
                    self._recv()
            return "ok"
        except (ConnectionError, OSError) as e:
            deadline = time.monotonic() + 5
            while self.proc.alive() and time.monotonic() < deadline:
                time.sleep(0.05)
            if self.proc.alive():
                return f"hung ({type(e).__name__})"
            last = [x for x in self.proc.output().splitlines() if x.strip()][-3:]
            return "died: " + " | ".join(last)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--versions", default="6.0.0,5.1.0,4.0.3,4.0.1")
    ap.add_argument("--ops", help="comma-separated op names (default: every op with a 7.0.0 rule)")
    ap.add_argument("--count", type=int, default=4, help="accepted (7.0.0) cases per op")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--retype", action="store_true", help="also run each case with its float tensors as "
                    "F32, F16 and BF16 (the type switches of the kernels)")
    a = ap.parse_args(argv)
    names = a.ops.split(",") if a.ops else gen.ops()
    findings = 0
    with tempfile.TemporaryDirectory(prefix="kgaps-") as tmp:
        for vs in a.versions.split(","):
            v: Version = tuple(int(x) for x in vs.split("."))  # type: ignore[assignment]
            rules = op_rules(v)
            assert rules is not None, vs
            server = Server(vs, Path(tmp))
            server.start()
            counts: Counter[str] = Counter()
            t0 = time.monotonic()
            try:
                for op in names:
                    if op not in rules.names or rules.rows.get(rules.names.index(op)) is None:
                        counts["op without a rule here"] += 1
                        continue
                    for drawn, _ in gen.generate(op, a.seed, a.count):
                        if drawn is None:
                            continue
                        variants = [drawn] + ([x for to in FLOATS if (x := retyped(drawn, to)) is not None]
                                              if a.retype else [])
                        for case in variants:
                            moved = translate(case, v)
                            if moved is None:
                                counts["op not in this version"] += 1
                                continue
                            why = judged(moved, v)
                            if why:
                                counts[f"refused {why}"] += 1
                                continue
                            if sum(moved.buffers) > MAX_BUFFERS:
                                counts["skipped: buffers past MAX_BUFFERS"] += 1
                                continue
                            got = server.run(moved, random.Random(f"{a.seed}:{op}:{case.index}"))
                            counts[got.split(":")[0].split(" ")[0]] += 1
                            if got != "ok":
                                findings += got.startswith("died")
                                print(f"{vs} {op}: {got}\n    {moved.describe()}", flush=True)
                                server.stop()
                                server.start()
            finally:
                server.stop()
            print(f"{vs}: {dict(sorted(counts.items()))} in {time.monotonic() - t0:.0f} s", flush=True)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
