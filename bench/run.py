#!/usr/bin/env python3
"""rpcguard benchmark (GitHub issue 4): the real llama.cpp client against the real server through
four arms in one run, alternating: direct, stunnel mTLS pair, HAProxy mTLS pair, rpcguard pair.

Usage (from the repository root; see bench/README.md):

    bash bench/install.sh && .venv/bin/python bench/run.py [--quick] [--arms A,B] [--workloads W,X]

How this works: for each workload the arms (bench/arms.py) are measured by the alternating
runner (bench/runner.py): before each repetition (``--fresh-every 1``, the default) every arm
gets a fresh real ``ggml-rpc-server`` and its proxy pair, then the arms take turns (direct,
stunnel, haproxy, rpcguard, then the reverse) so machine drift hits all arms alike. A repetition
is one real client process (``tests/realpeer/rpc_client_smoke.py``) or one synthetic protocol
client session (bench/protoclient.py). Before each instance stops, each proxy process's peak
RSS (``VmHWM``) and CPU time are read from /proc. The report
gives, per workload and arm, the median, min-max, ratio to direct (same run), whether the
generated tokens equal direct's, and per-process peak RSS; raw numbers go to
``bench/results/<UTC timestamp>.json``. This file is never collected by pytest (testpaths =
tests, and its name does not start with ``test_``).

``--baseline REV`` adds the arm ``rpcguard@REV``: the same pair run from the code of git revision
REV (bench/baseline.py), alternating with the others, so a change is compared with its baseline
under the same machine drift. The order of the arms is reversed on every other repetition
(ABBA), so neighbours in the order get no systematic advantage. Each proxy process's CPU is
read before each repetition and at its phase marks (bench/cpuacct.py): the report gives CPU per
generated token, per MB loaded or per synthetic operation, per process, next to HAProxy's.
The report itself is bench/report.py.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
for p in (str(ROOT), str(BENCH)):
    if p not in sys.path:
        sys.path.insert(0, p)

import arms as armlib  # noqa: E402
import baseline as baselib  # noqa: E402
import cpuacct  # noqa: E402
import machine  # noqa: E402
import protoclient  # noqa: E402
import runner  # noqa: E402
from report import fmt, report  # noqa: E402
from workloads import CACHE, DEFAULT_WORKLOADS, WORKLOADS, Workload, model_path, offloaded_bytes  # noqa: E402
from tests.support import realpeer  # noqa: E402
from tests.support.guard import Pki  # noqa: E402

MIB = 1024 * 1024
RESULTS = BENCH / "results"
CLIENT_TIMEOUT_S = 300  # one real client run (the 400 MB load takes ~1-5 s; this is a hang guard)


@dataclass
class Run:
    arm: str
    rep: int
    value: float | None
    loadavg: float
    extra: dict = field(default_factory=dict)
    error: str = ""


# ------------------------------------------------------------------------------------ helpers
def start_arm_retry(arm: str, work: Path, pki: Pki, args, tag: str) -> armlib.ArmStack:
    """Start an arm; one retry, since a free port picked by bind(0) can be taken by another job."""
    kw = {"profile_dir": args.profile, "profile_tag": tag, "profiler": args.profiler,
          "tree": args.trees.get(arm)}
    try:
        return armlib.start_arm(arm, work, pki, **kw)
    except (RuntimeError, TimeoutError, OSError, subprocess.CalledProcessError) as exc:
        print(f"   {arm}: start failed ({exc!s:.200}); retrying once", flush=True)
        return armlib.start_arm(arm, work, pki, **kw)


def measure(wl: Workload, stack: armlib.ArmStack, model: Path | None, model_bytes: int
            ) -> tuple[float, dict, dict[str, tuple[dict, float]]]:
    """One repetition on one arm: (value, details, phase -> (CPU delta per proxy process, units of
    work)), or raises RuntimeError. CPU is read right before the work and at its phase marks
    (bench/runner.py)."""
    endpoint = stack.endpoint
    if wl.kind == "client":
        assert model is not None
        ph = runner.client_phases(stack, model, n=wl.n_tokens, timeout=CLIENT_TIMEOUT_S)
        r = ph.run
        assert r.load_s is not None
        extra = {"load_s": r.load_s, "gen_tps": r.gen_tps, "tokens": r.tokens}
        cpu = {"load": (ph.load, model_bytes / 1e6), "gen": (ph.gen, len(r.tokens or []))}
        if wl.name in ("load", "rss"):
            return model_bytes / r.load_s / 1e6, extra, cpu
        if r.gen_tps is None:
            raise RuntimeError("client printed no tok/s")
        return r.gen_tps, extra, cpu
    if wl.kind == "bulk":
        out, spent = runner.bracket(stack.proxies, lambda: protoclient.bulk(endpoint))
    elif wl.kind == "burst":
        out, spent = runner.bracket(stack.proxies, lambda: protoclient.burst(endpoint))
    else:
        out, spent = runner.bracket(stack.proxies, lambda: protoclient.ping(endpoint))
    if wl.kind == "bulk":
        units, value = out["bytes"] / 1e6, out["mb_s"]
    else:
        units, value = out["count"], out["median_us"]
    cpu = {"all": (spent, units)}
    if wl.kind in ("bulk", "burst") and not out["intact"]:
        raise RuntimeError("GET_TENSOR read back different bytes than uploaded")
    return value, out, cpu


# ------------------------------------------------------------------------------------ workloads
def merge_samples(old: dict[str, dict] | None, new: dict[str, dict]) -> dict[str, dict]:
    """``ArmStack.sample()`` of the latest instance of an arm, with ``vmhwm_mb`` the peak over all
    its instances so far and ``instances`` their count."""
    if not old:
        return {label: {**v, "instances": 1} for label, v in new.items()}
    out = {}
    for label, v in new.items():
        prev = old.get(label, {})
        out[label] = {**v, "vmhwm_mb": max(v.get("vmhwm_mb", 0), prev.get("vmhwm_mb", 0)),
                      "instances": prev.get("instances", 0) + 1}
    return out


def run_workload(wl: Workload, arm_names: list[str], reps: int, work: Path, pki: Pki, args,
                 deadline: float, mtls_checked: dict) -> dict:
    model = model_path(wl.model) if wl.model else None
    model_bytes = offloaded_bytes(model) if model else 0
    print(f"\n== {wl.name}: {wl.title}; {reps} repetition(s) x {len(arm_names)} arm(s)", flush=True)
    runs: list[Run] = []
    samples: dict[str, dict] = {}
    tally = cpuacct.Tally()

    def retire(arm: str, stack: armlib.ArmStack) -> None:
        samples[arm] = merge_samples(samples.get(arm), stack.sample())

    def on_fresh(arm: str, stack: armlib.ArmStack | None) -> None:
        assert stack is not None  # start_arm_retry raises rather than return None
        if arm != "direct" and arm not in mtls_checked:
            mtls_checked[arm] = armlib.check_mtls(pki, stack.tls_port)
            stack.rebaseline()

    def one(rep: int, arm: str, stack: armlib.ArmStack | None) -> None:
        assert stack is not None
        la = os.getloadavg()[0]
        if not stack.alive():
            runs.append(Run(arm, rep, None, la, error="a process of this arm exited"))
            return
        try:
            value, extra, cpu = measure(wl, stack, model, model_bytes)
            extra["cpu"] = {phase: d for phase, (d, _) in cpu.items()}
            runs.append(Run(arm, rep, value, la, extra))
            if stack.proxies:
                for phase, (d, units) in cpu.items():
                    tally.add(arm, phase, d, units)
            print(f"   rep {rep + 1} {arm:9s} {fmt(value, wl.unit):>8s} {wl.unit}  (load avg {la:.2f})", flush=True)
        except Exception as exc:  # record and go on: one failed run must not lose the others
            runs.append(Run(arm, rep, None, la, error=str(exc)))
            print(f"   rep {rep + 1} {arm:9s} FAILED: {exc}", flush=True)

    alternation = runner.Alternation(arm_names, reps, lambda arm: start_arm_retry(arm, work, pki, args, f"{wl.name}-"),
                                     fresh_every=args.fresh_every, deadline=deadline, on_fresh=on_fresh,
                                     retire=retire)
    done = alternation.run(one)
    if done < reps:
        print(f"   time budget reached: stopped {wl.name} after {done} repetition(s)", flush=True)
    return {"workload": asdict(wl), "model": model.name if model else None, "model_offloaded_bytes": model_bytes,
            "fresh_every": args.fresh_every, "runs": [asdict(r) for r in runs], "proxies": samples,
            "cpu": tally.sums}


def _rss_case(endpoint: str, model_name: str | None, frame: int | None) -> dict:
    if model_name:
        model = model_path(model_name)
        r = realpeer.run_client(endpoint, model, n=4, timeout=CLIENT_TIMEOUT_S)
        out = {"ok": r.ok, "load_s": r.load_s, "tokens": r.tokens,
               "mb_s": offloaded_bytes(model) / r.load_s / 1e6 if r.ok and r.load_s else None}
        if not r.ok:
            raise RuntimeError("\n".join(r.output.strip().splitlines()[-5:]))
        return out
    if frame:
        return protoclient.bulk(endpoint, total_bytes=512 * MIB, frame_bytes=frame, buffer_bytes=frame)
    time.sleep(0.5)
    return {}


def run_rss(work: Path, pki: Pki, args) -> dict:
    """Each rpcguard arm alone: peak RSS of serve and connect for small vs huge tensors, a fresh
    pair per case; the same case without a proxy gives the MB/s column."""
    cases = [
        ("idle (started, no session yet)", None, None),
        ("load ~413 MB model, tensors <= 5.8 MB", "load400", None),
        ("load ~440 MB model, three 134 MB tensors", "bigtensor", None),
        ("synthetic: 512 MiB as 256 MiB SET_TENSOR frames", None, 256 * MIB),
    ]
    print("\n== rss: rpcguard peak RSS (VmHWM) per process, fresh pair per case", flush=True)
    out = []
    for i, (label, model_name, frame) in enumerate(cases):
        for arm in [a for a in args.arm_names if armlib.is_rpcguard(a)]:
            stack = start_arm_retry(arm, work, pki, args, f"rss{i}-")
            detail: dict = {}
            try:
                detail = _rss_case(stack.endpoint, model_name, frame)
            except Exception as exc:
                detail = {"error": str(exc)}
            finally:
                detail["proxies"] = stack.sample()
                stack.stop()
            hwm = {k: v.get("vmhwm_mb") for k, v in detail.get("proxies", {}).items()}
            print(f"   {arm:18s} {label:50s} " + "  ".join(f"{k} {fmt(v, 'MB')} MB" for k, v in hwm.items())
                  + (f"  FAILED: {detail['error']}" if detail.get("error") else ""), flush=True)
            out.append({"arm": arm, "case": label, "model": model_name, "frame_bytes": frame, **detail})
        if model_name or frame:  # the same case without a proxy, for the MB/s column
            direct = armlib.start_arm("direct", work, pki)
            try:
                direct_mb_s = _rss_case(direct.endpoint, model_name, frame).get("mb_s")
            except Exception as exc:
                direct_mb_s = None
                print(f"   direct {label}: FAILED: {exc}", flush=True)
            finally:
                direct.stop()
            for c in out:
                if c["case"] == label:
                    c["direct_mb_s"] = direct_mb_s
    return {"workload": asdict(WORKLOADS["rss"]), "cases": out}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 repetitions per workload (3 for the tiny model)")
    ap.add_argument("--arms", default=",".join(armlib.RUN_ARMS),
                    help=f"comma list, in run order, of {', '.join(armlib.ARMS)} (default: {','.join(armlib.RUN_ARMS)})")
    ap.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS),
                    help=f"comma list of {', '.join(WORKLOADS)} (default: all)")
    ap.add_argument("--baseline", metavar="REV",
                    help="also run the rpcguard pair of git revision REV as the arm rpcguard@REV, right after "
                         "the rpcguard arm (bench/baseline.py); the report compares the two")
    ap.add_argument("--baseline-tolerance", type=float, default=0.05,
                    help="a speed ratio to the baseline below 1 - this fails the no-regression check (default 0.05)")
    ap.add_argument("--fresh-every", type=int, default=1, metavar="N",
                    help="start a fresh server and proxy pair for every arm every N repetitions (default 1: "
                         "each repetition; 0: one instance per workload). Two instances of the same code "
                         "can differ by up to 1.6x in CPU per operation for their whole life "
                         "(docs/performance.md)")
    ap.add_argument("--reps", type=int, help="repetitions per workload (overrides the defaults and --quick)")
    ap.add_argument("--max-minutes", type=float, default=45.0,
                    help="time budget: no new repetition starts after this (default 45)")
    ap.add_argument("--profile", type=Path, help="attach a profiler to the rpcguard processes; writes "
                                                 "DIR/<workload>-<serve|connect>.* (see bench/profile_summary.py)")
    ap.add_argument("--profiler", choices=["perf", "py-spy", "cprofile"], default="perf",
                    help="perf: on-CPU samples by library (default); py-spy: Python + native frames, "
                         "wall-clock samples; cprofile: Python functions (adds overhead)")
    ap.add_argument("--nice", type=int, default=0,
                    help="renice the harness and everything it starts (all arms alike) by N, e.g. -10 to "
                         "shield the measurement from other jobs on a shared machine (needs root)")
    ap.add_argument("--json", type=Path, help="where to write the raw results (default bench/results/<ts>.json)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs, configs, PKI)")
    args = ap.parse_args(argv)

    arm_names = [a.strip() for a in args.arms.split(",") if a.strip()]
    wl_names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    bad = [a for a in arm_names if a not in armlib.ARMS] + [w for w in wl_names if w not in WORKLOADS]
    if bad:
        ap.error(f"unknown arm/workload: {', '.join(bad)}")
    try:
        realpeer.realpeer_python()
    except realpeer.MissingPeer as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    missing = [t for a, t in (("stunnel", "stunnel4"), ("haproxy", "haproxy")) if a in arm_names
               and subprocess.run(["sh", "-c", f"command -v {t}"], capture_output=True).returncode]
    if missing:
        print(f"bench: {', '.join(missing)} not installed: run `bash bench/install.sh`", file=sys.stderr)
        return 2
    args.trees = {}
    base_arm = None
    try:
        if "rpcguard" in arm_names:
            args.trees["rpcguard"] = baselib.working_tree()
        if args.baseline:
            tree = baselib.prepare(args.baseline, CACHE)
            name = f"rpcguard@{tree.revision[:7]}"
            at = arm_names.index("rpcguard") + 1 if "rpcguard" in arm_names else len(arm_names)
            arm_names.insert(at, name)
            args.trees[name] = tree
            base_arm = name
        for arm, tree in args.trees.items():
            tree.verify()
            print(f"arm {arm}: {tree.label} {tree.revision}, rpcguard imported from {tree.imported_from} "
                  f"(protocol core: {tree.core})" + "".join(f"; {n}" for n in tree.notes), flush=True)
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    args.arm_names = arm_names

    if args.nice:
        os.nice(args.nice)  # children inherit it: client, server and every proxy alike
    started = dt.datetime.now(dt.timezone.utc)
    deadline = time.monotonic() + args.max_minutes * 60
    work = Path(tempfile.mkdtemp(prefix="rpcguard-bench-"))
    pki = Pki(work / "pki")
    machine_info, versions = machine.environment()
    results: dict = {
        "started": started.isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, "bench/run.py", *(argv if argv is not None else sys.argv[1:])]),
        "machine": machine_info, "versions": versions,
        "git": args.trees["rpcguard"].revision if "rpcguard" in args.trees else baselib.working_tree().revision,
        "tools": armlib.tool_versions(), "arms": arm_names, "nice": os.nice(0),
        "trees": {arm: t.describe() for arm, t in args.trees.items()},
        "baseline": ({"arm": base_arm, "rev": args.baseline, "tolerance": args.baseline_tolerance}
                     if base_arm else None),
        "workloads": {},
        "mtls_checks": {},
    }
    print(f"rpcguard bench {results['started']} on {machine_info['host']} ({os.cpu_count()} CPUs, load avg "
          f"{' / '.join(map(str, machine_info['loadavg_start']))}, nice {os.nice(0)}); work dir {work}", flush=True)
    status = 0
    try:
        for name in wl_names:
            wl = WORKLOADS[name]
            if time.monotonic() > deadline:
                print(f"time budget reached: skipping {name}", flush=True)
                continue
            try:
                if name == "rss":
                    results["workloads"][name] = run_rss(work, pki, args)
                else:
                    reps = args.reps or (wl.quick_reps if args.quick else wl.reps)
                    results["workloads"][name] = run_workload(wl, arm_names, reps, work, pki, args, deadline,
                                                              results["mtls_checks"])
            except Exception:
                traceback.print_exc()
                status = 1
    finally:
        results["finished"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        results["machine"]["loadavg_end"] = machine.loadavg()
        out = args.json or RESULTS / f"{started.strftime('%Y%m%dT%H%M%SZ')}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        lines, checks = report(results)
        results["checks"] = [{"check": c, "ok": ok, "detail": d} for c, ok, d in checks]
        out.write_text(json.dumps(results, indent=1) + "\n")
        print("\n".join(lines))
        print("\n### checks (targets of issues 4, 10 and 12; ratios from this run)\n")
        for c, ok, d in checks:
            print(f"- {'PASS' if ok else 'FAIL'} {c}: {d}")
        print(f"\nraw results: {out} (bench/report.py {out} prints this report again)")
        if args.keep:
            print(f"work dir kept: {work}")
        else:
            subprocess.run(["rm", "-rf", str(work)])
    if status == 0 and not all(ok for _, ok, _ in checks):
        status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
