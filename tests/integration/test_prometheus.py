"""A REAL Prometheus (the Debian package, see .ci/install-ops-tools.sh) scrapes a running
connect -> serve pair after a REAL llama.cpp session and answers queries over its HTTP API
with the same byte counters rpcguard reports; the deploy alert rules load and evaluate
cleanly against the live series; promtool queries the same server.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tests.support import realpeer

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "rpcguard-rules.yml"


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:  # a missing tool is a failure, like a missing real peer
        pytest.fail(f"{name} not on PATH: run `sudo bash .ci/install-ops-tools.sh`")
    return path


def api(port: int, path: str, **params) -> dict:
    url = f"http://127.0.0.1:{port}{path}" + ("?" + urllib.parse.urlencode(params) if params else "")
    with urllib.request.urlopen(url, timeout=10) as rsp:
        body = json.loads(rsp.read())
    assert body["status"] == "success", body
    return body["data"]


def by_role(result: list[dict]) -> dict[str, float]:
    return {r["metric"]["role"]: float(r["value"][1]) for r in result}


@pytest.fixture
def prometheus(workdir):
    """Start Prometheus scraping the given metrics ports every second; yields a starter."""
    procs: list[realpeer.Proc] = []

    def start(serve_port: int, connect_port: int) -> int:
        binary = tool("prometheus")
        port = realpeer.free_port()
        shutil.copyfile(RULES, workdir / "rpcguard-rules.yml")
        cfg = workdir / "prometheus.yml"
        cfg.write_text(f"""\
global:
  scrape_interval: 1s
  scrape_timeout: 1s
  evaluation_interval: 1s
rule_files:
  - rpcguard-rules.yml
scrape_configs:
  - job_name: rpcguard
    static_configs:
      - targets: ["127.0.0.1:{serve_port}"]
        labels: {{component: node}}
      - targets: ["127.0.0.1:{connect_port}"]
        labels: {{component: client}}
""")
        check = subprocess.run([tool("promtool"), "check", "config", str(cfg)], capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
        proc = realpeer.start([binary, f"--config.file={cfg}", f"--storage.tsdb.path={workdir / 'tsdb'}",
                               f"--web.listen-address=127.0.0.1:{port}"], workdir / "prometheus.log", "prometheus")
        procs.append(proc)
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2) as rsp:
                    if rsp.status == 200:
                        return port
            except OSError:
                pass
            if not proc.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"prometheus did not become ready:\n{proc.output()[-3000:]}")
            time.sleep(0.2)

    yield start
    for p in procs:
        p.stop()


def test_prometheus_scrapes_the_byte_counters_of_a_real_session(pair, models, prometheus):
    connect, serve = pair()
    run = realpeer.run_client(connect.endpoint, models["tiny"], n=8)
    assert run.ok, run.output[-3000:]
    want = {g.role: g.value("rpcguard_bytes_total", command="SET_TENSOR", direction="request")
            for g in (serve, connect)}
    weights = realpeer.gguf_tensor_bytes(models["tiny"])
    assert all(v >= 0.97 * weights for v in want.values()), (want, weights)

    port = prometheus(serve.metrics_port, connect.metrics_port)
    query = 'rpcguard_bytes_total{job="rpcguard",command="SET_TENSOR",direction="request"}'
    deadline = time.monotonic() + 30
    while True:
        got = by_role(api(port, "/api/v1/query", query=query)["result"])
        if got == want or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert got == want, (got, want)

    # both targets up, labelled as configured; the model-load counters came along
    up = api(port, "/api/v1/query", query='up{job="rpcguard"}')["result"]
    assert sorted((r["metric"]["component"], r["value"][1]) for r in up) == [("client", "1"), ("node", "1")]
    uploads = by_role(api(port, "/api/v1/query", query='rpcguard_upload_bytes_total{kind="set_tensor"}')["result"])
    assert uploads["serve"] == serve.value("rpcguard_upload_bytes_total", kind="set_tensor") >= 0.97 * weights
    alloc = by_role(api(port, "/api/v1/query", query="rpcguard_alloc_bytes_total")["result"])
    assert alloc["serve"] == serve.value("rpcguard_alloc_bytes_total") > 0
    expiry = api(port, "/api/v1/query", query='rpcguard_certificate_expiry_timestamp_seconds{certificate="cert"}')
    assert {r["metric"]["role"] for r in expiry["result"]} == {"serve", "connect"}

    # promtool asks the same server the same question
    total = sum(want.values())
    res = subprocess.run([tool("promtool"), "query", "instant", f"http://127.0.0.1:{port}",
                          f"sum({query})"], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"=> {total:.0f} @" in res.stdout or f"=> {total:g} @" in res.stdout, (res.stdout, total)

    # the deploy rules loaded and evaluate without errors against the live series; none fires
    deadline = time.monotonic() + 15
    while True:
        groups = api(port, "/api/v1/rules")["groups"]
        rules = [r for g in groups for r in g["rules"]]
        if rules and all(r.get("lastEvaluation", "").startswith("2") and not r["lastEvaluation"].startswith("0001")
                         for r in rules) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert {g["file"].rsplit("/", 1)[-1] for g in groups} == {"rpcguard-rules.yml"}
    assert len(rules) >= 8 and all(r["health"] == "ok" and not r.get("lastError") for r in rules), rules
    firing = [a for a in api(port, "/api/v1/alerts")["alerts"] if a["state"] == "firing"]
    assert firing == [], firing
