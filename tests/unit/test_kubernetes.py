"""Checks of deploy/kubernetes: schemas, rpcguard configs, security invariants, consistency.

How this works: every document of every manifest listed in kustomization.yaml is validated,
offline: the core kinds with kubernetes-validate (Kubernetes' own OpenAPI schemas, strict: unknown
fields are errors) at ``K8S_VERSIONS``; the cert-manager and Prometheus Operator kinds with
jsonschema against JSON Schema generated from the cloudcoil models of those CRDs (pinned in
pyproject.toml), closed with ``additionalProperties: false`` like kubectl's strict field
validation. Each pod's rpcguard container is then replayed outside the cluster
(tests/support/k8s.py: its mounts laid out under a temp dir, certificates issued like
cert-manager's, absolute paths re-rooted there) and its arguments must pass ``rpcguard
check-config`` / the serve|connect config build. probe.py (the exec probe) runs against a real
mTLS HTTP server. The real ggml-rpc-server and the whole fleet on loopback:
tests/integration/test_kubernetes_fleet.py.
"""

from __future__ import annotations

import copy
import functools
import http.server
import importlib
import re
import ssl
import subprocess
import sys
import threading
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from rpcguard.cli import _overrides, _parser
from rpcguard.config.flags import build_config
from tests.support.k8s import (  # noqa: F401,F811  (issuers, pod_roots: fixtures)
    K8S, ROOT, RPC_SERVER, config_of, containers, docs, hours, issuers, kustomization, pod_roots,
    CSI_DRIVER, csi_expand, kustomize, mounted_certificate, named, of_kind, pod_names, pod_specs, reroot, rpc_server_port,
    rpcguard_containers, secret_certificate, volume_certificate,
)

CONTAINERFILE = ROOT / "deploy" / "container" / "Containerfile"
# The Kubernetes versions the core kinds are validated for (README.md): the oldest supported one
# (native sidecar containers, restartPolicy on init containers, are on by default from 1.29) and 1.33.
K8S_VERSIONS = ("1.29.0", "1.33.0")
# CRD kind -> the cloudcoil module holding its model (imported on first use: ~12 s of pydantic
# model building, paid only by the CRD tests)
CRD_MODELS = {
    ("cert-manager.io/v1", "Certificate"): "cloudcoil.models.cert_manager.v1",
    ("cert-manager.io/v1", "Issuer"): "cloudcoil.models.cert_manager.v1",
    ("cert-manager.io/v1", "ClusterIssuer"): "cloudcoil.models.cert_manager.v1",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "cloudcoil.models.prometheus_operator.v1",
}
MAX_LEAF_HOURS = 7 * 24  # "short duration"
# Volume types the Pod Security Standards' "restricted" profile allows (no hostPath among them)
PSA_RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                          "projected", "secret"}
# exporter-toolkit web-config keys (github.com/prometheus/exporter-toolkit, docs/web-configuration.md)
WEB_TLS_KEYS = {"cert_file", "key_file", "client_ca_file", "client_auth_type", "min_version", "max_version",
                "cipher_suites", "curve_preferences", "prefer_server_cipher_suites", "client_allowed_sans",
                "cert", "key"}


# ----------------------------------------------------------------------------- schemas


def test_kustomization_lists_every_manifest_and_image():
    files = sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(kustomization()["resources"]) == files
    used = {c["image"].rsplit(":", 1)[0] for spec in pod_specs().values() for c in containers(spec)}
    assert used == {i["name"] for i in kustomization()["images"]}


CORE = [(f, d) for f, d in docs() if (d["apiVersion"], d["kind"]) not in CRD_MODELS]
CUSTOM = [(f, d) for f, d in docs() if (d["apiVersion"], d["kind"]) in CRD_MODELS]


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("doc", [d for _, d in CORE], ids=[f"{f}:{d['kind']}/{d['metadata']['name']}" for f, d in CORE])
def test_core_kinds_validate_strictly(doc, version):
    kubernetes_validate.validate(doc, version, strict=True)


def test_core_validator_refuses_an_unknown_field():
    bad = copy.deepcopy(named("StatefulSet", "gpu-node"))
    bad["spec"]["template"]["spec"]["containers"][0]["securityContext"]["readOnlyRootFileSystem"] = True  # typo
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[-1], strict=True)


def _closed(schema):
    """Every object schema with declared properties refuses other keys (kubectl's strict mode)."""
    if isinstance(schema, dict):
        if "properties" in schema and "additionalProperties" not in schema:
            schema["additionalProperties"] = False
        for v in schema.values():
            _closed(v)
    elif isinstance(schema, list):
        for v in schema:
            _closed(v)
    return schema


@functools.cache
def crd_validator(api_version: str, kind: str) -> jsonschema.protocols.Validator:
    model = getattr(importlib.import_module(CRD_MODELS[(api_version, kind)]), kind)
    schema = _closed(model.model_json_schema(by_alias=True))
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


@pytest.mark.parametrize("doc", [d for _, d in CUSTOM], ids=[f"{f}:{d['kind']}/{d['metadata']['name']}" for f, d in CUSTOM])
def test_crd_kinds_validate_against_the_crd_models(doc):
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
              for e in crd_validator(doc["apiVersion"], doc["kind"]).iter_errors(doc)]
    assert errors == []


@pytest.mark.parametrize("kind, path, value", [
    ("Certificate", ("spec", "usages"), ["server auth", "serverauth"]),     # not an enum value
    ("Certificate", ("spec", "renewbefore"), "8h"),                          # unknown field
    ("ServiceMonitor", ("spec", "endpoints", 0, "scheme"), "tls"),          # not an enum value
    ("ServiceMonitor", ("spec", "endpoints", 0, "tlsConfig", "caFile2"), "x"),
])
def test_crd_validator_refuses_mistakes(kind, path, value):
    bad = copy.deepcopy(of_kind(kind)[-1])
    node = bad
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    assert list(crd_validator(bad["apiVersion"], kind).iter_errors(bad))


def test_kustomize_renders_the_same_objects_with_the_images_set():
    rendered = kustomize(K8S)
    key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
    assert sorted(map(key, rendered)) == sorted(key(d) for _, d in docs())
    want = {f"{i['name']}:{i['newTag']}".replace(i["name"], i["newName"], 1) for i in kustomization()["images"]}
    images = {c["image"] for d in rendered if "template" in d.get("spec", {})
              for c in containers(d["spec"]["template"]["spec"])}
    assert images == want


# ----------------------------------------------------------------------------- rpcguard configs


@pytest.mark.parametrize("workload", sorted({w for w, _, _ in rpcguard_containers()}))
def test_rpcguard_container_args_pass_check_config(workload, pod_roots):
    root = pod_roots[workload]
    (c,) = [c for w, _, c in rpcguard_containers() if w == workload]
    args = yaml.safe_load(reroot(yaml.safe_dump(c["args"]), root, c))
    config = Path(args[args.index("--config") + 1])
    run = subprocess.run([sys.executable, "-m", "rpcguard", "check-config", str(config)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(f"OK {config}: {args[0]}")
    # The container's own argument list, as `rpcguard serve|connect` reads it before starting.
    a = _parser().parse_args([*args[:args.index("--config")], "--config", str(config),
                              *args[args.index("--config") + 2:]])
    cfg = build_config(a.command, file=a.config, overrides=_overrides(a))
    assert cfg.role == a.command and cfg.tls.reload_interval_s > 0


def test_web_config_is_mutual_tls_with_mounted_files(pod_roots):
    for workload, _, c in rpcguard_containers():
        _, cfg = config_of(workload)
        web_path = pod_roots[workload] / cfg["metrics"]["web_config"].lstrip("/")
        web = yaml.safe_load(web_path.read_text())
        assert set(web) == {"tls_server_config"}
        tls = web["tls_server_config"]
        assert set(tls) <= WEB_TLS_KEYS
        assert tls["client_auth_type"] == "RequireAndVerifyClientCert"
        assert tls["client_allowed_sans"] == secret_certificate("prometheus-scrape-tls")["spec"]["uris"]
        assert "unsafe_public" not in cfg["metrics"]  # protected by the web config, not opted out
        for key in ("cert_file", "key_file", "client_ca_file"):
            assert Path(tls[key]).is_file(), (workload, key, tls[key])  # re-rooted: mounted
        ca_mount = str(Path(tls["client_ca_file"].replace(str(pod_roots[workload]), "")).parent)
        client_ca = mounted_certificate(workload, ca_mount)["issuerRef"]
        assert client_ca == secret_certificate("prometheus-scrape-tls")["spec"]["issuerRef"]


# ----------------------------------------------------------------------------- probe.py


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        code = 200 if self.path == "/healthz" else 503
        self.send_response(code)
        self.end_headers()
        self.wfile.write(b"ok" if code == 200 else b"not ready")

    def log_message(self, *args):
        pass


def test_probe_script_needs_a_metrics_client_certificate(pod_roots):
    root = pod_roots["gpu-node"]
    mtls, script = root / "etc/rpcguard/metrics-tls", root / "etc/rpcguard/common/probe.py"
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(mtls / "tls.crt", mtls / "tls.key")
    ctx.load_verify_locations(mtls / "ca.crt")
    ctx.verify_mode = ssl.CERT_REQUIRED
    srv = http.server.HTTPServer(("127.0.0.1", 0), _Health)
    srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    port = str(srv.server_address[1])

    def probe(path, *extra):
        cmd = [sys.executable, str(script), port, path, "--ca", str(mtls / "ca.crt"),
               "--cert", str(root / "etc/rpcguard/probe-tls/tls.crt"), "--key", str(root / "etc/rpcguard/probe-tls/tls.key"), *extra]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    try:
        ok, not_ready = probe("/healthz"), probe("/readyz")
        rpc = root / "etc/rpcguard/tls"  # a data-path certificate: other CA, refused
        wrong = probe("/healthz", "--cert", str(rpc / "tls.crt"), "--key", str(rpc / "tls.key"))
    finally:
        srv.shutdown()
    assert (ok.returncode, ok.stdout.strip()) == (0, "probe /healthz: HTTP 200 ok"), ok.stderr
    assert (not_ready.returncode, not_ready.stdout.strip()) == (1, "probe /readyz: HTTP 503 not ready")
    assert wrong.returncode == 1 and wrong.stdout.startswith("probe /healthz: ") and wrong.stderr == ""


def test_liveness_is_about_the_process_answering_not_its_certificates(pod_roots, tmp_path):
    """An expired metrics certificate (or a probe certificate the server refuses) fails readiness,
    not liveness: a restart would cut the sessions and fix nothing. Silence fails liveness."""
    import datetime as dt
    import socket

    from rpcguard.pki import certs

    root = pod_roots["gpu-node"]
    mtls, script = root / "etc/rpcguard/metrics-tls", root / "etc/rpcguard/common/probe.py"
    certs.init_ca(tmp_path / "ca")
    now = dt.datetime.now(dt.timezone.utc)
    expired = certs.issue(tmp_path, "expired", server=True, ips=["127.0.0.1"], ca_dir=tmp_path / "ca",
                          not_before=now - dt.timedelta(days=3), not_after=now - dt.timedelta(days=1))
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(expired.cert, expired.key)
    ctx.load_verify_locations(mtls / "ca.crt")
    ctx.verify_mode = ssl.CERT_REQUIRED
    srv = http.server.HTTPServer(("127.0.0.1", 0), _Health)
    srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    silent = socket.create_server(("127.0.0.1", 0))  # accepts (kernel backlog), never answers: a hung loop

    def probe(port, *extra):
        cmd = [sys.executable, str(script), str(port), "/healthz", "--ca", str(mtls / "ca.crt"),
               "--cert", str(root / "etc/rpcguard/probe-tls/tls.crt"),
               "--key", str(root / "etc/rpcguard/probe-tls/tls.key"), *extra]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    try:
        ready, alive = probe(srv.server_address[1]), probe(srv.server_address[1], "--alive")
        hung = probe(silent.getsockname()[1], "--alive")
    finally:
        srv.shutdown()
        silent.close()
    assert ready.returncode == 1, ready.stdout  # the expired certificate: not ready
    assert alive.returncode == 0 and alive.stdout.startswith("probe /healthz: alive ("), alive.stdout
    assert hung.returncode == 1 and "not answering" in hung.stdout, hung.stdout
    closed = probe(realpeer_free_port(), "--alive")
    assert closed.returncode == 1 and "ConnectionRefusedError" in closed.stdout, closed.stdout


def realpeer_free_port() -> int:
    from tests.support.realpeer import free_port

    return free_port()


def test_gpu_pods_have_a_disruption_budget():
    (pdb,) = of_kind("PodDisruptionBudget")
    sts = named("StatefulSet", "gpu-node")
    assert pdb["spec"]["selector"] == sts["spec"]["selector"] and pdb["spec"]["maxUnavailable"] == 1
    assert pdb["metadata"]["namespace"] == sts["metadata"]["namespace"]


def test_probes_hit_the_metrics_port(pod_roots):
    for workload, _, c in rpcguard_containers():
        _, cfg = config_of(workload)
        port = cfg["metrics"]["listen"].rsplit(":", 1)[1]
        probe = ["python3", "/etc/rpcguard/common/probe.py", port]
        assert c["livenessProbe"]["exec"]["command"] == probe + ["/healthz", "--alive"]
        assert c["readinessProbe"]["exec"]["command"] == probe + ["/readyz"]
        assert {"metrics": int(port)} == {p["name"]: p["containerPort"] for p in c["ports"] if p["name"] == "metrics"}


# ----------------------------------------------------------------------------- security invariants


def test_no_host_namespaces_ports_or_paths():
    for workload, spec in pod_specs().items():
        assert not any(spec.get(k) for k in ("hostNetwork", "hostPID", "hostIPC")), workload
        assert spec.get("automountServiceAccountToken") is False, workload
        assert not any("hostPort" in p for c in containers(spec) for p in c.get("ports", [])), workload
        # Pod Security "restricted" (the namespace enforces it): only these volume types
        kinds = {k for v in spec.get("volumes", []) for k in v if k != "name"}
        assert kinds <= PSA_RESTRICTED_VOLUMES, (workload, kinds - PSA_RESTRICTED_VOLUMES)


def test_every_container_is_hardened():
    for workload, spec in pod_specs().items():
        pod = spec["securityContext"]
        assert pod["seccompProfile"] == {"type": "RuntimeDefault"}, workload
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] > 0, workload
        for c in containers(spec):
            sc, where = c["securityContext"], f"{workload}/{c['name']}"
            assert sc.get("runAsNonRoot", pod["runAsNonRoot"]) is True and sc.get("runAsUser", 1) > 0, where
            assert sc["readOnlyRootFilesystem"] is True, where
            assert sc["allowPrivilegeEscalation"] is False and not sc.get("privileged"), where
            assert sc["capabilities"] == {"drop": ["ALL"]}, where
            assert {"cpu", "memory"} <= set(c["resources"]["requests"]) and "memory" in c["resources"]["limits"], where


def test_ggml_rpc_server_is_never_exposed():
    port = rpc_server_port()
    exposed = {p["containerPort"] for spec in pod_specs().values() for c in containers(spec) for p in c.get("ports", [])}
    exposed |= {p[k] for s in of_kind("Service") for p in s["spec"]["ports"] for k in ("port", "targetPort")}
    exposed |= {p["port"] for n in of_kind("NetworkPolicy") for r in n["spec"].get("ingress", []) + n["spec"].get("egress", [])
                for p in r.get("ports", [])}
    assert port not in exposed
    _, serve = config_of("gpu-node")
    assert [x["upstream"] for x in serve["listeners"]] == [f"127.0.0.1:{port}"]
    assert not any(x.get("unsafe_upstream") for x in serve["listeners"])
    # The gpu-node pod exposes serve's mTLS port and the metrics port, nothing else.
    ports = {p["containerPort"] for c in containers(pod_specs()["gpu-node"]) for p in c.get("ports", [])}
    assert ports == {int(serve["listeners"][0]["listen"].rsplit(":", 1)[1]), int(serve["metrics"]["listen"].rsplit(":", 1)[1])}


def test_network_policies_admit_only_llama_server_and_prometheus():
    assert named("NetworkPolicy", "default-deny")["spec"] == {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}
    _, serve = config_of("gpu-node")
    rpc_port = int(serve["listeners"][0]["listen"].rsplit(":", 1)[1])
    metrics_port = int(serve["metrics"]["listen"].rsplit(":", 1)[1])
    node = named("NetworkPolicy", "gpu-node")["spec"]
    assert node["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "gpu-node"}
    assert node["egress"] == []
    by_port = {r["ports"][0]["port"]: r["from"] for r in node["ingress"]}
    assert [len(r["ports"]) for r in node["ingress"]] == [1, 1] and set(by_port) == {rpc_port, metrics_port}
    assert by_port[rpc_port] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "llama-server"}}}]
    (prom,) = by_port[metrics_port]
    assert prom["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"}
    assert "kubernetes.io/metadata.name" in prom["namespaceSelector"]["matchLabels"]
    client = named("NetworkPolicy", "llama-server")["spec"]
    _, connect = config_of("llama-server")
    (prom_c,) = [r["from"] for r in client["ingress"] if r["ports"][0]["port"] == int(connect["metrics"]["listen"].rsplit(":", 1)[1])]
    assert prom_c == [prom]


# ----------------------------------------------------------------------------- consistency


def _issued() -> list[tuple[str, dict]]:
    """(label, Certificate spec) of everything cert-manager issues: each Certificate, and each CSI
    volume of each pod, as csi-driver would request it for that pod."""
    out = [(c["metadata"]["name"], c["spec"]) for c in of_kind("Certificate")]
    for workload, spec in pod_specs().items():
        for vol in spec["volumes"]:
            if "csi" in vol:
                out += [(f"{pod}/{vol['name']}", volume_certificate(workload, vol, pod)) for pod in pod_names(workload)]
    return out


def test_certificates_are_short_lived_and_used_for_their_role():
    for name, s in _issued():
        assert hours(s["renewBefore"]) < hours(s["duration"]), name
        if not s.get("isCA"):
            assert hours(s["duration"]) <= MAX_LEAF_HOURS, name
            assert s["privateKey"]["rotationPolicy"] == "Always", name
            assert (s["privateKey"]["algorithm"], s["privateKey"]["size"]) == ("ECDSA", 256), name
            assert len({"server auth", "client auth"} & set(s["usages"])) == 1, name
        assert not any("*" in n for n in s.get("dnsNames", [])), name  # no certificate stands for many
    expect = {("gpu-node", "/etc/rpcguard/tls"): ("server auth", "rpcguard-rpc-ca"),
              ("llama-server", "/etc/rpcguard/tls"): ("client auth", "rpcguard-rpc-ca"),
              ("gpu-node", "/etc/rpcguard/metrics-tls"): ("server auth", "rpcguard-metrics-ca"),
              ("llama-server", "/etc/rpcguard/metrics-tls"): ("server auth", "rpcguard-metrics-ca"),
              ("gpu-node", "/etc/rpcguard/probe-tls"): ("client auth", "rpcguard-metrics-ca"),
              ("llama-server", "/etc/rpcguard/probe-tls"): ("client auth", "rpcguard-metrics-ca")}
    for workload, spec, c in rpcguard_containers():
        for m in c["volumeMounts"]:
            if (workload, m["mountPath"]) in expect:
                s = mounted_certificate(workload, m["mountPath"])
                usage, issuer = expect.pop((workload, m["mountPath"]))
                assert usage in s["usages"] and s["issuerRef"]["name"] == issuer, (workload, m["mountPath"])
    assert expect == {}


# csi-driver's volume attributes (pkg/apis/v1alpha1/types.go) and the key usages cert-manager knows
CSI_KEYS = {"issuer-name", "issuer-kind", "issuer-group", "literal-subject", "common-name", "organizations",
            "organizationalunits", "countries", "provinces", "localities", "streetaddresses", "postalcodes",
            "serialnumber", "dns-names", "ip-sans", "uri-sans", "duration", "is-ca", "key-usages", "key-algorithm",
            "key-encoding", "key-size", "ca-file", "certificate-file", "privatekey-file", "fs-group", "renew-before",
            "reuse-private-key", "pkcs12-enable", "pkcs12-filename", "pkcs12-password"}
CERT_MANAGER_USAGES = {"signing", "digital signature", "content commitment", "key encipherment", "key agreement",
                       "data encipherment", "cert sign", "crl sign", "encipher only", "decipher only", "any",
                       "server auth", "client auth", "code signing", "email protection", "s/mime", "ipsec end system",
                       "ipsec tunnel", "ipsec user", "timestamping", "ocsp signing", "microsoft sgc", "netscape sgc"}


def test_csi_volumes_are_requests_csi_driver_accepts():
    """What csi-driver's validation (pkg/apis/validation) would refuse at mount time, and what it
    would silently ignore (a misspelt attribute), fails here instead."""
    seen = 0
    for workload, spec in pod_specs().items():
        for vol in [v for v in spec["volumes"] if "csi" in v]:
            seen += 1
            csi, where = vol["csi"], f"{workload}/{vol['name']}"
            assert csi["driver"] == CSI_DRIVER and csi["readOnly"] is True, where
            attrs = csi["volumeAttributes"]
            assert all(k.startswith("csi.cert-manager.io/") for k in attrs), where
            assert {k.split("/", 1)[1] for k in attrs} <= CSI_KEYS, (where, set(attrs))
            issuer = attrs["csi.cert-manager.io/issuer-name"]
            assert attrs.get("csi.cert-manager.io/issuer-kind", "Issuer") == "Issuer"
            (ns,) = {d["metadata"]["namespace"] for d in of_kind("StatefulSet") + of_kind("Deployment")
                     if d["metadata"]["name"] == workload}
            assert named("Issuer", issuer)["metadata"]["namespace"] == ns, where  # an Issuer is namespaced
            for key in ("duration", "renew-before"):
                hours(attrs["csi.cert-manager.io/" + key])  # asserts a duration
            assert {u.strip() for u in attrs["csi.cert-manager.io/key-usages"].split(",")} <= CERT_MANAGER_USAGES, where
            assert attrs["csi.cert-manager.io/key-encoding"] in {"PKCS1", "PKCS8"}, where
            # the pod's files: group-readable by the pod's fsGroup, which the containers run in
            assert int(attrs["csi.cert-manager.io/fs-group"]) == spec["securityContext"]["fsGroup"], where
            for pod in pod_names(workload):
                for key in ("common-name", "dns-names", "uri-sans"):
                    csi_expand(attrs.get("csi.cert-manager.io/" + key, ""), dict.fromkeys(
                        ("POD_NAME", "POD_NAMESPACE", "POD_UID", "SERVICE_ACCOUNT_NAME"), pod))
    assert seen >= 2  # the GPU pods' data-path and metrics certificates


def test_csi_expansion_is_the_drivers():
    values = {"POD_NAME": "gpu-node-1", "POD_NAMESPACE": "rpcguard", "POD_UID": "u", "SERVICE_ACCOUNT_NAME": "sa"}
    assert csi_expand("${POD_NAME}.gpu-node.$POD_NAMESPACE.svc", values) == "gpu-node-1.gpu-node.rpcguard.svc"
    with pytest.raises(AssertionError, match="undefined variable 'POD_IP'"):
        csi_expand("${POD_IP}", values)


def _dns_match(pattern: str, host: str) -> bool:
    return pattern == host or (pattern.startswith("*.") and host.split(".", 1)[1:] == [pattern[2:]])


def test_tunnels_match_the_nodes_llama_server_and_the_allow_list():
    sts = named("StatefulSet", "gpu-node")
    ns = sts["metadata"]["namespace"]
    _, connect = config_of("llama-server")
    _, serve = config_of("gpu-node")
    node_port = serve["listeners"][0]["listen"].rsplit(":", 1)[1]
    assert [t["server"] for t in connect["tunnels"]] == [
        f"gpu-node-{i}.{sts['spec']['serviceName']}.{ns}.svc:{node_port}" for i in range(sts["spec"]["replicas"])]
    hosts = [t.get("server_name") or t["server"].rsplit(":", 1)[0] for t in connect["tunnels"]]
    # one certificate per GPU pod: pod i's names tunnel i's node and no other
    for pod, host in zip(pod_names("gpu-node"), hosts, strict=True):
        names = mounted_certificate("gpu-node", "/etc/rpcguard/tls", pod)["dnsNames"]
        assert [h for h in hosts if any(_dns_match(p, h) for p in names)] == [host], (pod, names)
    (llama,) = [c for c in pod_specs()["llama-server"]["containers"] if c["name"] == "llama-server"]
    assert llama["args"][llama["args"].index("--rpc") + 1] == ",".join(t["listen"] for t in connect["tunnels"])
    client_cert = mounted_certificate("llama-server", "/etc/rpcguard/tls")
    assert set(client_cert["uris"]) <= set(serve["allow"]["uri"])
    assert not (serve["allow"].keys() - {"uri"})  # nothing else admitted


def test_service_monitors_scrape_over_mtls_with_the_prometheus_identity():
    for sm in of_kind("ServiceMonitor"):
        sel = sm["spec"]["selector"]["matchLabels"]
        (svc,) = [s for s in of_kind("Service") if sel.items() <= s["metadata"].get("labels", {}).items()]
        workload = svc["spec"]["selector"]["app.kubernetes.io/name"]
        metrics_certs = [mounted_certificate(workload, "/etc/rpcguard/metrics-tls", pod) for pod in pod_names(workload)]
        for ep in sm["spec"]["endpoints"]:
            assert ep["port"] in {p["name"] for p in svc["spec"]["ports"]}
            assert ep["scheme"] == "https"
            tls = ep["tlsConfig"]
            assert all(tls["serverName"] in m["dnsNames"] for m in metrics_certs), workload
            secret = tls["cert"]["secret"]["name"]
            assert tls["keySecret"]["name"] == tls["ca"]["secret"]["name"] == secret
            scrape = secret_certificate(secret)["spec"]
            assert "client auth" in scrape["usages"]
            assert all(scrape["issuerRef"] == m["issuerRef"] for m in metrics_certs), workload
            assert {"targetLabel": "job", "replacement": "rpcguard", "action": "replace"} in ep["relabelings"]


def test_container_recipe_matches_the_manifests():
    text = CONTAINERFILE.read_text()
    users = {spec["securityContext"]["runAsUser"] for spec in pod_specs().values()}
    # each stage's last USER: the manifests' images run as the manifests' user; rpcguard-node (contained
    # serve, not in these manifests) runs as root, which containment's full sandbox needs
    stages = re.split(r"^FROM \S+ AS ", text, flags=re.M)[1:]
    last_user = {st.split()[0]: (re.findall(r"^USER (\d+)", st, re.M) or [None])[-1] for st in stages}
    assert last_user.pop("rpcguard-node") == "0"
    assert users == {int(u) for u in last_user.values() if u is not None}
    setup = (ROOT / "tests" / "realpeer" / "setup.sh").read_text()
    version = re.search(r'LLAMA_CPP_PYTHON_VERSION:-([\d.]+)', setup).group(1)
    assert f"ARG LLAMA_CPP_PYTHON_VERSION={version}" in text
    tags = {i["name"].rsplit("/", 1)[1]: i["newTag"] for i in kustomization()["images"]}
    project = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert tags == {"rpcguard": project, RPC_SERVER: version, "llama-server": version}
    for target in ("rpcguard", RPC_SERVER, "llama-server"):
        assert re.search(rf"^FROM \S+ AS {re.escape(target)}$", text, re.M), target
