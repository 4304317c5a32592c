#!/usr/bin/env python3
"""What ``policy.clear_new_buffers`` (BUFFER_CLEAR injected after every ALLOC_BUFFER) costs a
model load, measured with the REAL llama.cpp client and server (issue 9).

Usage (from the repository root, with the real peers built by tests/realpeer/setup.sh):

    .venv/bin/python bench/studies/clear_bench.py [--reps 5] [--model-args "--preset bench"]

How this works: one real ``ggml-rpc-server`` and three connect -> serve pairs in front of it,
which differ only in ``clear_new_buffers``: ``off`` (neither side clears), ``serve`` (only
serve clears: what a node needs for tenant isolation) and ``both`` (the default: connect clears
too, so each new buffer is cleared twice). The real client loads the model (every layer
offloaded) and generates 4 tokens through each pair in turn (the order reversed every other
round, bench/runner.py), ``--reps`` rounds, so load and noise are spread over the variants
alike (a variant is one configuration of the rpcguard arm, bench/arms.py); the client's own load time ("load: X s", model file to
weights on the server) is reported per variant as median and min. This is a benchmark: it prints
figures, it never fails on a slow one.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from runner import orders  # noqa: E402  (bench/runner.py)

from tests.support import realpeer  # noqa: E402
from tests.support.guard import Pki, start_guard  # noqa: E402

VARIANTS = {"off": (False, False), "serve": (True, False), "both": (True, True)}  # (serve, connect)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--model-args", default="--preset bench")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="rpcguard-clear-bench-"))
    model = realpeer.make_model(work / "model.gguf", *a.model_args.split())
    pki = Pki(work / "pki")
    server, port = realpeer.start_rpc_server(work)
    guards = []
    endpoints = {}
    try:
        for variant, (on_serve, on_connect) in VARIANTS.items():
            cfgs = {}
            for role, on in (("serve", on_serve), ("connect", on_connect)):
                cfgs[role] = work / f"{variant}-{role}.yaml"
                cfgs[role].write_text(f"policy:\n  clear_new_buffers: {'true' if on else 'false'}\n")
            serve = start_guard("serve", work, ["--upstream", f"127.0.0.1:{port}", *pki.serve_args(),
                                                "--config", str(cfgs["serve"])])
            guards.append(serve)
            connect = start_guard("connect", work, ["--server", serve.endpoint, "--server-name", pki.node,
                                                    *pki.connect_args(), "--config", str(cfgs["connect"])])
            guards.append(connect)
            endpoints[variant] = (connect, serve)
        loads: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
        for rep, order in enumerate(orders(list(endpoints), a.reps)):
            for variant in order:
                connect = endpoints[variant][0]
                run = realpeer.run_client(connect.endpoint, model, n=4)
                if not run.ok or run.load_s is None:
                    print(run.output[-2000:], file=sys.stderr)
                    return 1
                loads[variant].append(run.load_s)
                print(f"rep {rep} {variant:5s} load {run.load_s:.3f} s", flush=True)
        clears = {variant: int(s.value("rpcguard_frames_total", command="BUFFER_CLEAR", direction="request"))
                  for variant, (_, s) in endpoints.items()}
        size_mb = model.stat().st_size / 1e6
        base = statistics.median(loads["off"])
        print(f"\nmodel {size_mb:.1f} MB, {a.reps} alternating rounds; BUFFER_CLEAR frames reaching the server "
              f"per variant: {clears}")
        for variant, xs in loads.items():
            med = statistics.median(xs)
            print(f"{variant:5s} median {med:.3f} s  min {min(xs):.3f} s  ({(med - base) * 1e3:+.0f} ms, "
                  f"{(med / base - 1) * 100:+.1f} % vs off)")
    finally:
        for g in guards:
            g.stop()
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
