"""Checks of the operations artifacts under deploy/.

docs/design.md's metrics table is the single source of metric names and labels: the
dashboard and the alert rules may only use metrics (and label matchers) from it.

promtool comes from .ci/install-ops-tools.sh. Without it the promtool tests skip locally but
FAIL when the environment variable CI is set, so CI cannot silently pass without them; the same
for systemd-analyze (Debian's systemd, which the same script installs).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.support import need

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.md"
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "rpcguard-dashboard.json"
RULES = DEPLOY / "prometheus" / "rpcguard-rules.yml"
RULES_TEST = DEPLOY / "prometheus" / "rpcguard-rules.test.yml"
PROM_CONFIG = DEPLOY / "prometheus" / "prometheus.example.yml"
UNITS = {
    "serve": DEPLOY / "systemd" / "rpcguard-serve.service",
    "connect": DEPLOY / "systemd" / "rpcguard-connect.service",
}
RELOAD_DROP_IN = DEPLOY / "systemd" / "rpcguard-notify-reload.conf"
INSTALL_SCRIPT = ROOT / ".ci" / "install-ops-tools.sh"

METRIC_RE = re.compile(r"rpcguard_[a-z_]+")
SELECTOR_RE = re.compile(r"(rpcguard_[a-z_]+)\s*\{([^}]*)\}")
MATCHER_RE = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)\s*"')
LABEL_VALUES_RE = re.compile(r"label_values\(\s*(rpcguard_[a-z_]+)\s*(?:\{[^}]*\})?\s*,\s*([A-Za-z_]\w*)\s*\)")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
TARGET_LABELS = {"job", "instance"}  # added by Prometheus at scrape time


# ----------------------------------------------------------------------------- design.md


def design_metrics() -> dict[str, dict]:
    """Parse the metrics table of docs/design.md: full name -> {"type", "labels"}."""
    text = DESIGN.read_text(encoding="utf-8")
    m = re.search(r"^## Metrics.*?$(.*?)(?=^## )", text, re.S | re.M)
    assert m, "docs/design.md has no '## Metrics' section"
    prefix_m = re.search(r"prefixed `([a-z_]+)`", m.group(0))
    prefix = prefix_m.group(1) if prefix_m else "rpcguard_"
    metrics: dict[str, dict] = {}
    for line in m.group(1).splitlines():
        line = line.strip()
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) < 3 or cells[0] in ("metric", "") or set(cells[0]) <= set("-: "):
            continue
        name = cells[0].strip("`")
        labels_cell = re.sub(r"\([^)]*\)", "", cells[2]).replace("`", "")
        labels = {lbl.strip() for lbl in labels_cell.split(",") if lbl.strip()}
        metrics[prefix + name] = {"type": cells[1].split()[0], "labels": labels}
    return metrics


def resolve_metric(name: str, metrics: dict[str, dict]) -> tuple[str, set[str]] | None:
    """Return (table name, allowed labels) for a name used in PromQL, or None if unknown."""
    if name in metrics:
        return name, metrics[name]["labels"] | TARGET_LABELS
    for suffix in HISTOGRAM_SUFFIXES:
        base = name[: -len(suffix)] if name.endswith(suffix) else None
        if base and base in metrics and metrics[base]["type"] == "histogram":
            extra = {"le"} if suffix == "_bucket" else set()
            return base, metrics[base]["labels"] | TARGET_LABELS | extra
    return None


def check_promql(expr: str, metrics: dict[str, dict], where: str) -> list[str]:
    """Metric names and label matchers of one expression against the design table."""
    errors = []
    for name in METRIC_RE.findall(expr):
        if resolve_metric(name, metrics) is None:
            errors.append(f"{where}: metric {name} is not in docs/design.md's metrics table")
    for name, body in SELECTOR_RE.findall(expr):
        resolved = resolve_metric(name, metrics)
        if resolved is None:
            continue
        for label in MATCHER_RE.findall(body):
            if label not in resolved[1]:
                errors.append(f"{where}: {name} has no label {label!r} (design.md: {sorted(resolved[1])})")
    for name, label in LABEL_VALUES_RE.findall(expr):
        resolved = resolve_metric(name, metrics)
        if resolved and label not in resolved[1]:
            errors.append(f"{where}: label_values({name}, {label}): no such label")
    return errors


def test_design_table_parses():
    metrics = design_metrics()
    assert len(metrics) >= 16
    assert metrics["rpcguard_command_duration_seconds"]["type"] == "histogram"
    assert metrics["rpcguard_frames_total"]["labels"] == {"role", "listener", "direction", "command"}
    assert metrics["rpcguard_upstream_protocol_info"]["labels"] == {"role", "listener", "upstream", "version"}
    assert metrics["rpcguard_reload_total"]["labels"] == {"role", "result"}
    # both sides export these series: `role` tells them apart on every one
    for name, m in metrics.items():
        assert "role" in m["labels"], name


# ----------------------------------------------------------------------------- dashboard


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def dashboard_panels(dash: dict) -> list[dict]:
    out = []
    for p in dash["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # collapsed rows keep their panels inside
    return out


def dashboard_exprs(dash: dict) -> list[tuple[str, str]]:
    """(where, expr) for every PromQL expression: panel targets, variables, annotations."""
    exprs = []
    for p in dashboard_panels(dash):
        for t in p.get("targets", []):
            if t.get("expr"):
                exprs.append((f"panel {p.get('title')!r} target {t.get('refId')}", t["expr"]))
    for v in dash.get("templating", {}).get("list", []):
        if v.get("type") == "query":
            q = v.get("query")
            q = q.get("query") if isinstance(q, dict) else q
            exprs.append((f"variable {v['name']}", q or ""))
    for a in dash.get("annotations", {}).get("list", []):
        if a.get("expr"):
            exprs.append((f"annotation {a.get('name')!r}", a["expr"]))
    return exprs


def test_dashboard_metric_names_and_labels_are_in_design_table():
    dash = load_dashboard()
    metrics = design_metrics()
    exprs = dashboard_exprs(dash)
    assert len(exprs) >= 15
    errors = [e for where, expr in exprs for e in check_promql(expr, metrics, where)]
    assert not errors, "\n".join(errors)


def test_dashboard_structure():
    dash = load_dashboard()
    assert 36 <= dash["schemaVersion"] <= 41
    assert dash["uid"] and dash["title"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    for name in ("role", "listener", "instance"):
        assert variables[name]["type"] == "query", name
        assert variables[name]["datasource"]["uid"] == "${DS_PROMETHEUS}", name

    panels = [p for p in dashboard_panels(dash) if p["type"] != "row"]
    ids = [p["id"] for p in dashboard_panels(dash)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in panels:
        assert p["datasource"]["uid"] == "${DS_PROMETHEUS}", p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${DS_PROMETHEUS}", p["title"]

    # no two panels overlap on the 24-column grid
    cells: dict[tuple[int, int], str] = {}
    for p in dashboard_panels(dash):
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = p["title"]


def test_dashboard_has_the_required_views():
    exprs = " ".join(e for _, e in dashboard_exprs(load_dashboard()))
    flat = re.sub(r"\s+", " ", exprs)
    for q in ("0.5", "0.9", "0.99"):
        # latency split by role: connect's includes the network and the node, serve's only the server
        assert f"histogram_quantile({q}, sum by (role, command, le) (rate(rpcguard_command_duration_seconds_bucket" in flat
    assert 'kind="hash_hit"' in flat and 'kind="set_tensor"' in flat  # cache hit ratio
    assert 'count by (version) (rpcguard_upstream_protocol_info{role="serve"})' in flat  # version skew, nodes only
    assert "rpcguard_certificate_expiry_timestamp_seconds" in flat and "time()" in flat
    for metric in ("sessions_active", "sessions_total", "refusals_total", "tls_handshake_failures_total",
                   "frames_total", "bytes_total", "alloc_bytes_total", "upload_bytes_total",
                   "firewall_violations_total", "upstream_queue_depth", "reload_total", "upstream_up",
                   "reload_last_successful", "reload_last_success_timestamp_seconds", "web_refusals_total"):
        assert f"rpcguard_{metric}" in flat, metric


def test_dashboard_sessions_are_sessions_and_refusals_only_the_reasons_that_moved():
    exprs = {where: re.sub(r"\s+", " ", e) for where, e in dashboard_exprs(load_dashboard())}
    sessions = [e for e in exprs.values() if "rpcguard_sessions_total" in e]
    assert sessions and all('result!~"probe|no_hello"' in e for e in sessions), sessions
    refusals = [e for e in exprs.values() if "rate(rpcguard_refusals_total" in e]
    # 144 reasons are exported at 0 per listener: the panel draws the ones that moved
    assert refusals and all(e.rstrip().endswith("> 0") for e in refusals), refusals
    # whether each listener enforces, what is switched off, and which core each instance runs
    flat = " ".join(exprs.values())
    assert "rpcguard_listener_enforcing" in flat and "rpcguard_listener_switched_off" in flat
    assert "count by (instance, role, version, core) (rpcguard_build_info" in flat


def test_dashboard_has_a_process_and_readiness_row():
    dash = load_dashboard()
    rows = [p for p in dash["panels"] if p["type"] == "row"]
    row = next(r for r in rows if "readiness" in r["title"].lower())
    below = sorted((p for p in dash["panels"] if p["type"] != "row" and p["gridPos"]["y"] > row["gridPos"]["y"]),
                   key=lambda p: p["gridPos"]["y"])
    exprs = " ".join(t["expr"] for p in below for t in p["targets"])
    for needle in ("process_resident_memory_bytes", "process_open_fds", "process_max_fds", "process_cpu_seconds_total",
                   "rpcguard_upstream_up", 'up{job="rpcguard"', "rpcguard_reload_last_successful"):
        assert needle in exprs, needle


# ----------------------------------------------------------------------------- alert rules

REQUIRED_ALERTS = {
    "RpcguardCertificateExpiresSoon", "RpcguardCertificateExpiresVerySoon", "RpcguardRefusalsRising",
    "RpcguardProtocolVersionSkew", "RpcguardUpstreamDown", "RpcguardDown", "RpcguardFirewallViolations",
    "RpcguardClientNotAllowed", "RpcguardReloadFailed",
}
RUNBOOK = ROOT / "docs" / "runbook.md"


def load_rules() -> list[dict]:
    doc = yaml.safe_load(RULES.read_text(encoding="utf-8"))
    return [r for g in doc["groups"] for r in g["rules"]]


def test_rules_use_design_metrics_and_are_annotated():
    metrics = design_metrics()
    rules = load_rules()
    alerts = {r["alert"]: r for r in rules if "alert" in r}
    assert REQUIRED_ALERTS <= set(alerts), REQUIRED_ALERTS - set(alerts)
    errors = []
    for r in rules:
        name = r.get("alert") or r.get("record")
        errors += check_promql(r["expr"], metrics, f"rule {name}")
        if "alert" in r:
            if r.get("labels", {}).get("severity") not in ("critical", "warning", "info"):
                errors.append(f"{name}: severity label missing or unknown")
            for key in ("summary", "description"):
                if not r.get("annotations", {}).get(key):
                    errors.append(f"{name}: annotation {key} missing")
    assert not errors, "\n".join(errors)
    assert 'up{job="rpcguard"}' in alerts["RpcguardDown"]["expr"]


def runbook_anchors() -> dict[str, str]:
    """GitHub-style anchors of docs/runbook.md's sections -> section text."""
    text = RUNBOOK.read_text(encoding="utf-8")
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return {re.sub(r"[^a-z0-9 _-]", "", title.strip().lower()).replace(" ", "-"): body
            for title, body in zip(parts[1::2], parts[2::2])}


def test_every_alert_has_a_runbook_section():
    anchors = runbook_anchors()
    alerts = {r["alert"]: r for r in load_rules() if "alert" in r}
    for name, rule in alerts.items():
        url = rule["annotations"].get("runbook_url", "")
        assert url.endswith(f"docs/runbook.md#{name.lower()}"), (name, url)
        body = anchors.get(name.lower())
        assert body is not None, f"docs/runbook.md has no section '## {name}'"
        for part in ("**Meaning.**", "**First checks.**", "**Fix.**"):
            assert part in body, (name, part)
    assert set(anchors) == {a.lower() for a in alerts}, "runbook sections without an alert"


def test_state_alerts_use_state_gauges():
    """Faults that last are alerted on gauges, so they cannot clear while the fault remains."""
    alerts = {r["alert"]: r for r in load_rules() if "alert" in r}
    assert "rpcguard_upstream_up" in alerts["RpcguardUpstreamDown"]["expr"]
    assert "increase(" not in alerts["RpcguardUpstreamDown"]["expr"]
    assert "rpcguard_reload_last_successful" in alerts["RpcguardReloadFailed"]["expr"]
    assert "increase(" not in alerts["RpcguardReloadFailed"]["expr"]
    skew = alerts["RpcguardProtocolVersionSkew"]["expr"]
    assert skew.count("rpcguard_upstream_protocol_info{") == skew.count('rpcguard_upstream_protocol_info{role="serve"}')
    assert 'reason="identity_not_allowed"' in alerts["RpcguardClientNotAllowed"]["expr"]


def test_rule_tests_pin_each_defect_of_issue_11():
    doc = yaml.safe_load(RULES_TEST.read_text(encoding="utf-8"))
    defects = {case["name"]: {a["alertname"] for a in case["alert_rule_test"]} for case in doc["tests"]
               if case["name"].startswith("DEFECT")}
    covered = set().union(*defects.values())
    assert {"RpcguardProtocolVersionSkew", "RpcguardUpstreamDown", "RpcguardReloadFailed",
            "RpcguardClientNotAllowed", "RpcguardCertificateExpiresVerySoon"} <= covered, defects


def test_rule_tests_cover_every_alert_firing_and_not_firing():
    alerts = {r["alert"] for r in load_rules() if "alert" in r}
    doc = yaml.safe_load(RULES_TEST.read_text(encoding="utf-8"))
    fires, silent = set(), set()
    for case in doc["tests"]:
        for a in case.get("alert_rule_test", []):
            (fires if a.get("exp_alerts") else silent).add(a["alertname"])
    assert alerts <= fires, f"no firing test for {alerts - fires}"
    assert alerts <= silent, f"no non-firing test for {alerts - silent}"


# ----------------------------------------------------------------------------- promtool


def promtool() -> str:
    path = shutil.which("promtool")
    if path:
        return path
    need.missing("promtool", f"install it as root with: bash {INSTALL_SCRIPT.relative_to(ROOT)}")


def run(cmd: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120)


def test_promtool_check_rules():
    res = run([promtool(), "check", "rules", str(RULES)])
    assert res.returncode == 0, res.stdout + res.stderr


def test_promtool_test_rules():
    res = run([promtool(), "test", "rules", RULES_TEST.name], cwd=RULES_TEST.parent)
    assert res.returncode == 0, res.stdout + res.stderr


def test_promtool_check_config(tmp_path):
    # promtool checks that the scrape job's TLS files exist: point them at real ones
    from rpcguard.pki import certs

    certs.init_ca(tmp_path)
    certs.issue(tmp_path, "prometheus", server=False)
    (tmp_path / "password").write_text("change-me\n")
    text = PROM_CONFIG.read_text(encoding="utf-8")
    assert "/etc/prometheus/rpcguard/" in text and "scheme: https" in text and "basic_auth:" in text
    cfg = tmp_path / PROM_CONFIG.name
    cfg.write_text(text.replace("/etc/prometheus/rpcguard/", f"{tmp_path}/"), encoding="utf-8")
    shutil.copyfile(RULES, tmp_path / RULES.name)
    res = run([promtool(), "check", "config", str(cfg)])
    assert res.returncode == 0, res.stdout + res.stderr
    assert "rule files found" in res.stdout  # the rule_files path resolved


def test_web_config_example_is_valid(tmp_path):
    """deploy/prometheus/rpcguard-web.example.yml loads with rpcguard's own parser."""
    import bcrypt

    from rpcguard.pki import certs
    from rpcguard.observe.webconfig import WebGuard, load_web_config

    certs.init_ca(tmp_path)
    certs.issue(tmp_path, "metrics", server=True, dns=["localhost"])
    text = (DEPLOY / "prometheus" / "rpcguard-web.example.yml").read_text(encoding="utf-8")
    path = tmp_path / "web.yml"
    path.write_text(text.replace("/etc/rpcguard/certs/", f"{tmp_path}/"), encoding="utf-8")
    wc = load_web_config(str(path))
    assert wc.tls and wc.authenticates and wc.client_auth_type == "RequireAndVerifyClientCert"
    assert bcrypt.checkpw(b"change-me", dict(wc.users)["prometheus"])
    assert WebGuard(wc).context is not None
    # and Prometheus's own checker takes it as shipped (it rejected client_allowed_sans: issue 31)
    res = run([promtool(), "check", "web-config", str(path)])
    assert res.returncode == 0, res.stdout + res.stderr
    # the optional key, uncommented, is still one rpcguard honours
    path.write_text(path.read_text(encoding="utf-8").replace("  # client_allowed_sans:", "  client_allowed_sans:"),
                    encoding="utf-8")
    assert load_web_config(str(path)).client_allowed_sans == ("spiffe://lab/prometheus",)


def grafana_to_promql(expr: str) -> str:
    """Replace Grafana's macros and template variables by values PromQL accepts."""
    expr = expr.replace("$__rate_interval", "5m").replace("$__interval", "1m").replace("$__range", "1h")
    return re.sub(r"\$\{?\w+\}?", ".*", expr)


def test_dashboard_exprs_are_valid_promql(tmp_path):
    """Every panel/annotation expression parses (checked as recording rules by promtool)."""
    exprs = [(w, e) for w, e in dashboard_exprs(load_dashboard()) if not e.startswith("label_values(")]
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard_expr:check{i}", "expr": grafana_to_promql(e)} for i, (_, e) in enumerate(exprs)
    ]}]}
    path = tmp_path / "dashboard-exprs.yml"
    path.write_text(yaml.safe_dump(rules, sort_keys=False), encoding="utf-8")
    res = run([promtool(), "check", "rules", str(path)])
    assert res.returncode == 0, res.stdout + res.stderr


# ----------------------------------------------------------------------------- systemd


def parse_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """Unit file -> {section: {key: [values in order]}}; keys may repeat, as in systemd."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"{path.name}: key outside a section: {line}"
        key, sep, value = line.partition("=")
        assert sep, f"{path.name}: not a key=value line: {line}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def seconds(value: str) -> float:
    total = 0.0
    for num, unit in re.findall(r"(\d+(?:\.\d+)?)\s*(ms|s|min|m|h)?", value):
        total += float(num) * {"ms": 0.001, "s": 1, "": 1, "min": 60, "m": 60, "h": 3600}[unit]
    return total


HARDENING = {
    "NoNewPrivileges": "yes",
    "ProtectSystem": "strict",
    "ProtectHome": "yes",
    "PrivateTmp": "yes",
    "PrivateDevices": "yes",
    "ProtectKernelTunables": "yes",
    "ProtectKernelModules": "yes",
    "ProtectKernelLogs": "yes",
    "ProtectControlGroups": "yes",
    "RestrictNamespaces": "yes",
    "LockPersonality": "yes",
    "MemoryDenyWriteExecute": "yes",
    "KillSignal": "SIGTERM",
    "Restart": "on-failure",
    "Type": "notify",  # READY=1 after bind; runs on every systemd (Debian 12's 252 has no notify-reload)
    "ExecReload": "/bin/kill -HUP $MAINPID",
    "NotifyAccess": "main",
    "RestartPreventExitStatus": "2",  # a config error does not restart-loop
    "User": "rpcguard",
    "Group": "rpcguard",
}


@pytest.mark.parametrize("role", sorted(UNITS))
def test_systemd_unit_hardening(role):
    unit = parse_unit(UNITS[role])
    svc = unit["Service"]
    last = {k: v[-1] for k, v in svc.items()}
    for key, want in HARDENING.items():
        assert last.get(key) == want, f"{role}: {key}={last.get(key)!r}, want {want!r}"
    assert svc["ExecStart"] == [f"/usr/local/bin/rpcguard {role} --config /etc/rpcguard/{role}.yaml"]
    assert set(last["RestrictAddressFamilies"].split()) == {"AF_INET", "AF_INET6", "AF_UNIX"}
    assert "@system-service" in svc["SystemCallFilter"][0].split()
    assert last["CapabilityBoundingSet"] == "", "no capabilities"
    assert all(v == "" for v in svc["CapabilityBoundingSet"])
    assert "/etc/rpcguard" in " ".join(svc["ReadOnlyPaths"]).split()
    assert last.get("DynamicUser", "no") == "no"
    # rpcguard drains for up to 30 s after SIGTERM; systemd must not SIGKILL before that
    assert 30 <= seconds(last["TimeoutStopSec"]) <= 60
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]
    assert 10 <= seconds(last["WatchdogSec"]) <= 120


def test_notify_reload_drop_in():
    """systemd >= 253: the optional drop-in makes the units Type=notify-reload, which sends SIGHUP
    itself, so it clears ExecReload."""
    drop = parse_unit(RELOAD_DROP_IN)
    assert drop == {"Service": {"Type": ["notify-reload"], "ExecReload": [""]}}


def _systemd_version(tool: str) -> int:
    m = re.match(r"systemd (\d+)", run([tool, "--version"]).stdout)
    return int(m.group(1)) if m else 0


def _verify(tool: str, tmp_path, drop_in: str = "") -> str:
    # verify insists that ExecStart's binary exists; point it at a real one when not installed
    binary = "/usr/local/bin/rpcguard"
    substitute = binary if os.access(binary, os.X_OK) else "/bin/true"
    paths = []
    for path in UNITS.values():
        copy = tmp_path / path.name
        copy.write_text(path.read_text(encoding="utf-8").replace(binary, substitute) + drop_in, encoding="utf-8")
        paths.append(str(copy))
    res = run([tool, "verify", *paths])
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert "Unknown" not in out and "ignoring" not in out and "Failed" not in out, out
    return out


def _systemd_analyze() -> str:
    tool = shutil.which("systemd-analyze")
    if not tool:  # never a silent skip: a failure under CI, a skip naming the install step elsewhere
        need.missing("systemd-analyze", f"install it as root with: bash {INSTALL_SCRIPT.relative_to(ROOT)}"
                                        " (Debian's systemd)")
    return tool


def test_systemd_analyze_verify_as_shipped(tmp_path):
    """The units as shipped run on this machine's systemd, whatever its version (Debian 12: 252)."""
    _verify(_systemd_analyze(), tmp_path)


def test_systemd_analyze_verify_with_reload_drop_in(tmp_path):
    """On systemd >= 253 the drop-in's notify-reload parses; below, verify says it ignores it."""
    tool = _systemd_analyze()
    text = "\n" + RELOAD_DROP_IN.read_text(encoding="utf-8")
    if _systemd_version(tool) >= 253:
        _verify(tool, tmp_path, text)
    else:
        with pytest.raises(AssertionError, match="notify-reload"):
            _verify(tool, tmp_path, text)


# ----------------------------------------------------------------------------- install script


def test_install_script_is_idempotent_and_guarded():
    text = INSTALL_SCRIPT.read_text(encoding="utf-8")
    assert text.startswith("#!")
    assert os.access(INSTALL_SCRIPT, os.X_OK)
    assert "command -v promtool" in text and "prometheus" in text
    res = run(["bash", "-n", str(INSTALL_SCRIPT)])
    assert res.returncode == 0, res.stderr


def test_systemd_analyze_verify_with_the_contained_drop_in(tmp_path):
    """serve.service with the drop-in for a contained serve (it runs its servers): verifies as
    shipped, and delegates the cgroup controllers the per-process limits need."""
    drop = DEPLOY / "systemd" / "rpcguard-serve-contained.conf"
    svc = parse_unit(drop)["Service"]
    assert svc["Delegate"] == ["memory pids"] and svc["ProtectControlGroups"] == ["no"]
    binary = "/usr/local/bin/rpcguard"
    substitute = binary if os.access(binary, os.X_OK) else "/bin/true"
    unit = tmp_path / "rpcguard-serve.service"
    unit.write_text(UNITS["serve"].read_text(encoding="utf-8").replace(binary, substitute) + "\n"
                    + drop.read_text(encoding="utf-8"), encoding="utf-8")
    res = run([_systemd_analyze(), "verify", str(unit)])
    out = res.stdout + res.stderr
    assert res.returncode == 0 and "Unknown" not in out and "ignoring" not in out, out
