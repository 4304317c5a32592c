"""rpcguard.observe.sdnotify, and a real ``rpcguard serve`` process talking to a fake systemd.

The fake systemd is a unix datagram socket made by the test (a path, and the abstract
namespace); the process gets it as NOTIFY_SOCKET exactly as systemd passes it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from rpcguard.observe.sdnotify import Notifier, monotonic_usec
from tests.support.guard import Pki
from tests.support.realpeer import PYTHON, reserve_port


def _dgram(address) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    sock.settimeout(15)
    return sock


def _fields(data: bytes) -> dict[str, str]:
    return dict(line.split("=", 1) for line in data.decode().splitlines() if line)


def test_notifier_path_socket(tmp_path):
    sock = _dgram(str(tmp_path / "notify"))
    n = Notifier.from_env({"NOTIFY_SOCKET": str(tmp_path / "notify")})
    assert n.enabled and n.ready("up")
    assert _fields(sock.recv(4096)) == {"READY": "1", "STATUS": "up"}
    before = monotonic_usec()
    assert n.reloading()
    got = _fields(sock.recv(4096))
    assert got["RELOADING"] == "1" and before <= int(got["MONOTONIC_USEC"]) <= monotonic_usec()
    n.close()


def test_notifier_abstract_namespace():
    name = f"rpcguard-test-{uuid.uuid4().hex}"
    sock = _dgram("\0" + name)
    n = Notifier.from_env({"NOTIFY_SOCKET": "@" + name})
    assert n.stopping("bye")
    assert _fields(sock.recv(4096)) == {"STOPPING": "1", "STATUS": "bye"}


def test_notifier_without_socket_is_a_no_op_and_a_dead_socket_is_ignored(tmp_path):
    assert not Notifier.from_env({}).send("READY=1")
    assert not Notifier.from_env({"NOTIFY_SOCKET": str(tmp_path / "nobody")}).send("READY=1")


def test_watchdog_usec_honours_watchdog_pid():
    assert Notifier.from_env({"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "2000000"}).watchdog_s == 2.0
    mine = {"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid())}
    assert Notifier.from_env(mine).watchdog_s == 2.0
    other = {**mine, "WATCHDOG_PID": str(os.getpid() + 1)}
    assert Notifier.from_env(other).watchdog_s == 0


# ----------------------------------------------------------------------------- a real process


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


def _recv_until(sock: socket.socket, key: str, seen: list[dict], timeout: float = 15) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        msg = _fields(sock.recv(4096))
        seen.append(msg)
        if key in msg:
            return msg
    raise AssertionError(f"no {key} in {seen}")


def test_serve_notifies_ready_reload_watchdog_and_stopping(tmp_path, pki):
    sock = _dgram(str(tmp_path / "notify"))
    cert, key = pki.issue("sdnode", server=True, ips=["127.0.0.1"])
    port = reserve_port()
    env = {**os.environ, "NOTIFY_SOCKET": str(tmp_path / "notify"), "WATCHDOG_USEC": "400000"}
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([PYTHON, "-m", "rpcguard", "serve", "--listen", f"127.0.0.1:{port}", "--upstream",
                             "127.0.0.1:9", "--metrics", "", "--cert", cert, "--key", key, "--ca", pki.path("ca"),
                             "--allow-cn", "x"], stdout=subprocess.PIPE, stderr=log, env=env)
    try:
        seen: list[dict] = []
        ready = _recv_until(sock, "READY", seen)
        # READY=1 means every listener is bound: the port takes a connection at once
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        assert "1 listener(s) ready" in ready["STATUS"]
        _recv_until(sock, "WATCHDOG", seen)  # WatchdogSec= honoured
        _recv_until(sock, "WATCHDOG", seen)

        proc.send_signal(signal.SIGHUP)
        before = monotonic_usec()
        reloading = _recv_until(sock, "RELOADING", seen)
        assert abs(int(reloading["MONOTONIC_USEC"]) - before) < 5_000_000
        done = _recv_until(sock, "READY", seen)
        assert done["STATUS"].startswith("reloaded (SIGHUP)"), done

        Path(cert).write_text("not a certificate\n")  # a broken rotation: the outcome says so
        proc.send_signal(signal.SIGHUP)
        _recv_until(sock, "RELOADING", seen)
        failed = _recv_until(sock, "READY", seen)
        assert "failed" in failed["STATUS"] and "previous certificates kept" in failed["STATUS"], failed

        proc.send_signal(signal.SIGTERM)
        stopping = _recv_until(sock, "STOPPING", seen)
        assert "draining" in stopping["STATUS"]
        out, _ = proc.communicate(timeout=20)
        assert proc.returncode == 0
        assert out == b"", out  # nothing on stdout: readiness is the log line and sd_notify
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    text = (tmp_path / "serve.log").read_text()
    assert text.count("listening on") == 1, text  # one "listening" line, not two


def test_config_error_exits_2_without_ready(tmp_path, pki):
    sock = _dgram(str(tmp_path / "notify"))
    sock.settimeout(0.5)
    env = {**os.environ, "NOTIFY_SOCKET": str(tmp_path / "notify")}
    p = subprocess.run([PYTHON, "-m", "rpcguard", "serve", "--listen", "127.0.0.1:1", "--upstream", "127.0.0.1:2",
                        "--allow-all", "--cert", pki.path(pki.client), "--key", pki.path(pki.client, "key"), "--ca", pki.path("ca")],
                       capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 2, p.stderr  # RestartPreventExitStatus=2: systemd does not restart-loop
    assert "extended key usage" in p.stderr and "Traceback" not in p.stderr
    with pytest.raises(socket.timeout):
        sock.recv(4096)
