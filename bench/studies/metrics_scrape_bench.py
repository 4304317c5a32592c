#!/usr/bin/env python3
"""What a scrape of rpcguard's metrics endpoint costs, plain and behind a web config (issue 11).

Usage (from the repository root):

    .venv/bin/python bench/studies/metrics_scrape_bench.py [--scrapes 200] [--listeners 4] [--bcrypt-cost 10]

How this works: one process runs the real endpoint (``rpcguard.observe.http.start_http``) on
loopback with a ``Metrics`` holding ``--listeners`` serve listeners (every reason, command and
mode exported at 0, as in production), and scrapes it ``--scrapes`` times with a real client:
once over plain HTTP, once over TLS with a client certificate and basic auth (exporter-toolkit
web config, bcrypt hash of cost ``--bcrypt-cost``). It prints the wall time per scrape (median
and p90, client + server, one request per connection like Prometheus without keep-alive), the
CPU time of this process per scrape, the exposition size, and the cost of the first
(uncached) bcrypt check against the cached ones: the cache is what keeps a scrape every 15 s
from costing a bcrypt on the proxy's CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import ssl
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import bcrypt  # noqa: E402
import yaml  # noqa: E402

from rpcguard.pki import certs  # noqa: E402
from rpcguard.observe.metrics import Metrics  # noqa: E402
from rpcguard.observe.http import start_http  # noqa: E402
from rpcguard.observe.webconfig import WebGuard  # noqa: E402

PASSWORD = "bench-password"


async def get(port: int, ctx: ssl.SSLContext | None, auth: str) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx,
                                                   server_hostname="localhost" if ctx else None)
    writer.write(f"GET /metrics HTTP/1.1\r\nHost: x\r\n{auth}\r\n".encode())
    data = await reader.read()
    writer.close()
    assert data.startswith(b"HTTP/1.1 200 "), data[:100]
    return len(data)


async def variant(name: str, metrics: Metrics, guard: WebGuard | None, ctx: ssl.SSLContext | None, auth: str,
              scrapes: int) -> None:
    server = await start_http(metrics, "127.0.0.1", 0, web=(lambda: guard) if guard else None)
    port = server.sockets[0].getsockname()[1]
    try:
        t0, c0 = time.perf_counter(), time.process_time()
        size = await get(port, ctx, auth)  # first scrape: with basic auth, the one bcrypt check
        first_ms = (time.perf_counter() - t0) * 1e3
        first_cpu_ms = (time.process_time() - c0) * 1e3
        walls = []
        c0 = time.process_time()
        for _ in range(scrapes):
            t = time.perf_counter()
            await get(port, ctx, auth)
            walls.append((time.perf_counter() - t) * 1e3)
        cpu_ms = (time.process_time() - c0) * 1e3 / scrapes
        walls.sort()
        print(f"{name:32s} first {first_ms:7.1f} ms (CPU {first_cpu_ms:6.1f} ms)  then median "
              f"{statistics.median(walls):6.2f} ms  p90 {walls[int(0.9 * len(walls))]:6.2f} ms  "
              f"CPU/scrape {cpu_ms:5.2f} ms  response {size / 1024:.0f} KiB")
    finally:
        server.close()
        await server.wait_closed()


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scrapes", type=int, default=200)
    ap.add_argument("--listeners", type=int, default=4)
    ap.add_argument("--bcrypt-cost", type=int, default=10)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        certs.init_ca(d)
        certs.issue(d, "metrics", server=True, dns=["localhost"], ips=["127.0.0.1"])
        certs.issue(d, "prometheus", server=False)
        t = time.perf_counter()
        hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(a.bcrypt_cost)).decode()
        print(f"bcrypt cost {a.bcrypt_cost}: one hash {1e3 * (time.perf_counter() - t):.0f} ms on this machine")
        web = d / "web.yml"
        web.write_text(yaml.safe_dump({
            "tls_server_config": {"cert_file": str(d / "metrics.pem"), "key_file": str(d / "metrics.key"),
                                  "client_ca_file": str(d / "ca.pem"),
                                  "client_auth_type": "RequireAndVerifyClientCert"},
            "basic_auth_users": {"prometheus": hashed}}))
        metrics = Metrics(role="serve")
        for i in range(a.listeners):
            metrics.listener("serve", f"gpu{i}", upstream=f"127.0.0.1:{50052 + i}")
        ctx = ssl.create_default_context(cafile=str(d / "ca.pem"))
        ctx.load_cert_chain(str(d / "prometheus.pem"), str(d / "prometheus.key"))
        auth = "Authorization: Basic " + base64.b64encode(f"prometheus:{PASSWORD}".encode()).decode() + "\r\n"
        print(f"{a.listeners} listeners, {a.scrapes} scrapes per variant, one connection per scrape")
        await variant("plain HTTP", metrics, None, None, "", a.scrapes)
        guard = WebGuard.load(str(web))
        await variant("mTLS + basic auth (cached)", metrics, guard, ctx, auth, a.scrapes)
        assert guard.auth is not None
        print(f"bcrypt checks done for {a.scrapes + 1} authenticated scrapes: {guard.auth.bcrypt_checks}")


if __name__ == "__main__":
    asyncio.run(main())
