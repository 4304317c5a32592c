#!/usr/bin/env python3
"""Parse cost of rpcguard's sans-IO session on real traffic, without any I/O.

Usage: ``.venv/bin/python bench/replay.py [--model tiny|bench|load400] [-n TOKENS] [--profile]``

How this works: ``capture`` runs the real llama.cpp client against a real server through a
plain Python TCP relay that records, per connection, every chunk read in order with its
direction. The model connection (the one with the most bytes) is saved to
``~/.cache/rpcguard-bench/<model>-n<N>.capture``. ``replay`` then feeds those chunks to a
``rpcguard.protocol.session.Session`` with the default (enforce) policy exactly as the relay
would, and times each call: the time of chunks that complete a GRAPH_COMPUTE frame gives the
per-token validation cost, the time of SET_TENSOR chunks gives the per-MB streaming cost.
``--profile`` adds a cProfile listing of the replay. This is what the relay costs in Python on
top of TLS and the sockets; compare it with the per-token time of the generation workloads.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pickle
import pstats
import struct
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
for p in (str(ROOT), str(BENCH)):
    if p not in sys.path:
        sys.path.insert(0, p)

from rpcguard.config import PolicyConfig  # noqa: E402
from rpcguard.policy import session_policy  # noqa: E402
from rpcguard.protocol.session import Session  # noqa: E402
from rpcguard.protocol.state import UpstreamFacts  # noqa: E402
from rpcguard.protocol.versions import COMMAND_NAMES  # noqa: E402
from run import CACHE, model_path  # noqa: E402
from tests.support import realpeer  # noqa: E402

READ_BYTES = 256 * 1024  # what the relay reads per call (relay.READ_BUFFER_BYTES)


async def _relay(listen_port: int, upstream_port: int, conns: list, done: asyncio.Event) -> asyncio.Server:
    async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        sr, sw = await asyncio.open_connection("127.0.0.1", upstream_port)
        chunks: list[tuple[str, bytes]] = []
        conns.append(chunks)

        async def pump(r: asyncio.StreamReader, w: asyncio.StreamWriter, tag: str) -> None:
            while data := await r.read(READ_BYTES):
                chunks.append((tag, data))
                w.write(data)
                await w.drain()
            w.close()

        await asyncio.gather(pump(cr, sw, "c"), pump(sr, cw, "s"), return_exceptions=True)

    return await asyncio.start_server(handle, "127.0.0.1", listen_port)


def capture(model: str, n: int) -> Path:
    out = CACHE / f"{model}-n{n}.capture"
    if out.exists():
        return out
    work = Path(tempfile.mkdtemp(prefix="rpcguard-replay-"))
    server, sport = realpeer.start_rpc_server(work, binary=True)
    conns: list = []
    lport = realpeer.free_port()

    async def main() -> realpeer.ClientRun:
        srv = await _relay(lport, sport, conns, asyncio.Event())
        loop = asyncio.get_running_loop()
        r = await loop.run_in_executor(None, lambda: realpeer.run_client(f"127.0.0.1:{lport}", model_path(model),
                                                                         n=n, timeout=300))
        srv.close()
        return r

    try:
        r = asyncio.run(main())
    finally:
        server.stop()
    if not r.ok:
        raise SystemExit(f"capture failed:\n{r.output[-2000:]}")
    biggest = max(conns, key=lambda cs: sum(len(d) for _, d in cs))
    out.write_bytes(pickle.dumps({"model": model, "n": n, "tokens": r.tokens, "chunks": biggest}))
    return out


def replay(path: Path, profile: bool) -> None:
    cap = pickle.loads(path.read_bytes())
    chunks = [(tag, memoryview(bytearray(data))) for tag, data in cap["chunks"]]
    policy = session_policy(PolicyConfig())
    by_cmd: dict[str, list[float]] = {}
    frames_in: dict[str, int] = {}

    def run_once() -> float:
        facts = UpstreamFacts()
        facts.version, facts.device_count = (7, 0, 0), 1  # as after the first session: no injected DEVICE_COUNT
        s = Session(policy, facts)
        total = 0.0
        for tag, view in chunks:
            first_cmd = COMMAND_NAMES[view[0]] if tag == "c" and s._req.at_boundary and view[0] < len(
                COMMAND_NAMES) else None
            t0 = time.perf_counter_ns()
            if tag == "c":
                s.client_data(view)
            else:
                s.server_data(view)
            dt = time.perf_counter_ns() - t0
            total += dt
            s.to_server.clear()
            s.to_client.clear()
            if tag == "c":
                key = first_cmd or "(body continuation)"
                by_cmd.setdefault(key, []).append(dt / 1e3)
                frames_in[key] = frames_in.get(key, 0) + len(view)
            else:
                by_cmd.setdefault("(responses)", []).append(dt / 1e3)
        return total / 1e9

    run_once()  # warm up
    by_cmd.clear()
    frames_in.clear()
    prof = cProfile.Profile() if profile else None
    if prof:
        prof.enable()
    seconds = run_once()
    if prof:
        prof.disable()
    c2s = sum(len(v) for t, v in chunks if t == "c")
    print(f"{path.name}: {len(chunks)} chunks, {c2s / 1e6:.1f} MB client->server, tokens {cap['n']}")
    print(f"whole session parse time {seconds * 1e3:.1f} ms ({c2s / 1e6 / seconds:.0f} MB/s of client bytes)\n")
    print("| chunk starting with | chunks | total ms | median us | max us | MB |")
    print("|---|---|---|---|---|---|")
    for k, v in sorted(by_cmd.items(), key=lambda kv: -sum(kv[1])):
        v.sort()
        print(f"| {k} | {len(v)} | {sum(v) / 1e3:.2f} | {v[len(v) // 2]:.1f} | {v[-1]:.1f} | "
              f"{frames_in.get(k, 0) / 1e6:.1f} |")
    if prof:
        print()
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)


def frame_counts(path: Path) -> dict[str, list[int]]:
    """Request frames in the captured client->server stream: command -> payload sizes."""
    cap = pickle.loads(path.read_bytes())
    stream = b"".join(d for t, d in cap["chunks"] if t == "c")
    out: dict[str, list[int]] = {}
    pos = 0
    while pos + 9 <= len(stream):
        cmd, n = struct.unpack_from("<BQ", stream, pos)
        out.setdefault(COMMAND_NAMES[cmd], []).append(n)
        pos += 9 + n
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", choices=["tiny", "bench", "load400"])
    ap.add_argument("-n", type=int, default=32, help="tokens to generate in the captured session")
    ap.add_argument("--profile", action="store_true", help="cProfile the replay")
    a = ap.parse_args(argv)
    path = capture(a.model, a.n)
    counts = frame_counts(path)
    print("request frames: " + ", ".join(f"{k} {len(v)}" for k, v in sorted(counts.items(), key=lambda kv: -len(kv[1]))))
    if "GRAPH_COMPUTE" in counts:
        g = counts["GRAPH_COMPUTE"]
        print(f"GRAPH_COMPUTE payloads {min(g)}-{max(g)} bytes (~{max(g) // 296} serialized tensors)")
    replay(path, a.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
