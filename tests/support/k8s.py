"""deploy/kubernetes as test data: the manifests, and each pod's rpcguard container replayed on disk.

How this works: the documents of every manifest listed in kustomization.yaml are loaded once;
small finders answer "the Certificate behind this Secret", "the config this container reads".
``lay_out_pods`` builds, per workload, a directory laid out like its rpcguard container's mounts:
ConfigMap data as files, and each certificate volume made by ``rpcguard certs`` from what
cert-manager would issue into it (``volume_certificate``: a Secret's Certificate, or the request
csi-driver makes for one pod from a CSI volume's attributes; same issuer, SANs and usage; CAs from
``make_issuers``). ``reroot`` puts that
directory in front of every absolute path under a mount point, so the manifests' own configs and
arguments run unchanged outside a cluster. Used by tests/unit/test_kubernetes.py and
tests/integration/test_kubernetes_fleet.py.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from rpcguard.pki import certs
from tests.support import need

__all__ = [
    "ROOT", "K8S", "RPC_SERVER", "kustomization", "docs", "of_kind", "named", "pod_specs", "containers",
    "rpcguard_containers", "hours", "secret_certificate", "volume_of", "volume_certificate",
    "mounted_certificate", "pod_names", "CSI_DRIVER", "csi_expand", "config_of", "rpc_server_port",
    "make_issuers", "lay_out_pod", "lay_out_pods", "issuers", "pod_roots", "reroot", "kustomize",
]

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
RPC_SERVER = "ggml-rpc-server"  # the container name of the real server in the GPU pod


# ----------------------------------------------------------------------------- loading


@functools.cache
def kustomization() -> dict:
    """deploy/kubernetes/kustomization.yaml."""
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


@functools.cache
def docs() -> tuple[tuple[str, dict], ...]:
    """(file, document) of every manifest the kustomization lists, in order."""
    out = []
    for name in kustomization()["resources"]:
        out += [(name, d) for d in yaml.safe_load_all((K8S / name).read_text()) if d is not None]
    return tuple(out)


def of_kind(kind: str) -> list[dict]:
    return [d for _, d in docs() if d["kind"] == kind]


def named(kind: str, name: str) -> dict:
    (d,) = [d for d in of_kind(kind) if d["metadata"]["name"] == name]
    return d


def pod_specs() -> dict[str, dict]:
    """Workload name -> its pod template's spec."""
    return {d["metadata"]["name"]: d["spec"]["template"]["spec"]
            for d in of_kind("Deployment") + of_kind("StatefulSet") + of_kind("DaemonSet")}


def containers(spec: dict) -> list[dict]:
    """Init containers (native sidecars included) and containers of a pod spec."""
    return spec.get("initContainers", []) + spec["containers"]


def rpcguard_containers() -> list[tuple[str, dict, dict]]:
    """(workload, pod spec, container) of every container that runs rpcguard."""
    return [(w, spec, c) for w, spec in pod_specs().items() for c in containers(spec) if c.get("command") == ["rpcguard"]]


def hours(text: str) -> float:
    """A cert-manager duration like "24h" or "1h30m" in hours."""
    m = re.fullmatch(r"(\d+)h(?:(\d+)m)?", text)
    assert m, f"duration {text!r}: expected like '24h' or '1h30m'"
    return int(m.group(1)) + int(m.group(2) or 0) / 60


def secret_certificate(secret: str) -> dict:
    """The Certificate whose secretName is ``secret``."""
    (cert,) = [c for c in of_kind("Certificate") if c["spec"]["secretName"] == secret]
    return cert


def volume_of(spec: dict, mount_path: str, container: dict) -> dict:
    """The pod volume the container mounts at ``mount_path``."""
    (vol_name,) = [m["name"] for m in container["volumeMounts"] if m["mountPath"] == mount_path]
    (vol,) = [v for v in spec["volumes"] if v["name"] == vol_name]
    return vol


# cert-manager's csi-driver (github.com/cert-manager/csi-driver): its driver name, the variables it
# expands in common-name, dns-names and uri-sans (pkg/requestgen), and the defaults it fills in
# (pkg/apis/defaults; renewal at 2/3 of the lifetime without renew-before, csi-lib).
CSI_DRIVER = "csi.cert-manager.io"
CSI = "csi.cert-manager.io/"
CSI_VARIABLES = ("POD_NAME", "POD_NAMESPACE", "POD_UID", "SERVICE_ACCOUNT_NAME")
CSI_DEFAULT_USAGES = "digital signature,key encipherment"
CSI_DEFAULT_DURATION = "2160h"


def csi_expand(text: str, values: dict[str, str]) -> str:
    """csi-driver's expansion: ``$NAME`` and ``${NAME}`` of CSI_VARIABLES; any other name is an error."""
    def one(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        assert name in CSI_VARIABLES, f"undefined variable {name!r}, known variables: {list(CSI_VARIABLES)}"
        return values[name]
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", one, text)


def pod_names(workload: str) -> list[str]:
    """The names the workload's pods get: <name>-N for a StatefulSet, one stand-in otherwise."""
    (d,) = [d for d in of_kind("Deployment") + of_kind("StatefulSet") + of_kind("DaemonSet")
            if d["metadata"]["name"] == workload]
    count = d["spec"].get("replicas", 1) if d["kind"] == "StatefulSet" else 1
    return [f"{workload}-{i}" for i in range(count)]


def volume_certificate(workload: str, vol: dict, pod_name: str | None = None) -> dict:
    """What cert-manager issues into a volume, as a Certificate spec: the Certificate behind a
    Secret volume, or for a CSI volume the request csi-driver makes for the pod ``pod_name``
    (default: the workload's first pod)."""
    if "secret" in vol:
        return secret_certificate(vol["secret"]["secretName"])["spec"]
    csi = vol["csi"]
    assert csi["driver"] == CSI_DRIVER and csi.get("readOnly") is True, vol["name"]
    a = csi["volumeAttributes"]
    (d,) = [d for d in of_kind("Deployment") + of_kind("StatefulSet") + of_kind("DaemonSet")
            if d["metadata"]["name"] == workload]
    values = {"POD_NAME": pod_name or pod_names(workload)[0], "POD_NAMESPACE": d["metadata"]["namespace"],
              "POD_UID": "00000000-0000-0000-0000-000000000000",
              "SERVICE_ACCOUNT_NAME": d["spec"]["template"]["spec"].get("serviceAccountName", "default")}

    def listed(key: str, default: str = "") -> list[str]:
        return [s.strip() for s in csi_expand(a.get(CSI + key, default), values).split(",") if s.strip()]

    duration = a.get(CSI + "duration", CSI_DEFAULT_DURATION)
    algorithm = a.get(CSI + "key-algorithm", "RSA")
    return {
        "commonName": csi_expand(a.get(CSI + "common-name", ""), values),
        "dnsNames": listed("dns-names"), "uris": listed("uri-sans"),
        "usages": listed("key-usages", CSI_DEFAULT_USAGES),
        "duration": duration, "renewBefore": a.get(CSI + "renew-before", f"{hours(duration) / 3:.0f}h"),
        "isCA": a.get(CSI + "is-ca", "false") == "true",
        "issuerRef": {"name": a[CSI + "issuer-name"], "kind": a.get(CSI + "issuer-kind", "Issuer"),
                      "group": a.get(CSI + "issuer-group", "cert-manager.io")},
        "privateKey": {"algorithm": algorithm,
                       "size": int(a.get(CSI + "key-size", "2048" if algorithm == "RSA" else "256")),
                       "encoding": a.get(CSI + "key-encoding", "PKCS1" if algorithm == "RSA" else "PKCS8"),
                       "rotationPolicy": "Never" if a.get(CSI + "reuse-private-key") == "true" else "Always"},
        "fsGroup": int(a[CSI + "fs-group"]) if CSI + "fs-group" in a else None,
        "files": {k: a.get(CSI + k + "-file", d) for k, d in
                  (("certificate", "tls.crt"), ("privatekey", "tls.key"), ("ca", "ca.crt"))},
    }


def mounted_certificate(workload: str, mount_path: str, pod_name: str | None = None) -> dict:
    """volume_certificate of what the workload's rpcguard container mounts at ``mount_path``."""
    (_, spec, c) = [x for x in rpcguard_containers() if x[0] == workload][0]
    return volume_certificate(workload, volume_of(spec, mount_path, c), pod_name)


def config_of(workload: str) -> tuple[str, dict]:
    """(file name, parsed YAML) of the rpcguard config a workload's container points at."""
    (_, spec, c) = [x for x in rpcguard_containers() if x[0] == workload][0]
    path = c["args"][c["args"].index("--config") + 1]
    mount = Path(path).parent.as_posix()
    (vol_name,) = [m["name"] for m in c["volumeMounts"] if m["mountPath"] == mount]
    (vol,) = [v for v in spec["volumes"] if v["name"] == vol_name]
    data = named("ConfigMap", vol["configMap"]["name"])["data"]
    return Path(path).name, yaml.safe_load(data[Path(path).name])


def rpc_server_port() -> int:
    """The ggml-rpc-server's port in the GPU pod; asserts it binds 127.0.0.1 and declares no port."""
    (c,) = [c for spec in pod_specs().values() for c in containers(spec) if c["name"] == RPC_SERVER]
    args = c["args"]
    assert args[args.index("-H") + 1] == "127.0.0.1"
    assert "ports" not in c
    return int(args[args.index("-p") + 1])


def make_issuers(pki: Path) -> dict[str, Path]:
    """Issuer name -> a directory with its CA (``rpcguard certs init-ca``), one per CA Certificate."""
    out: dict[str, Path] = {}
    for ca in [c for c in of_kind("Certificate") if c["spec"].get("isCA")]:
        (issuer,) = [i for i in of_kind("Issuer") if i["spec"].get("ca", {}).get("secretName") == ca["spec"]["secretName"]]
        out[issuer["metadata"]["name"]] = pki / ca["metadata"]["name"]
        certs.init_ca(out[issuer["metadata"]["name"]], common_name=ca["spec"]["commonName"])
    return out


def lay_out_pod(root: Path, workload: str, issuers: dict[str, Path], pod_name: str | None = None) -> Path:
    """``root`` laid out like the mounts of the workload's rpcguard container in pod ``pod_name``
    (default: its first pod): ConfigMaps as files, certificate volumes issued for that pod."""
    (_, spec, c) = [x for x in rpcguard_containers() if x[0] == workload][0]
    for m in c["volumeMounts"]:
        (vol,) = [v for v in spec["volumes"] if v["name"] == m["name"]]
        target = root / m["mountPath"].lstrip("/")
        target.mkdir(parents=True)
        if "configMap" in vol:
            for key, text in named("ConfigMap", vol["configMap"]["name"])["data"].items():
                (target / key).write_text(reroot(text, root, c))
        elif "secret" in vol or "csi" in vol:
            cert = volume_certificate(workload, vol, pod_name)
            ca_dir = issuers[cert["issuerRef"]["name"]]
            files = certs.issue(ca_dir, f"{pod_name or workload}-{vol['name']}", server="server auth" in cert["usages"],
                                dns=cert.get("dnsNames", []), uris=cert.get("uris", []),
                                common_name=cert["commonName"], days=1)
            (target / "tls.crt").write_bytes(Path(files.cert).read_bytes())
            (target / "tls.key").write_bytes(Path(files.key).read_bytes())
            # The kubelet (Secret) and csi-driver write the files root-owned, 0440 (csi-lib's
            # storage/filesystem.go) or the Secret's defaultMode: as root (CI) the test does the
            # same, so rpcguard's key permission check sees the pod's files.
            mode = vol["secret"]["defaultMode"] if "secret" in vol else 0o440
            (target / "tls.key").chmod(mode if os.geteuid() == 0 else 0o600)
            (target / "ca.crt").write_bytes((ca_dir / "ca.pem").read_bytes())
    return root


def lay_out_pods(tmp_path_factory, issuers: dict[str, Path]) -> dict[str, Path]:
    """Per workload: a directory laid out like its first pod's rpcguard container (root = '/')."""
    return {workload: lay_out_pod(tmp_path_factory.mktemp(workload), workload, issuers)
            for workload, _, _ in rpcguard_containers()}


# The module-scoped fixtures of the tests that start the pods' rpcguard processes (import them).
@pytest.fixture(scope="module")
def issuers(tmp_path_factory) -> dict[str, Path]:
    return make_issuers(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def pod_roots(tmp_path_factory, issuers) -> dict[str, Path]:
    return lay_out_pods(tmp_path_factory, issuers)


def reroot(text: str, root: Path, container: dict) -> str:
    """Put ``root`` in front of every path under one of the container's mount points."""
    mounts = sorted((m["mountPath"] for m in container["volumeMounts"]), key=len, reverse=True)
    pattern = r"(?<![\w/.-])(" + "|".join(map(re.escape, mounts)) + ")/"
    return re.sub(pattern, lambda m: f"{root}{m.group(1)}/", text)  # one pass: never twice


def kustomize(path: Path) -> list[dict]:
    """The objects ``kubectl kustomize PATH`` renders (kubectl from .ci/install-ops-tools.sh: CI
    fails without it, a developer's machine skips)."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        need.missing("kubectl", "install it as root with: bash .ci/install-ops-tools.sh")
    run = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return [d for d in yaml.safe_load_all(run.stdout) if d]
