"""Protocol-version matrix: rpcguard against REAL llama.cpp builds of several ggml-RPC versions.

Versions come from ``RPCGUARD_MATRIX`` (comma list, default ``7.0.0,5.0.0,3.6.1``). Each needs its
own build (``bash tests/realpeer/matrix.sh VERSION``); a missing build FAILS with that command.

For every version V:
  * direct: real server V + real client V produce the tiny model's tokens;
  * through the pair (client -> connect -> serve -> server, enforce mode): same tokens, nothing
    refused, no firewall violation, and serve reports ``upstream_protocol_info{version="V"}``.
For every ordered pair (A, B), A != B, of the matrix: client A against server B, directly and
through the pair. Where llama.cpp accepts the server, the pair must give the same tokens; where it
refuses at the handshake, the pair must refuse cleanly (the client names a version mismatch or ends
with no RPC device); where the handshake passes but the session dies in compute (4.0.0 <-> 4.0.2),
the pair must not let the real server crash. After any refusal the server and both proxies must be
up and carry a normal session.

``RPCGUARD_MATRIX_REPORT=FILE`` appends one JSON line per run (outcome, timings) for docs/matrix.md.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from rpcguard.protocol.versions import KNOWN_VERSIONS
from rpcguard.proxy.readiness import hello_probe
from tests.support import realpeer
from tests.support.guard import Guard, start_pair

MATRIX = [v.strip() for v in os.environ.get("RPCGUARD_MATRIX", "7.0.0,5.0.0,3.6.1").split(",") if v.strip()]
MIXED = [(a, b) for a, b in itertools.permutations(MATRIX, 2)]
N_TOKENS = 12
REPORT = os.environ.get("RPCGUARD_MATRIX_REPORT")

# What a llama.cpp client prints when it will not use a server (see docs/matrix.md):
#   "RPC server version mismatch: X.Y.Z"         every version, on a HELLO reply it rejects
#   "error: RPC server ... reported 0 devices"    rpc_client_smoke.py: add_server returned NULL (<= 5.0.0)
#   "error: no RPC device registered"             rpc_client_smoke.py: nothing usable registered
#   "Failed to connect to"                        2.0.0-5.0.0 skip, 7.0.0 abort message
CLEAN_REFUSAL = re.compile(r"RPC server version mismatch|reported 0 devices|no RPC device registered|"
                           r"Failed to connect to")
# What it prints when the server just closed on it (llama.cpp aborts: "crashed" or handshake failed).
ANY_REFUSAL = re.compile(CLEAN_REFUSAL.pattern + r"|Remote RPC server crashed|RPC handshake failed")


def peer(version: str) -> str:
    """The matrix build of ``version``; missing is a failure (with the build command), never a skip."""
    try:
        return realpeer.realpeer_python(version)
    except realpeer.MissingPeer as exc:
        pytest.fail(str(exc))


def report(**fields) -> None:
    if REPORT:
        with open(REPORT, "a") as f:
            f.write(json.dumps(fields) + "\n")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    try:
        return realpeer.make_model(tmp_path_factory.mktemp("matrix-models") / "tiny.gguf")
    except realpeer.MissingPeer as exc:
        pytest.fail(str(exc))


class Run:
    """One real client run, classified."""

    def __init__(self, endpoint: str, model: Path, version: str):
        peer(version)
        t0 = time.monotonic()
        try:
            # -v: 2.0.0 connects inside Llama(), whose quiet mode silences stderr (and the reason)
            self.result: realpeer.ClientRun | None = realpeer.run_client(endpoint, model, n=N_TOKENS,
                                                                          version=version, timeout=180,
                                                                          extra=["-v"])
            self.output = self.result.output
        except subprocess.TimeoutExpired as exc:
            self.result = None
            self.output = f"TIMEOUT after {exc.timeout} s\n" + str(exc.output or "")
        self.wall_s = round(time.monotonic() - t0, 2)

    @property
    def ok(self) -> bool:
        return self.result is not None and self.result.ok and self.result.tokens is not None

    @property
    def tokens(self) -> list[int] | None:
        return self.result.tokens if self.result else None

    @property
    def outcome(self) -> str:
        """ok | refused (the client rejected the server: clean) | aborted (the connection closed at
        the handshake, llama.cpp aborted) | crashed_in_compute (the model loaded, then the
        connection died mid-session) | failed (anything else, e.g. a hang)."""
        if self.ok:
            return "ok"
        if CLEAN_REFUSAL.search(self.output):
            return "refused"
        if ANY_REFUSAL.search(self.output):
            return "crashed_in_compute" if self.result and self.result.load_s is not None else "aborted"
        return "failed"

    def summary(self) -> str:
        """The llama.cpp lines that explain the outcome."""
        keep = [line for line in self.output.splitlines()
                if ANY_REFUSAL.search(line) or "RPC_CLIENT_OK" in line or "error" in line.lower()
                or "token ids" in line or "TIMEOUT" in line]
        rc = self.result.rc if self.result else None
        keep = [re.sub(r"\S*/vendor/llama\.cpp/", "", line.strip()) for line in keep]  # build dir noise
        return f"rc={rc} " + " | ".join(dict.fromkeys(keep))[:600]

    def fields(self) -> dict:
        r = self.result
        return {"outcome": self.outcome, "rc": r.rc if r else None, "tokens": self.tokens, "wall_s": self.wall_s,
                "load_s": r.load_s if r else None, "gen_tps": r.gen_tps if r else None,
                "summary": self.summary()}


class Server:
    def __init__(self, workdir: Path, version: str):
        peer(version)
        self.version = version
        self.proc, self.port = realpeer.start_rpc_server(workdir, version=version)

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def started_version(self) -> str | None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            m = re.search(r"Starting RPC server v(\d+\.\d+\.\d+)", self.proc.output())
            if m:
                return m.group(1)
            time.sleep(0.05)
        return None


@pytest.fixture
def servers(workdir):
    started: list[Server] = []

    def make(version: str) -> Server:
        s = Server(workdir, version)
        started.append(s)
        return s

    yield make
    for s in started:
        s.proc.stop()


@pytest.fixture
def guard_pair(workdir, pki):
    """connect -> serve -> a given upstream; like conftest's ``pair`` without its default server."""
    guards: list[Guard] = []

    def make(upstream_port: int) -> tuple[Guard, Guard]:
        return start_pair(workdir, pki, upstream_port, guards)

    yield make
    for g in guards:
        g.stop()


def violations(g: Guard) -> float:
    return g.value("rpcguard_firewall_violations_total")


def refusals(g: Guard) -> dict[str, float]:
    return {s.labels.get("reason", "?"): s.value for s in g.samples("rpcguard_refusals_total") if s.value}


def guard_logs(*guards: Guard) -> str:
    return "\n".join(f"--- {g.role} log (tail) ---\n" + "\n".join(g.output().splitlines()[-25:]) for g in guards)


_direct: dict[tuple[str, str], Run] = {}


def server_alive(srv: Server) -> bool:
    """The server served the failed client's session to its end and took the next one: it answers a
    HELLO (a positive signal; a wait for a crash that does not come would only read as alive)."""
    ok, why = asyncio.run(hello_probe("127.0.0.1", srv.port, frozenset(KNOWN_VERSIONS), timeout=30))
    return srv.proc.alive() and ("answered HELLO" in why or "speaks protocol" in why)


def direct_run(workdir: Path, servers, model: Path, client: str, server: str) -> Run:
    """Client ``client`` straight against a fresh server ``server`` (cached per module run)."""
    key = (client, server)
    if key not in _direct:
        srv = servers(server)
        _direct[key] = run = Run(srv.endpoint, model, client)
        report(kind="direct", client=client, server=server, server_alive=server_alive(srv), **run.fields())
    return _direct[key]


# ---------------------------------------------------------------------------------------------
# same version


@pytest.mark.parametrize("version", MATRIX)
def test_direct_same_version(version, workdir, servers, tiny):
    srv = servers(version)
    assert srv.started_version() == version, f"matrix build for {version} is a different protocol:\n" \
                                             f"{srv.proc.output()[-2000:]}"
    run = Run(srv.endpoint, tiny, version)
    _direct[(version, version)] = run
    report(kind="direct", client=version, server=version, **run.fields())
    assert run.ok, f"real client {version} vs server {version} failed:\n{run.output[-4000:]}"
    assert run.tokens is not None and len(run.tokens) == N_TOKENS


@pytest.mark.parametrize("version", MATRIX)
def test_pair_same_version(version, workdir, servers, guard_pair, tiny):
    direct = direct_run(workdir, servers, tiny, version, version)
    assert direct.ok, f"direct run of {version} failed, see test_direct_same_version:\n{direct.summary()}"
    srv = servers(version)
    connect, serve = guard_pair(srv.port)
    run = Run(connect.endpoint, tiny, version)
    report(kind="pair", client=version, server=version, refusals_serve=refusals(serve),
           refusals_connect=refusals(connect), **run.fields())
    logs = guard_logs(connect, serve)
    assert run.ok, f"client {version} through the pair failed:\n{run.output[-3000:]}\n{logs}"
    assert run.tokens == direct.tokens, f"pair tokens {run.tokens} != direct {direct.tokens}"
    for g in (connect, serve):
        assert refusals(g) == {}, f"{g.role} refused legitimate {version} traffic: {refusals(g)}\n{logs}"
        assert violations(g) == 0, f"{g.role} firewall violations on {version}\n{logs}"
    assert serve.value("rpcguard_upstream_protocol_info", version=version) == 1, \
        [s for s in serve.samples("rpcguard_upstream_protocol_info")]


# ---------------------------------------------------------------------------------------------
# mixed versions


# llama.cpp accepts a patch-level difference (same major, client minor >= server minor), but ggml's op
# enum is not stable across patches: 4.0.2 inserted COL2IM_1D and LIGHTNING_INDEXER, so GLU is 95 in
# 4.0.0 and 97 in 4.0.2. rpcguard can only check a graph against the SERVER's op table (HELLO carries
# no client version).
KNOWN_BUGS: dict[tuple[str, str], str] = {}  # (client, server) -> why the pair still fails
MIXED_PARAMS = [pytest.param(a, b, id=f"client{a}-server{b}",
                             marks=[pytest.mark.xfail(strict=True, reason=KNOWN_BUGS[(a, b)])]
                             if (a, b) in KNOWN_BUGS else [])
                for a, b in MIXED]


@pytest.mark.parametrize("client,server", MIXED_PARAMS)
def test_mixed_versions(client, server, workdir, servers, guard_pair, tiny):
    direct = direct_run(workdir, servers, tiny, client, server)
    assert direct.outcome != "failed", f"direct client {client} vs server {server}: unexplained failure:\n" \
                                       f"{direct.output[-3000:]}"

    srv = servers(server)
    connect, serve = guard_pair(srv.port)
    run = Run(connect.endpoint, tiny, client)
    alive = server_alive(srv)
    report(kind="pair", client=client, server=server, server_alive=alive, refusals_serve=refusals(serve),
           refusals_connect=refusals(connect), **run.fields())
    logs = guard_logs(connect, serve)
    if direct.ok:
        # llama.cpp itself accepts this combination: so must the pair, with the same tokens.
        assert run.ok, f"direct {client}->{server} works but the pair failed:\n{run.summary()}\n{logs}"
        assert run.tokens == direct.tokens
        for g in (connect, serve):
            assert violations(g) == 0, f"{g.role} firewall violations\n{logs}"
        return
    if direct.outcome in ("refused", "aborted"):
        # llama.cpp refuses (or is closed on) at the handshake: the pair must refuse, and cleanly.
        assert run.outcome == "refused", \
            f"direct: {direct.summary()}\npair: {run.summary()}\n{run.output[-2000:]}\n{logs}"
    else:
        # the handshake passes but the session dies in compute (the server crashes directly):
        # the pair cannot make it work, but must not let the server crash.
        assert not run.ok, f"pair succeeded where llama.cpp fails: {run.summary()}"
    assert alive, f"the real {server} server died behind rpcguard (client {client}):\n" \
                  f"{srv.proc.output()[-1500:]}\npair: {run.summary()}\n{logs}"
    assert connect.proc.alive() and serve.proc.alive(), logs
    # ...and both proxies still carry a normal session (a client that matches the server).
    after = Run(connect.endpoint, tiny, server)
    assert after.ok, f"normal {server} session after the refusal failed:\n{after.summary()}\n{logs}"
    same = _direct.get((server, server))
    if same is not None and same.ok:
        assert after.tokens == same.tokens
