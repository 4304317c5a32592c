"""A listener on a GPU node (issue 29.3): its server is one sandboxed process per session by
default and serve says so; --upstream with policy.backend cuda, or upstream.isolation identity /
shared, or the sandbox off, on a GPU node is a WARNING naming what it gives up (index ops reading
and writing any tenant's device memory, a sticky CUDA fault ending every tenant) and which of
those ops are refused or forwarded uncontained, and rpcguard_listener_switched_off{what=
"gpu_uncontained"} 1. Configs parsed by the real config reader."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from rpcguard.config.model import parse_config
from rpcguard.observe import downgrades
from rpcguard.observe.metrics import Metrics

TRUE = "/bin/true" if Path("/bin/true").exists() else "/usr/bin/true"
RL = {"role": "serve", "listener": "gpu0"}


@pytest.fixture
def base(tmp_path: Path) -> Path:
    for name in ("cert.pem", "key.pem", "ca.pem"):
        (tmp_path / name).write_text("x")
    return tmp_path


def config(base: Path, upstream, policy: dict | None = None):
    listener = {"name": "gpu0", "listen": "0.0.0.0:50100", "upstream": upstream}
    if policy is not None:
        listener["policy"] = policy
    data = {"tls": {"cert": "cert.pem", "key": "key.pem", "ca": "ca.pem"}, "allow": {"cn": ["llama1"]},
            "listeners": [listener]}
    return parse_config(data, base_dir=str(base))


def report(cfg, caplog) -> tuple[list[str], float | None]:
    m = Metrics(CollectorRegistry(), role="serve")
    with caplog.at_level(logging.INFO, logger="rpcguard"):
        lines = downgrades.report(cfg, m)
    return lines, m.registry.get_sample_value("rpcguard_listener_switched_off", {**RL, "what": "gpu_uncontained"})


def test_a_gpu_listener_defaults_to_one_process_per_session_and_says_so(base, caplog):
    cfg = config(base, {"exec": [TRUE, "-d", "CUDA0"]})
    managed = cfg.items[0].managed
    assert managed is not None and managed.gpu and managed.isolation == "session"
    lines, gauge = report(cfg, caplog)
    assert lines == [] and gauge == 0
    said = [r.getMessage() for r in caplog.records if r.name == "rpcguard.downgrades" and r.levelno == logging.INFO]
    assert len(said) == 1 and "GPU node: one sandboxed server process per session" in said[0]
    assert "GET_ROWS" in said[0]


def test_a_cpu_server_is_not_a_gpu_listener(base, caplog):
    cfg = config(base, {"exec": [TRUE, "-d", "CPU"], "isolation": "shared"})
    assert not cfg.items[0].managed.gpu
    lines, gauge = report(cfg, caplog)
    assert lines == [] and gauge == 0


@pytest.mark.parametrize("upstream, policy, why", [
    ({"exec": [TRUE, "-d", "CUDA0"], "isolation": "shared"}, None, "upstream.isolation: shared"),
    ({"exec": [TRUE, "-d", "CUDA1"], "isolation": "identity"}, None, "upstream.isolation: identity"),
    ({"exec": [TRUE, "-d", "CUDA0"], "sandbox": {"mode": "off"}}, None, "upstream.sandbox.mode: off"),
    ("127.0.0.1:50052", {"backend": "cuda"}, "--upstream: one server someone else runs"),
])
def test_an_uncontained_gpu_listener_is_said_loudly_and_counted(base, caplog, upstream, policy, why):
    lines, gauge = report(config(base, upstream, policy), caplog)
    said = [line for line in lines if "GPU NODE NOT CONTAINED" in line]
    assert len(said) == 1 and gauge == 1, lines
    assert f"({why})" in said[0] and "gpu0" in said[0]
    assert "sticky CUDA fault" in said[0] and "every tenant" in said[0]
    assert "refused op_needs_containment on a CUDA device: GET_ROWS, SET_ROWS, ADD_ID, MUL_MAT_ID" in said[0]
    assert "FORWARDED UNCONTAINED" not in said[0]
    warned = [r.getMessage() for r in caplog.records if r.name == "rpcguard.downgrades" and r.levelno == logging.WARNING]
    assert said[0] in warned


def test_the_acknowledgement_is_named_in_the_warning(base, caplog):
    policy = {"backend": "cuda", "allow_unverified_ops": ["GET_ROWS", "SET_ROWS", "ADD_ID", "MUL_MAT_ID"]}
    lines, gauge = report(config(base, "127.0.0.1:50052", policy), caplog)
    said = [line for line in lines if "GPU NODE NOT CONTAINED" in line]
    assert len(said) == 1 and gauge == 1
    assert "FORWARDED UNCONTAINED (a profile's policy.allow_unverified_ops): GET_ROWS, SET_ROWS, ADD_ID, MUL_MAT_ID" \
        in said[0]
    assert "refused op_needs_containment on a CUDA device: SSM_SCAN" in said[0] and "every model" not in said[0]


def test_an_upstream_held_to_the_cpu_layer_is_not_a_gpu_listener(base, caplog):
    for policy in (None, {"backend": "cpu"}, {"backend": "auto"}):
        lines, gauge = report(config(base, "127.0.0.1:50052", policy), caplog)
        assert lines == [] and gauge == 0
