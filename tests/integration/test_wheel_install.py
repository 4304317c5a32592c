"""An install a new user can finish (issue 31.5): rpcguard's wheel, built from this tree, installed
into a fresh virtual environment with its dependencies from the package index, runs a guarded real
llama.cpp session from that installed copy alone (not from the source tree)."""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

import pytest

from rpcguard.cli import READY_MESSAGE
from tests.support import realpeer
from tests.support.guard import Guard, bound_metrics_port, bound_ports, wait_for_line

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(900)


def test_wheel_in_a_fresh_venv_runs_a_guarded_session(pki, models, workdir, rpc_server, tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--wheel-dir", str(wheels), str(ROOT)],
                   check=True, capture_output=True, timeout=600)
    (wheel,) = wheels.glob("rpcguard-*.whl")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    res = subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(wheel)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    exe = env_dir / "bin" / "rpcguard"
    version = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert version.returncode == 0 and version.stdout.startswith("rpcguard "), version.stdout + version.stderr
    where = subprocess.run([str(py), "-c", "import rpcguard; print(rpcguard.__file__)"], capture_output=True,
                           text=True, timeout=60, cwd=tmp_path).stdout
    assert where.startswith(str(env_dir)), where  # the installed copy, not the checkout

    def start(role: str, args: list[str]) -> Guard:
        proc = realpeer.start([str(exe), role, "--listen", "127.0.0.1:0", "--metrics", "127.0.0.1:0", *args],
                              workdir / f"wheel-{role}.log", f"installed rpcguard {role}")
        wait_for_line(proc, READY_MESSAGE)
        text = proc.output()
        return Guard(proc, next(iter(bound_ports(text).values())), bound_metrics_port(text) or 0, role)

    serve = start("serve", ["--upstream", f"127.0.0.1:{rpc_server}", *pki.serve_args(), "--allow-all"])
    connect = start("connect", ["--server", f"127.0.0.1:{serve.port}", "--server-name", pki.node, "--no-check",
                                *pki.connect_args()])
    try:
        run = realpeer.run_client(connect.endpoint, models["tiny"], n=4)
        assert run.ok, run.output[-3000:]
        direct = realpeer.run_client(f"127.0.0.1:{rpc_server}", models["tiny"], n=4)
        assert run.tokens == direct.tokens
        assert serve.value("rpcguard_sessions_total", result="ok") >= 1
    finally:
        connect.stop()
        serve.stop()
