"""Per-identity profiles (issue 10, item 5) with the REAL ggml-rpc-server and REAL llama.cpp.

Three identities on one listener, each held to its own profile:

* ``grafana-probe`` -> ``monitor``: only HELLO, DEVICE_COUNT and GET_DEVICE_MEMORY, one session at a
  time. A raw client reading the device memory works; anything else (ALLOC_BUFFER, and a real
  llama.cpp loading a model) is refused ``command_not_allowed``; a second concurrent session is
  refused ``too_many_sessions``.
* ``tenant-a`` -> ``tenant``: a 1 MiB allocation quota, so a real llama.cpp model load is refused
  ``alloc_quota_exceeded``.
* ``client1`` (no profile named: the listener's own settings) runs a real llama.cpp session.

The audit record names identity and profile; ``rpcguard_profile_sessions_total{profile}`` counts them.
A reload that changes a profile applies to the next session of that identity.
"""

from __future__ import annotations

import json
import signal
import socket
import ssl
import struct

import pytest

from rpcguard.protocol import encode
from rpcguard.protocol.versions import REFUSAL_CODES
from tests.integration.test_ops import mismatch
from tests.support import realpeer
from tests.support.guard import Guard, start_guard

MIB = 1 << 20


@pytest.fixture
def guards():
    made: list[Guard] = []

    def make(*args, **kw) -> Guard:
        g = start_guard(*args, **kw)
        made.append(g)
        return g

    yield make
    for g in made:
        g.stop()


def open_session(pki, port: int, cert: str, key: str) -> tuple[ssl.SSLSocket, bytes]:
    """mTLS as ``cert``, send HELLO; returns the socket and the HELLO reply payload."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(pki.path("ca"))
    ctx.load_cert_chain(cert, key)
    s = ctx.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=15), server_hostname=pki.node)
    s.sendall(encode.hello_request())
    return s, reply(s)


def reply(s: ssl.SSLSocket) -> bytes:
    def exact(n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = s.recv(n - len(buf))
            if not chunk:
                raise EOFError(f"closed after {len(buf)} of {n} bytes")
            buf += chunk
        return buf
    return exact(struct.unpack("<Q", exact(8))[0])


def closed(s: ssl.SSLSocket) -> bool:
    try:
        return s.recv(1) == b""
    except (ConnectionError, ssl.SSLError):
        return True


def audit_records(guard: Guard) -> list[dict]:
    out = []
    for line in guard.output().splitlines():
        if line.startswith("{") and '"session_end"' in line:
            out.append(json.loads(line))
    return out


def test_two_identities_two_profiles_each_held_to_its_own(pki, workdir, rpc_server, models, guards):
    probe_cert, probe_key = pki.issue("grafana-probe", server=False)
    tenant_cert, tenant_key = pki.issue("tenant-a", server=False)
    cfg = workdir / "serve.yaml"
    cfg.write_text(
        "log: {format: json}\n"
        "profiles:\n"
        "  monitor:\n"
        "    policy: {allow_commands: ['@handshake', GET_DEVICE_MEMORY]}\n"
        "    limits: {max_sessions: 1}\n"
        "  tenant:\n"
        "    policy: {max_session_alloc_bytes: 1MiB}\n"
        "allow:\n"
        "  - {cn: [grafana-probe], profile: monitor}\n"
        "  - {cn: [tenant-a], profile: tenant}\n"
        "  - {cn: [client1]}\n")
    serve = guards("serve", workdir, ["--upstream", f"127.0.0.1:{rpc_server}", "--config", str(cfg),
                                      *pki.serve_args()])

    # monitor: reads the device memory like a dashboard probe ...
    s, hello = open_session(pki, serve.port, probe_cert, probe_key)
    assert hello[:3] == bytes([7, 0, 0])
    s.sendall(encode.request("DEVICE_COUNT"))
    (count,) = struct.unpack("<I", reply(s))
    assert count >= 1
    s.sendall(encode.request("GET_DEVICE_MEMORY", struct.pack("<I", 0)))
    free, total = struct.unpack("<QQ", reply(s))
    assert 0 < free <= total
    # ... one session at a time: a second one is refused at its HELLO (0.0.N)
    s2, hello2 = open_session(pki, serve.port, probe_cert, probe_key)
    assert hello2[:3] == bytes([0, 0, REFUSAL_CODES["too_many_sessions"]]), hello2
    s2.close()
    # ... and may not allocate
    s.sendall(encode.request("ALLOC_BUFFER", struct.pack("<IQ", 0, 4096)))
    assert closed(s)
    s.close()
    assert serve.wait_value("rpcguard_refusals_total", 1, reason="command_not_allowed") == 1
    assert serve.wait_value("rpcguard_refusals_total", 1, reason="too_many_sessions") == 1

    # a real llama.cpp client holding the monitor identity cannot load a model
    as_probe = guards("connect", workdir, ["--server", serve.endpoint, "--server-name", pki.node,
                                           *pki.connect_args(probe_cert, probe_key)])
    run = realpeer.run_client(as_probe.endpoint, models["tiny"], n=2)
    assert not run.ok
    assert serve.wait_value("rpcguard_refusals_total", 2, reason="command_not_allowed") >= 2

    # tenant: held to its 1 MiB quota (the tiny model needs ~2.2 MiB of buffers)
    as_tenant = guards("connect", workdir, ["--server", serve.endpoint, "--server-name", pki.node,
                                            *pki.connect_args(tenant_cert, tenant_key)])
    run = realpeer.run_client(as_tenant.endpoint, models["tiny"], n=2)
    assert not run.ok
    assert serve.wait_value("rpcguard_refusals_total", 1, reason="alloc_quota_exceeded") == 1

    # client1: no profile named, the listener's own settings: a real session runs
    as_client = guards("connect", workdir, ["--server", serve.endpoint, "--server-name", pki.node,
                                            *pki.connect_args()])
    run = realpeer.run_client(as_client.endpoint, models["tiny"], n=4)
    assert run.ok, run.output[-3000:]

    # the audit record names identity and profile; the bounded label counts each profile
    records = audit_records(serve)
    by_reason = {(r["identity"], r["profile"], r["reason"], r["command"]) for r in records}
    assert ("CN=grafana-probe", "monitor", "command_not_allowed", "ALLOC_BUFFER") in by_reason, by_reason
    assert ("CN=grafana-probe", "monitor", "too_many_sessions", None) in by_reason, by_reason
    assert ("CN=tenant-a", "tenant", "alloc_quota_exceeded", "ALLOC_BUFFER") in by_reason, by_reason
    assert {r["profile"] for r in records if r["identity"] == "CN=client1"} == {"default"}
    assert any(r["identity"] == "CN=client1" and r["result"] == "ok" and r["alloc_bytes"] > MIB for r in records)
    monitor = [r for r in records if r["profile"] == "monitor"]
    assert serve.value("rpcguard_profile_sessions_total", profile="monitor") == len(monitor) >= 3
    assert serve.value("rpcguard_profile_sessions_total", profile="tenant") == sum(
        r["profile"] == "tenant" for r in records) >= 1
    assert serve.wait_value("rpcguard_profile_sessions_total", 1, profile="default") >= 1
    # the probe identity never reached an allocation: nothing it did was forwarded beyond reads
    assert all(r["alloc_bytes"] == 0 for r in monitor)

    # a profile changes on reload (SIGHUP): the next monitor session may allocate
    refused = serve.value("rpcguard_refusals_total", reason="command_not_allowed")
    cfg.write_text(cfg.read_text().replace("allow_commands: ['@handshake', GET_DEVICE_MEMORY]",
                                           "allow_commands: ['@handshake', GET_DEVICE_MEMORY, '@alloc']"))
    serve.proc.popen.send_signal(signal.SIGHUP)
    assert serve.wait_value("rpcguard_reload_total", 1, result="ok") == 1, serve.output()[-2000:]
    line = [x for x in serve.output().splitlines() if "config reloaded" in x][-1]
    assert "config reloaded (SIGHUP): changed listeners[listener0].profiles.monitor.policy.allow_commands" in line
    s, _ = open_session(pki, serve.port, probe_cert, probe_key)
    s.sendall(encode.request("ALLOC_BUFFER", struct.pack("<IQ", 0, 4096)))
    handle, size = struct.unpack("<QQ", reply(s))
    assert handle and size >= 4096
    s.close()
    assert serve.wait_value("rpcguard_profile_sessions_total", len(monitor) + 1, profile="monitor") == len(monitor) + 1
    assert serve.value("rpcguard_refusals_total", reason="command_not_allowed") == refused
