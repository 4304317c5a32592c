#!/usr/bin/env python3
"""The I/O floor of a Python TLS relay: CPU per operation of HAProxy, rpcguard and three
pass-through pairs that do no ggml-rpc work (bench/passthrough.py), in one run (issue 12).

Usage (from the repository root; see bench/README.md, "The I/O floor"):

    .venv/bin/python bench/floor.py [--arms haproxy,rpcguard,aio,bio,thread] [--workload ping|burst]
        [--reps 3] [--count 5000] [--json FILE]

How this works: the alternating runner (bench/runner.py) gives every arm (bench/arms.py:
``haproxy``, ``rpcguard``, and the pass-through pairs ``aio``, ``bio``, ``thread``, ``sock``, two
bench/passthrough.py processes of that design) a fresh real ``ggml-rpc-server`` and a fresh
proxy pair before every repetition; the arms take turns in the order given, reversed on every
other repetition (ABBA, as bench/run.py). Against each pair, one
synthetic client session (bench/protoclient.py) of 100 round trips warms the pair up; then the
exact CPU time of each proxy process (bench/cpuacct.py) is read before and after one measured
session of ``--count`` operations: ``ping`` is a GET_ALIGNMENT round trip, ``burst`` a decode
step (five small SET_TENSORs sent piecewise and a GET_TENSOR round trip). The measured session
includes its TLS handshake, HELLO, buffer allocation and 50 (ping) or 20 (burst) warm-up
operations, all charged to ``--count`` (~1-2% at the default count). On each arm's first
instance, before any warm-up, ``arms.check_mtls`` proves each server-side proxy speaks TLS 1.3 only and
refuses a client without a certificate. The table gives per arm the
median over repetitions of the session's median operation latency and of each process's CPU
microseconds per operation, with the best (lowest) repetition next to it: on a shared machine
other jobs only ever add CPU time (cache misses, wake-ups), so the best is the second, steadier
reading. Each is divided by HAProxy's process on the same side
(client side: HAProxy client, rpcguard connect, pass-through connect; server side: HAProxy
server, rpcguard serve, pass-through serve). Never collected by pytest (name, testpaths).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
for _p in (str(ROOT), str(BENCH)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import arms as armlib  # noqa: E402
import machine  # noqa: E402
import passthrough  # noqa: E402
import protoclient  # noqa: E402
import runner  # noqa: E402
from tests.support import realpeer  # noqa: E402
from tests.support.guard import Pki  # noqa: E402

__all__ = ["ARMS", "WORKLOADS", "Run", "arm_list", "measure", "summarize", "main"]

ARMS = ("haproxy", "rpcguard", *passthrough.DESIGNS)  # the default --arms (any of arms.PROXIED)
WORKLOADS = {"ping": protoclient.ping, "burst": protoclient.burst}
SIDE, SIDES = armlib.SIDE, armlib.SIDES
WARMUP_PINGS = 100
REFERENCE = "haproxy"


@dataclass
class Run:
    arm: str
    rep: int
    latency_us: float | None = None
    cpu_us: dict[str, float] = field(default_factory=dict)  # side -> CPU us per operation
    mtls: dict[str, bool] = field(default_factory=dict)  # arms.check_mtls of the first instance, rep 0 only
    error: str = ""


# ------------------------------------------------------------------------------ measuring
def measure(stack: armlib.ArmStack | None, arm: str, rep: int, workload: str, count: int) -> Run:
    """One repetition of one arm on its fresh stack: warm-up session, measured session."""
    run = Run(arm, rep)
    if stack is None:
        run.error = "start failed"
        return run
    try:
        protoclient.ping(stack.endpoint, count=WARMUP_PINGS)
        result, spent = runner.bracket(stack.proxies, lambda: WORKLOADS[workload](stack.endpoint, count=count))
        run.latency_us = round(result["median_us"], 1)
        run.cpu_us = {SIDE[label]: round(d["run_s"] / count * 1e6, 1) for label, d in spent.items()}
        if result.get("intact") is False:
            run.error = "data corrupted on the way"
    except (OSError, RuntimeError, ValueError) as exc:  # ConnectionError is an OSError
        run.error = f"{type(exc).__name__}: {_short(exc)}"
    return run


def _short(exc: BaseException) -> str:
    """One line for a failure: the message's first line and, when it quotes a process's log, the
    log's last line (the child's own error)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    text = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
    return text[:300]


def run_all(arms: list[str], workload: str, reps: int, count: int) -> list[Run]:
    """Every arm, a fresh stack each repetition (bench/runner.py); the mTLS check on each arm's
    first instance, recorded in its first repetition."""
    runs: list[Run] = []
    mtls: dict[str, dict[str, bool]] = {}
    start_errors: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="rpcguard-floor-") as tmp:
        work = Path(tmp)
        pki = Pki(work / "pki")

        def start(arm: str) -> armlib.ArmStack | None:
            try:
                start_errors.pop(arm, None)
                return armlib.start_arm(arm, work, pki)
            except (OSError, RuntimeError, subprocess.SubprocessError, realpeer.MissingPeer) as exc:
                start_errors[arm] = f"start: {_short(exc)}"
                return None

        def on_fresh(arm: str, stack: armlib.ArmStack | None) -> None:
            if stack is not None and arm not in mtls:
                mtls[arm] = armlib.check_mtls(pki, stack.tls_port)

        def one(rep: int, arm: str, stack: armlib.ArmStack | None) -> None:
            run = measure(stack, arm, rep, workload, count)
            if arm in start_errors:
                run.error = start_errors[arm]
            if rep == 0:
                run.mtls = mtls.get(arm, {})
            print(f"  rep {rep} {arm:9} {_progress(run)}", file=sys.stderr, flush=True)
            runs.append(run)

        runner.Alternation(arms, reps, start, on_fresh=on_fresh).run(one)
    return runs


def _progress(run: Run) -> str:
    if run.error:
        return f"error: {run.error}"
    return f"{run.latency_us} us/op, CPU us/op " + ", ".join(f"{k} {v}" for k, v in sorted(run.cpu_us.items()))


# ------------------------------------------------------------------------------ reporting
def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 1) if values else None


def summarize(runs: list[Run], arms: list[str]) -> dict[str, dict]:
    """Per arm: medians and bests (minimum) over its good repetitions, and each side's CPU ratio
    to HAProxy's (median to median, best to best)."""
    out: dict[str, dict] = {}
    for arm in arms:
        good = [r for r in runs if r.arm == arm and not r.error]
        per_side = {side: [r.cpu_us[side] for r in good if side in r.cpu_us] for side in SIDES}
        out[arm] = {"runs": len(good), "errors": sum(1 for r in runs if r.arm == arm and r.error),
                    "latency_us": _median([r.latency_us for r in good if r.latency_us is not None]),
                    "cpu_us": {side: _median(v) for side, v in per_side.items()},
                    "best_cpu_us": {side: min(v) if v else None for side, v in per_side.items()}}
    ref = out.get(REFERENCE)
    for row in out.values():
        for key, ratio in (("cpu_us", "ratio"), ("best_cpu_us", "best_ratio")):
            row[ratio] = {side: _ratio(row[key][side], ref[key][side] if ref else None) for side in SIDES}
    return out


def _ratio(value: float | None, reference: float | None) -> float | None:
    return round(value / reference, 2) if value is not None and reference else None


def _cell(value, suffix: str = "") -> str:
    return "-" if value is None else f"{value}{suffix}"


def table(summary: dict[str, dict], workload: str) -> str:
    """Markdown: per arm, median latency, and per side CPU us/op and its ratio to HAProxy's,
    each as "median (best)"."""
    op = {"ping": "round trip", "burst": "decode step"}[workload]
    lines = [f"| arm | median {op} (us) | client-side CPU us/op | vs HAProxy | server-side CPU us/op | vs HAProxy"
             " | runs |", "|---|---:|---:|---:|---:|---:|---:|"]
    for arm, row in summary.items():
        cells = []
        for side in SIDES:
            cells.append(f"{_cell(row['cpu_us'][side])} ({_cell(row['best_cpu_us'][side])})")
            cells.append(f"{_cell(row['ratio'][side], 'x')} ({_cell(row['best_ratio'][side], 'x')})")
        runs = f"{row['runs']}" + (f" ({row['errors']} failed)" if row["errors"] else "")
        lines.append(f"| {arm} | {_cell(row['latency_us'])} | {' | '.join(cells)} | {runs} |")
    lines.append("")
    lines.append("CPU cells: median over repetitions (best repetition); ratios: median to HAProxy's median "
                 "(best to HAProxy's best), same side of the pair.")
    return "\n".join(lines)


def header(args, env: dict, load_before: list[float], load_after: list[float]) -> str:
    m, v = env["machine"], env["versions"]
    return "\n".join([
        f"I/O floor, workload {args.workload}, {args.reps} repetitions x {args.count} operations, "
        f"{env['started']} UTC",
        f"machine: {m['host']}, {m['cpus']} x {m['cpu_model']}, Linux {m['kernel']}, Python {m['python']}",
        f"versions: {v['haproxy']}; {v['python_ssl']}; uvloop {v['uvloop']}; rpcguard {v['rpcguard_core']}; "
        f"llama-cpp-python {v['llama_cpp_python']} (ggml-rpc {v['ggml_rpc_protocol']})",
        f"load average (1/5/15 min): before {' '.join(map(str, load_before))}, "
        f"after {' '.join(map(str, load_after))}",
    ])


def _mtls_line(runs: list[Run]) -> str:
    checked = [r for r in runs if r.mtls]
    bad = [r.arm for r in checked if not all(r.mtls.values())]
    if bad:
        return f"mTLS check FAILED (TLS 1.3 only, client certificate required) for: {', '.join(bad)}"
    return (f"mTLS check (TLS 1.3, no client certificate refused, TLS 1.2 refused): passed for "
            f"{', '.join(r.arm for r in checked) or 'no arm'}")


# ------------------------------------------------------------------------------------ CLI
def arm_list(ap: argparse.ArgumentParser, text: str, at_least: int = 1) -> list[str]:
    """The arms of ``--arms`` (``arms.arm_list``, proxied arms only); ``ap.error`` otherwise."""
    try:
        return armlib.arm_list(text, armlib.PROXIED, at_least)
    except ValueError as exc:
        ap.error(str(exc))
        raise  # not reached: ap.error exits


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, from {','.join(armlib.PROXIED)}")
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="ping")
    ap.add_argument("--reps", type=int, default=3, help="repetitions per arm (a fresh stack each)")
    ap.add_argument("--count", type=int, default=5000, help="measured operations per repetition")
    ap.add_argument("--json", type=Path, help="also write the runs and the summary to this file")
    args = ap.parse_args(argv)
    args.arm_list = arm_list(ap, args.arms)
    if args.reps < 1 or args.count < 1:
        ap.error("--reps and --count must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    started = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M")
    mach, versions = machine.environment()
    load_before = machine.loadavg()
    runs = run_all(args.arm_list, args.workload, args.reps, args.count)
    load_after = machine.loadavg()
    summary = summarize(runs, args.arm_list)
    env = {"started": started, "machine": mach, "versions": versions}
    print(header(args, env, load_before, load_after))
    print()
    print(table(summary, args.workload))
    print(_mtls_line(runs))
    for run in runs:
        if run.error:
            print(f"failed: {run.arm} repetition {run.rep}: {run.error}")
    if args.json:
        args.json.write_text(json.dumps({**env, "workload": args.workload, "reps": args.reps, "count": args.count,
                                         "loadavg_before": load_before, "loadavg_after": load_after,
                                         "runs": [asdict(r) for r in runs], "summary": summary}, indent=1))
    return 0 if all(not r.error and all(r.mtls.values()) for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
