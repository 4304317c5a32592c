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

import copy
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


# -- the CPU planner's work buffer at several server thread counts (issue 28 item 1) --------------

# Server thread counts the work-buffer ops run at (the server may run more threads than cores).
THREADS = tuple(int(x) for x in os.environ.get("RPCGUARD_ACCEPT_THREADS", "1,4").split(","))


@pytest.fixture(scope="module")
def runners(tmp_path_factory):
    """One sanitizer server per thread count, started when first asked for."""
    try:
        asan_binary()
    except MissingSanitizerBuild as exc:
        pytest.fail(str(exc))
    made: dict[int, Runner] = {}

    def get(threads: int) -> Runner:
        if threads not in made:
            made[threads] = Runner(tmp_path_factory.mktemp(f"acceptfuzz-t{threads}"), budget_s=BUDGET_S,
                                   threads=threads)
        return made[threads]

    yield get
    for r in made.values():
        r.close()



# -- the CPU backend's fused kernel: RMS_NORM then MUL (ggml-cpu.c:3079-3095) ---------------------

FUSED_COUNT = 12


@pytest.mark.parametrize("threads", THREADS, ids=lambda t: f"t{t}")
def test_fused_rms_norm_mul_pairs_run_clean(runners, threads):
    """ggml-cpu runs an RMS_NORM and the MUL listed right after it as one kernel when the norm's use
    count (sent by the client, ggml-rpc.cpp) is 1 and the weight is an F32 row of unit stride
    (accept_gen.fused): a kernel neither op's rule was derived from. Pairs at the edges of what the
    RMS_NORM and MUL rules accept, every one fusable, run clean at each thread count."""
    notes: list[str] = []
    camp = Campaign(runners(threads), findings_dir=None, report=None, log=notes.append, shrink=False,
                    stop_on_finding=True)
    st, dry = camp.run_some("RMS_NORM", gen.fused_cases(SEED, FUSED_COUNT), FUSED_COUNT)
    assert st.outcomes["gate_refused"] == 0, "\n".join(notes)
    findings = "\n".join(f"{f.outcome.kind}: {f.outcome.summary}\n    {f.case.describe()}" for f in camp.found.values())
    if camp.found:
        pytest.fail(f"fused RMS_NORM*MUL on -t {threads}: forwarded graphs broke the sanitizer server:\n{findings}",
                    pytrace=False)
    assert not dry and st.ran == FUSED_COUNT, dict(st.outcomes)


def _span_of(case: gen.Case, tid: int) -> int:
    """The index of node ``tid`` in gen.output_spans(case) (the nodes with a buffer, in list order)."""
    return [t.id for t in case.tensors if t.id in case.nodes and t.buf >= 0].index(tid)


def test_the_server_runs_those_pairs_fused(runner):
    """The pairs of the test above reach the fused kernel, not the two ops one after the other:
    fused, the RMS_NORM result is never written (its span keeps the pre-fill); the same graph with
    a use count of 2 runs the two apart and writes it, and the product is the same both ways."""
    checked = 0
    for case, _ in gen.fused_cases(SEED, FUSED_COUNT):
        rms, mul = (case.by_id(i) for i in case.nodes[-2:])
        if (mul.view_src and mul.view_src in (rms.id, rms.view_src)) or mul.buf == rms.buf:
            continue  # the product written over the norm's bytes: nothing to tell them apart by
        apart = copy.deepcopy(case)
        apart.by_id(rms.id).use_count = 2
        one, two = runner.run(case, second=False), runner.run(apart, second=False)
        assert (one.kind, two.kind) == ("clean", "clean"), (one.summary, two.summary)
        r, m = _span_of(case, rms.id), _span_of(case, mul.id)
        assert one.spans[m] == two.spans[m], case.describe()
        assert one.spans[r] != two.spans[r], f"not fused: {case.describe()}"
        checked += 1
    assert checked >= FUSED_COUNT // 2, checked


@pytest.mark.parametrize("threads", THREADS, ids=lambda t: f"t{t}")
@pytest.mark.parametrize("op", gen.WORK_OPS)
def test_work_buffer_ops_run_clean_at_server_thread_counts(runners, op, threads):
    """The ops whose kernel uses the planner's work buffer, on a server of ``threads`` threads:
    half of their cases (all of CPY's and SET_ROWS' planner-edge ones) carry an ADD, so the graph
    runs on all of them (accept_gen._all_threads_node)."""
    notes: list[str] = []
    camp = Campaign(runners(threads), findings_dir=None, report=None, log=notes.append, shrink=False,
                    stop_on_finding=True)
    st = camp.run_op(op, SEED, COUNT)
    assert st.outcomes["gate_refused"] == 0, "\n".join(notes)
    findings = "\n".join(f"{f.outcome.kind}: {f.outcome.summary}\n    {f.case.describe()}" for f in camp.found.values())
    if camp.found:
        pytest.fail(f"{op} on -t {threads}: forwarded graphs broke the sanitizer server:\n{findings}", pytrace=False)
    assert st.ran >= COUNT * 3 // 4, dict(st.outcomes)


def _t(i: int, typ: int, ne: tuple[int, int, int, int], buf: int, **kw) -> gen.Tensor:
    from rpcguard.protocol.oprules import contiguous_nb

    return gen.Tensor(i, typ, ne, contiguous_nb(typ, ne), buf, **kw)


def _node(i: int, op: str, typ: int, ne, buf: int, srcs: list[int], view_src: int = 0) -> gen.Tensor:
    return _t(i, typ, ne, buf, op=gen.TABLE.ids[op], src=srcs + [0] * (10 - len(srcs)), view_src=view_src,
              flags=gen.FLAG_COMPUTE, fill="none" if view_src else "prefill")


def attack_cpy() -> gen.Case:
    """Issue 28.1 (a): F32 rows of 4096 copied into Q8_0 rows of 32 (same element count): the
    planner's per-thread row is the destination's, 128 bytes (ggml-cpu.c:2862), dup_to_q writes
    the 16 KiB source row into it (ops.cpp:297)."""
    q8 = 8
    ts = [_t(1, gen.F32, (4096, 2, 1, 1), 0), _t(2, q8, (32, 256, 1, 1), 1, fill="zero"),
          _node(3, "CPY", q8, (32, 256, 1, 1), 1, [1, 2], view_src=2)]
    return gen.Case("CPY", 0, 0, "attack-src-row-longer", [32768, 34 * 256], ts, [3])


def attack_set_rows() -> gen.Case:
    """Issue 28.1 (b): SET_ROWS of 8 F16 rows of 256 into F32, beside an ADD (n_threads tasks, so
    the graph runs on every thread): one task's F32 row planned (ggml-cpu.c:2367), every thread
    converts its rows through its own (ops.cpp:5501)."""
    i64 = 27
    ts = [_t(1, gen.F16, (256, 8, 1, 1), 0), _t(2, i64, (8, 1, 1, 1), 1, fill="zero"),
          _t(3, gen.F32, (256, 8, 1, 1), 2, fill="zero"),
          _t(4, gen.F32, (4, 2, 1, 1), 3), _t(5, gen.F32, (4, 2, 1, 1), 4),
          _node(6, "ADD", gen.F32, (4, 2, 1, 1), 5, [4, 5]),
          _node(7, "SET_ROWS", gen.F32, (256, 8, 1, 1), 2, [1, 2, 3], view_src=3)]
    return gen.Case("SET_ROWS", 0, 0, "attack-all-threads", [4096, 64, 8192, 32, 32, 32], ts, [6, 7])


ATTACKS = {"cpy-src-row-longer": attack_cpy, "set-rows-f16-all-threads": attack_set_rows}


@pytest.fixture
def old_rules(monkeypatch):
    """The firewall before issue 28.1 in this process: no work-buffer use check."""
    import rpcguard.protocol.graph as graph

    monkeypatch.setattr(graph, "check_work_use", lambda *a, **k: None)


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_work_buffer_attacks_overflow_the_server_on_the_old_rules(runners, old_rules, name):
    """What the check refuses is a real heap overflow: forwarded by the old rules (the gate's
    session), the -t 4 ASan server reports a heap-buffer-overflow WRITE."""
    case = ATTACKS[name]()
    assert gen.accepts(case) is None  # the old rules forward it
    out = runners(4).run(case, fresh=True)
    # ASan's heap-buffer-overflow (or, with a valgrind stand-in as the sanitizer server, its invalid write)
    assert (out.kind == "asan" and "AddressSanitizer: heap-buffer-overflow" in out.summary
            or out.kind == "valgrind" and "valgrind: Invalid write" in out.summary), (out.kind, out.summary)


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_work_buffer_attacks_are_refused(name):
    assert gen.accepts(ATTACKS[name]()) == "work_buffer_overflow"


def _buffers_of(frames) -> dict[int, tuple[int, int]]:
    """handle -> (base, size) from a recorded session's ALLOC_BUFFER / BUFFER_GET_BASE answers (the
    gate's own map is emptied when the case's buffers are freed, which races with a crash)."""
    import struct

    from tests.fuzz.wire import CMD

    sizes, out = {}, {}
    for f in frames:
        if f.cmd == CMD["ALLOC_BUFFER"] and f.answer and len(f.answer) >= 16:
            handle, size = struct.unpack_from("<QQ", f.answer)
            sizes[handle] = size
        elif f.cmd == CMD["BUFFER_GET_BASE"] and f.answer and len(f.answer) == 8:
            handle = struct.unpack_from("<Q", f.payload)[0]
            out[handle] = (struct.unpack("<Q", f.answer)[0], sizes.get(handle, 0))
    return out


def test_work_buffer_attacks_refused_through_serve_and_the_server_lives(runners, tmp_path, monkeypatch):
    """Both attack sessions, recorded on the -t 4 ASan server (the old rules forward them: each
    is a heap-buffer-overflow there), replayed through a real ``rpcguard serve --upstream`` in
    front of that server (default policy, mTLS): refused ``work_buffer_overflow``, the server
    reports nothing and still computes a benign graph through serve afterwards."""
    from tests.fuzz.replay import Replayer
    from tests.support.guard import Pki, start_guard

    import rpcguard.protocol.graph as graph

    runner = runners(4)
    recorded = {}
    with monkeypatch.context() as m:
        m.setattr(graph, "check_work_use", lambda *a, **k: None)  # the old rules, in this process only
        for name, make in sorted(ATTACKS.items()):
            out = runner.run(make(), fresh=True)
            assert out.kind in ("asan", "valgrind"), (name, out.kind, out.summary)
            recorded[name] = out
    benign = attack_cpy()
    benign.tensors[0] = _t(1, gen.F32, (32, 256, 1, 1), 0)  # rows of the destination's length
    benign.buffers[0] = 32 * 256 * 4
    assert gen.accepts(benign) is None
    ok = runner.run(benign, fresh=True)
    assert ok.kind == "clean", (ok.kind, ok.summary)
    runner._drop()  # the server serves one connection at a time: serve's from now on

    pki = Pki(tmp_path / "pki")
    serve = start_guard("serve", tmp_path, ["--upstream", f"127.0.0.1:{runner.server.port}", "--log-format", "json",
                                            *pki.serve_args()])
    try:
        replayer = Replayer(serve, pki)
        for name, out in recorded.items():
            runner.server.mark()
            ending = replayer.run(out.frames, _buffers_of(out.frames))
            assert ending.label == "refused:work_buffer_overflow", (name, ending)
            verdict = runner.server.verdict()
            assert not verdict.finding and runner.server.alive(), (name, verdict.kind, verdict.summary)
        ending = replayer.run(ok.frames, _buffers_of(ok.frames))
        assert ending.label == "forwarded:ok", ending
        assert runner.server.alive() and not runner.server.verdict().finding
    finally:
        serve.stop()


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
