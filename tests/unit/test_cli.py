"""Every rpcguard subcommand with bad input: one clear line, the right exit code, never a traceback.

Exit codes: 2 usage or configuration (the operator must change something), 1 runtime (a node
or port that does not answer). Each case runs the real ``python -m rpcguard`` process.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from rpcguard.observe.metrics import Metrics
from tests.support.guard import Pki
from tests.support.realpeer import PYTHON, reserve_port


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    p = Pki(tmp_path_factory.mktemp("pki"))
    p.issue("other-node", server=True, dns=["node1"])  # a valid pair whose key does not match node1.pem
    open_key = p.dir / "open.key"
    open_key.write_bytes(Path(p.path(p.node, "key")).read_bytes())
    open_key.chmod(0o644)
    p.dir.joinpath("garbage.pem").write_bytes(b"\x00\xffnot pem at all")
    now = dt.datetime.now(dt.timezone.utc)
    p.issue("expired-node", server=True, ips=["127.0.0.1"], not_before=now - dt.timedelta(days=3),
            not_after=now - dt.timedelta(days=1))
    subprocess.run([PYTHON, "-m", "rpcguard", "certs", "csr", str(p.dir), "req", "--client"], check=True,
                   capture_output=True)
    return p


@pytest.fixture(scope="module")
def busy_port():
    s = socket.create_server(("127.0.0.1", 0))
    yield s.getsockname()[1]
    s.close()


@pytest.fixture(scope="module")
def pages():
    """An HTTP server with a real rpcguard metrics page (/metrics) and a page that is not one (/x/metrics)."""
    body = Metrics().exposition()

    class H(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            data = body if self.path == "/metrics" else b"[]" if self.path == "/refusals" else b"<html>hi</html>"
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv.server_address[1]
    srv.shutdown()


def rg(*args: str, cwd: Path | None = None, stdout=subprocess.PIPE) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-m", "rpcguard", *args], stdout=stdout, stderr=subprocess.PIPE, text=True,
                          timeout=60, cwd=cwd, stdin=subprocess.DEVNULL)


def tls(p: Pki, cert: str | None = None, key: str | None = None, ca: str | None = None) -> list[str]:
    return ["--cert", cert or p.path(p.node), "--key", key or p.path(p.node, "key"), "--ca", ca or p.path("ca")]


def serve(p: Pki, *extra: str, **files: str) -> list[str]:
    return ["serve", "--listen", "127.0.0.1:0", "--upstream", "127.0.0.1:50052", "--metrics", "", *tls(p, **files),
            "--allow-cn", p.client, *extra]


def ctls(p: Pki) -> list[str]:
    return ["--cert", p.path(p.client), "--key", p.path(p.client, "key"), "--ca", p.path("ca")]


# (id, argv builder, exit code, text expected in stderr)
CASES = [
    ("no-command", lambda p, t: [], 2, "usage"),
    ("unknown-command", lambda p, t: ["frobnicate"], 2, "invalid choice"),
    ("serve-no-tls", lambda p, t: ["serve", "--listen", "127.0.0.1:0", "--upstream", "127.0.0.1:1"], 2, "--cert"),
    ("serve-missing-cert", lambda p, t: serve(p, cert=str(t / "nope.pem")), 2, "no such file"),
    ("serve-cert-is-dir", lambda p, t: serve(p, cert=str(t)), 2, "not a regular file"),
    ("serve-0644-key", lambda p, t: serve(p, key=str(p.dir / "open.key")), 2, "chmod 600"),
    ("serve-key-mismatch", lambda p, t: serve(p, key=p.path("other-node", "key")), 2, "does not match"),
    ("serve-client-cert", lambda p, t: serve(p, cert=p.path(p.client), key=p.path(p.client, "key")), 2,
     "extended key usage"),
    ("serve-garbage-cert", lambda p, t: serve(p, cert=str(p.dir / "garbage.pem")), 2, "not a PEM"),
    ("serve-garbage-ca", lambda p, t: serve(p, ca=str(p.dir / "garbage.pem")), 2, "not a PEM"),
    ("serve-leaf-as-ca", lambda p, t: serve(p, ca=p.path(p.node)), 2, "not a CA"),
    ("serve-bad-listen", lambda p, t: serve(p, "--listen", "nohostport"), 2, "--listen"),
    ("serve-public-upstream", lambda p, t: serve(p, "--upstream", "10.1.2.3:50052"), 2, "--unsafe-upstream"),
    ("serve-public-metrics", lambda p, t: serve(p, "--metrics", "0.0.0.0:9450"), 2, "--metrics-unsafe-public"),
    ("serve-bad-reload", lambda p, t: serve(p, "--tls-reload-interval-s", "-1"), 2, "--tls-reload-interval-s"),
    ("serve-busy-port", lambda p, t: ["serve", "--listen", f"127.0.0.1:{t.busy}", "--upstream", "127.0.0.1:1",
                                      "--allow-all", "--metrics", "", *tls(p)], 1, "cannot listen"),
    ("serve-missing-config", lambda p, t: ["serve", "--config", str(t / "nope.yaml")], 2, "cannot read config"),
    ("serve-config-dir", lambda p, t: ["serve", "--config", str(t)], 2, "cannot read config"),
    ("serve-binary-config", lambda p, t: ["serve", "--config", str(p.dir / "garbage.pem")], 2, "config error"),
    ("connect-server-cert", lambda p, t: ["connect", "--listen", "127.0.0.1:0", "--server", "127.0.0.1:1",
                                          "--metrics", "", *tls(p)], 2, "extended key usage"),
    ("connect-busy-port", lambda p, t: ["connect", "--listen", f"127.0.0.1:{t.busy}", "--server", "127.0.0.1:1",
                                        "--metrics", "", "--no-check", *ctls(p)], 1, "cannot listen"),
    ("connect-public-listen", lambda p, t: ["connect", "--listen", "10.0.0.1:5000", "--server", "127.0.0.1:1",
                                            *ctls(p)], 2, "--unsafe-listen"),
    ("check-closed-port", lambda p, t: ["check", "--server", f"127.0.0.1:{reserve_port()}",
                                        "--server-name", "node1", *ctls(p)], 1, ""),
    ("check-server-cert", lambda p, t: ["check", "--server", "127.0.0.1:1", *tls(p)], 2, "extended key usage"),
    ("check-no-server", lambda p, t: ["check", *ctls(p)], 2, "--server"),
    ("check-bad-server", lambda p, t: ["check", "--server", "x", *ctls(p)], 2, "--server"),
    ("check-0644-key", lambda p, t: ["check", "--server", "127.0.0.1:1", "--cert", p.path(p.node), "--key",
                                     str(p.dir / "open.key"), "--ca", p.path("ca")], 2, "chmod 600"),
    ("check-config-missing", lambda p, t: ["check-config", str(t / "nope.yaml")], 2, "cannot read config"),
    ("check-config-dir", lambda p, t: ["check-config", str(t)], 2, "cannot read config"),
    ("check-config-empty", lambda p, t: ["check-config", os.devnull], 2, "empty file"),
    ("check-config-0644-key", lambda p, t: ["check-config", t.config(key=str(p.dir / "open.key"))], 2, "chmod 600"),
    ("check-config-key-mismatch", lambda p, t: ["check-config", t.config(key=p.path("other-node", "key"))], 2,
     "does not match"),
    ("check-config-client-cert", lambda p, t: ["check-config", t.config(cert=p.path(p.client),
                                                                        key=p.path(p.client, "key"))], 2,
     "extended key usage"),
    ("check-config-min-version", lambda p, t: ["check-config", t.config(min_version="1.1")], 2,
     "tls.min_version: must be one of 1.3, 1.2, got '1.1'"),
    ("serve-min-version-flag", lambda p, t: serve(p, "--tls-min-version", "1.1"), 2, "invalid choice: '1.1'"),
    ("init-ca-bad-path", lambda p, t: ["certs", "init-ca", "/proc/rpcguard/ca"], 2, "cannot create"),
    ("init-ca-exists", lambda p, t: ["certs", "init-ca", str(p.dir)], 2, "already exists"),
    ("init-ca-days", lambda p, t: ["certs", "init-ca", str(t / "ca2"), "--days", "0"], 2, "days"),
    ("init-ca-days-text", lambda p, t: ["certs", "init-ca", str(t / "ca3"), "--days", "ten"], 2, "invalid int"),
    ("issue-no-ca", lambda p, t: ["certs", "issue", str(t), "n1", "--server"], 2, "ca.pem"),
    ("issue-no-dir-no-ca", lambda p, t: ["certs", "issue", str(t / "nodir"), "n1", "--server"], 2, "ca.pem"),
    ("issue-dir-is-a-file", lambda p, t: ["certs", "issue", str(p.dir / "garbage.pem"), "n1", "--server",
                                          "--ca-dir", str(p.dir)], 2, "not a directory"),
    ("issue-bad-name", lambda p, t: ["certs", "issue", str(p.dir), "../x", "--client"], 2, "invalid certificate name"),
    ("issue-bad-ip", lambda p, t: ["certs", "issue", str(p.dir), "n2", "--server", "--ip", "1.2.3"], 2, "invalid IP"),
    ("issue-bad-dns", lambda p, t: ["certs", "issue", str(p.dir), "n3", "--server", "--dns", "a..b"], 2, "invalid DNS"),
    ("issue-bad-uri", lambda p, t: ["certs", "issue", str(p.dir), "n4", "--client", "--uri", "nope"], 2, "invalid URI"),
    ("issue-no-kind", lambda p, t: ["certs", "issue", str(p.dir), "n5"], 2, "--server"),
    ("issue-both-kinds", lambda p, t: ["certs", "issue", str(p.dir), "n6", "--server", "--client"], 2, "not allowed"),
    ("issue-exists", lambda p, t: ["certs", "issue", str(p.dir), p.node, "--server"], 2, "already exists"),
    ("issue-ca-dir-missing", lambda p, t: ["certs", "issue", str(t), "n7", "--client", "--ca-dir", str(t / "x")], 2,
     "ca.pem"),
    ("csr-dir-under-a-file", lambda p, t: ["certs", "csr", str(p.dir / "garbage.pem" / "d"), "n8", "--client"], 2,
     "cannot create the directory"),
    ("csr-bad-name", lambda p, t: ["certs", "csr", str(t), "ca", "--client"], 2, "invalid certificate name"),
    ("sign-missing-csr", lambda p, t: ["certs", "sign", str(t / "x.csr"), "--ca-dir", str(p.dir), "--out",
                                       str(t / "x.pem")], 2, "cannot read CSR"),
    ("sign-garbage-csr", lambda p, t: ["certs", "sign", str(p.dir / "garbage.pem"), "--ca-dir", str(p.dir),
                                       "--out", str(t / "x.pem")], 2, "not a PEM certificate signing request"),
    ("sign-cert-as-csr", lambda p, t: ["certs", "sign", p.path(p.node), "--ca-dir", str(p.dir), "--out",
                                       str(t / "x.pem")], 2, "not a PEM certificate signing request"),
    ("sign-wrong-kind", lambda p, t: ["certs", "sign", str(p.dir / "req.csr"), "--server", "--ca-dir", str(p.dir),
                                      "--out", str(t / "x.pem")], 2, "asks for a client certificate"),
    ("sign-no-ca", lambda p, t: ["certs", "sign", str(p.dir / "req.csr"), "--ca-dir", str(t), "--out",
                                 str(t / "x.pem")], 2, "ca.pem"),
    ("sign-out-exists", lambda p, t: ["certs", "sign", str(p.dir / "req.csr"), "--ca-dir", str(p.dir), "--out",
                                      p.path(p.node)], 2, "already exists"),
    ("sign-out-bad-dir", lambda p, t: ["certs", "sign", str(p.dir / "req.csr"), "--ca-dir", str(p.dir), "--out",
                                       "/proc/nodir/x.pem"], 2, "cannot write"),
    ("revoke-not-a-cert", lambda p, t: ["certs", "revoke", str(p.dir / "garbage.pem"), "--ca-dir", str(p.dir)], 2,
     "not a PEM certificate"),
    ("revoke-no-ca", lambda p, t: ["certs", "revoke", p.path(p.node), "--ca-dir", str(t)], 2, "ca.pem"),
    ("crl-zero-days", lambda p, t: ["certs", "crl", "--ca-dir", str(p.dir), "--days", "0"], 2,
     "days must be a positive integer"),
    ("get-server-bad-backend", lambda p, t: ["get-server", "--backend", "tpu"], 2, "expected cpu, cuda or auto"),
    ("get-server-dry-run", lambda p, t: ["get-server", "--backend", "cpu", "--dry-run", "--prefix", str(t)], 0,
     "would run: cmake"),
    ("ops-unknown-protocol", lambda p, t: ["ops", "--protocol", "9.9.9"], 2, "no op table for protocol 9.9.9"),
    ("ops-bad-protocol", lambda p, t: ["ops", "--protocol", "seven"], 2, "--protocol: not a version"),
    ("status-closed", lambda p, t: ["status", "--metrics", f"127.0.0.1:{reserve_port()}"], 1, "cannot read"),
    ("status-bad-url", lambda p, t: ["status", "--metrics", "ftp://x/metrics"], 2, "--metrics"),
    ("status-no-host", lambda p, t: ["status", "--metrics", "http://"], 2, "--metrics"),
    ("status-bad-port", lambda p, t: ["status", "--metrics", "127.0.0.1:notaport"], 2, "--metrics"),
    ("status-not-metrics", lambda p, t: ["status", "--metrics", f"http://127.0.0.1:{t.pages}/x"], 1,
     "not an rpcguard metrics page"),
]


class _Ctx:
    """What the case builders need besides the PKI: a scratch dir, a busy port, config writers."""

    def __init__(self, tmp: Path, pki: Pki, busy: int, pages: int) -> None:
        self.tmp, self.pki, self.busy, self.pages = tmp, pki, busy, pages

    def __truediv__(self, name: str) -> Path:
        return self.tmp / name

    def __str__(self) -> str:
        return str(self.tmp)

    def __fspath__(self) -> str:
        return str(self.tmp)

    def config(self, **files: str) -> str:
        p = self.pki
        tls_files = {"cert": p.path(p.node), "key": p.path(p.node, "key"), "ca": p.path("ca"), **files}
        path = self.tmp / "serve.yaml"
        path.write_text(json.dumps({"tls": tls_files, "allow": {"cn": [p.client]},
                                    "listeners": [{"listen": "127.0.0.1:0", "upstream": "127.0.0.1:50052"}]}))
        return str(path)


def main_in_process(args: list[str], capsys) -> subprocess.CompletedProcess:
    """``rpcguard.cli.main(args)`` in this process (a process per case would cost ~0.7 s each):
    an exception escaping main() fails the test, as a traceback would reach the user."""
    import logging

    from rpcguard import cli

    root = logging.getLogger()
    saved = root.handlers[:], root.level, cli._LOGGING[0]
    try:
        try:
            code = cli.main(args)
        except SystemExit as exc:  # argparse
            code = exc.code
        out = capsys.readouterr()
    finally:
        root.handlers[:], root.level, cli._LOGGING[0] = saved
    return subprocess.CompletedProcess(args, code, out.out, out.err)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_ends_in_one_clear_line(case, pki, tmp_path, busy_port, pages, capsys):
    name, argv, code, text = case
    t = _Ctx(tmp_path, pki, busy_port, pages)
    p = main_in_process([str(a) for a in argv(pki, t)], capsys)
    out = p.stdout + p.stderr
    assert "Traceback" not in out, out
    assert p.returncode == code, (p.returncode, out)
    assert text in p.stderr or text in p.stdout, out
    if code == 2 and not text.startswith(("usage", "invalid choice", "invalid int", "not allowed", "--server")):
        assert len(p.stderr.strip().splitlines()) == 1, p.stderr  # one line, not a dump
    elif code == 2 and name not in ("check-no-server", "check-bad-server"):
        assert p.stderr.startswith("usage") or p.stderr.count("\n") <= 3, p.stderr  # argparse: usage + error


def test_json_log_stream_stays_json_on_a_config_error(pki, tmp_path):
    p = rg(*serve(pki, "--log-format", "json", key=str(pki.dir / "open.key")))
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert lines and all(json.loads(line)["level"] for line in lines), p.stderr
    assert "chmod 600" in lines[-1]


def test_every_subcommand_is_walked():
    """The table above covers every subcommand and certs sub-subcommand of the parser."""
    from rpcguard.cli import _parser

    sub = next(a for a in _parser()._actions if a.dest == "command")
    covered = {c[0].split("-")[0] for c in CASES}
    named = {n for n in sub.choices for c in CASES if c[0] == n or c[0].startswith(n + "-")}
    certs = next(a for a in sub.choices["certs"]._actions if a.dest == "certs_command")
    assert set(sub.choices) - {"certs"} <= named | covered, set(sub.choices) - named
    assert {n.replace("init-ca", "init") for n in certs.choices} <= covered, certs.choices


def test_status_defaults_url_forms_and_broken_pipe(pages):
    for form in (f"127.0.0.1:{pages}", f"http://127.0.0.1:{pages}", f"http://127.0.0.1:{pages}/",
                 f"http://127.0.0.1:{pages}/metrics"):
        p = rg("status", "--metrics", form)
        assert p.returncode == 0 and f"rpcguard instance at http://127.0.0.1:{pages}/metrics" in p.stdout, p.stderr
    # stdout closed by its reader (`rpcguard status | head -0`): it read what it wanted: quiet, exit 0
    r, w = os.pipe()
    os.close(r)
    try:
        p = subprocess.run([PYTHON, "-m", "rpcguard", "status", "--metrics", f"127.0.0.1:{pages}"], stdout=w,
                           stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(w)
    assert "Traceback" not in p.stderr and "Exception ignored" not in p.stderr, p.stderr
    assert p.returncode == 0 and p.stderr == ""


def test_check_config_broken_pipe(pki, tmp_path):
    t = _Ctx(tmp_path, pki, 0, 0)
    r, w = os.pipe()
    os.close(r)
    try:
        p = subprocess.run([PYTHON, "-m", "rpcguard", "check-config", t.config()], stdout=w, stderr=subprocess.PIPE,
                           text=True, timeout=60)
    finally:
        os.close(w)
    assert "Traceback" not in p.stderr and p.returncode == 0 and p.stderr == "", p.stderr  # `| head -1`


def test_stdout_closed_or_full_is_one_line_not_an_internal_error(pages):
    for how, kw, why in (("closed", {"stdout": None, "pass_fds": ()}, "stdout is closed"),
                         ("full", {}, "No space left on device")):
        cmd = [PYTHON, "-m", "rpcguard", "status", "--metrics", f"127.0.0.1:{pages}"]
        if how == "closed":
            p = subprocess.run(["sh", "-c", '"$@" >&-', "sh", *cmd], stderr=subprocess.PIPE, text=True, timeout=60)
        else:
            with open("/dev/full", "w") as full:
                p = subprocess.run(cmd, stdout=full, stderr=subprocess.PIPE, text=True, timeout=60)
        assert p.returncode == 1 and p.stderr == f"rpcguard: cannot write the output: {why}\n", (how, p.stderr)


def test_a_very_long_certificate_name_is_one_line(tmp_path):
    p = rg("certs", "init-ca", str(tmp_path / "ca"))
    assert p.returncode == 0, p.stderr
    for kind in ("issue", "csr"):
        args = ["certs", kind, str(tmp_path), "a" * 300, "--server"] + (["--ca-dir", str(tmp_path / "ca")]
                                                                        if kind == "issue" else [])
        p = rg(*args)
        assert p.returncode == 2 and p.stderr == ("rpcguard: certificate name of 300 characters: at most 64 (it is the "
                                                  "file name and the common name)\n"), p.stderr


def test_check_config_runs_the_start_up_checks_and_warns(pki, tmp_path):
    t = _Ctx(tmp_path, pki, 0, 0)
    p = rg("check-config", t.config())
    assert p.returncode == 0 and p.stdout.startswith("OK ") and "WARNING" not in p.stdout, p.stdout + p.stderr
    p = rg("check-config", t.config(cert=pki.path("expired-node"), key=pki.path("expired-node", "key")))
    assert p.returncode == 0, p.stderr
    assert "WARNING certificate expired" in p.stdout, p.stdout
    other = Pki(tmp_path / "other")
    p = rg("check-config", t.config(cert=other.path(other.node), key=other.path(other.node, "key")))
    assert "WARNING certificate untrusted" in p.stdout, p.stdout


def test_check_config_and_serve_say_loudly_that_a_listener_does_not_enforce(pki, tmp_path):
    t = _Ctx(tmp_path, pki, 0, 0)
    p = rg("check-config", t.config())
    assert "NOT ENFORCING" not in p.stdout, p.stdout
    path = Path(t.config())
    data = json.loads(path.read_text())
    data["policy"] = {"mode": "monitor"}
    path.write_text(json.dumps(data))
    p = rg("check-config", str(path))
    assert p.returncode == 0, p.stderr
    (line,) = [x for x in p.stdout.splitlines() if "NOT ENFORCING" in x]
    assert line.startswith("  WARNING serve listener listener0: NOT ENFORCING: profile default: firewall in "
                           "monitor mode"), line


def test_check_config_names_the_accepted_versions_and_refuses_unknown_ones(pki, tmp_path):
    t = _Ctx(tmp_path, pki, 0, 0)
    p = rg("check-config", t.config())
    assert "  listener0: accepted protocol versions 2.0.0, " in p.stdout and "7.0.0, 7.0.1 (every version rpcguard " \
        "knows)" in p.stdout, p.stdout
    path = Path(t.config())
    data = json.loads(path.read_text())
    for versions, code in ((["7.0.0", "5.0.0"], 0), (["9.9.9"], 2)):
        data["policy"] = {"accepted_versions": versions}
        path.write_text(json.dumps(data))
        p = rg("check-config", str(path))
        assert p.returncode == code, p.stdout + p.stderr
    assert p.stderr.startswith("rpcguard: config error: policy.accepted_versions[0]: must be a protocol version "
                               "rpcguard knows (2.0.0, "), p.stderr
    data["policy"] = {"accepted_versions": ["7.0.0", "5.0.0"]}
    path.write_text(json.dumps(data))
    assert "  listener0: accepted protocol versions 5.0.0, 7.0.0\n" in rg("check-config", str(path)).stdout


def test_status_without_metrics_tries_serve_then_connect_defaults():
    from rpcguard.cli import DEFAULT_STATUS

    assert DEFAULT_STATUS == ("127.0.0.1:9450", "127.0.0.1:9451")
    busy = []
    for addr in DEFAULT_STATUS:  # on this machine nothing should listen there; if something does, skip the check
        host, port = addr.split(":")
        with socket.socket() as s:
            busy.append(s.connect_ex((host, int(port))) == 0)
    if any(busy):
        pytest.skip("a default metrics port is in use on this machine")
    p = rg("status")
    assert p.returncode == 1 and "9450" in p.stderr and "9451" in p.stderr, p.stderr


def test_flags_reach_the_config(pki, tmp_path):
    from rpcguard.cli import _overrides, _parser
    from rpcguard.config.flags import build_config

    a = _parser().parse_args(serve(pki, "--tls-reload-interval-s", "2.5", "--metrics", "0.0.0.0:0",
                                   "--metrics-unsafe-public"))
    cfg = build_config("serve", overrides=_overrides(a))
    assert cfg.tls.reload_interval_s == 2.5 and cfg.metrics.unsafe_public and cfg.metrics.listen.port == 0


def test_json_log_stream_is_pure_json_from_start_to_stop(pki, tmp_path):
    """--log-format json: every stderr line is JSON (config warnings, ready, drain), stdout empty."""
    import signal
    import time

    t = _Ctx(tmp_path, pki, 0, 0)
    cfg = Path(t.config(cert=pki.path("expired-node"), key=pki.path("expired-node", "key")))  # warns at start
    proc = subprocess.Popen([PYTHON, "-m", "rpcguard", "serve", "--config", str(cfg), "--metrics", "",
                             "--log-format", "json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        lines = []
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            if '"msg":"ready:' in line:
                break
        proc.send_signal(signal.SIGTERM)
        out, rest = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    lines += rest.splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    assert out == "" and proc.returncode == 0
    msgs = [r["msg"] for r in records]
    assert any(m.startswith("certificate expired") for m in msgs) and any(m.startswith("ready:") for m in msgs), msgs
    assert sum("listening on" in m for m in msgs) == 1, msgs


def test_records_logged_while_reading_the_config_come_out_in_the_chosen_format():
    import io
    import logging

    from rpcguard.observe.logs import setup_logging
    from rpcguard.cli import _Held

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        with _Held() as held:
            logging.getLogger("rpcguard.config").warning("early %s", "warning")
        stream = io.StringIO()
        setup_logging("json", stream=stream)
        held.replay()
        assert json.loads(stream.getvalue())["msg"] == "early warning"
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])


def test_an_unexpected_error_is_one_line_too(monkeypatch, capsys, tmp_path):
    """A bug (here: a failure injected into certs.init_ca) still ends in one line and exit 1."""
    from rpcguard.pki import certs

    def boom(*a, **k):
        raise RuntimeError("injected")

    monkeypatch.setattr(certs, "init_ca", boom)
    p = main_in_process(["certs", "init-ca", str(tmp_path)], capsys)
    assert p.returncode == 1 and p.stderr.count("\n") == 1 and "internal error (RuntimeError: injected)" in p.stderr


def test_version_says_core_protocols_openssl_and_commit():
    import ssl

    from rpcguard.protocol.versions import KNOWN_VERSIONS, format_version

    p = rg("--version")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].startswith("rpcguard ") and "protocol core: " in lines[0], lines
    assert lines[1] == "protocol versions: " + ", ".join(format_version(v) for v in KNOWN_VERSIONS)
    assert lines[2].startswith(ssl.OPENSSL_VERSION + "; Python ")
    assert lines[3].startswith("commit ") and lines[3] != "commit ", lines


@pytest.mark.parametrize("command,needle", [
    (["serve"], "required, as flags or in --config: --listen and --upstream"),
    (["connect"], "required, as flags or in --config: --listen and --server"),
    (["check"], "required: --server, or --config with tunnels"),
    (["certs", "init-ca"], "(default: 1825)"),
    (["certs", "issue"], "(default: 30)"),
])
def test_help_shows_defaults_and_what_is_required(command, needle):
    p = rg(*command, "--help")
    assert p.returncode == 0 and needle in " ".join(p.stdout.split()), p.stdout
    if command[0] in ("serve", "connect"):  # each role's own metrics default (config/flags.py)
        port = {"serve": 9450, "connect": 9451}[command[0]]
        assert f"default 127.0.0.1:{port}" in " ".join(p.stdout.split()) and "(default: None)" not in p.stdout


def test_help_defaults_come_from_the_config_defaults():
    # a default is written once (the config dataclass); the help texts are made from it
    from rpcguard.config.flags import FLAGS, help_text
    from rpcguard.config.model import LogConfig, TlsConfig

    by_name = {f.name: f for f in FLAGS}
    assert help_text(by_name["tls-min-version"], "serve").endswith(f"(default {TlsConfig.__dataclass_fields__['min_version'].default})")
    assert help_text(by_name["log-level"], "connect") == f"default {LogConfig().level}"
    for f in FLAGS:
        for role in f.roles:
            assert "{" not in help_text(f, role), (f.name, role)
    text = " ".join(rg("serve", "--help").stdout.split())
    assert "(default 1.3)" in text and "default enforce" in text and "default info" in text


@pytest.mark.parametrize("args", [["--version"], ["--help"], ["serve", "--help"]])
def test_help_and_version_into_a_closed_pipe_are_quiet(args):
    r, w = os.pipe()
    os.close(r)
    try:
        p = subprocess.run([PYTHON, "-m", "rpcguard", *args], stdout=w, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(w)
    assert p.returncode == 0 and p.stderr == "", p.stderr
