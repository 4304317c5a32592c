"""The exploit corpus (tests/corpus/exploits.py) against the REAL server, with and without rpcguard.

For every case that applies to protocol 7.0.0 (the real peer), an *authenticated* attacker (it
holds a valid client certificate, or sits next to llama.cpp on the connect port) speaks
ggml-rpc itself: HELLO, waits for the reply, the preamble (ALLOC_BUFFER + BUFFER_GET_BASE, so the
case has a real handle, base and size), then the case's frames; all but the last are valid and
answered.

* ``test_refused_through_the_tunnel``: attacker -> ``connect`` -> ``serve`` -> real server. The
  last frame is refused by ``connect`` (the first validator to see it) with the case's reason
  (``rpcguard_refusals_total{reason}`` on connect, nothing new with that reason on serve), the
  attacker's connection is closed without an answer, both proxies and the real server stay up,
  and a real llama.cpp session through the same proxies right after gives the baseline tokens.
* ``test_refused_by_serve_alone``: the same frames straight to ``serve`` over mTLS (defense in
  depth: serve does not rely on connect having validated anything).
* ``test_effect_on_unprotected_server``: cases marked ``dangerous=False`` only, sent directly to a
  fresh unprotected real ggml-rpc-server: the effect the corpus states ("abort": the process
  dies; "close": the connection is dropped and the server keeps serving) is observed. Cases
  marked dangerous are never sent to an unprotected server.

``RPCGUARD_CORPUS_REPORT=FILE`` appends one JSON line per test (case, outcome, server log line)
for docs/firewall.md.
"""

from __future__ import annotations

import json
import os
import socket
import ssl
import struct
import time
from dataclasses import dataclass

import pytest

from rpcguard.protocol import encode
from rpcguard.protocol.versions import NO_RESPONSE, spec_for
from rpcguard.reasons import FIREWALL_REASONS
from tests.corpus import CASES, Case, CaseContext, preamble_frames
from tests.support import realpeer
from tests.support.guard import Guard, start_guard
from tests.support.rawclient import read_response

VERSION = (7, 0, 0)  # the real peer's protocol (llama-cpp-python 0.3.36)
APPLICABLE = [c for c in CASES if c.applies(VERSION)]
SAFE = [c for c in APPLICABLE if not c.dangerous]
REPORT = os.environ.get("RPCGUARD_CORPUS_REPORT")
READ_TIMEOUT_S = 10.0


def report(**fields) -> None:
    if REPORT:
        with open(REPORT, "a") as f:
            f.write(json.dumps(fields) + "\n")


# ------------------------------------------------------------------------------ the attacker
@dataclass
class Attack:
    ctx: CaseContext
    tail: bytes  # what came back after the last frame
    ending: str  # "closed" (EOF or reset) or "timeout"


def attack(s: socket.socket, case: Case) -> Attack:
    """HELLO, preamble, then the case's frames on ``s``; returns what the last frame got back."""
    s.settimeout(READ_TIMEOUT_S)
    s.sendall(encode.hello_request(VERSION))
    hello = read_response(s)
    version = (hello[0], hello[1], hello[2])
    assert version == VERSION, f"HELLO answered {version}"
    alloc, get_base = preamble_frames(version)
    s.sendall(alloc)
    handle, size = struct.unpack("<QQ", read_response(s))
    assert handle, "ALLOC_BUFFER failed"
    s.sendall(get_base[:-8] + struct.pack("<Q", handle))
    (base,) = struct.unpack("<Q", read_response(s))
    ctx = CaseContext(version, handle, base, size)
    frames = case.build(ctx)
    spec = spec_for(version)
    for frame in frames[:-1]:  # valid set-up frames: accepted and, if they have one, answered
        s.sendall(frame)
        rule = spec.rule(frame[0])
        if rule is not None and rule.response != NO_RESPONSE:
            read_response(s)
    tail = b""
    try:
        s.sendall(frames[-1])
        while chunk := s.recv(65536):
            tail += chunk
        ending = "closed"
    except (ConnectionError, ssl.SSLError, EOFError):
        ending = "closed"
    except socket.timeout:
        ending = "timeout"
    return Attack(ctx, tail, ending)


def plain(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=READ_TIMEOUT_S)


def mtls(pki, port: int) -> socket.socket:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(pki.path("ca"))
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(pki.path(pki.client), pki.path(pki.client, "key"))
    return ctx.wrap_socket(plain(port), server_hostname=pki.node)


# ------------------------------------------------------------------------------ protected stack
@dataclass
class Stack:
    """A real ggml-rpc-server with ``serve`` and ``connect`` in front of it (enforce mode)."""

    server: realpeer.Proc
    port: int
    serve: Guard
    connect: Guard

    def alive(self) -> bool:
        return self.server.alive() and self.serve.proc.alive() and self.connect.proc.alive()

    def stop(self) -> None:
        for p in (self.connect.proc, self.serve.proc, self.server):
            p.stop()

    def logs(self) -> str:
        return "\n".join(f"--- {name}:\n{text[-2500:]}" for name, text in
                         (("connect", self.connect.output()), ("serve", self.serve.output()),
                          ("server", self.server.output())))


def _policy_yaml(policy: dict) -> str:
    lines = ["policy:", "  mode: enforce"]
    for key, value in sorted(policy.items()):
        if isinstance(value, (set, frozenset, list, tuple)):
            lines.append(f"  {key}: [{', '.join(sorted(value))}]")
        else:
            lines.append(f"  {key}: {value}")
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def stacks(tmp_path_factory, pki, peer_python):
    """One protected stack per distinct ``case.policy``, kept across cases (the point is that it
    keeps serving); a stack found dead is restarted so one failure does not cascade."""
    made: dict[str, Stack] = {}
    root = tmp_path_factory.mktemp("corpus-stacks")

    def get(case: Case) -> Stack:
        cfg_text = _policy_yaml(dict(case.policy))
        st = made.get(cfg_text)
        if st is not None and st.alive():
            return st
        if st is not None:
            st.stop()
        d = root / f"stack{len(os.listdir(root))}"
        d.mkdir()
        cfg = d / "policy.yaml"
        cfg.write_text(cfg_text)
        server, port = realpeer.start_rpc_server(d)
        started: list[Guard] = []
        try:
            started.append(start_guard("serve", d, ["--upstream", f"127.0.0.1:{port}", "--config", str(cfg),
                                                    *pki.serve_args()]))
            started.append(start_guard("connect", d, ["--server", started[0].endpoint, "--server-name", pki.node,
                                                      "--config", str(cfg), *pki.connect_args()]))
        except RuntimeError as exc:
            for g in started:
                g.stop()
            server.stop()
            pytest.fail(f"case {case.id} needs the firewall policy {dict(case.policy)} (case.policy), which "
                        f"rpcguard's configuration cannot express, so no real rpcguard process can refuse it:\n"
                        f"{cfg_text}{exc}", pytrace=False)
        made[cfg_text] = st = Stack(server, port, *started)
        return st

    yield get
    for st in made.values():
        st.stop()


@pytest.fixture(scope="module")
def baseline(models, tmp_path_factory) -> list[int]:
    """Tokens of the tiny model on a direct, untouched real server."""
    d = tmp_path_factory.mktemp("corpus-baseline")
    server, port = realpeer.start_rpc_server(d)
    try:
        run = realpeer.run_client(f"127.0.0.1:{port}", models["tiny"], n=8)
        assert run.ok, run.output[-3000:]
        return run.tokens
    finally:
        server.stop()


def refusals(guard: Guard, reason: str) -> float:
    return guard.value("rpcguard_refusals_total", reason=reason)


def still_serves(st: Stack, models, baseline) -> None:
    assert st.alive(), st.logs()
    run = realpeer.run_client(st.connect.endpoint, models["tiny"], n=8)
    assert run.ok, run.output[-3000:] + st.logs()
    assert run.tokens == baseline


# ------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("case", APPLICABLE, ids=lambda c: c.id)
def test_refused_through_the_tunnel(case: Case, stacks, models, baseline):
    st = stacks(case)
    before_c, before_s = refusals(st.connect, case.expected_reason), refusals(st.serve, case.expected_reason)
    with plain(st.connect.port) as s:
        got = attack(s, case)
    assert got.ending == "closed" and got.tail == b"", (got, st.logs())
    # Exactly one of the pair refuses it. Both ends are rpcguard (TLS ALPN), so connect leaves the
    # request firewall to serve (validate_requests: auto) and keeps framing, sizes and the
    # allow-list: a firewall rule (reasons.FIREWALL_REASONS) is serve's refusal, the others connect's.
    refuser = st.serve if case.expected_reason in FIREWALL_REASONS else st.connect
    other = st.serve if refuser is st.connect else st.connect
    before = before_c if refuser is st.connect else before_s
    after = refuser.wait_value("rpcguard_refusals_total", before + 1, reason=case.expected_reason)
    assert after == before + 1, (case.expected_reason, refuser.metrics_text(), st.logs())
    assert refusals(other, case.expected_reason) == (before_s if other is st.serve else before_c)
    assert case.expected_reason in refuser.output()  # the log line names the rule
    report(test="tunnel", case=case.id, reason=case.expected_reason, outcome="refused")
    still_serves(st, models, baseline)


@pytest.mark.parametrize("case", APPLICABLE, ids=lambda c: c.id)
def test_refused_by_serve_alone(case: Case, stacks, pki, models, baseline):
    st = stacks(case)
    before = refusals(st.serve, case.expected_reason)
    with mtls(pki, st.serve.port) as s:
        got = attack(s, case)
    assert got.ending == "closed" and got.tail == b"", (got, st.logs())
    after = st.serve.wait_value("rpcguard_refusals_total", before + 1, reason=case.expected_reason)
    assert after == before + 1, (case.expected_reason, st.serve.metrics_text(), st.logs())
    report(test="serve", case=case.id, reason=case.expected_reason, outcome="refused")
    still_serves(st, models, baseline)


def _hello_probe(port: int) -> bool:
    try:
        with plain(port) as s:
            s.sendall(encode.hello_request(VERSION))
            return len(read_response(s)) == 28
    except (OSError, EOFError):
        return False


def _server_says(output: str, outcome: str) -> str:
    """The server's own words about the attack connection (its first log line after accepting
    it), with the build path trimmed; a signal death prints nothing."""
    lines = output.splitlines()
    start = next((i for i, l in enumerate(lines) if "Accepted client connection" in l), len(lines))
    for line in lines[start + 1:]:
        line = line.strip()
        if line and "Client connection closed" not in line and "Accepted client connection" not in line:
            return line.split("vendor/llama.cpp/", 1)[-1][:220]
    return "(nothing logged)" if outcome != "abort" else "(nothing logged: killed by a signal)"


@pytest.mark.parametrize("case", SAFE, ids=lambda c: c.id)
def test_effect_on_unprotected_server(case: Case, workdir):
    assert not case.dangerous  # never send a dangerous case to a server without the proxy
    server, port = realpeer.start_rpc_server(workdir)
    try:
        with plain(port) as s:
            got = attack(s, case)
        deadline = time.monotonic() + 5
        while server.alive() and time.monotonic() < deadline and case.effect == "abort":
            time.sleep(0.05)
        if not server.alive():
            outcome = "abort"
        elif got.ending == "closed" and got.tail == b"":
            # Positive signal: the server takes one connection at a time, so a HELLO answered on
            # the next one means it finished the attack's alive (a crash 0.3 s late no longer
            # reads as a close). No answer: wait for the exit that explains it.
            answered = _hello_probe(port)
            if not answered:
                deadline = time.monotonic() + 10
                while server.alive() and time.monotonic() < deadline:
                    time.sleep(0.05)
            outcome = "close" if answered and server.alive() else "abort"
        elif got.ending == "timeout":
            outcome = "hang"
        else:
            outcome = "answered"
        detail = _server_says(server.output(), outcome)
        report(test="unprotected", case=case.id, outcome=outcome, returncode=server.popen.returncode,
               server_log=detail)
        print(f"{case.id}: {outcome} (rc={server.popen.returncode}) {detail}")
        assert outcome == case.effect, (outcome, got, server.output()[-2000:])
        if outcome == "abort":
            assert server.popen.returncode in (-6, -11, -8, -7), server.popen.returncode  # SIGABRT/SEGV/FPE/BUS
        else:
            assert _hello_probe(port), "the unprotected server stopped serving after a close"
    finally:
        server.stop()


def test_monitor_mode_counts_and_forwards(workdir, pki, models, baseline):
    """policy.mode=monitor: a violation is logged and counted on both sides, and the frame is
    forwarded: here a harmless case, which the real server then refuses itself (it closes)."""
    case = next(c for c in SAFE if c.id == "cve-2024-type-table-overflow")
    assert case.effect == "close"
    server, port = realpeer.start_rpc_server(workdir)
    serve = start_guard("serve", workdir, ["--upstream", f"127.0.0.1:{port}", "--mode", "monitor",
                                           *pki.serve_args()])
    connect = start_guard("connect", workdir, ["--server", serve.endpoint, "--server-name", pki.node,
                                               "--mode", "monitor", *pki.connect_args()])
    st = Stack(server, port, serve, connect)
    try:
        with plain(connect.port) as s:
            got = attack(s, case)
        assert got.ending == "closed" and got.tail == b""
        for g in (connect, serve):
            assert g.wait_value("rpcguard_firewall_violations_total", 1, reason=case.expected_reason,
                                mode="monitor") == 1, g.metrics_text()
            assert refusals(g, case.expected_reason) == 0
            assert g.logged("monitor: would refuse") and case.expected_reason in g.output()
        assert "invalid tensor type received" in server.output()  # the frame reached the server
        still_serves(st, models, baseline)
    finally:
        st.stop()


def test_enforce_refusal_counts_as_firewall_violation(stacks, models, baseline):
    """A frame refused by a firewall rule in enforce mode is a firewall violation with
    mode="enforce" (docs/design.md metrics table): the critical alert RpcguardFirewallViolations
    (deploy/prometheus/rpcguard-rules.yml) and the dashboard's violations panel select exactly
    ``rpcguard_firewall_violations_total{mode="enforce"}``."""
    case = next(c for c in APPLICABLE if c.id == "cve-2024-type-table-overflow")
    st = stacks(case)

    def violations(g: Guard) -> float:
        return g.value("rpcguard_firewall_violations_total", reason=case.expected_reason, mode="enforce")

    # Through the pair, the node's serve runs the firewall (connect: validate_requests auto).
    before_refused, before = refusals(st.serve, case.expected_reason), violations(st.serve)
    with plain(st.connect.port) as s:
        got = attack(s, case)
    assert got.ending == "closed" and got.tail == b""
    assert st.serve.wait_value("rpcguard_refusals_total", before_refused + 1,
                               reason=case.expected_reason) == before_refused + 1
    after = st.serve.wait_value("rpcguard_firewall_violations_total", before + 1, timeout=3,
                                reason=case.expected_reason, mode="enforce")
    assert after == before + 1, (
        f"refused with {case.expected_reason} in enforce mode, but rpcguard_firewall_violations_total"
        f'{{mode="enforce"}} did not move ({before} -> {after}): the RpcguardFirewallViolations alert '
        f"never fires for blocked exploits.\n"
        + "\n".join(l for l in st.serve.metrics_text().splitlines() if "firewall_violations" in l
                    or "refusals_total" in l))
    still_serves(st, models, baseline)
