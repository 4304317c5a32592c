"""Downgrades are loud: what a policy switches off, whether a listener enforces, the WARNING lines
and the gauges (downgrades.report), with configs parsed by the real config reader."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from rpcguard.observe import downgrades
from rpcguard.config.model import parse_config
from rpcguard.observe.metrics import Metrics
from rpcguard.protocol.settings import CHECK_NAMES, FirewallPolicy, Profile, SessionPolicy
from rpcguard.observe.webconfig import load_web_config


@pytest.fixture
def base(tmp_path: Path) -> Path:
    for name in ("cert.pem", "key.pem", "ca.pem"):
        (tmp_path / name).write_text("x")
    return tmp_path


def serve(base: Path, **extra) -> dict:
    return {"tls": {"cert": "cert.pem", "key": "key.pem", "ca": "ca.pem"}, "allow": {"cn": ["llama1"]},
            "listeners": [{"name": "gpu0", "listen": "0.0.0.0:50100", "upstream": "127.0.0.1:50052"},
                          {"name": "gpu1", "listen": "0.0.0.0:50101", "upstream": "127.0.0.1:50053"}], **extra}


def test_what_a_policy_switches_off():
    assert downgrades.switched_off(SessionPolicy()) == ()
    assert downgrades.switched_off(SessionPolicy(mode="monitor")) == ("monitor_mode",)
    off = SessionPolicy(firewall=FirewallPolicy(disabled_checks=frozenset({"graph_ops", "tensor"}),
                                                allow_unverified_ops=frozenset({"SSM_SCAN"})))
    assert downgrades.switched_off(off) == ("check_tensor", "check_graph_ops", "unverified_ops")
    assert set(downgrades.SWITCHED_OFF) == {"monitor_mode", "unverified_ops", "shared_upstream", "gpu_uncontained",
                                            *(f"check_{c}" for c in CHECK_NAMES)}


def test_a_listener_enforces_only_when_every_profile_does():
    strict, loose = Profile("default"), Profile("tenant", SessionPolicy(mode="monitor"))
    assert downgrades.enforces(strict) and downgrades.enforces(strict, {})
    assert not downgrades.enforces(strict, {"tenant": loose})
    assert not downgrades.enforces(loose)
    # ops allowed by name are an opt-in counted per use: the listener still enforces every check
    named = Profile("default", SessionPolicy(firewall=FirewallPolicy(allow_unverified_ops=frozenset({"SSM_SCAN"}))))
    assert downgrades.enforces(named)


def test_report_warns_per_listener_and_sets_the_gauges(base, caplog):
    data = serve(base, policy={"mode": "monitor"})
    data["listeners"][1]["policy"] = {"mode": "enforce", "checks": {"graph_ops": False}}
    cfg = parse_config(data, base_dir=str(base))
    m = Metrics(CollectorRegistry(), role="serve")
    with caplog.at_level(logging.WARNING, logger="rpcguard"):
        lines = downgrades.report(cfg, m)
    assert [r.getMessage() for r in caplog.records if r.name == "rpcguard.downgrades"] == lines
    assert len(lines) == 2 and all("NOT ENFORCING" in line for line in lines)
    assert "gpu0" in lines[0] and "monitor mode" in lines[0] and "TLS handshake" in lines[0]
    assert "gpu1" in lines[1] and "graph_ops switched off" in lines[1] and "monitor" not in lines[1]
    g = m.registry.get_sample_value
    for name, what in (("gpu0", "monitor_mode"), ("gpu1", "check_graph_ops")):
        rl = {"role": "serve", "listener": name}
        assert g("rpcguard_listener_enforcing", rl) == 0
        assert g("rpcguard_listener_switched_off", {**rl, "what": what}) == 1
        assert sum(g("rpcguard_listener_switched_off", {**rl, "what": w}) for w in downgrades.SWITCHED_OFF) == 1
    # the file fixed: no warning, every listener enforcing (a reload calls report again)
    caplog.clear()
    m_cfg = parse_config(serve(base), base_dir=str(base))
    with caplog.at_level(logging.WARNING, logger="rpcguard"):
        assert downgrades.report(m_cfg, m) == []
    assert g("rpcguard_listener_enforcing", {"role": "serve", "listener": "gpu0"}) == 1
    assert g("rpcguard_listener_switched_off", {"role": "serve", "listener": "gpu0", "what": "monitor_mode"}) == 0


def test_report_names_a_monitoring_profile(base):
    data = serve(base, profiles={"trial": {"policy": {"mode": "monitor"}}},
                 allow=[{"cn": ["llama1"], "profile": "trial"}])
    lines = downgrades.report(parse_config(data, base_dir=str(base)), Metrics(CollectorRegistry()))
    assert len(lines) == 2 and all("profile trial: firewall in monitor mode" in line for line in lines)


def test_public_metrics_without_tls_and_auth_are_a_downgrade(base, tmp_path):
    m = Metrics(CollectorRegistry(), role="serve")
    cfg = parse_config(serve(base, metrics={"listen": "0.0.0.0:9450", "unsafe_public": True}), base_dir=str(base))
    (line,) = downgrades.report(cfg, m)
    assert "metrics endpoint 0.0.0.0:9450 is served beyond loopback without TLS" in line
    assert m.registry.get_sample_value("rpcguard_metrics_unprotected", {"role": "serve"}) == 1
    # TLS + basic auth: protected, no warning
    web = tmp_path / "web.yml"
    web.write_text("tls_server_config:\n  cert_file: cert.pem\n  key_file: key.pem\n"
                   "basic_auth_users:\n  prom: $2b$12$hNf2lSsxfm0.i4a.1kVpSOVyBCfIB51VRjgBUyv6kdnyTlgWj81Ay\n")
    (tmp_path / "key.pem").chmod(0o600)
    wc = load_web_config(str(web))
    assert downgrades.report(cfg, m, wc) == []
    assert m.registry.get_sample_value("rpcguard_metrics_unprotected", {"role": "serve"}) == 0


@pytest.mark.parametrize("allow, shared", [
    ({"cn": ["llama1"]}, False),  # one tenant: single-tenant use of --upstream
    ({"cn": ["llama1", "llama2"]}, True),
    ({"uri": ["spiffe://lab/llama/*"]}, True),
    ({"ip": ["10.0.0.0/8"]}, True),
    ({"all": True}, True),
])
def test_an_upstream_shared_by_several_identities_is_said_loudly(base, caplog, allow, shared):
    """issue 28.6: --upstream (one server someone else runs) with more than one allowed identity:
    a WARNING per listener and rpcguard_listener_switched_off{what="shared_upstream"}; the
    listener still enforces its firewall."""
    m = Metrics(CollectorRegistry(), role="serve")
    data = serve(base)
    data["allow"] = allow  # {"all": true}: any certificate of the CA (--allow-all)
    cfg = parse_config(data, base_dir=str(base))
    with caplog.at_level(logging.WARNING, logger="rpcguard"):
        lines = downgrades.report(cfg, m)
    g = m.registry.get_sample_value
    rl = {"role": "serve", "listener": "gpu0"}
    assert g("rpcguard_listener_switched_off", {**rl, "what": "shared_upstream"}) == (1 if shared else 0)
    assert g("rpcguard_listener_enforcing", rl) == 1
    said = [line for line in lines if "SHARED UPSTREAM" in line]
    assert len(said) == (2 if shared else 0), lines
    if shared:
        assert "serve -- ggml-rpc-server" in said[0] and "gpu0" in said[0]


def test_a_contained_listener_is_not_a_shared_upstream(base, tmp_path):
    data = serve(base)
    data["allow"] = {"cn": ["llama1", "llama2"]}
    true = "/bin/true" if Path("/bin/true").exists() else "/usr/bin/true"
    data["listeners"] = [{"name": "gpu0", "listen": "0.0.0.0:50100", "upstream": {"exec": [true]}}]
    m = Metrics(CollectorRegistry(), role="serve")
    assert downgrades.report(parse_config(data, base_dir=str(base)), m) == []
    assert m.registry.get_sample_value("rpcguard_listener_switched_off",
                                       {"role": "serve", "listener": "gpu0", "what": "shared_upstream"}) == 0
