"""Cross-check of the kernel oracle: replay constructor-built graphs on a REAL ggml-rpc-server.

    .venv/bin/python -m tests.differential.asan_replay [--op OP ...] [--clean N] [--server BIN]

The kernel oracle (tests/support/ggmlkernel.py) computes in-process behind guard pages. This
replays the same graphs over the wire, the way an attacker would, on the AddressSanitizer +
UBSan build of ggml-rpc-server (tests/realpeer/sanitizer.sh on the sanitize branch:
$REALPEER_ASAN_SERVER_BIN or $REALPEER_HOME/asan.env), or with ``--server`` on any binary.

How this works: per graph, every tensor that owns memory gets its OWN server buffer
(ALLOC_BUFFER of exactly the size the oracle mapped, ``Built.buffers``: the tensor, its views and
a leaf's room; BUFFER_CLEAR 0), so ASan's redzone after each allocation catches what the guard
page catches in-process, to the byte. The payload's
buffer handles and data pointers are rebased onto those buffers, GRAPH_COMPUTE is sent, and a
GET_ALIGNMENT must still be answered. A dead server is a kernel refusal; its log says how (an
ASan report, a UBSan report, a GGML_ASSERT/ABORT) and a fresh server is started. Every graph the
oracle says the kernel refuses is replayed, plus ``--clean`` of the kernel-clean ones; the tool
prints both verdicts side by side and the agreement. A tool for people (a full run takes
minutes: every crash restarts an ASan server), not part of the pytest run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import socket
import struct
import sys
import tempfile
import time
from pathlib import Path

from rpcguard.protocol import encode
from rpcguard.protocol.encode import TENSOR_STRUCT
from rpcguard.protocol.tensor import decode_tensor
from rpcguard.protocol.versions import TENSOR_BYTES
from tests.support import realpeer
from tests.support.ggmlref import Built, kernel_refused

__all__ = ["Replayer", "main"]

V7 = (7, 0, 0)
SAN_ENV = {
    "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1:halt_on_error=1:allocator_may_return_null=1",
    "UBSAN_OPTIONS": "halt_on_error=1:abort_on_error=1:print_stacktrace=0",
}
MARKERS = (
    re.compile(r"ERROR: AddressSanitizer: [\w-]+.*"),
    re.compile(r"\S+:\d+:\d+: runtime error: .*"),
    re.compile(r"\S+\.(?:c|cpp|h):\d+: (?:GGML_ASSERT.*|.*error.*|not implemented.*)"),
)
_I_BUF, _I_DATA = 2, -3  # fields of TENSOR_STRUCT: buffer handle, data pointer


def asan_binary() -> str | None:
    path = os.environ.get("REALPEER_ASAN_SERVER_BIN") or realpeer._read_env(
        realpeer.REALPEER_HOME / "asan.env").get("REALPEER_ASAN_SERVER_BIN")  # fmt: skip
    return path if path and os.access(path, os.X_OK) else None


def _recv(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            raise EOFError
        out += chunk
    return out


def _call(s: socket.socket, cmd: str, payload: bytes) -> bytes:
    s.sendall(encode.request(cmd, payload))
    return _recv(s, struct.unpack("<Q", _recv(s, 8))[0])


class Replayer:
    """One sanitizer server at a time; restarted after every graph that kills it."""

    def __init__(self, binary: str, workdir: Path) -> None:
        self.binary, self.workdir = binary, workdir
        self.server: realpeer.Proc | None = None
        self.sock: socket.socket | None = None
        self.log_at = 0
        self.restarts = 0
        self.port: int | None = None

    def _start(self) -> None:
        port = self.port = self.port or realpeer.reserve_port()  # one reserved port for every restart
        log = self.workdir / f"san-{port}-{self.restarts}.log"
        self.server = realpeer.start([self.binary, "-H", "127.0.0.1", "-p", str(port), "-t", "1"], log,
                                     f"asan-rpc-server:{port}", dict(SAN_ENV))  # fmt: skip
        realpeer.wait_port(port, timeout=60, proc=self.server.popen)
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.sock.sendall(encode.hello_request(V7))
        _recv(self.sock, struct.unpack("<Q", _recv(self.sock, 8))[0])

    def close(self) -> None:
        if self.sock:
            self.sock.close()
        if self.server:
            self.server.stop()
        self.sock = self.server = None

    def run(self, b: Built) -> str:
        """'ok' when the server computed the graph and still answers, else how it died."""
        if self.server is None or not self.server.alive():
            self.close()
            self._start()
        assert self.sock is not None and self.server is not None
        s = self.sock
        ts = [decode_tensor(b.payload, b.tensor_bytes + TENSOR_BYTES * i) for i in range(b.n_tensors)]
        bufs: dict[int, tuple[int, int]] = {}  # fake handle -> (real handle, real base)
        try:
            for fake, _, size in b.buffers:  # a buffer per tensor that owns memory, as the oracle mapped it
                handle, _ = struct.unpack("<QQ", _call(s, "ALLOC_BUFFER", struct.pack("<IQ", 0, size)))
                (base,) = struct.unpack("<Q", _call(s, "BUFFER_GET_BASE", struct.pack("<Q", handle)))
                s.sendall(encode.request("BUFFER_CLEAR", struct.pack("<QB", handle, 0)))  # no answer in 7.0.0
                bufs[fake] = (handle, base)
            fake_base = {h: base for h, base, _ in b.buffers}
            out = bytearray(b.payload)
            for i, t in enumerate(ts):
                if t.buffer not in bufs:
                    continue
                handle, base = bufs[t.buffer]
                off = b.tensor_bytes + TENSOR_BYTES * i
                f = list(TENSOR_STRUCT.unpack_from(out, off))
                f[_I_BUF], f[_I_DATA] = handle, base + (t.data - fake_base[t.buffer])
                TENSOR_STRUCT.pack_into(out, off, *f)
            s.sendall(encode.request("GRAPH_COMPUTE", bytes(out)))
            _call(s, "GET_ALIGNMENT", struct.pack("<I", 0))
            for handle, _ in bufs.values():
                s.sendall(encode.request("FREE_BUFFER", struct.pack("<Q", handle)))  # no answer in 7.0.0
            return "ok"
        except (EOFError, OSError):
            deadline = time.monotonic() + 10
            while self.server.alive() and time.monotonic() < deadline:
                time.sleep(0.05)
            text = self.server.output()
            self.close()
            self.restarts += 1
            for m in MARKERS:
                hit = m.search(text)
                if hit:
                    return "dead: " + re.sub(r"^\S*?/(ggml/src/)", r"\1", hit.group(0))[:200]
            return "dead: " + (text.strip().splitlines() or ["no output"])[-1][:200]


def main(argv: list[str] | None = None) -> int:
    from tests.differential.oracle import run  # noqa: PLC0415  (heavy: only for the tool)

    ap = argparse.ArgumentParser(prog="python -m tests.differential.asan_replay", description=__doc__.splitlines()[0])
    ap.add_argument("--op", action="append", help="only these ops")
    ap.add_argument("--clean", type=int, default=40, help="kernel-clean graphs to replay too (sampled)")
    ap.add_argument("--cases", type=int, default=30)
    ap.add_argument("--server", help="server binary (default: the ASan build)")
    ap.add_argument("--mutations", action="store_true",
                    help="replay instead the mutated graphs rpcguard forwards though no constructor builds them "
                         "(test_mutations_refused's misses): which of them the kernel survives")
    args = ap.parse_args(argv)
    binary = args.server or asan_binary()
    if not binary:
        print("asan_replay: no sanitizer server: run `bash tests/realpeer/sanitizer.sh` or pass --server", file=sys.stderr)
        return 2
    if args.mutations:
        return _mutations(binary, args)
    res = run(cases=args.cases, mutated=0, only=set(args.op) if args.op else None, keep_built=True)
    refused = [(op, g, rec, b) for op, r in res.items() for g, rec, b in r.built_graphs if kernel_refused(b.kernel)]
    clean = [(op, g, rec, b) for op, r in res.items() for g, rec, b in r.built_graphs if b.kernel == "ok"]
    random.Random(1).shuffle(clean)
    todo = refused + clean[: args.clean]
    agree = 0
    with tempfile.TemporaryDirectory(prefix="asan-replay-") as tmp:
        rep = Replayer(binary, Path(tmp))
        t0 = time.monotonic()
        try:
            for op, gen, recipe, b in todo:
                got = rep.run(b)
                same = (got == "ok") == (b.kernel == "ok")
                agree += same
                print(f"{'  ' if same else '!!'} {op:<18} [{gen}] oracle: {b.kernel[:90]} | server: {got}")
                if not same:
                    print(f"   recipe={json.dumps(recipe)}")
        finally:
            rep.close()
    print(f"{agree}/{len(todo)} agree ({len(refused)} kernel-refused, {min(args.clean, len(clean))} kernel-clean "
          f"replayed; {rep.restarts} server restarts; {time.monotonic() - t0:.0f} s; server {binary})")
    return 0


def _mutations(binary: str, args: argparse.Namespace) -> int:
    from tests.differential.oracle import run
    from tests.differential.report import DEFAULT_MUTATED

    res = run(cases=args.cases, mutated=DEFAULT_MUTATED, only=set(args.op) if args.op else None)
    todo = [(op, m) for op, r in sorted(res.items()) for m in r.missed if m.payload]
    dead = 0
    with tempfile.TemporaryDirectory(prefix="asan-replay-") as tmp:
        rep = Replayer(binary, Path(tmp))
        try:
            for op, m in todo:
                n = struct.unpack_from("<I", m.payload, 4)[0]
                n_tensors = struct.unpack_from("<I", m.payload, 8 + 8 * n)[0]
                nodes = list(struct.unpack_from(f"<{n}Q", m.payload, 8))
                got = rep.run(Built(m.payload, nodes, n_tensors, []))
                dead += got != "ok"
                print(f"{'!!' if got != 'ok' else '  '} {op:<16} [{m.gen}] {m.label}: server {got}")
        finally:
            rep.close()
    print(f"{dead}/{len(todo)} forwarded mutations kill the server ({binary})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
