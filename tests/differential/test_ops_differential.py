"""rpcguard's GRAPH_COMPUTE validator against the REAL ggml constructors (issue 9).

Every op the harness can build (tests/differential/ops.py) is generated many times with a
seeded generator and built in one batch by the real libggml of the pinned llama-cpp-python
(tests/support/ggmlref.py). Per op:

* ``test_constructor_builds``: the real constructors accept some of the generated inputs (a
  generator that never builds proves nothing), or none for an op whose constructor always aborts;
* ``test_no_false_refusal``: rpcguard accepts EVERY graph the real constructors built;
* ``test_mutations_refused``: every single-field mutation of the op's node or of its leaf
  inputs that no constructor call produces (checked by rebuilding with the real constructors
  when the mutation corresponds to other inputs) is refused with a FirewallRefusal (any other
  exception from the validator fails the test too).

The per-op figures are printed at the end of the run (and by ``python -m tests.differential.report``).
Knobs: RPCGUARD_DIFF_CASES (default 30 per generator), RPCGUARD_DIFF_MUTATED (3), RPCGUARD_DIFF_SEED (1).
"""

from __future__ import annotations

import json
import os

import pytest

from tests.differential import oracle, report
from tests.differential.ops import GENERATORS, UNBUILDABLE

OPS = sorted({op for op, _ in GENERATORS.values()})
CASES = int(os.environ.get("RPCGUARD_DIFF_CASES", report.DEFAULT_CASES))
MUTATED = int(os.environ.get("RPCGUARD_DIFF_MUTATED", report.DEFAULT_MUTATED))
SEED = int(os.environ.get("RPCGUARD_DIFF_SEED", report.DEFAULT_SEED))
SHOWN = 5  # failing cases quoted in one assertion message


@pytest.fixture(scope="module")
def results() -> dict[str, oracle.OpResult]:
    res = oracle.run(seed=SEED, cases=CASES, mutated=MUTATED)
    oracle.LAST_RESULTS = res  # printed by conftest.pytest_terminal_summary
    return res


@pytest.mark.parametrize("op", OPS)
def test_constructor_builds(results, op):
    r = results[op]
    assert not r.spec_errors, "\n".join(r.spec_errors[:SHOWN])
    if op in UNBUILDABLE:
        assert r.built == 0, f"{op}: the real constructor built {r.built} nodes of an op it was read to refuse"
        return
    assert r.built > 0, f"{op}: the real constructors refused all {r.generated} generated inputs"


@pytest.mark.parametrize("op", OPS)
def test_no_false_refusal(results, op):
    r = results[op]
    lines = [f"[{g}] {reason}: {json.dumps(recipe)}" for g, recipe, reason in r.false_refusals[:SHOWN]]
    assert not r.false_refusals, (
        f"{op}: rpcguard refused {len(r.false_refusals)} of {r.built} graphs the real constructors built:\n"
        + "\n".join(lines)
    )


@pytest.mark.parametrize("op", OPS)
def test_mutations_refused(results, op):
    r = results[op]
    assert r.must_refuse > 0 or r.built == 0, f"{op}: no mutation to check"
    lines = [f"[{m.gen}] {m.label} ({m.rebuild_note}){' ' + m.reason if m.reason else ''}: {json.dumps(m.recipe)}"
             for m in r.missed[:SHOWN]]
    assert not r.missed, (
        f"{op}: rpcguard accepted {len(r.missed)} of {r.must_refuse} mutated nodes no constructor builds "
        f"({report.missed_kinds(r)}):\n" + "\n".join(lines)
    )
