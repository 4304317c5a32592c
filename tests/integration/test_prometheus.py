"""A REAL Prometheus (the Debian package, see .ci/install-ops-tools.sh) scrapes a running
connect -> serve pair after a REAL llama.cpp session and answers queries over its HTTP API
with the same byte counters rpcguard reports; the deploy alert rules load and evaluate
cleanly against the live series; promtool queries the same server.

With a web config (exporter-toolkit format) on both instances, Prometheus scrapes them over
mTLS with basic auth, and two more jobs (no client certificate, wrong password) are refused:
up == 0 for them, and the refusal reasons show in rpcguard's own metric (scraped by the good
job) and log.
"""

from __future__ import annotations

import base64
import json
import shutil
import signal
import ssl
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import bcrypt
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

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

    def start(serve_port: int, connect_port: int, scrape_configs: list[dict] | None = None) -> int:
        binary = tool("prometheus")
        shutil.copyfile(RULES, workdir / "rpcguard-rules.yml")
        cfg = workdir / "prometheus.yml"
        default = [{"job_name": "rpcguard", "static_configs": [
            {"targets": [f"127.0.0.1:{serve_port}"], "labels": {"component": "node"}},
            {"targets": [f"127.0.0.1:{connect_port}"], "labels": {"component": "client"}}]}]
        cfg.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": ["rpcguard-rules.yml"],
            "scrape_configs": scrape_configs or default}, sort_keys=False))
        check = subprocess.run([tool("promtool"), "check", "config", str(cfg)], capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
        proc = realpeer.start([binary, f"--config.file={cfg}", f"--storage.tsdb.path={workdir / 'tsdb'}",
                               "--web.listen-address=127.0.0.1:0"], workdir / "prometheus.log", "prometheus")
        procs.append(proc)
        port = realpeer.wait_bound(proc.popen)  # its web port, the only one it listens on
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
    assert len(rules) >= 10 and all(r["health"] == "ok" and not r.get("lastError") for r in rules), rules
    firing = [a for a in api(port, "/api/v1/alerts")["alerts"] if a["state"] == "firing"]
    assert firing == [], firing


# ----------------------------------------------------------------------------- mTLS + basic auth

PASSWORD = "scrape-me-please"


def scrape(port: int, pki, user: str = "prometheus", password: str = PASSWORD) -> dict[tuple, float]:
    """Read an instance's /metrics the way Prometheus does (mTLS + basic auth): {(name, labels): value}."""
    ctx = ssl.create_default_context(cafile=pki.path("ca"))
    ctx.load_cert_chain(pki.path("prometheus"), pki.path("prometheus", "key"))
    req = urllib.request.Request(f"https://127.0.0.1:{port}/metrics", headers={
        "Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()})
    with urllib.request.urlopen(req, timeout=10, context=ctx) as rsp:
        text = rsp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def pick(samples: dict[tuple, float], name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and all(dict(ls).get(k) == x for k, x in labels.items()))


def test_prometheus_scrapes_two_instances_over_mtls_with_basic_auth(pair, pki, models, workdir, prometheus):
    pki.issue("metrics", server=True, dns=["localhost"], ips=["127.0.0.1"])
    pki.issue("prometheus", server=False, uris=["spiffe://lab/prometheus"])
    web = workdir / "web.yml"
    web.write_text(yaml.safe_dump({
        "tls_server_config": {"cert_file": pki.path("metrics"), "key_file": pki.path("metrics", "key"),
                              "client_ca_file": pki.path("ca"), "client_auth_type": "RequireAndVerifyClientCert"},
        "basic_auth_users": {"prometheus": bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(10)).decode()},
        "http_server_config": {"headers": {"X-Content-Type-Options": "nosniff"}}}))
    connect, serve = pair(serve_args=["--web-config", str(web)], connect_args=["--web-config", str(web)])
    run = realpeer.run_client(connect.endpoint, models["tiny"], n=8)
    assert run.ok, run.output[-3000:]
    want = {g.role: pick(scrape(g.metrics_port, pki), "rpcguard_bytes_total", command="SET_TENSOR",
                         direction="request") for g in (serve, connect)}
    assert all(v > 0 for v in want.values()), want
    # the endpoint refuses plain HTTP outright (TLS only)
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{serve.metrics_port}/metrics", timeout=5).read()

    tls = {"ca_file": pki.path("ca"), "cert_file": pki.path("prometheus"), "key_file": pki.path("prometheus", "key")}
    targets = [{"targets": [f"127.0.0.1:{serve.metrics_port}"], "labels": {"component": "node"}},
               {"targets": [f"127.0.0.1:{connect.metrics_port}"], "labels": {"component": "client"}}]
    port = prometheus(serve.metrics_port, connect.metrics_port, [
        {"job_name": "rpcguard", "scheme": "https", "tls_config": tls, "static_configs": targets,
         "basic_auth": {"username": "prometheus", "password": PASSWORD}},
        {"job_name": "no-client-cert", "scheme": "https", "tls_config": {"ca_file": pki.path("ca")},
         "basic_auth": {"username": "prometheus", "password": PASSWORD},
         "static_configs": [{"targets": [f"127.0.0.1:{serve.metrics_port}"]}]},
        {"job_name": "wrong-password", "scheme": "https", "tls_config": tls,
         "basic_auth": {"username": "prometheus", "password": "guess"},
         "static_configs": [{"targets": [f"127.0.0.1:{serve.metrics_port}"]}]},
    ])

    def up() -> dict[str, str]:
        return {f'{r["metric"]["job"]}/{r["metric"].get("component", "-")}': r["value"][1]
                for r in api(port, "/api/v1/query", query="up")["result"]}

    refused = 'sum by (reason) (rpcguard_web_refusals_total{job="rpcguard", role="serve"})'
    deadline = time.monotonic() + 30
    while True:
        ups = up()
        reasons = {r["metric"]["reason"]: float(r["value"][1])
                   for r in api(port, "/api/v1/query", query=refused)["result"]}
        done = (ups == {"rpcguard/node": "1", "rpcguard/client": "1", "no-client-cert/-": "0", "wrong-password/-": "0"}
                and reasons.get("tls_no_client_cert", 0) > 0 and reasons.get("auth_failed", 0) > 0)
        if done or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert ups == {"rpcguard/node": "1", "rpcguard/client": "1", "no-client-cert/-": "0", "wrong-password/-": "0"}, ups
    # the refusals are visible in rpcguard's own metric (scraped by the good job) ...
    assert reasons["tls_no_client_cert"] > 0 and reasons["auth_failed"] > 0, reasons
    assert reasons.get("auth_required", 0) == 0 and reasons.get("tls_unknown_ca", 0) == 0, reasons
    # ... and in its log, with the scraper's address
    log = serve.output()
    assert "metrics endpoint refused peer=127.0.0.1:" in log and "reason=tls_no_client_cert" in log, log[-3000:]
    assert "reason=auth_failed" in log, log[-3000:]
    # and why Prometheus marks the targets down
    health = {t["scrapePool"]: t for t in api(port, "/api/v1/targets")["activeTargets"]}
    assert health["wrong-password"]["lastError"].endswith("401 Unauthorized"), health["wrong-password"]
    # (the TLS alert is not always flushed before the close: Go may only see "EOF"; the reason
    # is on rpcguard's side, asserted above)
    assert health["no-client-cert"]["health"] == "down" and health["no-client-cert"]["lastError"], health
    assert health["rpcguard"]["health"] == "up" and not health["rpcguard"]["lastError"], health

    # a counter read through Prometheus equals what each instance reports over mTLS
    query = 'rpcguard_bytes_total{job="rpcguard",command="SET_TENSOR",direction="request"}'
    got = by_role(api(port, "/api/v1/query", query=query)["result"])
    assert got == want, (got, want)
    # the state gauges arrive too: serve probed its real upstream, both loaded their config
    upstream = by_role(api(port, "/api/v1/query", query='rpcguard_upstream_up{job="rpcguard"}')["result"])
    assert upstream == {"serve": 1.0, "connect": 1.0}, upstream
    ok = by_role(api(port, "/api/v1/query", query='rpcguard_reload_last_successful{job="rpcguard"}')["result"])
    assert ok == {"serve": 1.0, "connect": 1.0}, ok
    fds = api(port, "/api/v1/query", query='process_open_fds{job="rpcguard"}')["result"]
    assert len(fds) == 2 and all(float(r["value"][1]) > 3 for r in fds), fds

    # SIGHUP reloads the web config: the password "guess" becomes the right one for serve, so the
    # wrong-password job comes up and the good job's serve target goes down (connect unchanged)
    data = yaml.safe_load(web.read_text())
    data["basic_auth_users"]["prometheus"] = bcrypt.hashpw(b"guess", bcrypt.gensalt(10)).decode()
    web.write_text(yaml.safe_dump(data))
    serve.proc.popen.send_signal(signal.SIGHUP)
    want_up = {"rpcguard/node": "0", "rpcguard/client": "1", "no-client-cert/-": "0", "wrong-password/-": "1"}
    deadline = time.monotonic() + 30
    while (ups := up()) != want_up and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ups == want_up, (ups, serve.output()[-2000:])
    assert serve.logged("config reloaded (SIGHUP): new metrics web config")
