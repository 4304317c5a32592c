"""Every setting declared once: the key tables of tls / metrics / log (config/process.py), the flags
made from the tables (config/flags.py), and tls.min_version's one default and one list of values."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest
import yaml

from rpcguard.config import flags as flagmod
from rpcguard.config.flags import FLAGS, KEY_TABLES, build_config
from rpcguard.config.model import parse_config
from rpcguard.config.process import LOG_KEYS, METRICS_KEYS, TLS_KEYS, LogConfig, MetricsConfig, TlsConfig
from rpcguard.config.read import choice
from rpcguard.errors import ConfigError
from rpcguard.pki import tls as pkitls
from rpcguard.pki.tlsversion import DEFAULT_MIN_VERSION, TLS_MIN_VERSIONS


@pytest.fixture
def base(tmp_path: Path, monkeypatch) -> Path:
    for name in ("cert.pem", "key.pem", "ca.pem"):
        (tmp_path / name).write_text("x")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def write(path: Path, data: dict) -> str:
    path.write_text(yaml.safe_dump(data))
    return str(path)


TLS = {"cert": "cert.pem", "key": "key.pem", "ca": "ca.pem"}


def serve_file(base: Path, **extra) -> str:
    data = {"tls": dict(TLS), "allow": {"cn": ["c"]},
            "listeners": [{"name": "a", "listen": "127.0.0.1:0", "upstream": "127.0.0.1:50052"}], **extra}
    return write(base / "serve.yaml", data)


# ---------------------------------------------------------------- the tables


@pytest.mark.parametrize("table, cls", [(TLS_KEYS, TlsConfig), (METRICS_KEYS, MetricsConfig), (LOG_KEYS, LogConfig)])
def test_each_key_is_a_field_and_each_field_a_key(table, cls) -> None:
    assert set(table) == {f.name for f in dataclasses.fields(cls)}


def test_every_flag_of_a_section_names_a_row_of_its_table_and_takes_its_choices() -> None:
    for f in FLAGS:
        if f.scope != "global":
            continue
        section, key = f.key.split(".")
        read = KEY_TABLES[section][key]  # KeyError: a flag for a key no table reads
        assert f.choices == (read.choices if isinstance(read, choice) else None), f.name


# ---------------------------------------------------------------- tls.min_version: one default, one list


def test_min_version_has_one_default_and_one_list() -> None:
    assert TlsConfig.__dataclass_fields__["min_version"].default == DEFAULT_MIN_VERSION
    for builder in (pkitls.server_context, pkitls.client_context, pkitls.probe_context):
        assert inspect.signature(builder).parameters["min_version"].default == DEFAULT_MIN_VERSION, builder
    assert TLS_KEYS["min_version"].choices == TLS_MIN_VERSIONS  # type: ignore[attr-defined]
    (flag,) = (f for f in FLAGS if f.key == "tls.min_version")
    assert flag.choices == TLS_MIN_VERSIONS
    assert tuple(pkitls._VERSIONS) == TLS_MIN_VERSIONS


@pytest.mark.parametrize("value, shown", [("1.1", "'1.1'"), (1.0, "1.0"), ("TLS13", "'TLS13'")])
def test_a_bad_min_version_is_one_line_naming_the_key(base: Path, value, shown) -> None:
    data = {"tls": {**TLS, "min_version": value}, "tunnels": [{"listen": "127.0.0.1:1", "server": "n:1"}]}
    with pytest.raises(ConfigError) as info:
        parse_config(data, base_dir=str(base))
    assert str(info.value) == f"tls.min_version: must be one of {', '.join(TLS_MIN_VERSIONS)}, got {shown}"


def test_log_and_metrics_read_by_their_tables(base: Path) -> None:
    data = {"tls": TLS, "log": {"format": "json", "level": "debug"}, "metrics": {"listen": ""},
            "tunnels": [{"listen": "127.0.0.1:1", "server": "n:1"}]}
    cfg = parse_config(data, base_dir=str(base))
    assert (cfg.log, cfg.metrics.listen) == (LogConfig("json", "debug"), None)
    with pytest.raises(ConfigError, match=r"^log.level: must be one of debug, info, warning, error, got 'loud'$"):
        parse_config({**data, "log": {"level": "loud"}}, base_dir=str(base))


# ---------------------------------------------------------------- flags reach any section


@pytest.fixture
def limit_flags(monkeypatch):
    """Flags for limits keys (none of the shipped flags sets one yet): what a new row of FLAGS would add."""
    extra = {"max_sessions": ("limits", "max_sessions"), "drain_timeout_s": ("limits", "drain_timeout_s")}
    monkeypatch.setattr(flagmod, "GLOBAL", {**flagmod.GLOBAL, **extra})


def test_a_limits_flag_works_when_the_file_has_no_limits_section(base: Path, limit_flags) -> None:
    # main: KeyError 'limits' (only tls, metrics, log and policy were copied for the flags)
    cfg = build_config("serve", file=serve_file(base), overrides={"max_sessions": 3})
    assert cfg.limits.max_sessions == 3 and cfg.listeners[0].default.limits.max_sessions == 3
    cfg = build_config("serve", overrides={**TLS, "listen": "127.0.0.1:0", "upstream": "127.0.0.1:1",
                                           "allow_all": True, "max_sessions": 5})
    assert cfg.limits.max_sessions == 5


def test_a_bad_limits_flag_value_names_the_flag(base: Path, limit_flags) -> None:
    with pytest.raises(ConfigError) as info:
        build_config("serve", file=serve_file(base), overrides={"max_sessions": -1})
    assert str(info.value) == "--max-sessions: must be an integer > 0, got -1"


def test_a_limits_flag_beats_a_profile_s_own_limit(base: Path, limit_flags) -> None:
    file = serve_file(base, limits={"max_sessions": 8}, profiles={"batch": {"limits": {"max_sessions": 2}}},
                      allow=[{"cn": ["b"], "profile": "batch"}, {"cn": ["c"]}])
    assert build_config("serve", file=file).listeners[0].profiles["batch"].limits.max_sessions == 2
    (li,) = build_config("serve", file=file, overrides={"max_sessions": 4}).listeners
    assert (li.default.limits.max_sessions, li.profiles["batch"].limits.max_sessions) == (4, 4)


def test_a_policy_flag_beats_a_listener_s_and_a_profile_s_own_value(base: Path) -> None:
    # main: only --mode did; --allow-unverified-op left a listener's own allow_unverified_ops in place
    file = serve_file(base, profiles={"p": {"policy": {"allow_unverified_ops": ["IM2COL"]}}},
                      allow=[{"cn": ["p"], "profile": "p"}, {"cn": ["c"]}])
    data = yaml.safe_load(Path(file).read_text())
    data["listeners"][0]["policy"] = {"allow_unverified_ops": ["SSM_SCAN"]}
    file = write(base / "serve.yaml", data)
    (li,) = build_config("serve", file=file, overrides={"allow_unverified_op": ["RWKV_WKV6"]}).listeners
    assert li.policy.firewall.allow_unverified_ops == frozenset({"RWKV_WKV6"})
    assert li.profiles["p"].policy.firewall.allow_unverified_ops == frozenset({"RWKV_WKV6"})
    (li,) = build_config("serve", file=file).listeners  # no flag: the file's layers
    assert li.policy.firewall.allow_unverified_ops == frozenset({"SSM_SCAN"})


def test_a_policy_flag_beats_a_tunnel_s_own_value(base: Path) -> None:
    file = write(base / "connect.yaml", {"tls": TLS, "tunnels": [
        {"listen": "127.0.0.1:1", "server": "n:1", "policy": {"mode": "monitor"}},
        {"listen": "127.0.0.1:2", "server": "n:2"}]})
    cfg = build_config("connect", file=file, overrides={"mode": "enforce"})
    assert [t.policy.mode for t in cfg.tunnels] == ["enforce", "enforce"]


def test_a_profile_setting_a_top_only_limit_is_still_named_by_its_key(base: Path, limit_flags) -> None:
    file = serve_file(base, profiles={"batch": {"limits": {"drain_timeout_s": 2}}},
                      allow=[{"cn": ["b"], "profile": "batch"}, {"cn": ["c"]}])
    with pytest.raises(ConfigError) as info:
        build_config("serve", file=file, overrides={"drain_timeout_s": 4.0})
    assert str(info.value).startswith("profiles.batch.limits.drain_timeout_s: cannot be set in a profile")
