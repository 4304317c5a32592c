"""deploy/kubernetes-contained: the fleet of deploy/kubernetes with contained GPU nodes (serve runs
ggml-rpc-server itself, a fresh sandboxed process per session), checked offline.

How this works: ``kubectl kustomize`` renders the overlay and the base; everything but the three
objects the overlay changes (the Namespace's Pod Security labels, the GPU pod's serve.yaml and its
StatefulSet) must come out as the base's; those three are validated against Kubernetes' schemas
(strict) and held to what docs/containment.md says the sandbox needs: one container, the server
binary where the image's recipe puts it, exactly the seven capabilities, unconfined seccomp and
AppArmor for that container only, a writable emptyDir as the cache root, and a serve.yaml that
the config build accepts with per-session isolation and the sandbox required.
"""

from __future__ import annotations

import re
import shutil

import kubernetes_validate
import pytest
import yaml

from rpcguard.config.model import parse_config
from tests.support.k8s import K8S, ROOT, containers, issuers, kustomize, pod_roots, reroot  # noqa: F401 (fixtures)

OVERLAY = ROOT / "deploy" / "kubernetes-contained"
CONTAINERFILE = ROOT / "deploy" / "container" / "Containerfile"
# securityContext.appArmorProfile is a field from Kubernetes 1.30 on: the overlay needs 1.30 (the base 1.29)
K8S_VERSIONS = ("1.30.0", "1.33.0")
# docs/containment.md, "What the host must give": what serve uses of root to build the sandbox
SANDBOX_CAPS = ["SYS_ADMIN", "SETUID", "SETGID", "CHOWN", "FOWNER", "SYS_PTRACE", "KILL"]
CHANGED = {("Namespace", "rpcguard"), ("ConfigMap", "gpu-node-rpcguard"), ("StatefulSet", "gpu-node")}


def _render(path) -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for d in kustomize(path)}


@pytest.fixture(scope="module")
def rendered() -> tuple[dict, dict]:
    return _render(OVERLAY), _render(K8S)


def _pod(objs: dict) -> dict:
    return objs[("StatefulSet", "gpu-node")]["spec"]["template"]["spec"]


def _serve_yaml(objs: dict) -> dict:
    return yaml.safe_load(objs[("ConfigMap", "gpu-node-rpcguard")]["data"]["serve.yaml"])


def test_only_the_gpu_pod_and_the_namespace_labels_change(rendered):
    contained, base = rendered
    assert contained.keys() == base.keys()
    for key in contained.keys() - CHANGED:
        assert contained[key] == base[key], key
    for key in CHANGED:
        assert contained[key] != base[key], key


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("key", sorted(CHANGED))
def test_changed_objects_validate_strictly(rendered, key, version):
    kubernetes_validate.validate(rendered[0][key], version, strict=True)


def test_the_gpu_pod_is_one_container_running_the_server_through_serve(rendered):
    contained, _ = rendered
    spec = _pod(contained)
    (c,) = containers(spec)  # no ggml-rpc-server sidecar
    assert c["name"] == "rpcguard-serve" and c["command"] == ["rpcguard"]
    stage = re.search(r"^FROM \S+ AS rpcguard-node$(.*?)(?=^FROM |\Z)", CONTAINERFILE.read_text(), re.M | re.S)
    assert stage and c["image"].split("/")[-1].startswith("rpcguard-node:")
    listener = _serve_yaml(contained)["listeners"][0]
    exec_ = listener["upstream"]["exec"]
    assert re.search(rf"^COPY --from=\S+ \S+ {re.escape(exec_[0])}$", stage.group(1), re.M), exec_[0]
    assert listener["upstream"]["isolation"] == "session"
    assert listener["upstream"]["sandbox"]["mode"] == "required"
    assert c["resources"]["limits"].get("nvidia.com/gpu") == 1  # the GPU is the server's, inside serve's container


def test_only_the_sandbox_needs_are_granted(rendered):
    contained, base = rendered
    spec = _pod(contained)
    (c,) = containers(spec)
    sc = c["securityContext"]
    assert sc["capabilities"] == {"drop": ["ALL"], "add": SANDBOX_CAPS}
    assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"]
    assert sc["runAsUser"] == 0 and sc["runAsNonRoot"] is False  # the server gets uid_base+N in its sandbox
    assert sc["seccompProfile"] == {"type": "Unconfined"} and sc["appArmorProfile"] == {"type": "Unconfined"}
    assert spec["securityContext"] == _pod(base)["securityContext"]  # the pod's defaults stay restricted
    assert not any(spec.get(k) for k in ("hostNetwork", "hostPID", "hostIPC"))
    doc = (ROOT / "docs" / "containment.md").read_text()
    assert all(f"CAP_{cap}" in doc or cap in doc for cap in SANDBOX_CAPS)


def test_the_cache_root_is_a_writable_emptydir(rendered):
    contained, _ = rendered
    spec = _pod(contained)
    (c,) = containers(spec)
    root = _serve_yaml(contained)["listeners"][0]["upstream"]["sandbox"]["cache_root"]
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == root]
    assert not mount.get("readOnly")
    (vol,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    assert "emptyDir" in vol and vol["emptyDir"].get("sizeLimit")


def test_the_namespace_enforces_privileged_and_still_reports_restricted(rendered):
    labels = rendered[0][("Namespace", "rpcguard")]["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "privileged"
    assert labels["pod-security.kubernetes.io/warn"] == labels["pod-security.kubernetes.io/audit"] == "restricted"


def test_the_contained_serve_yaml_builds(rendered, pod_roots):
    """With the base pod's mounts laid out (its certificates, web config), re-rooted like
    tests/unit/test_kubernetes.py does for the base."""
    (c,) = containers(_pod(rendered[0]))
    text = reroot(rendered[0][("ConfigMap", "gpu-node-rpcguard")]["data"]["serve.yaml"], pod_roots["gpu-node"], c)
    data = yaml.safe_load(text)
    upstream = data["listeners"][0]["upstream"]
    assert upstream["exec"][0] == "/usr/local/bin/ggml-rpc-server"  # the image's; not on this machine
    upstream["exec"][0] = shutil.which("true")  # any executable: the build checks it exists
    cfg = parse_config(data, "serve", source="serve.yaml")
    (item,) = cfg.listeners
    managed = item.managed  # the listener's upstream.exec
    assert managed is not None and managed.exec[1:] == ("-c",)
    assert managed.isolation == "session" and managed.sandbox.mode == "required" and managed.spare
