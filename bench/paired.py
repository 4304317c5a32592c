#!/usr/bin/env python3
"""CPU per generated token of proxy pairs that run side by side, the real client alternating
between them, compared in pairs of neighbouring runs (issue 12).

Usage (from the repository root; see bench/README.md, "Paired runs"):

    .venv/bin/python bench/paired.py [--arms haproxy,aio,rpcguard] [--model tiny|bench]
        [--reps 12] [--restart-every 3] [--tokens N] [--json FILE]

How this works: the alternating runner (bench/runner.py) gives every arm (bench/arms.py:
``haproxy``, ``stunnel``, ``rpcguard``, or a pass-through pair such as ``aio`` or ``sock``) one real
``ggml-rpc-server`` and one proxy pair, kept running for ``--restart-every`` repetitions and then
started afresh (two
instances of the same code can differ by up to 1.6x for their whole life, so a result needs
several instances). A short client run warms each instance up. Then each
repetition runs the real llama.cpp client (greedy, ``--tokens``) once through every arm, in the
order given, reversed every other repetition, and reads the exact CPU time of each proxy
process at the client's "load:" and "token ids:" lines (bench/cpuacct.py): CPU per generated
token, per side of the pair. The runs of one repetition are seconds apart, so they see the same
state of a machine whose speed moves by up to 2x over minutes (docs/performance.md); the report
gives, per arm, the medians and the median over repetitions of the ratio of its run to the first
arm's run of the same repetition. A run that fails is reported and left out of the ratios.
Never collected by pytest.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
for _p in (str(ROOT), str(BENCH)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import arms as armlib  # noqa: E402
import machine  # noqa: E402
import runner  # noqa: E402
import workloads  # noqa: E402
from tests.support import realpeer  # noqa: E402
from tests.support.guard import Pki  # noqa: E402

__all__ = ["MODELS", "main"]

MODELS = {"tiny": ("gentiny", 100), "bench": ("gen100", 64)}  # model -> (bench/workloads name, tokens)
WARMUP_TOKENS = 4
TIMEOUT_S = 300


def _model(name: str, work: Path) -> Path:
    return realpeer.make_model(work / "tiny.gguf") if name == "tiny" else workloads.model_path(name)


def one_run(stack, model: Path, tokens: int) -> dict:
    """One client run through ``stack``: tok/s and CPU ms per generated token per side."""
    try:
        ph = runner.client_phases(stack, model, n=tokens, timeout=TIMEOUT_S)
    except RuntimeError as exc:
        lines = str(exc).strip().splitlines()
        return {"error": lines[-1][:300] if lines else "client failed"}
    return {"tok_s": ph.run.gen_tps, "tokens": ph.run.tokens,
            "cpu_ms": {armlib.SIDE[label]: round(d["run_s"] * 1e3 / tokens, 4) for label, d in ph.gen.items()}}


def summarize(runs: dict[str, list[dict]], arms: list[str]) -> dict[str, dict]:
    """Per arm: medians, and the median of its per-repetition ratios to the first arm."""
    base, out = arms[0], {}
    for arm in arms:
        pairs = [(b, r) for b, r in zip(runs[base], runs[arm]) if "error" not in b and "error" not in r]
        good = [r for r in runs[arm] if "error" not in r]
        row: dict = {"runs": len(good), "failed": len(runs[arm]) - len(good)}
        if good:
            row["tok_s"] = round(statistics.median(r["tok_s"] for r in good), 1)
            row["cpu_ms"] = {s: round(statistics.median(r["cpu_ms"][s] for r in good), 4) for s in armlib.SIDES}
        if pairs:
            row["speed_vs_first"] = round(statistics.median(r["tok_s"] / b["tok_s"] for b, r in pairs), 3)
            row["cpu_vs_first"] = {s: round(statistics.median(r["cpu_ms"][s] / b["cpu_ms"][s] for b, r in pairs), 3)
                                   for s in armlib.SIDES}
        out[arm] = row
    return out


def table(summary: dict[str, dict], arms: list[str]) -> str:
    lines = [f"| arm | runs | median tok/s | client-side CPU ms/token | server-side CPU ms/token | "
             f"paired vs {arms[0]}: speed | CPU client / server |", "|---|---:|---:|---:|---:|---:|---:|"]
    for arm in arms:
        r = summary[arm]
        cpu, rel = r.get("cpu_ms", {}), r.get("cpu_vs_first", {})
        lines.append(f"| {arm} | {r['runs']} | {r.get('tok_s', '-')} | {cpu.get('client', '-')} | "
                     f"{cpu.get('server', '-')} | {r.get('speed_vs_first', '-')} | "
                     f"{rel.get('client', '-')} / {rel.get('server', '-')} |")
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", default="haproxy,aio,rpcguard", help=f"comma-separated, from {','.join(armlib.PROXIED)}")
    ap.add_argument("--model", choices=sorted(MODELS), default="tiny")
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--restart-every", type=int, default=3, help="fresh servers and pairs every N repetitions")
    ap.add_argument("--tokens", type=int, help="tokens per run (default: 100 tiny, 64 bench)")
    ap.add_argument("--json", type=Path, help="also write the runs and the summary to this file")
    args = ap.parse_args(argv)
    try:
        args.arm_list = armlib.arm_list(args.arms, armlib.PROXIED, at_least=2)
    except ValueError as exc:
        ap.error(str(exc))
    if args.reps < 1 or args.restart_every < 1:
        ap.error("--reps and --restart-every must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    tokens = args.tokens or MODELS[args.model][1]
    started = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M")
    mach, versions = machine.environment()
    load_before = machine.loadavg()
    runs: dict[str, list[dict]] = {arm: [] for arm in args.arm_list}
    with tempfile.TemporaryDirectory(prefix="rpcguard-paired-") as tmp:
        work = Path(tmp)
        pki = Pki(work / "pki")
        model = _model(args.model, work)

        def warm_up(arm: str, stack: armlib.ArmStack | None) -> None:
            assert stack is not None
            realpeer.run_client(stack.endpoint, model, n=WARMUP_TOKENS, timeout=TIMEOUT_S)

        def one(rep: int, arm: str, stack: armlib.ArmStack | None) -> None:
            assert stack is not None
            result = one_run(stack, model, tokens)
            runs[arm].append(result)
            shown = result.get("error") or f"{result['tok_s']} tok/s, CPU ms/token {result['cpu_ms']}"
            print(f"  rep {rep} {arm:9} {shown}", file=sys.stderr, flush=True)

        runner.Alternation(args.arm_list, args.reps, lambda arm: armlib.start_arm(arm, work, pki),
                           fresh_every=args.restart_every, on_fresh=warm_up).run(one)
    summary = summarize(runs, args.arm_list)
    tokens_differ = len({tuple(r["tokens"] or ()) for rs in runs.values() for r in rs if "error" not in r}) > 1
    print(f"paired runs {started} UTC, {mach['cpus']} CPUs ({mach['cpu_model']}), kernel {mach['kernel']}; model "
          f"{args.model}, {tokens} tokens, {args.reps} repetitions, fresh instances every {args.restart_every}; load average {load_before} -> {machine.loadavg()}\n")
    print(table(summary, args.arm_list))
    if tokens_differ:
        print("\nFAIL: the arms generated different tokens")
    if args.json:
        args.json.write_text(json.dumps({"started": started, "machine": mach, "versions": versions, "model": args.model,
                                         "tokens": tokens, "reps": args.reps, "runs": runs, "summary": summary},
                                        indent=1))
    return 1 if tokens_differ or any(r["failed"] for r in summary.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
