"""What a session start costs when serve runs the server (issue 18), against a server started by hand.

Variants: ``upstream`` (serve --upstream to a ggml-rpc-server someone started: today), ``shared``
(serve -- ggml-rpc-server, isolation: shared), ``session`` (a fresh sandboxed process per session,
with the spare) and ``session-nospare``. Per variant: the wall time of sessions that allocate a
buffer (each needs a fresh process under ``session``), of probe-only sessions (HELLO +
GET_DEVICE_MEMORY, which a kept process serves), and the real llama.cpp client's model load
(7 sessions, 6 of them probes). Prints one JSON line per variant with medians.

    .venv/bin/python bench/studies/session_start.py [--n 20] [--loads 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.integration.test_containment_real import server_binary, write_config  # noqa: E402
from tests.support import realpeer  # noqa: E402
from tests.support.guard import Pki, start_guard  # noqa: E402
from tests.support.rawclient import RawClient, mtls_socket  # noqa: E402

VARIANTS = {
    "upstream": None,
    "shared": "      isolation: shared\n",
    "session": "      isolation: session\n",
    "session-nospare": "      isolation: session\n      spare: false\n",
}


def _median_ms(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1000, 1)


def run_variant(variant: str, work: Path, pki: Pki, model: Path, n: int, loads: int) -> dict:
    server = None
    if VARIANTS[variant] is None:
        server, port = realpeer.start_rpc_server(work)
        args = ["--upstream", f"127.0.0.1:{port}"]
    else:
        args = ["--config", write_config(work, f"{variant}.yaml", f"      exec: [{server_binary()}]\n" + VARIANTS[variant])]
    serve = start_guard("serve", work, [*pki.serve_args(), *args])
    connect = start_guard("connect", work, ["--server", serve.endpoint, "--server-name", pki.node,
                                            *pki.connect_args()])
    try:
        time.sleep(1.0)  # the spare is up
        dirty, probe = [], []
        for _ in range(n):
            t0 = time.monotonic()
            c = RawClient.session(mtls_socket(pki, serve.port))
            c.alloc(4096)
            c.close()
            dirty.append(time.monotonic() - t0)
            time.sleep(0.3)  # a client's think time: lets the spare start again
        for _ in range(n):
            t0 = time.monotonic()
            c = RawClient.session(mtls_socket(pki, serve.port))
            c.call("GET_DEVICE_MEMORY", struct.pack("<I", 0))
            c.close()
            probe.append(time.monotonic() - t0)
        burst = time.monotonic()
        for _ in range(5):  # back to back: the spare cannot keep up
            c = RawClient.session(mtls_socket(pki, serve.port))
            c.alloc(4096)
            c.close()
        burst_s = (time.monotonic() - burst) / 5
        load = []
        for _ in range(loads):
            run = realpeer.run_client(connect.endpoint, model)
            assert run.ok, run.output
            load.append(run.load_s or 0.0)
        starts = serve.value("rpcguard_upstream_start_seconds_total")
        count = serve.value("rpcguard_upstream_starts_total")
        return {"variant": variant, "dirty_session_ms": _median_ms(dirty), "probe_session_ms": _median_ms(probe),
                "back_to_back_dirty_ms": round(burst_s * 1000, 1), "client_load_s": round(statistics.median(load), 3),
                "process_start_ms": round(starts / count * 1000, 1) if count else None, "processes": int(count)}
    finally:
        connect.stop()
        serve.stop()
        if server is not None:
            server.stop()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--loads", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        pki = Pki(work / "pki")
        model = realpeer.make_model(work / "tiny.gguf")
        for variant in a.variants.split(","):
            print(json.dumps(run_variant(variant, work, pki, model, a.n, a.loads)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
