"""The fleet of deploy/kubernetes on loopback, with the real ggml-rpc-server and llama.cpp client.

How this works: each pod's rpcguard container is laid out on disk (tests/support/k8s.py) with
certificates issued like cert-manager's; then the real ggml-rpc-server runs with the manifest's
arguments (it must listen on loopback only), and the whole fleet runs: one server and one
``rpcguard serve`` per StatefulSet replica, one ``rpcguard connect``, each with its container's
arguments and config, only the addresses moved to free loopback ports (the node names stay the
TLS server names). connect's start-up check must reach every node and the real llama.cpp client
must generate through a tunnel. The metrics endpoint behind the manifests' web config is
checked too (probe.py, the Prometheus identity).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from rpcguard.pki import certs
from tests.support import realpeer
from rpcguard.cli import READY_MESSAGE
from tests.support.guard import bound_metrics_port, bound_ports, wait_for_line
from tests.support.k8s import (  # noqa: F401,F811  (issuers, pod_roots: fixtures)
    RPC_SERVER, containers, issuers, lay_out_pod, named, pod_names, pod_roots, pod_specs, reroot,
    rpc_server_port, rpcguard_containers, secret_certificate,
)

pytestmark = pytest.mark.integration


def _rpc_server_bin() -> str:
    env = realpeer._read_env(realpeer.REALPEER_HOME / "env.sh")
    if "REALPEER_RPC_SERVER_BIN" not in env:
        pytest.fail("no real ggml-rpc-server: run tests/realpeer/setup.sh (scripts/test.sh does)")
    return env["REALPEER_RPC_SERVER_BIN"]


def test_real_rpc_server_takes_the_manifest_arguments_and_binds_loopback(tmp_path):
    binary = _rpc_server_bin()
    (c,) = [c for spec in pod_specs().values() for c in containers(spec) if c["name"] == RPC_SERVER]
    port = realpeer.reserve_port()
    args = [str(port) if a == str(rpc_server_port()) else a for a in c["args"]]
    proc = realpeer.start([binary, *args], tmp_path / "rpc-server.log", "rpc-server")
    try:
        realpeer.wait_port(port, proc=proc.popen)
        listening = [line.split()[1] for line in Path("/proc/net/tcp").read_text().splitlines()[1:]
                     if line.split()[3] == "0A" and int(line.split()[1].split(":")[1], 16) == port]
        listening6 = [line.split()[1] for line in Path("/proc/net/tcp6").read_text().splitlines()[1:]
                      if line.split()[3] == "0A" and int(line.split()[1].split(":")[1], 16) == port]
    finally:
        proc.stop()
    assert listening == [f"0100007F:{port:04X}"] and listening6 == []


def _rerooted_args(workload: str, root: Path) -> tuple[list[str], Path]:
    (c,) = [c for w, _, c in rpcguard_containers() if w == workload]
    args = yaml.safe_load(reroot(yaml.safe_dump(c["args"]), root, c))
    return args, Path(args[args.index("--config") + 1])


def _start_rpcguard(args: list[str], config: Path, data: dict, log: Path) -> realpeer.Proc:
    config.write_text(yaml.safe_dump(data))
    i = args.index("--config")
    proc = realpeer.start([sys.executable, "-m", "rpcguard", *args[:i], "--config", str(config),
                           *args[i + 2:]], log, log.stem)
    wait_for_line(proc, READY_MESSAGE)
    return proc


def test_fleet_runs_on_loopback_with_the_manifest_configs_and_certificates(pod_roots, issuers, tmp_path):
    """Both pods' containers with their own arguments, configs and certificates (issued like
    cert-manager's: SANs, usages, two CAs; each GPU pod its own, as csi-driver issues them), only the
    addresses moved to free loopback ports and the node names kept as TLS server names: connect's
    start-up check reaches every node, one node's certificate does not pass for another's name, and
    the real llama.cpp client generates through the first tunnel, admitted by its SPIFFE identity."""
    binary = _rpc_server_bin()
    (rpc_c,) = [c for spec in pod_specs().values() for c in containers(spec) if c["name"] == RPC_SERVER]
    replicas = named("StatefulSet", "gpu-node")["spec"]["replicas"]
    node_roots = [pod_roots["gpu-node"]] + [lay_out_pod(tmp_path / pod, "gpu-node", issuers, pod)
                                            for pod in pod_names("gpu-node")[1:]]
    connect_args, connect_conf = _rerooted_args("llama-server", pod_roots["llama-server"])
    model = realpeer.make_model(tmp_path / "tiny.gguf")
    procs: list[realpeer.Proc] = []
    try:
        serve_ports, metrics_ports = [], []
        for i in range(replicas):
            rpc_port = realpeer.reserve_port()
            args = [str(rpc_port) if a == str(rpc_server_port()) else a for a in rpc_c["args"]]
            procs.append(realpeer.start([binary, *args], tmp_path / f"rpc-{i}.log", f"rpc-{i}"))
            realpeer.wait_port(rpc_port, proc=procs[-1].popen)
            serve_args, serve_conf = _rerooted_args("gpu-node", node_roots[i])
            data = yaml.safe_load(serve_conf.read_text())
            data["listeners"][0].update(listen="127.0.0.1:0", upstream=f"127.0.0.1:{rpc_port}")
            data["metrics"]["listen"] = "127.0.0.1:0"
            serve = _start_rpcguard(serve_args, serve_conf.with_name(f"serve-{i}.yaml"), data,
                                    tmp_path / f"serve-{i}.log")
            procs.append(serve)
            (serve_port,) = bound_ports(serve.output()).values()
            serve_ports.append(serve_port)
            metrics_ports.append(bound_metrics_port(serve.output()))
        data = yaml.safe_load(connect_conf.read_text())
        assert len(data["tunnels"]) == replicas
        for t, port in zip(data["tunnels"], serve_ports):
            host = t["server"].rsplit(":", 1)[0]
            t.update(listen="127.0.0.1:0", server=f"127.0.0.1:{port}", server_name=host)
        data["metrics"]["listen"] = "127.0.0.1:0"
        connect = _start_rpcguard(connect_args, connect_conf.with_name("connect-loopback.yaml"), data,
                                  tmp_path / "connect.log")
        procs.append(connect)
        tunnel_ports = bound_ports(connect.output())
        deadline = time.monotonic() + 30  # connect checks its nodes right after it is ready
        while True:
            checks = [line for line in connect.output().splitlines() if '"msg":"check: ' in line]
            if len(checks) >= replicas or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert len(checks) == replicas and all("OK " in line and "protocol 7.0.0" in line for line in checks), checks
        # node 1's own certificate does not answer to node 0's name
        crossed = subprocess.run(
            [sys.executable, "-m", "rpcguard", "check", *(f"--{k}={data['tls'][k]}" for k in ("cert", "key", "ca")),
             "--server", f"127.0.0.1:{serve_ports[1]}", "--server-name", data["tunnels"][0]["server_name"], "--json"],
            capture_output=True, text=True, timeout=60)
        assert crossed.returncode == 1 and "node_name_mismatch" in crossed.stdout, (crossed.stdout, crossed.stderr)
        run = realpeer.run_client(f"127.0.0.1:{tunnel_ports[data['tunnels'][0]['name']]}", model, n=8, timeout=120)
        assert run.ok and len(run.tokens) == 8, run.output[-2000:]
        # the real metrics endpoint behind the manifests' web config
        _check_metrics_endpoint(pod_roots["gpu-node"], issuers, metrics_ports[0])
    finally:
        for p in reversed(procs):
            p.stop()
    assert "spiffe://cluster.local/ns/rpcguard/sa/llama-server" in (tmp_path / "serve-0.log").read_text()


def _check_metrics_endpoint(root: Path, issuers: dict[str, Path], port: int) -> None:
    """probe.py reaches /healthz and /readyz with the probe certificate, /metrics needs Prometheus'."""
    scrape = secret_certificate("prometheus-scrape-tls")["spec"]
    prom = certs.issue(issuers[scrape["issuerRef"]["name"]], "prometheus-test", server=False, uris=scrape["uris"],
                       common_name=scrape["commonName"], days=1)
    script = root / "etc/rpcguard/common/probe.py"
    ca = ["--ca", str(root / "etc/rpcguard/metrics-tls/ca.crt")]
    probe_cert = ["--cert", str(root / "etc/rpcguard/probe-tls/tls.crt"), "--key", str(root / "etc/rpcguard/probe-tls/tls.key")]

    def probe(path: str, cert: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(script), str(port), path, *ca, *cert],
                              capture_output=True, text=True, timeout=30)
    for path in ("/healthz", "/readyz"):
        r = probe(path, probe_cert)
        assert r.returncode == 0, r.stdout
    refused = probe("/metrics", probe_cert)  # not the Prometheus identity
    assert refused.returncode == 1 and "HTTP 403" in refused.stdout, refused.stdout
    scraped = probe("/metrics", ["--cert", str(prom.cert), "--key", str(prom.key)])
    assert scraped.returncode == 0 and "rpcguard_" in scraped.stdout, scraped.stdout
