"""serve runs the REAL ggml-rpc-server itself, a fresh sandboxed process per session (issue 18).

* A payload standing for code execution inside the server (tests/support/escape_payload.c,
  built here) tries the escapes, reports each on stderr and execs the real server: run as
  ``serve -- payload ggml-rpc-server``, every attempt is denied while the real llama.cpp client
  through it gets the tokens it gets direct. The control arm (``sandbox: {mode: off}``) lets the
  same attempts through, so the test can fail.
* A marker one session leaves in the server's freed memory is not readable by the next session
  (per-session processes); the control (``isolation: shared``) reads it back.
* The real server SIGKILLed or aborted mid-session: the session ends ``upstream_crashed`` with the
  identity, the next session is served within seconds, the identity is quarantined after N
  crashes (answered 0.0.12 at HELLO) while another identity is still served.
* Without the sandbox's tools: ``required`` exits 2 with one line, ``best_effort`` serves with a
  warning and ``rpcguard_upstream_sandbox_missing``.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import struct
import subprocess
import threading
import time
from pathlib import Path

import pytest

from rpcguard.protocol import encode
from rpcguard.upstream.sandbox import SandboxSettings, cache_dir
from tests.integration.test_isolation_real import PATTERN, SMALL, f32
from tests.support import realpeer
from tests.support.guard import Pki, start_guard
from tests.support.rawclient import PeerClosed, RawClient, mtls_socket, read_response
from tests.support.waiting import wait_until

HERE = Path(__file__).resolve().parent
PAYLOAD_SRC = HERE.parent / "support" / "escape_payload.c"
USR_FILE = "/usr/local/rpcguard-escape-test"  # the control arm really writes it (then removed)
EXPECTED_ESCAPES = ("connect_loopback", "connect_external", "read_serve_key", "read_serve_config",
                    "read_other_cache", "write_outside_cache", "write_usr", "signal_outside", "ptrace_outside",
                    "unshare_userns", "io_uring", "keyring")


def server_binary() -> str:
    py = realpeer.realpeer_python()
    return subprocess.check_output(
        [py, "-c", "import importlib.util,os;s=importlib.util.find_spec('llama_cpp');"
                   "print(os.path.join(list(s.submodule_search_locations)[0],'lib','ggml-rpc-server'))"],
        text=True).strip()


def write_config(workdir: Path, name: str, upstream: str, extra: str = "") -> str:
    path = workdir / name
    path.write_text("listeners:\n  - upstream:\n" + upstream + extra)
    return str(path)


class Sink:
    """A loopback listener that counts the connections it gets (an escape would be one)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.hits = 0
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.hits += 1
            conn.close()

    def close(self) -> None:
        self.sock.close()


def build_payload(workdir: Path, **targets: object) -> str:
    out = workdir / "payload"
    defs = [f"-D{k}={v}" if isinstance(v, int) else f'-D{k}="{v}"' for k, v in targets.items()]
    subprocess.run(["gcc", "-O1", "-Wall", *defs, "-o", str(out), str(PAYLOAD_SRC)], check=True)
    return str(out)


def escapes(output: str) -> dict[str, str]:
    return dict(re.findall(r"ESCAPE (\w+): (\w+)", output))


def _escape_run(pki: Pki, workdir: Path, models: dict, mode: str) -> tuple[dict[str, str], object, bool, list]:
    """serve -- payload ggml-rpc-server -c, with the sandbox in ``mode``; a real client through it."""
    sink, outside = Sink(), subprocess.Popen(["sleep", "300"])
    listen_port = realpeer.free_port()
    cache_root = workdir / f"cache-{mode}"
    other = Path(cache_dir(SandboxSettings(cache_root=str(cache_root)), "CN=someone-else"))
    other.mkdir(parents=True)
    (other / "marker").write_text("another tenant's cache file\n")
    outside_file = workdir / f"escaped-{mode}.txt"
    cfg = write_config(workdir, f"payload-{mode}.yaml",
                       f"      exec: [PAYLOAD, {server_binary()}, -c]\n"
                       f"      sandbox: {{mode: {mode}, cache_root: {cache_root}}}\n")
    payload = build_payload(workdir, CONNECT_PORT=sink.port, EXTERNAL_IP="10.255.255.1", LISTEN_PORT=listen_port,
                            SERVE_KEY=pki.path(pki.node, "key"), SERVE_CONFIG=cfg,
                            OTHER_CACHE_FILE=str(other / "marker"), OUTSIDE_FILE=str(outside_file),
                            OUTSIDE_PID=outside.pid, USR_FILE=USR_FILE)
    Path(cfg).write_text(Path(cfg).read_text().replace("PAYLOAD", payload))
    serve = start_guard("serve", workdir, [*pki.serve_args(), "--config", cfg])
    connect = start_guard("connect", workdir, ["--server", serve.endpoint, "--server-name", pki.node,
                                               *pki.connect_args()])
    try:
        # the spare ran the payload at serve's start: its own listener is up (or not) now
        wait_until(lambda: len(escapes(serve.output())) >= len(EXPECTED_ESCAPES), 30, "the payload's report")
        try:
            socket.create_connection(("127.0.0.1", listen_port), 2).close()
            reachable = True
        except OSError:
            reachable = False
        run = realpeer.run_client(connect.endpoint, models["tiny"])
        seen = escapes(serve.output())
        assert sink.hits == (0 if mode == "required" else sink.hits)
        return seen, run, reachable, [sink.hits, outside_file.exists(), outside.poll()]
    finally:
        connect.stop()
        serve.stop()
        outside.kill()
        sink.close()
        if os.path.exists(USR_FILE):  # the control arm (no sandbox) wrote it as root
            os.unlink(USR_FILE)


def test_payload_escapes_are_denied_and_tokens_stay_identical(pki, workdir, models, rpc_server):
    direct = realpeer.run_client(f"127.0.0.1:{rpc_server}", models["tiny"])
    assert direct.ok, direct.output
    seen, run, reachable, (hits, wrote, outside_rc) = _escape_run(pki, workdir, models, "required")
    assert run.ok, run.output
    assert run.tokens == direct.tokens
    assert set(EXPECTED_ESCAPES) <= set(seen), seen
    assert all(seen[name] == "denied" for name in EXPECTED_ESCAPES), seen
    assert not reachable  # its own listener is bound inside a network namespace nobody can reach
    assert hits == 0 and not wrote and outside_rc is None


def test_payload_escapes_succeed_without_the_sandbox(pki, workdir, models):
    """The control arm: the same payload with ``sandbox: {mode: off}`` gets out, so the test above
    can fail; the server still serves (the sandbox changes nothing in the data path)."""
    seen, run, reachable, (hits, wrote, _) = _escape_run(pki, workdir, models, "off")
    assert run.ok, run.output
    for name in ("connect_loopback", "read_serve_key", "read_serve_config", "read_other_cache",
                 "write_outside_cache", "signal_outside", "unshare_userns", "keyring"):
        assert seen[name] == "ALLOWED", (name, seen)
    assert reachable and hits >= 1 and wrote


def _marker_left(pki: Pki, serve) -> bytes:
    """Session 1 writes PATTERN into a buffer and frees it; what session 2 reads from a new one."""
    one = RawClient.session(mtls_socket(pki, serve.port))
    t = one.alloc(SMALL)
    one.sock.sendall(encode.request("SET_TENSOR", f32(t.buffer, t.data, SMALL) + b"\0" + struct.pack("<Q", 0)
                                    + PATTERN))
    assert one.call("GET_TENSOR", f32(t.buffer, t.data, SMALL) + struct.pack("<QQ", 0, SMALL)) == PATTERN
    one.sock.sendall(encode.request("FREE_BUFFER", struct.pack("<Q", t.buffer)))
    one.close()
    two = RawClient.session(mtls_socket(pki, serve.port))
    t = two.alloc(SMALL)
    data = two.call("GET_TENSOR", f32(t.buffer, t.data, SMALL) + struct.pack("<QQ", 0, SMALL))
    two.close()
    return data


@pytest.mark.parametrize("isolation", ["session", "shared"])
def test_a_sessions_marker_is_gone_in_the_next_sessions_process(pki, workdir, isolation):
    # BUFFER_CLEAR off: only the process boundary stands between the two sessions
    cfg = write_config(workdir, f"iso-{isolation}.yaml", f"      exec: [{server_binary()}]\n"
                                                         f"      isolation: {isolation}\n",
                       "policy:\n  clear_new_buffers: false\n")
    serve = start_guard("serve", workdir, [*pki.serve_args(), "--config", cfg])
    try:
        data = _marker_left(pki, serve)
        # 16-byte pieces of session 2's new buffer that are pieces of session 1's marker (anywhere:
        # the allocator need not hand the freed bytes out at the same offset)
        leaked = sum(1 for i in range(0, SMALL, 16) if any(data[i:i + 16]) and data[i:i + 16] in PATTERN)
        if isolation == "session":
            # a fresh process: none of session 1's bytes. (Not all zeros: the new process's
            # allocator may hand out a chunk of its own start-up, a free-list pointer in its first
            # bytes, as CI saw once.)
            assert leaked == 0, data[:64]
            assert serve.value("rpcguard_upstream_exits_total", cause="killed") >= 1
        else:  # the control: one process for both sessions hands the freed bytes out
            assert leaked > SMALL // 32, data[:64]
    finally:
        serve.stop()


def serving_pid(serve_pid: int) -> int | None:
    """The descendant ggml-rpc-server of serve with a connection established (not the spare)."""
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    todo, found = [serve_pid], []
    while todo:
        pid = todo.pop()
        for kid in kids.get(pid, []):
            todo.append(kid)
            try:
                exe = os.readlink(f"/proc/{kid}/exe")
                tcp = open(f"/proc/{kid}/net/tcp").read()
            except OSError:
                continue
            if exe.endswith("ggml-rpc-server") and any(ln.split()[3] == "01" for ln in tcp.splitlines()[1:]):
                found.append(kid)
    return found[0] if found else None


def hello_answer(pki: Pki, port: int, cert: tuple[str, str] | None = None) -> tuple[int, int, int]:
    ctx = None
    if cert is not None:
        import ssl
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=pki.path("ca"))
        ctx.check_hostname = False
        ctx.load_cert_chain(*cert)
        raw = socket.create_connection(("127.0.0.1", port), 10)
        sock = ctx.wrap_socket(raw)
    else:
        sock = mtls_socket(pki, port)
    sock.sendall(encode.request("HELLO", bytes(24)))
    rsp = read_response(sock)
    sock.close()
    return struct.unpack_from("<BBB", rsp)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGABRT])
def test_a_server_that_dies_mid_session_names_the_session_and_quarantines_its_identity(pki, workdir, sig):
    cfg = write_config(workdir, "crash.yaml", f"      exec: [{server_binary()}]\n"
                                              "      quarantine: {crashes: 2, window_s: 600, duration_s: 600}\n")
    serve = start_guard("serve", workdir, [*pki.serve_args(), "--config", cfg])
    other = pki.issue("tenant2", server=False)
    try:
        for n in (1, 2):
            c = RawClient.session(mtls_socket(pki, serve.port))
            c.alloc(SMALL)  # a session with state in its server
            pid = wait_until(lambda: serving_pid(serve.proc.popen.pid), 10, "the session's server process")
            os.kill(pid, sig)
            with pytest.raises((PeerClosed, ConnectionError, OSError)):
                c.call("GET_ALIGNMENT", struct.pack("<I", 0))
            c.close()
            wait_until(lambda: serve.output().count("reason=upstream_crashed") >= n, 10, "the crash in the log")
            t0 = time.monotonic()
            if n == 1:  # the next session is served, in a fresh process, within seconds
                nxt = RawClient.session(mtls_socket(pki, serve.port))
                assert nxt.alloc(SMALL).buffer
                nxt.close()
                assert time.monotonic() - t0 < 5
        line = [ln for ln in serve.output().splitlines() if "reason=upstream_crashed" in ln][-1]
        assert "identity=CN=client1" in line and f"signal {sig.name}" in line, line
        assert "command=" in line and "command=-" not in line, line
        pm = [ln for ln in serve.output().splitlines() if "post-mortem:" in ln][-1]
        assert '["ALLOC_BUFFER",' in pm and '"last_graph":null' in pm, pm  # its requests, no graph sent
        assert serve.value("rpcguard_upstream_crashes_total") == 2
        # two crashes within the window: this identity is answered 0.0.12, another is served
        assert hello_answer(pki, serve.port) == (0, 0, 12)
        assert hello_answer(pki, serve.port, other)[0] >= 2
        assert serve.value("rpcguard_refusals_total", reason="identity_quarantined") >= 1
        assert serve.value("rpcguard_identities_quarantined") == 1
    finally:
        serve.stop()


def test_without_the_sandbox_tools_required_exits_2_and_best_effort_warns(pki, workdir):
    env = {"PATH": "/nonexistent"}  # no bwrap, no setpriv
    cfg = write_config(workdir, "req.yaml", f"      exec: [{server_binary()}]\n")
    g = start_guard("serve", workdir, [*pki.serve_args(), "--config", cfg], env=env, ready=False)
    try:
        assert g.proc.popen.wait(30) == 2
    finally:
        if g.proc.alive():
            g.stop()
    lines = [ln for ln in g.output().splitlines() if "config error" in ln]
    assert len(lines) == 1 and "upstream.sandbox.mode" in lines[0] and "bwrap" in lines[0], g.output()
    cfg = write_config(workdir, "best.yaml", f"      exec: [{server_binary()}]\n"
                                             "      sandbox: {mode: best_effort}\n")
    serve = start_guard("serve", workdir, [*pki.serve_args(), "--config", cfg], env=env)
    try:
        c = RawClient.session(mtls_socket(pki, serve.port))
        assert c.alloc(SMALL).buffer
        c.close()
        assert serve.logged("sandbox mechanism namespaces unavailable")
        assert serve.value("rpcguard_upstream_sandbox_missing", mechanism="namespaces") == 1
        assert serve.value("rpcguard_upstream_sandbox_missing", mechanism="own_uid") == 1
    finally:
        serve.stop()


@pytest.mark.parametrize("isolation", ["session", "shared"])
def test_the_watchdog_ends_a_session_whose_server_stops_answering(pki, workdir, isolation):
    """The server SIGSTOPped with a response owed: after limits.max_graph_s the session ends
    upstream_hung, its process is killed (shared: and restarted), the next session is served."""
    cfg = write_config(workdir, f"hung-{isolation}.yaml", f"      exec: [{server_binary()}]\n"
                                                          f"      isolation: {isolation}\n",
                       "limits:\n  max_graph_s: 2\n")
    serve = start_guard("serve", workdir, [*pki.serve_args(), "--config", cfg])
    try:
        c = RawClient.session(mtls_socket(pki, serve.port))
        c.alloc(SMALL)
        pid = wait_until(lambda: serving_pid(serve.proc.popen.pid), 10, "the session's server process")
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises((PeerClosed, ConnectionError, OSError)):
            c.call("GET_ALIGNMENT", struct.pack("<I", 0))
        c.close()
        assert 1.5 < time.monotonic() - t0 < 10
        wait_until(lambda: "reason=upstream_hung" in serve.output(), 10, "the hang in the log")
        line = [ln for ln in serve.output().splitlines() if "reason=upstream_hung" in ln][-1]
        assert "result=error" in line and "identity=CN=client1" in line, line
        wait_until(lambda: not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z",
                   10, "the hung server killed")
        if isolation == "shared":
            assert serve.logged("the shared server hung in session")
        nxt = RawClient.session(mtls_socket(pki, serve.port))
        assert nxt.alloc(SMALL).buffer
        nxt.close()
    finally:
        serve.stop()


def server_processes(serve_pid: int) -> list[int]:
    """Every ggml-rpc-server below serve (running, not zombies)."""
    out, todo = [], [serve_pid]
    while todo:
        pid = todo.pop()
        try:
            kids = [int(k) for t in os.listdir(f"/proc/{pid}/task")
                    for k in open(f"/proc/{pid}/task/{t}/children").read().split()]
        except OSError:
            continue
        for kid in kids:
            todo.append(kid)
            try:
                if os.readlink(f"/proc/{kid}/exe").endswith("ggml-rpc-server"):
                    out.append(kid)
            except OSError:
                pass
    return out


def test_a_reload_that_changes_the_command_replaces_the_processes(pki, workdir):
    cfg = write_config(workdir, "reload.yaml", f"      exec: [{server_binary()}]\n      isolation: shared\n")
    # a fixed port: the reload replaces the listener, which binds its listen address again (port 0
    # would give the new listener another port)
    serve = start_guard("serve", workdir, [*pki.serve_args(), "--config", cfg], port=realpeer.reserve_port())
    try:
        c = RawClient.session(mtls_socket(pki, serve.port))
        assert c.alloc(SMALL).buffer
        c.close()
        old = server_processes(serve.proc.popen.pid)
        assert len(old) == 1
        Path(cfg).write_text(Path(cfg).read_text().replace("isolation: shared", "isolation: session"))
        serve.proc.popen.send_signal(signal.SIGHUP)
        wait_until(lambda: "config reloaded" in serve.output(), 15, "the reload")
        assert serve.logged("replaced listener listener0") or serve.logged("listeners[listener0].managed")
        for _ in range(2):  # two sessions, each in a process of its own
            c = RawClient.session(mtls_socket(pki, serve.port))
            assert c.alloc(SMALL).buffer
            c.close()
        # the shared process of the replaced listener is gone; what runs now is the new pool's
        wait_until(lambda: not set(old) & set(server_processes(serve.proc.popen.pid)), 10, "the old process gone")
        assert serve.value("rpcguard_upstream_sessions_by_start_total", start="shared") == 0  # the new pool's
        assert serve.value("rpcguard_upstream_starts_total") >= 2
        # the spare: started after the last session's process ended (late on a busy machine)
        running = wait_until(lambda: server_processes(serve.proc.popen.pid), 10, "the spare")
    finally:
        serve.stop()
    # serve's exit takes its processes with it (killed at close; bwrap --die-with-parent)
    wait_until(lambda: not [p for p in running if os.path.exists(f"/proc/{p}")], 10, "the servers gone")


def test_not_root_the_server_still_gets_only_its_own_loopback(workdir):
    """serve as an unprivileged user (the hardened unit's User=): bwrap makes a user namespace,
    nshelper.py brings the connections out of the server's network namespace. Its own uid is
    missing (best_effort: a warning and the metric); the network stays closed."""
    import shutil
    import tempfile

    from tests.support.guard import READY_MESSAGE, wait_for_line

    base = Path(tempfile.mkdtemp(prefix="rpcguard-nonroot-"))
    try:
        os.chmod(base, 0o755)
        bindir = base / "bin"
        bindir.mkdir()
        src = Path(server_binary())
        for f in [src, *src.parent.glob("lib*.so*")]:
            shutil.copy(f, bindir / f.name)
        sink = Sink()
        payload = build_payload(workdir, CONNECT_PORT=sink.port, EXTERNAL_IP="10.255.255.1",
                                LISTEN_PORT=realpeer.free_port(), SERVE_KEY="/nonexistent", SERVE_CONFIG="/nonexistent",
                                OTHER_CACHE_FILE="/nonexistent", OUTSIDE_FILE=str(base / "escaped"),
                                OUTSIDE_PID=os.getpid(), USR_FILE="/nonexistent/x")
        shutil.copy(payload, bindir / "payload")
        pki = Pki(base / "pki")
        (base / "cache").mkdir()
        for p in [base / "pki", base / "cache", *(base / "pki").iterdir()]:
            os.chown(p, 65534, 65534)
        cfg = base / "serve.yaml"
        cfg.write_text(f"listeners:\n  - upstream:\n      exec: [{bindir / 'payload'}, {bindir / 'ggml-rpc-server'}]\n"
                       f"      sandbox: {{mode: best_effort, cache_root: {base / 'cache'}}}\n")
        port, mport = realpeer.free_port(), realpeer.free_port()
        proc = realpeer.start(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", realpeer.PYTHON, "-m",
                               "rpcguard", "serve", "--config", str(cfg), "--listen", f"127.0.0.1:{port}", "--metrics",
                               f"127.0.0.1:{mport}", *pki.serve_args(), "--allow-all"],
                              workdir / "serve-nonroot.log", "rpcguard serve (nobody)")
        try:
            wait_for_line(proc, READY_MESSAGE)
            c = RawClient.session(mtls_socket(pki, port))
            assert c.alloc(SMALL).buffer
            c.close()
            wait_until(lambda: "connect_external" in escapes(proc.output()), 15, "the payload's report")
            seen = escapes(proc.output())
            assert seen["connect_loopback"] == "denied" and seen["connect_external"] == "denied", seen
            assert sink.hits == 0
            assert "sandbox mechanism own_uid unavailable" in proc.output()
            assert "network_namespace unavailable" not in proc.output()
            from tests.support.guard import Guard
            g = Guard(proc, port, mport, "serve")
            assert g.value("rpcguard_upstream_sandbox_missing", mechanism="network_namespace") == 0
            assert g.value("rpcguard_upstream_sandbox_missing", mechanism="own_uid") == 1
        finally:
            proc.stop()
            sink.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_a_mamba2_model_works_contained_and_is_refused_uncontained(pki, workdir, rpc_server):
    """SSM_SCAN indexes its state with tensor contents (oprules.needs_containment): forwarded to a
    contained server (a fresh sandboxed process per session), refused op_needs_containment by the
    same serve running one shared process."""
    model = realpeer.make_model(workdir / "mamba2.gguf", "--preset", "mamba2")
    direct = realpeer.run_client(f"127.0.0.1:{rpc_server}", model)
    assert direct.ok, direct.output[-2000:]
    for isolation in ("session", "shared"):
        cfg = write_config(workdir, f"mamba-{isolation}.yaml", f"      exec: [{server_binary()}]\n"
                                                               f"      isolation: {isolation}\n")
        serve = start_guard("serve", workdir, [*pki.serve_args(), "--config", cfg])
        connect = start_guard("connect", workdir, ["--server", serve.endpoint, "--server-name", pki.node,
                                                   *pki.connect_args()])
        try:
            run = realpeer.run_client(connect.endpoint, model)
            if isolation == "session":
                assert run.ok, (run.output[-2000:], serve.output()[-3000:])
                assert run.tokens == direct.tokens
            else:
                assert not run.ok
                assert serve.value("rpcguard_refusals_total", reason="op_needs_containment") >= 1, serve.output()[-3000:]
                assert serve.logged("upstream.isolation: session")
        finally:
            connect.stop()
            serve.stop()


@pytest.mark.parametrize("mode", ["required", "off"])
def test_the_servers_die_with_a_killed_serve(pki, workdir, mode):
    """serve SIGKILLed: no drain, no close; its servers go with it (bwrap --die-with-parent, and
    the parent-death signal rpcguard sets on what it spawns: all there is with sandbox off)."""
    cfg = write_config(workdir, f"die-{mode}.yaml", f"      exec: [{server_binary()}]\n      sandbox: {{mode: {mode}}}\n")
    serve = start_guard("serve", workdir, [*pki.serve_args(), "--config", cfg])
    try:
        c = RawClient.session(mtls_socket(pki, serve.port))
        assert c.alloc(SMALL).buffer
        running = wait_until(lambda: server_processes(serve.proc.popen.pid), 15, "the session's server")
    except BaseException:
        serve.stop()
        raise
    serve.proc.popen.kill()  # SIGKILL: no drain, no close
    serve.proc.popen.wait(10)
    c.close()
    wait_until(lambda: not [p for p in running if os.path.exists(f"/proc/{p}")
                            and open(f"/proc/{p}/stat").read().split()[2] != "Z"], 10, "the servers gone")
