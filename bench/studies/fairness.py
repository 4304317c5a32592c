#!/usr/bin/env python3
"""Another tenant's latency while one session floods serve (issue 21, loop fairness).

Starts the real ``ggml-rpc-server`` and ``rpcguard serve`` in front of it (``--python PY`` picks
the interpreter, and so the tree, that runs serve: ``/work/main/.venv/bin/python`` for main), then
measures, first on a quiet node and then while one mTLS session floods it: another client's TLS
handshake with serve, and a GET /healthz on serve's metrics endpoint. ``--flood frames``
pipelines GET_ALIGNMENT as fast as it can (and reads the answers); ``--flood graphs`` sends
12,000-node graphs that cost ~0.35 s of validation CPU each, renamed so none is cached;
``--flood handshakes`` opens and drops TLS handshakes without a certificate from four threads
(tests/support/floods.py). Prints the medians and p90s and their ratio to the quiet baseline of
the same run, and one JSON line (``--json``).

    .venv/bin/python bench/studies/fairness.py [--flood frames|graphs|handshakes] [--seconds 6] [--python PY]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.support import realpeer  # noqa: E402
from tests.support.floods import FrameFlood, GraphFlood, HandshakeFlood  # noqa: E402
from tests.support.guard import Pki  # noqa: E402
from tests.support.rawclient import mtls_context  # noqa: E402

FLOODS = {"frames": FrameFlood, "graphs": GraphFlood, "handshakes": HandshakeFlood}

def anonymous_context(pki: Pki) -> ssl.SSLContext:
    """Trusts the node's CA, presents no certificate."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(pki.path("ca"))
    return ctx


def handshake_s(pki: Pki, port: int) -> float:
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as raw:
        with mtls_context(pki).wrap_socket(raw, server_hostname=pki.node):
            return time.perf_counter() - t0


def healthz_s(mport: int) -> float:
    t0 = time.perf_counter()
    with urllib.request.urlopen(f"http://127.0.0.1:{mport}/healthz", timeout=30) as rsp:
        rsp.read()
    return time.perf_counter() - t0


def sample(pki: Pki, port: int, mport: int, seconds: float) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"handshake": [], "healthz": []}
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        out["handshake"].append(handshake_s(pki, port))
        out["healthz"].append(healthz_s(mport))
        time.sleep(0.1)
    return out


def stats(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"n": len(xs), "p50_ms": round(statistics.median(xs) * 1e3, 2),
            "p90_ms": round(xs[int(0.9 * (len(xs) - 1))] * 1e3, 2), "max_ms": round(xs[-1] * 1e3, 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=6.0, help="sampling time, quiet and under the flood")
    ap.add_argument("--python", default=sys.executable, help="the interpreter that runs rpcguard serve")
    ap.add_argument("--flood", choices=sorted(FLOODS), default="frames")
    ap.add_argument("--tree", help="run serve from this source tree (PYTHONPATH), e.g. a bench/baseline.py "
                                   "tree in ~/.cache/rpcguard-bench/trees/COMMIT")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="fairness-"))
    pki = Pki(work / "pki")
    server, up = realpeer.start_rpc_server(work)
    port, mport = realpeer.free_port(), realpeer.free_port()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if a.tree:
        env["PYTHONPATH"] = a.tree
    log = open(work / "serve.log", "wb")
    serve = subprocess.Popen([a.python, "-m", "rpcguard", "serve", "--listen", f"127.0.0.1:{port}", "--metrics",
                              f"127.0.0.1:{mport}", "--upstream", f"127.0.0.1:{up}", *pki.serve_args(),
                              "--allow-all"], stdout=log, stderr=subprocess.STDOUT, cwd=work, env=env)
    flood = None
    try:
        realpeer.wait_port(port, proc=serve)
        realpeer.wait_port(mport, proc=serve)
        quiet = sample(pki, port, mport, a.seconds)
        ctx = anonymous_context(pki) if a.flood == "handshakes" else mtls_context(pki)
        flood = FLOODS[a.flood](lambda: ctx.wrap_socket(
            socket.create_connection(("127.0.0.1", port)), server_hostname=pki.node))
        flood.start()
        time.sleep(1.0)  # the flood is in full swing
        busy = sample(pki, port, mport, a.seconds)
        flood.stop = True
        result: dict[str, object] = {"python": a.python, "tree": a.tree or str(ROOT), "flood": a.flood,
                                     "flood_answered_per_s": round(flood.answered / (a.seconds + 1), 1)}
        for what in ("handshake", "healthz"):
            q, b = stats(quiet[what]), stats(busy[what])
            result[what] = {"quiet": q, "flood": b, "ratio_p50": round(b["p50_ms"] / q["p50_ms"], 1),
                            "ratio_p90": round(b["p90_ms"] / q["p90_ms"], 1)}
            print(f"{what:9s} quiet p50 {q['p50_ms']:7.2f} ms p90 {q['p90_ms']:7.2f} ms | flood p50 "
                  f"{b['p50_ms']:7.2f} ms p90 {b['p90_ms']:7.2f} ms max {b['max_ms']:7.1f} ms | ratio p50 "
                  f"{result[what]['ratio_p50']}x p90 {result[what]['ratio_p90']}x")  # type: ignore[index]
        unit = {"frames": "GET_ALIGNMENT", "graphs": "graphs", "handshakes": "handshakes"}[a.flood]
        print(f"flood answered {result['flood_answered_per_s']} {unit}/s")
        if a.json:
            print(json.dumps(result))
    finally:
        if flood is not None:
            flood.close()
        serve.terminate()
        serve.wait(10)
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
