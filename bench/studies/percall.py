#!/usr/bin/env python3
"""CPU per call of rpcguard's data path, without I/O, for several source trees side by side.

Usage (from the repository root, real peers built by tests/realpeer/setup.sh):

    .venv/bin/python bench/studies/percall.py capture /tmp/tiny128.pkl [--tokens 128]
    .venv/bin/python bench/studies/percall.py compare /tmp/tiny128.pkl --trees TREE,TREE[,...] [--rounds 6] [--json F]

How this works: ``capture`` runs the real llama.cpp client with the tiny model (the ``gentiny``
workload's) through a recording relay (tests/support/capture.py) to the real server and pickles
the session's chunks, each direction in arrival order. ``compare`` runs, for every tree in turn
(``--rounds`` times, so that drift on the machine hits every tree alike), a fresh interpreter
with ``cwd`` and ``PYTHONPATH`` at that tree (a tree from ``bench/run.py --baseline REV`` lives
in ``~/.cache/rpcguard-bench/trees/<commit>``, compiled core built), which measures with the
thread's CPU clock:

* ``session``: the chunks fed to ``Session.client_data`` / ``server_data``; per generated token,
  over the decode steps after the last GRAPH_COMPUTE (``steady``) and over the whole generation
  (``gen``: from the first GRAPH_COMPUTE, both graphs included); ``full`` checks (serve) and
  ``node`` (connect, request checks left to an enforcing node).
* ``link``: the same chunks through ``Endpoint.get_buffer`` / ``buffer_updated`` ->
  ``Link.data`` -> the Session, transports that do nothing: the relay's per-read glue on top.
* ``linkcall``: ns per ``buffer_updated`` -> ``Link.data`` with a stub session returning one
  urgent frame (``client``) or one answer (``server``): the relay glue alone.
* ``graph``: one recorded GRAPH_COMPUTE re-validated cold (every verdict cache emptied) and warm.

Each figure is the minimum over the repetitions inside one process; the table gives, per tree,
the median over rounds of those minima (and their range). Never collected by pytest.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

C2S, S2C = 0, 1  # tests/support/capture.py
ROOT = Path(__file__).resolve().parents[2]
GRAPH_COMPUTE, GET_TENSOR = 10, 8  # command ids, checked against versions.COMMAND_IDS in _measure


# ------------------------------------------------------------------------------ capture
def capture(out: Path, tokens: int) -> None:
    sys.path.insert(0, str(ROOT))
    from tests.support import realpeer
    from tests.support.capture import CaptureRelay

    work = Path(tempfile.mkdtemp(prefix="rpcguard-percall-"))
    server, port = realpeer.start_rpc_server(work)
    try:
        relay = CaptureRelay(port)
        run = realpeer.run_client(relay.endpoint, realpeer.make_model(work / "tiny.gguf"), n=tokens, timeout=300)
        time.sleep(0.3)
        relay.close()
        if not run.ok:
            raise SystemExit(run.output[-2000:])
        sess = max(relay.conns, key=lambda c: c.c2s)
        out.write_bytes(pickle.dumps({"chunks": sess.chunks, "tokens": run.tokens, "n": tokens}))
        print(f"{out}: {len(sess.chunks)} chunks, {sess.c2s} bytes client->server, {sess.s2c} back")
    finally:
        server.stop()


# ------------------------------------------------------------------------------ measuring (in the tree)
def _frames(stream: bytes) -> list[tuple[int, int, int]]:
    out, pos = [], 0
    while pos + 9 <= len(stream):
        cmd, n = stream[pos], int.from_bytes(stream[pos + 1 : pos + 9], "little")
        out.append((pos, cmd, n))
        pos += 9 + n
    return out


def _chunk_at(chunks: list, c2s_offset: int) -> int:
    """Index of the chunk holding byte ``c2s_offset`` of the client->server stream."""
    pos = 0
    for i, (d, b) in enumerate(chunks):
        if d == C2S:
            if pos + len(b) > c2s_offset:
                return i
            pos += len(b)
    return len(chunks)


def _measure(cap_path: str, reps: int) -> dict:
    import rpcguard
    from rpcguard.protocol.session import Session, SessionPolicy
    from rpcguard.protocol.state import UpstreamFacts
    from rpcguard.protocol.versions import COMMAND_IDS

    try:  # the I/O layer moved to rpcguard/proxy/ after 2026-12-02
        from rpcguard.proxy.endpoint import Endpoint
        from rpcguard.proxy.link import Link
    except ImportError:
        from rpcguard.endpoint import Endpoint
        from rpcguard.relay import Link

    assert (COMMAND_IDS["GRAPH_COMPUTE"], COMMAND_IDS["GET_TENSOR"]) == (GRAPH_COMPUTE, GET_TENSOR)
    cap = pickle.loads(Path(cap_path).read_bytes())
    chunks = cap["chunks"]
    reply = b"".join(b for d, b in chunks if d == S2C)[:11]
    version = (reply[8], reply[9], reply[10])
    stream = b"".join(b for d, b in chunks if d == C2S)
    frames = _frames(stream)
    graphs = [(off, n) for off, cmd, n in frames if cmd == GRAPH_COMPUTE]
    gen_from = _chunk_at(chunks, graphs[0][0])
    steady_from = _chunk_at(chunks, graphs[-1][0] + 9 + graphs[-1][1]) + 1
    steady_at = sum(len(b) for d, b in chunks[:steady_from] if d == C2S)
    tokens = {"gen": cap["n"], "steady": sum(1 for off, cmd, _ in frames if cmd == GET_TENSOR and off >= steady_at)}
    clk = time.thread_time_ns

    def session(mode: str) -> Session:
        s = Session(SessionPolicy(clear_new_buffers=False),
                    UpstreamFacts(version=version, device_count=1, memory={0: (1 << 62, 1 << 62)}))
        if mode == "node":
            s.leave_requests_to_node()
        return s

    class Transport:
        def write(self, data: object) -> None: ...
        def writelines(self, data: object) -> None: ...
        def get_write_buffer_size(self) -> int: return 0
        def pause_reading(self) -> None: ...
        def resume_reading(self) -> None: ...

    class Lc:  # the Lifecycle in ACTIVE hands the session's own methods to the link
        state = None  # never VALIDATING: the link feeds at once

        def __init__(self, s) -> None:
            self.client_data, self.server_data, self.out = s.client_data, s.server_data, s.out
            self.rx_bytes, self.actions = 0, []
            # every tree's names for one feed: ``feed(from_client, ...)`` since 8b0959b, the two
            # ``*_bytes`` before it, the session's own methods before the lifecycle had a contract
            self.client_bytes, self.server_bytes = self.client_data, self.server_data

        def feed(self, from_client: bool, view, now_ns: int):
            if from_client:
                self.rx_bytes += len(view)
                return self.client_data(view, now_ns)
            return self.server_data(view, now_ns)

        def session_events(self, out) -> None:
            out.events.clear()

    def link_for(lc) -> tuple:
        link = object.__new__(Link)
        link.lc, link._clock_ns, link._held, link.route, link.id = lc, time.monotonic_ns, bytearray(), None, 1
        link._later, link._gone, link._tasks = [], False, set()  # set in Link.__init__, read on the data path
        link.client, link.upstream = Endpoint(link, True), Endpoint(link, False)
        link.client.transport, link.upstream.transport = Transport(), Transport()
        return link.client, link.upstream

    def replay(mode: str, through_link: bool) -> dict[str, int]:
        s = session(mode)
        if through_link:
            ends = link_for(Lc(s))
        to_server, to_client, feed = s.to_server, s.to_client, (s.client_data, s.server_data)
        spent = {"gen": 0, "steady": 0}
        for i, (d, b) in enumerate(chunks):
            t0 = clk()
            if through_link:
                ep = ends[d]
                ep.get_buffer(len(b))[: len(b)] = b
                ep.buffer_updated(len(b))
            else:
                feed[d](memoryview(b), time.monotonic_ns())
                to_server.clear()
                to_client.clear()
            dt = clk() - t0
            if i >= gen_from:
                spent["gen"] += dt
            if i >= steady_from:
                spent["steady"] += dt
        return spent

    res: dict = {"rpcguard": rpcguard.__file__}
    for what, through in (("session", False), ("link", True)):
        for mode in ("full", "node"):
            runs = [replay(mode, through) for _ in range(reps)]
            for part in ("steady", "gen"):
                res[f"{what}_{mode}_{part}_us_per_token"] = round(min(r[part] for r in runs) / tokens[part] / 1e3, 2)

    # the relay glue alone: a stub session, one frame each way per call
    chunk = b"x" * 300

    class Out:
        def __init__(self) -> None:
            self.to_server: list = []
            self.to_client: list = []
            self.events: list = []
            self.urgent = True

    out = Out()
    stub = type("Stub", (), {})()
    stub.client_data = lambda view, now: (out.to_server.append(chunk), out)[1]
    stub.server_data = lambda view, now: (out.to_client.append(chunk), out)[1]
    stub.rx_bytes, stub.actions, stub.out = 0, [], out
    client, upstream = link_for(Lc(stub))
    for name, ep in (("client", client), ("server", upstream)):
        ep.get_buffer(300)
        best = []
        for _ in range(5):
            t0 = clk()
            for _ in range(100_000):
                ep.buffer_updated(300)
            best.append((clk() - t0) / 100_000)
        res[f"linkcall_{name}_ns"] = round(min(best))

    # graph validation, cold and warm, of the last recorded GRAPH_COMPUTE
    off, n = graphs[-1]
    raw = memoryview(stream[off : off + 9 + n])
    for cold in (True, False):
        s = session("full")
        for d, b in chunks[: _chunk_at(chunks, off)]:
            (s.client_data if d == C2S else s.server_data)(memoryview(b))
            s.to_server.clear()
            s.to_client.clear()
        cut = off - sum(len(b) for d, b in chunks[: _chunk_at(chunks, off)] if d == C2S)
        if cut:
            s.client_data(memoryview(chunks[_chunk_at(chunks, off)][1][:cut]))
        s.client_data(raw)
        s.to_server.clear()
        st, times = s.state, []
        for _ in range(max(20, reps * 5)):
            if cold:
                st.tensor_cache.clear()
                st.layout_cache.clear()
                st.node_cache.clear()
            if hasattr(st, "inflight_flops"):
                st.inflight_flops = 0  # the compute budget of queued graphs (no answer in a replay)
            t0 = clk()
            s.client_data(raw)
            times.append(clk() - t0)
            s.to_server.clear()
        res["graph_cold_us" if cold else "graph_warm_us"] = round(min(times) / 1e3, 1)
    return res


# ------------------------------------------------------------------------------ comparing trees
def compare(cap_path: Path, trees: list[Path], rounds: int, reps: int, json_path: Path | None = None) -> None:
    rows: dict[str, list[dict]] = {str(t): [] for t in trees}
    load0 = os.getloadavg()[0]
    sys.path[:0] = [str(ROOT), str(ROOT / "bench")]  # in this process only, not in the measuring ones
    from runner import orders  # bench/runner.py: reversed every other round

    by_name = {str(t): t for t in trees}
    for order in orders(list(by_name), rounds):
        for tree in (by_name[name] for name in order):
            env = dict(os.environ, PYTHONPATH=str(tree))
            p = subprocess.run([sys.executable, str(Path(__file__).resolve()), "_measure", str(cap_path),
                                "--reps", str(reps)], cwd=tree, env=env, capture_output=True, text=True, timeout=900)
            if p.returncode:
                raise SystemExit(f"{tree}: {p.stderr[-2000:]}")
            got = json.loads(p.stdout.strip().splitlines()[-1])
            if not Path(got["rpcguard"]).resolve().is_relative_to(tree.resolve()):
                raise SystemExit(f"{tree}: rpcguard imported from {got['rpcguard']}")
            rows[str(tree)].append(got)
    keys = [k for k in rows[str(trees[0])][0] if k != "rpcguard"]
    lines = [f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}, load average {os.getloadavg()[0]:.2f} "
             f"(started at {load0:.2f}); {rounds} rounds; median over rounds of the per-process minimum (range)",
             "| figure | " + " | ".join(t.name[:12] for t in trees) + " |", "|---|" + "---:|" * len(trees)]
    for k in keys:
        cells = []
        for t in trees:
            xs = [g[k] for g in rows[str(t)]]
            cells.append(f"{statistics.median(xs):g} ({min(xs):g}-{max(xs):g})")
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    if json_path is not None:
        json_path.write_text(json.dumps({"command": sys.argv, "trees": [str(t) for t in trees], "report": lines,
                                         "runs": {str(t): rows[str(t)] for t in trees}}, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("action", choices=["capture", "compare", "_measure"])
    ap.add_argument("capture_file", type=Path)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--trees", help="comma list of source trees (compare)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--reps", type=int, default=10, help="replays per process")
    ap.add_argument("--json", type=Path, help="compare: also write the table and every process's figures here")
    a = ap.parse_args()
    if a.action == "capture":
        capture(a.capture_file, a.tokens)
    elif a.action == "_measure":
        print(json.dumps(_measure(str(a.capture_file), a.reps)))
    else:
        if not a.trees:
            ap.error("compare needs --trees")
        compare(a.capture_file.resolve(), [Path(t).expanduser().resolve() for t in a.trees.split(",")], a.rounds, a.reps, a.json)


if __name__ == "__main__":
    main()
