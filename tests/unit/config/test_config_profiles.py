"""Unit tests for profiles (config, allow-list matching, Route.profile_for) and reload diffing."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from rpcguard.config.model import config_summary, parse_config
from rpcguard.config.flags import build_config
from rpcguard.config.diff import ConfigDiff, diff_configs, keep_restart_keys
from rpcguard.errors import ConfigError
from rpcguard.pki.identity import PeerIdentity
from rpcguard.observe.metrics import ListenerTraffic
from rpcguard.protocol.settings import Limits, Profile
from rpcguard.proxy.route import Route


@pytest.fixture
def base(tmp_path: Path) -> Path:
    for name in ("cert.pem", "key.pem", "ca.pem"):
        (tmp_path / name).write_text("x")
    return tmp_path


def data() -> dict:
    return {
        "tls": {"cert": "cert.pem", "key": "key.pem", "ca": "ca.pem"},
        "policy": {"max_graph_nodes": 1000},
        "limits": {"hello_timeout_s": 7},
        "profiles": {
            "monitor": {"policy": {"allow_commands": ["@handshake", "GET_DEVICE_MEMORY"]},
                        "limits": {"max_sessions": 2}},
            "tenant": {"policy": {"max_session_alloc_bytes": "1GiB", "mode": "monitor"}},
        },
        "allow": [{"cn": ["probe"], "profile": "monitor"}, {"uri": ["spiffe://lab/t/*"], "profile": "tenant"},
                  {"cn": ["probe", "client1"]}],
        "listeners": [{"name": "gpu0", "listen": "127.0.0.1:50100", "upstream": "127.0.0.1:50052"},
                      {"name": "gpu1", "listen": "127.0.0.1:50101", "upstream": "127.0.0.1:50053",
                       "policy": {"max_graph_nodes": 50}}],
    }


def error(d: dict, base: Path) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(d, base_dir=str(base))
    text = str(info.value)
    assert "\n" not in text
    return text


def ident(cn: str | None = None, uri: str | None = None) -> PeerIdentity:
    return PeerIdentity(cn, (), (uri,) if uri else (), (), 1, 0.0, "00")


def test_profiles_merge_over_each_listeners_own_settings(base: Path) -> None:
    cfg = parse_config(data(), base_dir=str(base))
    gpu0, gpu1 = cfg.listeners
    for li, nodes in ((gpu0, 1000), (gpu1, 50)):
        mon, ten = li.profiles["monitor"], li.profiles["tenant"]
        assert (mon.name, ten.name, li.default.name) == ("monitor", "tenant", "default")
        assert mon.policy.allowed_commands == {"HELLO", "DEVICE_COUNT", "GET_DEVICE_MEMORY"}
        assert mon.policy.firewall.max_graph_nodes == ten.policy.firewall.max_graph_nodes == nodes
        assert (mon.limits.max_sessions, mon.limits.hello_timeout_s) == (2, 7.0)
        assert ten.limits == cfg.limits == Limits(hello_timeout_s=7.0)
        assert (ten.policy.firewall.max_session_alloc_bytes, ten.policy.mode) == (1 << 30, "monitor")
        assert li.default.policy.mode == "enforce" and li.default.policy.firewall.max_session_alloc_bytes == 0
    assert "acl=CN:probe=>monitor,URI:spiffe://lab/t/*=>tenant,CN:probe,CN:client1" in config_summary(cfg)[0]
    assert "profile monitor: mode=enforce commands=3 max_sessions=2" in config_summary(cfg)[0]


def test_first_matching_entry_decides_the_profile(base: Path) -> None:
    gpu0 = parse_config(data(), base_dir=str(base)).listeners[0]
    route = Route("serve", "gpu0", "127.0.0.1", 50052, ListenerTraffic("serve", "gpu0"),
                  default=gpu0.default, profiles=gpu0.profiles, allow=gpu0.allow)
    # "probe" is also in the last (default) entry: the first entry wins
    assert route.profile_for(ident("probe")) is gpu0.profiles["monitor"]
    assert route.profile_for(ident(uri="spiffe://lab/t/a")) is gpu0.profiles["tenant"]
    assert route.profile_for(ident("client1")) is gpu0.default
    assert route.allow is not None and not route.allow.allows(ident("nobody"))
    assert route.traffic.profile_sessions == {"monitor": 1, "tenant": 1, "default": 1}
    assert route.default is gpu0.default  # (route.policy / route.limits: read-only views of it for the old relay)
    # a reload swaps the route's settings; a Profile already handed out is unchanged
    held = route.profile_for(ident("probe"))
    route.profiles = {"monitor": Profile("monitor", limits=Limits(max_sessions=9))}
    assert route.profile_for(ident("probe")).limits.max_sessions == 9 and held.limits.max_sessions == 2


@pytest.mark.parametrize("mutate, expected", [
    (lambda d: d["allow"][0].update(profile="nope"),
     "allow[0].profile: unknown profile 'nope' (defined in profiles: monitor, tenant)"),
    (lambda d: d.pop("profiles"), "allow[0].profile: unknown profile 'monitor' (defined in profiles: none)"),
    (lambda d: d["profiles"].update(default={}),
     "profiles.default: 'default' is reserved: it names the listener's own policy and limits"),
    (lambda d: d["profiles"]["monitor"]["limits"].update(handshake_timeout_s=3),
     "profiles.monitor.limits.handshake_timeout_s: cannot be set in a profile: it applies before the identity "
     "(and so its profile) is known; set it in the top-level limits"),
    (lambda d: d["profiles"]["monitor"]["limits"].update(drain_timeout_s=3),
     "profiles.monitor.limits.drain_timeout_s: cannot be set in a profile: it applies to the whole process; "
     "set it in the top-level limits"),
    (lambda d: d["profiles"]["monitor"]["limits"].update(max_pending_per_source=3),
     "profiles.monitor.limits.max_pending_per_source: cannot be set in a profile: it counts every identity that "
     "connects from one address; set it in the top-level limits"),
    (lambda d: d["profiles"]["tenant"]["policy"].update(max_graph=1),
     "profiles.tenant.policy.max_graph: unknown key (did you mean 'max_graph_nodes'? expected one of: accepted_versions, allow_commands, "
     "allow_unverified_ops, backend, checks, clear_new_buffers, denied_ops, device_memory_share_bytes, max_alloc_bytes, max_cuda_scratch_bytes, max_graph_bytes, "
     "max_graph_compute_s, max_graph_cpu_ms, max_graph_nodes, max_graph_tensors, max_request_bytes, "
     "max_session_alloc_bytes, max_work_bytes, mode, node_gflops, server_threads, validate_requests)"),
    (lambda d: d["profiles"]["tenant"].update(acl={}),
     "profiles.tenant.acl: unknown key (expected one of: limits, policy)"),
    (lambda d: d.update(profiles=["monitor"]),
     "profiles: must be a mapping of name -> {policy, limits}, got a list"),
    (lambda d: d["profiles"].update({"bad name": {}}),
     "profiles.bad name: must be a name of letters, digits, '_', '.', '-', got 'bad name'"),
    (lambda d: d["allow"].append({}), "allow[3]: empty entry: give cn/dns/uri/ip entries or all: true"),
    (lambda d: d["allow"].append({"all": True, "cn": ["x"]}),
     "allow[3].all: all: true admits any certificate; remove it or the entries"),
    (lambda d: d["allow"][1].update(uri=["spiffe://a/*/b"]),
     "allow[1].uri[0]: 'spiffe://a/*/b': only a trailing '/*' wildcard is supported"),
    (lambda d: d.update(allow=[]),
     "allow: empty allow-list: give cn/dns/uri/ip entries (--allow-cn/-dns/-uri/-ip), or all: true "
     "(--allow-all) to admit any certificate signed by tls.ca"),
    (lambda d: d["listeners"][1].update(allow=[{"cn": ["x"], "profile": "gone"}]),
     "listeners[1].allow[0].profile: unknown profile 'gone' (defined in profiles: monitor, tenant)"),
])
def test_profile_errors_name_the_key(base: Path, mutate, expected: str) -> None:
    d = data()
    mutate(d)
    assert error(d, base) == expected


def test_profiles_are_serve_only(base: Path) -> None:
    d = {"tls": data()["tls"], "profiles": {}, "tunnels": [{"listen": "127.0.0.1:1", "server": "n:1"}]}
    assert error(d, base) == "profiles: only valid for rpcguard serve (this is a connect config)"


def test_flags_with_profiles(base: Path, monkeypatch) -> None:
    d = data()
    d["listeners"] = d["listeners"][:1]
    f = base / "p.yaml"
    f.write_text(yaml.safe_dump(d))
    monkeypatch.chdir(base)
    cfg = build_config("serve", file=str(f), overrides={"mode": "enforce"})  # --mode beats a profile's own
    assert cfg.listeners[0].profiles["tenant"].policy.mode == "enforce"
    with pytest.raises(ConfigError) as info:
        build_config("serve", file=str(f), overrides={"allow_cn": ["x"]})
    assert str(info.value) == ("--allow-cn: the config file's allow-list is a list of entries (profiles); "
                               "put this identity in the file instead")


def test_diff_names_what_changed(base: Path) -> None:
    old = parse_config(data(), base_dir=str(base))
    assert diff_configs(old, old) == ConfigDiff() and ConfigDiff().summary() == "no change"
    d = data()
    d["policy"]["max_graph_nodes"] = 10  # every listener and every profile: named once per listener
    d["limits"]["hello_timeout_s"] = 3  # and not repeated per profile
    d["profiles"]["monitor"]["limits"]["max_sessions"] = 5
    d["profiles"]["tenant"]["policy"]["allow_commands"] = ["@query"]
    d["allow"][2]["cn"] = ["client2"]
    d["listeners"][1]["upstream"] = "127.0.0.1:50099"  # replaced
    d["listeners"].append({"name": "gpu2", "listen": "127.0.0.1:50102", "upstream": "127.0.0.1:50054"})
    d["metrics"] = {"listen": "127.0.0.1:9999"}
    d["log"] = {"format": "json", "level": "debug"}
    new = parse_config(d, base_dir=str(base))
    diff = diff_configs(old, new)
    assert diff.changed == (
        "log.level", "limits.hello_timeout_s", "listeners[gpu0].policy.max_graph_nodes", "listeners[gpu0].allow",
        "listeners[gpu0].profiles.monitor.limits.max_sessions", "listeners[gpu0].profiles.tenant.policy.allow_commands",
        "listeners[gpu1].upstream")
    assert (diff.kept, diff.added, diff.removed, diff.replaced) == (("metrics.listen", "log.format"), ("gpu2",), (), ("gpu1",))
    assert diff.summary() == (
        "changed log.level, limits.hello_timeout_s, listeners[gpu0].policy.max_graph_nodes, listeners[gpu0].allow, "
        "listeners[gpu0].profiles.monitor.limits.max_sessions, listeners[gpu0].profiles.tenant.policy.allow_commands, "
        "listeners[gpu1].upstream; added listener gpu2; replaced listener gpu1; kept until restart: metrics.listen, "
        "log.format")
    kept = keep_restart_keys(old, new)
    assert (kept.metrics.listen, kept.log.format, kept.log.level) == (old.metrics.listen, "text", "debug")
    assert kept.listeners == new.listeners
    # the kept keys stay reported until the process restarts with them
    assert diff_configs(kept, new).kept == ("metrics.listen", "log.format")
    # removing a listener and a profile
    d2 = copy.deepcopy(data())
    del d2["listeners"][1]
    del d2["profiles"]["tenant"]
    del d2["allow"][1]
    diff = diff_configs(old, parse_config(d2, base_dir=str(base)))
    assert diff.summary() == ("changed listeners[gpu0].allow, listeners[gpu0].profiles.tenant, profiles.tenant; "
                              "removed listener gpu1")
    # a policy key named as the user writes it (checks, max_graph_cpu_ms, allow_commands)
    d3 = data()
    d3["policy"].update(checks={"op_params": False}, max_graph_cpu_ms=100)
    d3["listeners"] = d3["listeners"][:1]
    d0 = data()
    d0["listeners"] = d0["listeners"][:1]
    assert diff_configs(parse_config(d0, base_dir=str(base)), parse_config(d3, base_dir=str(base))).changed == (
        "listeners[gpu0].policy.checks", "listeners[gpu0].policy.max_graph_cpu_ms")


def test_unused_and_shadowed_profiles_are_warned_about(base: Path, caplog) -> None:
    d = data()
    d["profiles"]["spare"] = {}
    d["allow"].insert(1, {"all": True})  # the tenant entry behind it can never decide a profile
    with caplog.at_level("WARNING"):
        cfg = parse_config(d, base_dir=str(base))
    assert not caplog.records  # data, logged by the caller
    msgs = [w for w in cfg.warnings if "profile" in w]
    assert msgs == ["profiles.spare: no allow-list entry names it (unused)"] + [
        f"{li}: the entry naming profile tenant never decides a profile: an earlier entry (all: true) matches "
        "every certificate first" for li in ("gpu0", "gpu1")]
