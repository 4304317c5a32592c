"""The arithmetic of the benchmark harness: the alternation of arms (bench/runner.py), CPU deltas and
sums (bench/cpuacct.py), speed ratios against a baseline (bench/report.py), the paired ratios of
bench/paired.py and the dependency comparison that decides whether a baseline revision needs a
venv of its own (bench/baseline.py). The measurements themselves are
run by bench/run.py, never by pytest."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import arms  # noqa: E402
import baseline  # noqa: E402
import cpuacct  # noqa: E402
import paired  # noqa: E402
import report  # noqa: E402
import runner  # noqa: E402


def sample(user: float, sys_: float, exact: float) -> dict:
    return {"user_s": user, "sys_s": sys_, "exact_s": exact}


def test_delta_gives_tick_and_exact_cpu_per_process():
    d = cpuacct.delta({"serve": sample(1.0, 0.5, 1.61)}, {"serve": sample(1.25, 0.6, 1.9725)})["serve"]
    assert d == {"user_s": pytest.approx(0.25), "sys_s": pytest.approx(0.1), "run_s": pytest.approx(0.3625)}


def test_delta_leaves_out_a_process_gone_at_either_end():
    before = {"a": sample(0, 0, 0), "b": None}
    after = {"a": None, "b": sample(1, 1, 2)}
    assert cpuacct.delta(before, after) == {}


def test_cpu_sample_counts_the_time_of_threads_that_exited():
    """The exact figure is the process CPU clock: a thread's time stays after the thread ends
    (per-thread counters would lose it: stunnel runs each connection in a thread)."""
    child = subprocess.Popen([sys.executable, "-c", (
        "import sys, threading, time\n"
        "def burn():\n    t = time.process_time()\n    while time.process_time() - t < 0.2: pass\n"
        "th = threading.Thread(target=burn); th.start(); th.join()\n"
        "print('done', flush=True); sys.stdin.read()")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "done"
        got = arms.cpu_sample(child.pid)
        assert got is not None and got["exact_s"] >= 0.2
        assert got["user_s"] + got["sys_s"] >= 0.1  # ticks, coarser, but the same order
    finally:
        child.stdin.close()
        child.wait(10)
    assert arms.cpu_sample(child.pid) is None  # reaped: gone


def test_tally_sums_phases_and_per_unit_divides_by_the_units_of_work():
    tally = cpuacct.Tally()
    for _ in range(2):
        tally.add("haproxy", "gen", {"client-side": {"user_s": 0.02, "sys_s": 0.01, "run_s": 0.032}}, 128)
    slot = tally.sums["haproxy"]["gen"]
    assert slot["units"] == 256 and slot["reps"] == 2
    per = cpuacct.per_unit(slot)["client-side"]
    assert per["total"] == pytest.approx(0.064 * 1e3 / 256)
    assert per["user"] == pytest.approx(0.04 * 1e3 / 256)
    assert cpuacct.per_unit({"units": 0, "procs": slot["procs"]}) == {}


def test_parse_client_output_reads_tokens_load_time_and_rate():
    out = ("load: 1.250 s for 105.0 MB model (84.0 MB/s incl. setup)\n"
           "generated 4 tokens in 0.100 s: 40.0 tok/s (45.5 tok/s after the first)\n"
           "token ids: [1, 2, 3, 4]\nRPC_CLIENT_OK\n")
    r = cpuacct.parse_client_output(0, out)
    assert r.ok and r.tokens == [1, 2, 3, 4] and r.load_s == 1.25 and r.gen_tps == 45.5
    assert cpuacct.parse_client_output(-6, "load: 1.0 s").ok is False


@pytest.mark.parametrize("a, b, higher_better, want", [
    (110.0, 100.0, True, 1.1),  # rate: 10 % more tok/s is 1.1x faster
    (90.0, 100.0, False, 100 / 90),  # latency: 90 us instead of 100 us is faster too
    (None, 100.0, True, None),
    (100.0, 0.0, True, None),
])
def test_speed_ratio_is_above_one_when_the_first_is_faster(a, b, higher_better, want):
    got = report.speed_ratio(a, b, higher_better)
    assert got == (pytest.approx(want) if want is not None else None)


def test_paired_ratios_pair_repetitions_and_skip_failed_runs():
    runs = [{"arm": "rpcguard", "rep": 0, "value": 200.0}, {"arm": "rpcguard@abc", "rep": 0, "value": 100.0},
            {"arm": "rpcguard@abc", "rep": 1, "value": 50.0}, {"arm": "rpcguard", "rep": 1, "value": 100.0},
            {"arm": "rpcguard", "rep": 2, "value": None}, {"arm": "rpcguard@abc", "rep": 2, "value": 80.0}]
    assert report.paired_ratios(runs, "rpcguard", "rpcguard@abc", True) == [2.0, 2.0]
    assert report.paired_ratios(runs, "rpcguard", "rpcguard@abc", False) == [0.5, 0.5]


def test_dependencies_of_ignores_order_and_other_tables():
    one = '[project]\nname = "x"\ndependencies = ["b>=1", "a"]\n[project.optional-dependencies]\ntest = ["c"]\n'
    two = '[project]\ndependencies = ["a", "b>=1"]\n'
    assert baseline.dependencies_of(one) == baseline.dependencies_of(two) == ["a", "b>=1"]
    assert baseline.dependencies_of('[project]\nname = "x"\n') == []


def test_paired_summary_divides_each_run_by_the_first_arm_s_run_of_the_same_repetition():
    def run(tok_s: float, client: float, server: float) -> dict:
        return {"tok_s": tok_s, "tokens": [1, 2], "cpu_ms": {"client": client, "server": server}}

    runs = {
        "haproxy": [run(100, 0.1, 0.1), run(50, 0.2, 0.2), run(100, 0.1, 0.1)],
        # each run twice HAProxy's CPU of the same repetition, whatever the level of the machine
        "rpcguard": [run(80, 0.2, 0.3), run(40, 0.4, 0.6), {"error": "Remote RPC server crashed"}],
    }
    got = paired.summarize(runs, ["haproxy", "rpcguard"])
    assert got["haproxy"]["cpu_vs_first"] == {"client": 1.0, "server": 1.0}
    assert got["rpcguard"]["cpu_vs_first"] == {"client": 2.0, "server": 3.0}  # the failed run is left out
    assert got["rpcguard"]["speed_vs_first"] == 0.8
    assert (got["rpcguard"]["runs"], got["rpcguard"]["failed"]) == (2, 1)
    assert got["rpcguard"]["cpu_ms"] == {"client": 0.3, "server": 0.45}  # medians of its own runs
    assert "| rpcguard | 2 | 60.0 | 0.3 | 0.45 | 0.8 | 2.0 / 3.0 |" in paired.table(got, ["haproxy", "rpcguard"])


class FakeStack:
    def __init__(self, arm: str, n: int, log: list) -> None:
        self.arm, self.n, self.log, self.proxies = arm, n, log, {}

    def stop(self) -> None:
        self.log.append(("stop", self.arm, self.n))


def test_alternation_reverses_the_order_every_other_repetition_and_restarts_every_n():
    log: list = []
    started: dict[str, int] = {}

    def start(arm: str) -> FakeStack:
        started[arm] = started.get(arm, 0) + 1
        log.append(("start", arm, started[arm]))
        return FakeStack(arm, started[arm], log)

    alt = runner.Alternation(["a", "b", "c"], 4, start, fresh_every=2,
                             on_fresh=lambda arm, s: log.append(("fresh", arm, s.n)),
                             retire=lambda arm, s: log.append(("retire", arm, s.n)))
    assert alt.run(lambda rep, arm, s: log.append(("measure", rep, arm, s.n))) == 4
    measured = [(rep, arm, n) for kind, *rest in log if kind == "measure" for rep, arm, n in [rest]]
    assert [arm for _, arm, _ in measured] == list("abc" "cba" "abc" "cba")
    assert {n for rep, _, n in measured if rep < 2} == {1} and {n for rep, _, n in measured if rep >= 2} == {2}
    # every arm is (re)started before any is measured, and retired before it stops
    first = log.index(("measure", 0, "a", 1))
    assert all(e[0] in ("start", "fresh") for e in log[:first]) and len(log[:first]) == 6
    assert log.index(("retire", "b", 1)) + 1 == log.index(("stop", "b", 1))
    assert sorted(e for e in log if e[0] == "stop") == sorted([("stop", arm, n) for arm in "abc" for n in (1, 2)])
    assert sorted(e for e in log if e[0] == "retire") == sorted([("retire", arm, n) for arm in "abc" for n in (1, 2)])
    assert runner.orders(["x", "y"], 3) == [["x", "y"], ["y", "x"], ["x", "y"]]


def test_alternation_stops_at_the_deadline_and_stops_every_instance_on_failure():
    log: list = []
    alt = runner.Alternation(["a", "b"], 5, lambda arm: FakeStack(arm, 1, log), deadline=0.0)
    assert alt.run(lambda rep, arm, s: None) == 0  # monotonic() is past 0 already
    assert log == []

    def boom(rep: int, arm: str, s) -> None:
        if arm == "b":
            raise RuntimeError("measure failed")

    with pytest.raises(RuntimeError):
        runner.Alternation(["a", "b"], 2, lambda arm: FakeStack(arm, 1, log)).run(boom)
    assert sorted(log) == [("stop", "a", 1), ("stop", "b", 1)]


def test_arm_registry_has_one_meaning_of_arm():
    assert set(arms.RUN_ARMS) <= set(arms.ARMS) and "direct" not in arms.PROXIED
    assert {a for a in arms.ARMS if arms.ARM_TABLE[a].kind == "passthrough"} == {"aio", "bio", "thread", "sock"}
    assert arms.arm_list("haproxy, sock", arms.PROXIED, at_least=2) == ["haproxy", "sock"]
    with pytest.raises(ValueError):
        arms.arm_list("direct", arms.PROXIED)
    assert {arms.SIDE[label] for label in ("connect", "client-side")} == {"client"}
