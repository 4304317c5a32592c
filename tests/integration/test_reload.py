"""Reload everything (issue 10, item 4) on a running serve with the REAL ggml-rpc-server and REAL llama.cpp.

SIGHUP applies policy, limits and listeners, not only TLS material and allow-lists:

* a policy change (``max_graph_nodes`` below the real decode graph) refuses the next real session
  while a session that started before the reload keeps generating on the old policy;
* a limit change (``hello_timeout_s``) holds the next connection to the new value;
* a listener added starts serving, one removed stops accepting while its running session
  finishes, one whose address changed is replaced;
* a key that cannot change live (``log.format``) is named, kept, and counted in the gauge;
* a broken file changes nothing and says why in one line;
* one log line names what changed, and ``rpcguard_reload_*`` says how it went.

serve runs from a config file only (no ``--listen`` flag), as a multi-listener node does.
"""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path

import pytest
import yaml

from rpcguard.cli import READY_MESSAGE
from tests.integration.test_ops import LongClient, closed_after, tls_open, wait_until
from tests.support import realpeer
from tests.support.guard import PYTHON, Guard, start_guard, wait_for_line


@pytest.fixture
def procs():
    """Processes (Guard, LongClient, realpeer.Proc) stopped at the end of the test."""
    made: list = []
    yield made
    for p in reversed(made):
        if isinstance(p, LongClient):
            p.stop()
        elif isinstance(p, Guard):
            p.stop()
        else:
            p.stop()


def write_config(path: Path, data: dict) -> None:
    """Atomic replace, the way an editor or a config manager writes."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(data, sort_keys=False))
    os.replace(tmp, path)


def base_config(pki, mport: int, listeners: list[dict], **extra) -> dict:
    return {"tls": {"cert": pki.path(pki.node), "key": pki.path(pki.node, "key"), "ca": pki.path("ca")},
            "metrics": {"listen": f"127.0.0.1:{mport}"}, "allow": {"all": True}, **extra,
            "listeners": listeners}


def start_serve(workdir: Path, cfg: Path, port: int, mport: int, procs: list) -> Guard:
    proc = realpeer.start([PYTHON, "-m", "rpcguard", "serve", "--config", str(cfg)],
                          workdir / f"serve-{port}.log", "rpcguard serve")
    guard = Guard(proc, port, mport, "serve")
    procs.append(guard)
    wait_for_line(proc, READY_MESSAGE)
    realpeer.wait_port(port, proc=proc.popen)
    return guard


def tunnel(workdir: Path, pki, port: int, procs: list) -> Guard:
    g = start_guard("connect", workdir, ["--server", f"127.0.0.1:{port}", "--server-name", pki.node,
                                         *pki.connect_args()])
    procs.append(g)
    return g


def sighup(serve: Guard, result: str, n: int) -> None:
    serve.proc.popen.send_signal(signal.SIGHUP)
    assert serve.wait_value("rpcguard_reload_total", n, result=result) == n, serve.output()[-3000:]


def last_line(serve: Guard, text: str) -> str:
    lines = [line for line in serve.output().splitlines() if text in line]
    assert lines, serve.output()[-3000:]
    return lines[-1]


def refused_connection(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


def test_reload_policy_limits_and_listeners(pki, models, workdir, rpc_server, procs):
    up2 = realpeer.start_rpc_server(workdir)  # listener b's own real server (a's is busy with a long session)
    procs.append(up2[0])
    # reserved ports: the reloads move listeners to ports named in the file (realpeer.reserve_port)
    pa, pb, pa2, mport = (realpeer.reserve_port() for _ in range(4))
    a = {"name": "a", "listen": f"127.0.0.1:{pa}", "upstream": f"127.0.0.1:{rpc_server}"}
    b = {"name": "b", "listen": f"127.0.0.1:{pb}", "upstream": f"127.0.0.1:{up2[1]}"}
    cfg = workdir / "serve.yaml"
    write_config(cfg, base_config(pki, mport, [a], limits={"hello_timeout_s": 10}))
    serve = start_serve(workdir, cfg, pa, mport, procs)
    to_a = tunnel(workdir, pki, pa, procs)

    # a real llama.cpp session starts on the old settings and stays open across the reloads
    long_a = LongClient(workdir, to_a.endpoint, models["tiny"], rounds=1)
    procs.append(long_a)
    long_a.wait_for("WAITING 1")

    # 1. policy (a decode graph has far more than 2 nodes), limits, and a new listener
    write_config(cfg, base_config(pki, mport, [{**a, "policy": {"max_graph_nodes": 2}}, b],
                                  limits={"hello_timeout_s": 2}))
    sighup(serve, "ok", 1)
    assert last_line(serve, "config reloaded").endswith(
        "config reloaded (SIGHUP): changed limits.hello_timeout_s, listeners[a].policy.max_graph_nodes; "
        "added listener b")
    assert serve.value("rpcguard_reload_last_successful") == 1 and serve.value("rpcguard_reload_kept_keys") == 0
    realpeer.wait_port(pb, proc=serve.proc.popen)

    # the session that started before the reload still computes its graphs on the old policy
    # (it holds a's single-client upstream: the next session on a waits for it to end)
    long_a.go(1)
    assert long_a.finish() == 0, long_a.proc.output()[-3000:]
    rounds = long_a.rounds()
    assert rounds[0] == rounds[1] and len(rounds[0]) == 8, rounds
    assert serve.value("rpcguard_refusals_total", listener="a", reason="graph_too_large") == 0

    run = realpeer.run_client(to_a.endpoint, models["tiny"], n=2)  # the new policy refuses its graph
    assert not run.ok, run.output[-2000:]
    assert serve.wait_value("rpcguard_refusals_total", 1, listener="a", reason="graph_too_large") == 1
    assert "reason=graph_too_large" in last_line(serve, "session end")

    to_b = tunnel(workdir, pki, pb, procs)  # the added listener serves real sessions
    run_b = realpeer.run_client(to_b.endpoint, models["tiny"], n=4)
    assert run_b.ok, run_b.output[-3000:]
    assert rounds[0][:4] == run_b.tokens

    with tls_open(pki, pb, hello=False) as s:  # the new hello_timeout_s (2 s, was 10 s)
        assert 1.5 < closed_after(s) < 6
    assert serve.wait_value("rpcguard_refusals_total", 1, listener="b", reason="hello_timeout") == 1


    # 2. remove listener b while a real session runs on it; a key that cannot change live
    long_b = LongClient(workdir, to_b.endpoint, models["tiny"], rounds=1)
    procs.append(long_b)
    long_b.wait_for("WAITING 1")
    write_config(cfg, base_config(pki, mport, [{**a, "policy": {"max_graph_nodes": 2}}],
                                  limits={"hello_timeout_s": 2}, log={"format": "json"}))
    sighup(serve, "ok", 2)
    assert last_line(serve, "config reloaded").endswith(
        "config reloaded (SIGHUP): removed listener b; kept until restart: log.format")
    assert "log.format cannot change while running" in last_line(serve, "cannot change while running")
    assert serve.value("rpcguard_reload_kept_keys") == 1
    assert refused_connection(pb)  # b stopped accepting ...
    long_b.go(1)  # ... and its running session finished normally
    assert long_b.finish() == 0, long_b.proc.output()[-3000:]
    assert serve.wait_value("rpcguard_sessions_total", 2, listener="b", result="ok") >= 2
    assert "{" not in last_line(serve, "session end")  # still the text log format

    # 3. a broken file changes nothing (a still refuses the graph) and says why in one line
    write_config(cfg, base_config(pki, mport, [a], limits={"hello_timeout_s": -1}))
    sighup(serve, "error", 1)
    line = last_line(serve, "reload (SIGHUP) failed")
    assert line.endswith("nothing changed, keeping the previous certificates and configuration: "
                         "limits.hello_timeout_s: must be a number of seconds > 0, got -1"), line
    assert serve.value("rpcguard_reload_last_successful") == 0
    run = realpeer.run_client(to_a.endpoint, models["tiny"], n=2)
    assert not run.ok
    assert serve.wait_value("rpcguard_refusals_total", 2, listener="a", reason="graph_too_large") == 2

    # 4. fixed, with listener a moved to another port: replaced; the default policy is back
    write_config(cfg, base_config(pki, mport, [{**a, "listen": f"127.0.0.1:{pa2}"}]))
    sighup(serve, "ok", 3)
    assert last_line(serve, "config reloaded").endswith(
        "config reloaded (SIGHUP): changed limits.hello_timeout_s, listeners[a].listen; replaced listener a")
    # (log.format is back to the value in use: nothing kept any more)
    assert serve.value("rpcguard_reload_last_successful") == 1 and serve.value("rpcguard_reload_kept_keys") == 0
    realpeer.wait_port(pa2, proc=serve.proc.popen)
    assert refused_connection(pa)
    to_a2 = tunnel(workdir, pki, pa2, procs)
    run = realpeer.run_client(to_a2.endpoint, models["tiny"], n=4)
    assert run.ok, run.output[-3000:]
    assert run.tokens == run_b.tokens
    wait_until(lambda: serve.value("rpcguard_sessions_active") == 0, what="sessions to end")
