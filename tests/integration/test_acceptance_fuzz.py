"""Acceptance-region fuzz (issue 20, item 2): what each op rule ACCEPTS runs clean on the ASan+UBSan server.

tests/fuzz/accept_gen.py draws, per op with a 7.0.0 rule, graphs at the edges of what the rule
lets through (size-1 dimensions with any stride, zero and huge strides, views and in-place
results, empty nodes, element counts at the limits, params at the edges of their ranges and of
float precision, every type combination the rule passes) and keeps only those rpcguard's
firewall forwards. tests/fuzz/accept_run.py runs each one on the real ggml-rpc-server of the
pinned sdist built with AddressSanitizer + UndefinedBehaviorSanitizer (tests/realpeer/sanitizer.sh),
every frame through an in-process rpcguard ``Session`` (the object serve runs per connection,
default policy; ``FirewallPolicy(contained=True)`` for SSM_SCAN, which only a contained serve
forwards: in production a fresh per-session process), and fails on a sanitizer report, an abort, a crash, a compute over the budget,
or a byte outside the tensors' spans written (write canary) or read (read canary).

One test per op, a short seeded run (``COUNT`` accepted cases each; the long run and its counts
are in docs/acceptance-fuzz.md). Ops with findings the rules do not fix yet are listed in
``OPEN``: a strict xfail, so the day a rule fixes the op the test XPASSes and fails until its
row is removed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.fuzz import accept_gen as gen
from tests.fuzz.accept_run import FINDINGS_DIR, Campaign, Runner
from tests.fuzz.sanserver import MissingSanitizerBuild, asan_binary

SEED = 20  # issue 20
COUNT = int(os.environ.get("RPCGUARD_ACCEPT_COUNT", "10"))
BUDGET_S = 20.0  # per graph, generous for a loaded CI machine (clean cases take < 1 s)

# Findings on main not fixed by a rule yet, per op (seed 20, COUNT cases): remove a row when fixed.
OPEN: dict[str, str] = {
}
# The long run's reproducers (tests/fuzz/findings/accept-*.json), replayed case by case: strict xfail
# while a file says "status": "open" (set it to "fixed" once a rule refuses the case or it runs clean).
# Compute-time findings (accept-timeout-*) depend on the machine's load: documented, not replayed.
REPRODUCERS = sorted(p for p in FINDINGS_DIR.glob("accept-*.json") if not p.name.startswith("accept-timeout-"))


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    try:
        asan_binary()
    except MissingSanitizerBuild as exc:
        pytest.fail(str(exc))  # never a skip: scripts/test.sh builds it
    r = Runner(tmp_path_factory.mktemp("acceptfuzz"), budget_s=BUDGET_S)
    yield r
    r.close()


@pytest.mark.parametrize("op", gen.ops())
def test_accepted_cases_run_clean(runner, op, request):
    if op in OPEN:
        request.node.add_marker(pytest.mark.xfail(strict=True, reason=f"open: {OPEN[op]}"))
    notes: list[str] = []
    camp = Campaign(runner, findings_dir=None, report=None, log=notes.append, shrink=False, stop_on_finding=True)
    st = camp.run_op(op, SEED, COUNT)
    assert st.outcomes["gate_refused"] == 0, "\n".join(notes)  # every generated case is one serve forwards
    findings = "\n".join(f"{f.outcome.kind}: {f.outcome.summary} (class {f.hole})\n    {f.case.describe()}"
                         for f in camp.found.values())
    if camp.found:
        pytest.fail(f"{op}: graphs rpcguard forwards broke the sanitizer server:\n{findings}", pytrace=False)
    assert st.ran >= COUNT * 3 // 4, dict(st.outcomes)
    # the rest are not findings either: span notes, nondeterministic (aliased) results, server_closed
    assert st.clean >= st.ran // 2, dict(st.outcomes)


@pytest.mark.parametrize("path", REPRODUCERS, ids=lambda p: p.stem)
def test_reproducer(runner, path: Path, request):
    obj = json.loads(path.read_text())
    if obj.get("status") == "open":
        request.node.add_marker(pytest.mark.xfail(strict=True, reason=f"open finding: {obj['note'][:300]}"))
    case = gen.Case.from_json(obj["case"])
    refused = gen.accepts(case)
    if refused is not None:
        return  # a rule refuses it now: fixed
    out = runner.run(case, fresh=True)
    assert not out.finding, f"{path.name}: {out.kind} {out.summary}\n{case.describe()}"
