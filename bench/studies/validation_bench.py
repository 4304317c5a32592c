#!/usr/bin/env python3
"""What the frame firewall costs, measured on REAL llama.cpp traffic (issue 3).

Usage (from the repository root, with the real peers built by tests/realpeer/setup.sh):

    .venv/bin/python bench/studies/validation_bench.py [--n-tokens 64] [--reps 7] [--e2e-reps 7] [--json FILE]
    .venv/bin/python bench/studies/validation_bench.py --model-args "--preset bench --n-layer 16" --e2e-reps 0
    .venv/bin/python bench/studies/validation_bench.py --peer-version 2.0.0 --e2e-reps 0

How this works:

1. **Capture.** A real ``ggml-rpc-server`` runs on loopback with a tiny TCP relay in front of it
   (``CaptureRelay``, in this process) that forwards and records every chunk of every
   connection, in arrival order and with its direction. The real llama.cpp client
   (``tests/realpeer/rpc_client_smoke.py``) loads the ~105 MB f16 ``bench`` model through the
   relay and generates ``--n-tokens`` greedy tokens. The longest connection is the model session.
2. **Direct baseline, same run.** The same client runs ``--reps`` times directly against the
   server; its "tok/s after the first" gives the direct time per generated token. The fastest
   run is the baseline (least disturbed by other load, and the smallest denominator: the
   percentages are upper bounds).
3. **Offline replay.** The recorded model session is fed, chunk by chunk and in the recorded
   order, into ``rpcguard.protocol.session.Session`` (what ``connect`` and ``serve`` each run per
   connection), once with the default policy (enforce, every check on) and once with every
   firewall check switched off (``FirewallPolicy.disabled_checks`` = all: framing, session rules
   and counters only). The difference is the firewall's own cost. Time spent after the first
   GRAPH_COMPUTE (prompt processing + generation) divided by the generated tokens is the added
   time per token, shown against the direct time per token.
4. **GRAPH_COMPUTE throughput.** Recorded GRAPH_COMPUTE frames (the first of each size, up to
   four, and the last) are re-validated in a
   session replayed up to the byte where that frame starts (so its buffers and bases are
   known): *warm* (the per-session cache of already validated tensors holds the weights, as
   from the second graph of a session on) and *cold* (cache emptied before every frame, the
   worst case), plus the framing-only baseline. Frames per second and µs per frame.
   Clients since 3.6.1 send GRAPH_COMPUTE only when the graph changes and GRAPH_RECOMPUTE (4
   bytes) for the other tokens; 2.0.0 sends a GRAPH_COMPUTE per token (warm: the weights'
   tensors are cached). The "one cold GRAPH_COMPUTE per token" line is a worst-case bound.
   ``--peer-version V`` captures a matrix build's client and server (tests/realpeer/matrix.sh).
5. **End to end** (``--e2e-reps``, 0 = off). The real client through ``rpcguard connect`` ->
   ``rpcguard serve`` with every check on, and with every check off (``policy.checks``), in
   alternation with direct runs: time per token as llama.cpp sees it (TLS and relay included).

Offline figures are the CPU time of the replaying thread (``time.thread_time_ns``): on a busy
machine a preemption would otherwise add a whole scheduler slice (~4 ms) to a 2 ms replay.
This is a benchmark, not a test: it never fails on a slow figure, it prints them. The target of
issue 3 is < 5 % added time per generated token.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

if "--pure-core" in sys.argv:  # the .py sources even where the compiled core is installed
    from tests.support.corereplay import _SourceFirst  # noqa: E402

    sys.meta_path.insert(0, _SourceFirst())
from rpcguard.protocol import core_description  # noqa: E402
from rpcguard.protocol.firewall import CHECK_NAMES, FirewallPolicy  # noqa: E402
from rpcguard.protocol.session import Session, SessionPolicy  # noqa: E402
from rpcguard.protocol.state import UpstreamFacts  # noqa: E402
from rpcguard.protocol.versions import COMMAND_IDS, COMMAND_NAMES, spec_for  # noqa: E402
from tests.support import realpeer  # noqa: E402
from tests.support.capture import C2S, S2C, CaptureRelay  # noqa: E402  (the relay the op survey and the fuzzer use)

CACHE = Path(os.environ.get("RPCGUARD_BENCH_CACHE") or Path.home() / ".cache" / "rpcguard-bench")
GRAPH_COMPUTE = COMMAND_IDS["GRAPH_COMPUTE"]
# The replay feeds recorded server answers: the session must not inject frames of its own
# (BUFFER_CLEAR after ALLOC_BUFFER is answered before 6.0.0, and the recording has no answer).
FULL = SessionPolicy(clear_new_buffers=False)
FRAMING_ONLY = SessionPolicy(firewall=FirewallPolicy(disabled_checks=frozenset(CHECK_NAMES)), clear_new_buffers=False)


# ------------------------------------------------------------------------------ replay
def c2s_frames(chunks: list[tuple[int, bytes]]) -> list[tuple[int, int, int]]:
    """(offset in the client->server stream, command, payload length) of every request frame."""
    stream = b"".join(d for direction, d in chunks if direction == C2S)
    out, pos = [], 0
    while pos + 9 <= len(stream):
        cmd, n = stream[pos], int.from_bytes(stream[pos + 1 : pos + 9], "little")
        out.append((pos, cmd, n))
        pos += 9 + n
    return out


def recorded_version(chunks) -> tuple[int, int, int]:
    """The protocol version of the server's HELLO reply (the first server->client bytes)."""
    first = b""
    for direction, d in chunks:
        if direction == S2C:
            first += d
            if len(first) >= 11:
                break
    return (first[8], first[9], first[10])


def new_session(policy: SessionPolicy, version: tuple[int, int, int], devices: int) -> Session:
    # The upstream's version, device count and memory are known from earlier connections (as in
    # the proxy, UpstreamFacts outlive sessions): so the session does not inject a DEVICE_COUNT or
    # GET_DEVICE_MEMORY whose answer the recording does not hold.
    memory = {d: (1 << 62, 1 << 62) for d in range(devices)}
    return Session(policy, UpstreamFacts(version=version, device_count=devices, memory=memory))


def split_at(chunks, c2s_offset: int) -> tuple[list, list]:
    """The recorded chunks before and from ``c2s_offset`` of the client->server stream (the
    chunk holding that byte is cut in two)."""
    pos = 0
    for i, (direction, data) in enumerate(chunks):
        if direction == C2S:
            if pos + len(data) > c2s_offset:
                cut = c2s_offset - pos
                head = chunks[:i] + ([(C2S, data[:cut])] if cut else [])
                return head, [(C2S, data[cut:])] + chunks[i + 1 :]
            pos += len(data)
    return list(chunks), []


def _feed(s: Session, chunks) -> None:
    to_server, to_client = s.to_server, s.to_client
    client, server = s.client_data, s.server_data
    for direction, data in chunks:
        (client if direction == C2S else server)(memoryview(data))
        to_server.clear()
        to_client.clear()


def replay(chunks, policy: SessionPolicy, devices: int, *, stop_at: int | None = None,
           split: int | None = None) -> tuple[Session, int, int]:
    """Feed the recorded chunks into a fresh Session, in two timed blocks cut at the
    client->server offset ``split`` (the first GRAPH_COMPUTE: model load, then prompt +
    generation). Returns (session, CPU ns of the first block, of the second). With
    ``stop_at``, only the chunks before that client->server offset are fed (untimed)."""
    s = new_session(policy, recorded_version(chunks), devices)
    if stop_at is not None:
        _feed(s, split_at(chunks, stop_at)[0])
        return s, 0, 0
    first, second = split_at(chunks, split if split is not None else 1 << 62)
    clock = time.thread_time_ns  # CPU time of this thread: preemption by other load is not counted
    t0 = clock()
    _feed(s, first)
    t1 = clock()
    _feed(s, second)
    t2 = clock()
    return s, t1 - t0, t2 - t1


def graph_rates(chunks, frames, devices: int, min_s: float) -> list[dict]:
    """Validation rate of every recorded GRAPH_COMPUTE frame: warm, cold and framing only."""
    stream = b"".join(d for direction, d in chunks if direction == C2S)
    graphs = [(off, n) for off, cmd, n in frames if cmd == GRAPH_COMPUTE]
    # Clients before 3.6.1 send a GRAPH_COMPUTE per token: measure the first of each distinct size
    # (prompt, decode, ...), at most four, and always the last one (a decode graph).
    picked, sizes = [], set()
    for off, n in graphs:
        if n not in sizes and len(picked) < 4:
            sizes.add(n)
            picked.append((off, n))
    if graphs and graphs[-1] not in picked:
        picked.append(graphs[-1])
    out = []
    for off, n in picked:
        raw = memoryview(stream[off : off + 9 + n])
        at = 9 + spec_for(recorded_version(chunks)).graph_header  # after [u32 device] u32 n_nodes
        row = {"offset": off, "bytes": 9 + n, "n_nodes": int.from_bytes(raw[at - 4 : at], "little")}
        at += 8 * row["n_nodes"]
        row["n_tensors"] = int.from_bytes(raw[at : at + 4], "little")
        for name, policy, cold in (("warm", FULL, False), ("cold", FULL, True), ("framing", FRAMING_ONLY, False)):
            s, _, _ = replay(chunks, policy, devices, stop_at=off)
            st = s.state
            s.client_data(raw)  # first pass fills the cache (and proves the frame valid here)
            s.to_server.clear()
            times = []
            t_end = time.thread_time() + min_s
            while time.thread_time() < t_end or len(times) < 20:
                if cold:  # every graph verdict cache: tensors, layouts, nodes
                    st.tensor_cache.clear()
                    st.layout_cache.clear()
                    st.node_cache.clear()
                t0 = time.thread_time_ns()
                s.client_data(raw)
                times.append(time.thread_time_ns() - t0)
                s.to_server.clear()
            med = statistics.median(times)
            row[name + "_us"] = med / 1e3
            row[name + "_per_s"] = 1e9 / med
        out.append(row)
    return out


# ------------------------------------------------------------------------------ real runs
PEER_VERSION: str | None = None  # --peer-version: a matrix build (tests/realpeer/matrix.sh) instead of the pin


def run(endpoint: str, model: Path, n: int) -> realpeer.ClientRun:
    r = realpeer.run_client(endpoint, model, n=n, timeout=600, version=PEER_VERSION)
    if not r.ok:
        raise SystemExit(f"client run against {endpoint} failed:\n{r.output[-3000:]}")
    return r


def ms_per_token(r: realpeer.ClientRun) -> float:
    return 1000.0 / r.gen_tps if r.gen_tps else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-args", default="--preset bench",
                    help="make_tiny_model.py arguments (default: --preset bench, ~105 MB f16)")
    ap.add_argument("--n-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=7, help="direct runs for the baseline")
    ap.add_argument("--replays", type=int, default=5, help="offline replays per policy")
    ap.add_argument("--e2e-reps", type=int, default=7, help="end-to-end runs per arm or variant (0 = skip)")
    ap.add_argument("--min-s", type=float, default=0.5, help="seconds per GRAPH_COMPUTE rate measurement")
    ap.add_argument("--peer-version", help="real client and server of this protocol version (a matrix build, "
                                           "e.g. 5.0.0) instead of the default pin")
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument("--pure-core", action="store_true",
                    help="replay with the pure-Python protocol core even where the compiled one is installed")
    a = ap.parse_args()
    print(f"rpcguard {core_description()}", flush=True)
    global PEER_VERSION
    PEER_VERSION = a.peer_version

    CACHE.mkdir(parents=True, exist_ok=True)
    margs = a.model_args.split()
    model = realpeer.make_model(CACHE / ("validation-" + "_".join(x.strip("-") for x in margs) + ".gguf"), *margs)
    if a.peer_version and a.e2e_reps:
        ap.error("--peer-version: end to end runs use the default pin; add --e2e-reps 0")
    work = Path(tempfile.mkdtemp(prefix="rpcguard-valbench-"))
    server, port = realpeer.start_rpc_server(work, version=a.peer_version)
    direct_ep = f"127.0.0.1:{port}"
    res: dict = {"peer_version": a.peer_version or "pin", "model": str(model), "model_mb": model.stat().st_size / 1e6, "n_tokens": a.n_tokens,
                 "python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
                 "protocol_core": core_description()}
    try:
        # 1. capture
        relay = CaptureRelay(port)
        cap = run(f"127.0.0.1:{relay.port}", model, a.n_tokens)
        time.sleep(0.3)
        relay.close()
        sess = max(relay.conns, key=lambda c: c.c2s)
        frames = c2s_frames(sess.chunks)
        counts: dict[str, int] = {}
        for _, cmd, _ in frames:
            counts[COMMAND_NAMES[cmd]] = counts.get(COMMAND_NAMES[cmd], 0) + 1
        res["capture"] = {"connections": len(relay.conns), "session_c2s_bytes": sess.c2s,
                          "session_s2c_bytes": sess.s2c, "session_chunks": len(sess.chunks), "requests": counts}
        devices = 1

        # 2. direct baseline (same run)
        direct = [run(direct_ep, model, a.n_tokens) for _ in range(a.reps)]
        assert all(r.tokens == cap.tokens for r in direct), "direct tokens differ from the captured run"
        # The fastest direct run is the baseline: the least disturbed by other load on the
        # machine, and the smallest denominator, so the percentages below are upper bounds.
        d_ms = min(ms_per_token(r) for r in direct)
        res["direct_ms_per_token"] = d_ms
        res["direct_ms_per_token_median"] = statistics.median(ms_per_token(r) for r in direct)
        res["direct_ms_per_token_all"] = [ms_per_token(r) for r in direct]

        # 3. offline replay of the whole session
        rep = {}
        for name, policy in (("full", FULL), ("framing", FRAMING_ONLY)):
            loads, infers = [], []
            first_graph = next(off for off, cmd, _ in frames if cmd == GRAPH_COMPUTE)
            for _ in range(a.replays):
                s, t_load, t_infer = replay(sess.chunks, policy, devices, split=first_graph)
                assert s.stats.req_frames[GRAPH_COMPUTE] == counts.get("GRAPH_COMPUTE", 0)
                loads.append(t_load)
                infers.append(t_infer)
            rep[name] = {"load_ms": min(loads) / 1e6, "inference_ms": min(infers) / 1e6}
        fw_infer_ms = max(0.0, rep["full"]["inference_ms"] - rep["framing"]["inference_ms"])
        rep["firewall_inference_ms"] = fw_infer_ms
        rep["firewall_load_ms"] = rep["full"]["load_ms"] - rep["framing"]["load_ms"]
        rep["session_ms_per_token"] = rep["full"]["inference_ms"] / a.n_tokens
        rep["firewall_ms_per_token"] = fw_infer_ms / a.n_tokens
        rep["session_pct_of_direct_token"] = 100 * rep["session_ms_per_token"] / d_ms
        rep["firewall_pct_of_direct_token"] = 100 * rep["firewall_ms_per_token"] / d_ms
        res["replay"] = rep

        # 4. GRAPH_COMPUTE validation rates
        graphs = graph_rates(sess.chunks, frames, devices, a.min_s)
        res["graphs"] = graphs
        decode = graphs[-1]  # the last graph is a single-token decode graph
        res["cold_graph_per_token_pct"] = 100 * (decode["cold_us"] / 1e3) / d_ms
        res["warm_graph_per_token_pct"] = 100 * (decode["warm_us"] / 1e3) / d_ms

        # 5. end to end through the real proxies
        if a.e2e_reps:
            res["e2e"] = e2e(work, model, a.n_tokens, a.e2e_reps, direct_ep, cap.tokens)
    finally:
        server.stop()

    report(res)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))
    return 0


def e2e(work: Path, model: Path, n: int, reps: int, direct_ep: str, tokens: list[int]) -> dict:
    from tests.support.guard import Pki, start_guard

    pki = Pki(work / "pki")
    off = work / "checks-off.yaml"
    off.write_text("policy:\n  checks:\n" + "".join(f"    {c}: false\n" for c in CHECK_NAMES))
    guards = []
    variants = {}
    try:
        for name, extra in (("rpcguard", []), ("rpcguard_checks_off", ["--config", str(off)])):
            serve = start_guard("serve", work, ["--upstream", direct_ep, *pki.serve_args(), *extra])
            connect = start_guard("connect", work, ["--server", serve.endpoint, "--server-name", pki.node,
                                                    *pki.connect_args(), *extra])
            guards += [serve, connect]
            variants[name] = (connect.endpoint, serve, connect)
        endpoints = {"direct": direct_ep, **{k: v[0] for k, v in variants.items()}}
        got: dict[str, list[float]] = {k: [] for k in endpoints}
        sys.path.insert(0, str(ROOT / "bench"))
        from runner import orders  # bench/runner.py: reversed every other repetition

        for order in orders(list(endpoints), reps):
            for name in order:
                r = run(endpoints[name], model, n)
                if r.tokens != tokens:
                    raise SystemExit(f"{name}: tokens differ from direct")
                got[name].append(ms_per_token(r))
        for name, (_, serve, connect) in variants.items():
            for g in (serve, connect):
                if g.value("rpcguard_refusals_total"):
                    raise SystemExit(f"{name}: {g.role} refused something:\n{g.output()[-2000:]}")
        med = {k: statistics.median(v) for k, v in got.items()}
        best = {k: min(v) for k, v in got.items()}
        return {"ms_per_token": med, "best_ms_per_token": best, "all": got,
                "rpcguard_vs_direct": med["rpcguard"] / med["direct"],
                "checks_on_vs_off": med["rpcguard"] / med["rpcguard_checks_off"],
                "best_rpcguard_vs_direct": best["rpcguard"] / best["direct"],
                "best_checks_on_vs_off": best["rpcguard"] / best["rpcguard_checks_off"]}
    finally:
        for g in guards:
            g.stop()


def report(r: dict) -> None:
    p = print
    cap = r["capture"]
    p(f"peer {r['peer_version']}; model {r['model']} ({r['model_mb']:.0f} MB), {r['n_tokens']} generated tokens, "
      f"Python {r['python']}, {r['cpus']} CPUs")
    p(f"captured: {cap['connections']} connections; model session {cap['session_c2s_bytes'] / 1e6:.1f} MB "
      f"client->server in {cap['session_chunks']} chunks; requests {cap['requests']}")
    d = r["direct_ms_per_token"]
    p(f"direct (same run): {d:.3f} ms per generated token (fastest of "
      f"{', '.join(f'{x:.3f}' for x in r['direct_ms_per_token_all'])}; median "
      f"{r['direct_ms_per_token_median']:.3f}); percentages below are of the fastest")
    rep = r["replay"]
    p("\noffline replay of the model session through rpcguard.protocol.session.Session (best of N):")
    p(f"  {'':28s} {'load':>10s} {'prompt+generation':>18s}")
    for name in ("full", "framing"):
        label = "enforce, every check on" if name == "full" else "framing only (checks off)"
        p(f"  {label:28s} {rep[name]['load_ms']:8.2f} ms {rep[name]['inference_ms']:15.2f} ms")
    p(f"  firewall (difference)        {rep['firewall_load_ms']:8.2f} ms {rep['firewall_inference_ms']:15.2f} ms")
    p(f"  per generated token: session {rep['session_ms_per_token'] * 1000:.1f} µs "
      f"= {rep['session_pct_of_direct_token']:.2f} % of a direct token; firewall alone "
      f"{rep['firewall_ms_per_token'] * 1000:.1f} µs = {rep['firewall_pct_of_direct_token']:.2f} %  (target < 5 %)")
    p("\nGRAPH_COMPUTE validation (Session.client_data on the recorded frame, median):")
    p(f"  {'nodes':>6s} {'tensors':>8s} {'bytes':>9s} | {'warm µs':>8s} {'frames/s':>9s} | "
      f"{'cold µs':>8s} {'frames/s':>9s} | {'framing µs':>10s}  cold/framing")
    for g in r["graphs"]:
        p(f"  {g['n_nodes']:6d} {g['n_tensors']:8d} {g['bytes']:9d} | {g['warm_us']:8.1f} {g['warm_per_s']:9.0f} | "
          f"{g['cold_us']:8.1f} {g['cold_per_s']:9.0f} | {g['framing_us']:10.1f}  {g['cold_us'] / g['framing_us']:.1f}x")
    p(f"  one decode GRAPH_COMPUTE per token would add: warm {r['warm_graph_per_token_pct']:.2f} %, "
      f"cold {r['cold_graph_per_token_pct']:.2f} % of a direct token")
    if cap["requests"].get("GRAPH_RECOMPUTE"):
        p("  (a bound: this client sent GRAPH_RECOMPUTE, not a new graph, for the tokens whose graph was unchanged)")
    else:
        p("  (this client sends a GRAPH_COMPUTE for every token: the warm figure applies, see the replay above)")
    if "e2e" in r:
        e = r["e2e"]
        p("\nend to end, real client through TLS + relay (ms per generated token; direct and two variants of "
          "the rpcguard arm, alternated):")
        for k, v in e["ms_per_token"].items():
            p(f"  {k:22s} median {v:7.3f}  best {e['best_ms_per_token'][k]:7.3f}  "
              f"({', '.join(f'{x:.2f}' for x in e['all'][k])})")
        p(f"  median: rpcguard / direct = {e['rpcguard_vs_direct']:.3f}, checks on / off = {e['checks_on_vs_off']:.3f};"
          f" best: rpcguard / direct = {e['best_rpcguard_vs_direct']:.3f}, checks on / off = "
          f"{e['best_checks_on_vs_off']:.3f}")


if __name__ == "__main__":
    sys.exit(main())
