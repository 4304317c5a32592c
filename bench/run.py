#!/usr/bin/env python3
"""rpcguard benchmark (GitHub issue 4): the real llama.cpp client against the real server through
four arms in one run, alternating: direct, stunnel mTLS pair, HAProxy mTLS pair, rpcguard pair.

Usage (from the repository root; see bench/README.md):

    bash bench/install.sh && .venv/bin/python bench/run.py [--quick] [--arms A,B] [--workloads W,X]

How this works: for each workload, every arm gets a fresh real ``ggml-rpc-server`` and its
proxy pair (bench/arms.py); then the repetitions go round-robin over the arms (direct,
stunnel, haproxy, rpcguard, direct, ...) so machine drift hits all arms alike. A repetition is
one real client process (``tests/realpeer/rpc_client_smoke.py``) or one synthetic protocol
client session (bench/protoclient.py). After the last repetition each proxy process's peak
RSS (``VmHWM``) and CPU time are read from /proc, then the stacks are stopped. The report
gives, per workload and arm, the median, min-max, ratio to direct (same run), whether the
generated tokens equal direct's, and per-process peak RSS; raw numbers go to
``bench/results/<UTC timestamp>.json``. This file is never collected by pytest (testpaths =
tests, and its name does not start with ``test_``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
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
import protoclient  # noqa: E402
from tests.support import realpeer  # noqa: E402
from tests.support.guard import Pki  # noqa: E402

MIB = 1024 * 1024
CACHE = Path(os.environ.get("RPCGUARD_BENCH_CACHE") or Path.home() / ".cache" / "rpcguard-bench")
RESULTS = BENCH / "results"
CLIENT_TIMEOUT_S = 300  # one real client run (the 400 MB load takes ~1-5 s; this is a hang guard)

# name -> make_tiny_model.py arguments (weights from --seed 0, so files are reproducible)
MODELS = {
    "tiny": [],  # 0.6 MB f32
    "bench": ["--preset", "bench"],  # ~105 MB f16, largest tensor 5.8 MB
    "load400": ["--preset", "bench", "--n-layer", "16"],  # ~413 MB f16, same tensor sizes as bench
    # ~440 MB f16 with three 134 MB FFN tensors: one SET_TENSOR frame of 134 MB each
    "bigtensor": ["--preset", "bigtensor", "--n-embd", "2048", "--n-ff", "32768", "--n-layer", "1"],
}


@dataclass(frozen=True)
class Workload:
    name: str
    title: str
    kind: str  # "client" (real llama.cpp), "bulk", "ping" or "burst" (bench/protoclient.py)
    unit: str
    higher_better: bool
    reps: int
    quick_reps: int
    model: str = ""
    n_tokens: int = 0
    target: float | None = None  # minimum rpcguard/direct ratio (issue 4)


WORKLOADS = {w.name: w for w in (
    Workload("load", "model load, ~413 MB f16 (offloaded MB / Llama() seconds)", "client", "MB/s", True,
             7, 2, "load400", 4, 0.6),
    Workload("gen100", "generation, ~105 MB model, 64 tokens (tok/s after the first)", "client", "tok/s", True,
             7, 2, "bench", 64, 0.97),
    Workload("gentiny", "generation, tiny 0.6 MB model, 128 tokens (tok/s after the first)", "client", "tok/s",
             True, 15, 3, "tiny", 128, 0.75),
    Workload("bulk", "synthetic SET_TENSOR upload, 512 MiB in 8 MiB frames", "bulk", "MB/s", True, 5, 2),
    Workload("ping", "synthetic GET_ALIGNMENT round trip, 2000 pings (median of the run)", "ping", "us", False,
             5, 2),
    Workload("burst", "synthetic decode-step shape: 5 small SET_TENSOR + GET_TENSOR round trip, 1000 steps",
             "burst", "us", False, 5, 2),
    Workload("rss", "rpcguard peak RSS vs tensor size (fresh pair per case)", "rss", "MB", False, 1, 1),
)}
DEFAULT_WORKLOADS = ("load", "gen100", "gentiny", "bulk", "ping", "burst", "rss")
RSS_TARGET_MB = 80.0


@dataclass
class Run:
    arm: str
    rep: int
    value: float | None
    loadavg: float
    extra: dict = field(default_factory=dict)
    error: str = ""


# ------------------------------------------------------------------------------------ helpers
def model_path(name: str) -> Path:
    CACHE.mkdir(parents=True, exist_ok=True)
    return realpeer.make_model(CACHE / f"{name}.gguf", *MODELS[name])


def offloaded_bytes(path: Path) -> int:
    """Bytes llama.cpp uploads over RPC (all tensors but token_embd), cached beside the model."""
    side = path.with_suffix(".bytes")
    if side.exists() and side.stat().st_mtime >= path.stat().st_mtime:
        return int(side.read_text())
    n = realpeer.gguf_tensor_bytes(path)
    side.write_text(str(n))
    return n


def start_arm_retry(arm: str, work: Path, pki: Pki, args, tag: str) -> armlib.ArmStack:
    """Start an arm; one retry, since a free port picked by bind(0) can be taken by another job."""
    try:
        return armlib.start_arm(arm, work, pki, profile_dir=args.profile, profile_tag=tag,
                                profiler=args.profiler)
    except (RuntimeError, TimeoutError, OSError, subprocess.CalledProcessError) as exc:
        print(f"   {arm}: start failed ({exc!s:.200}); retrying once", flush=True)
        return armlib.start_arm(arm, work, pki, profile_dir=args.profile, profile_tag=tag,
                                profiler=args.profiler)


def measure(wl: Workload, endpoint: str, model: Path | None, model_bytes: int) -> tuple[float, dict]:
    """One repetition on one arm; returns (value, details) or raises RuntimeError."""
    if wl.kind == "client":
        assert model is not None
        r = realpeer.run_client(endpoint, model, n=wl.n_tokens, timeout=CLIENT_TIMEOUT_S)
        if not r.ok or r.load_s is None:
            tail = "\n".join(r.output.strip().splitlines()[-5:])
            raise RuntimeError(f"client rc={r.rc}: {tail}")
        extra = {"load_s": r.load_s, "gen_tps": r.gen_tps, "tokens": r.tokens}
        if wl.name in ("load", "rss"):
            return model_bytes / r.load_s / 1e6, extra
        if r.gen_tps is None:
            raise RuntimeError("client printed no tok/s")
        return r.gen_tps, extra
    if wl.kind == "bulk":
        out = protoclient.bulk(endpoint)
        if not out["intact"]:
            raise RuntimeError("GET_TENSOR read back different bytes than uploaded")
        return out["mb_s"], out
    if wl.kind == "burst":
        out = protoclient.burst(endpoint)
        if not out["intact"]:
            raise RuntimeError("GET_TENSOR read back different bytes than uploaded")
        return out["median_us"], out
    out = protoclient.ping(endpoint)
    return out["median_us"], out


def summarize(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    return {"n": len(values), "median": statistics.median(values), "min": min(values), "max": max(values)}


def fmt(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "us" or v >= 100:
        return f"{v:.0f}"
    return f"{v:.1f}" if v >= 10 else f"{v:.2f}"


# ------------------------------------------------------------------------------------ workloads
def run_workload(wl: Workload, arm_names: list[str], reps: int, work: Path, pki: Pki, args,
                 deadline: float, mtls_checked: dict) -> dict:
    model = model_path(wl.model) if wl.model else None
    model_bytes = offloaded_bytes(model) if model else 0
    print(f"\n== {wl.name}: {wl.title}; {reps} repetition(s) x {len(arm_names)} arm(s)", flush=True)
    stacks: dict[str, armlib.ArmStack] = {}
    runs: list[Run] = []
    samples: dict[str, dict] = {}
    try:
        for arm in arm_names:
            stacks[arm] = start_arm_retry(arm, work, pki, args, f"{wl.name}-")
            if arm != "direct" and arm not in mtls_checked:
                mtls_checked[arm] = armlib.check_mtls(pki, stacks[arm].tls_port)
                stacks[arm].rebaseline()
        for rep in range(reps):
            if time.monotonic() > deadline:
                print(f"   time budget reached: stopping {wl.name} after {rep} repetition(s)", flush=True)
                break
            for arm in arm_names:
                stack = stacks[arm]
                la = os.getloadavg()[0]
                if not stack.alive():
                    runs.append(Run(arm, rep, None, la, error="a process of this arm exited"))
                    continue
                try:
                    value, extra = measure(wl, stack.endpoint, model, model_bytes)
                    runs.append(Run(arm, rep, value, la, extra))
                    print(f"   rep {rep + 1} {arm:9s} {fmt(value, wl.unit):>8s} {wl.unit}  (load avg {la:.2f})",
                          flush=True)
                except Exception as exc:  # record and go on: one failed run must not lose the others
                    runs.append(Run(arm, rep, None, la, error=str(exc)))
                    print(f"   rep {rep + 1} {arm:9s} FAILED: {exc}", flush=True)
        for arm, stack in stacks.items():
            samples[arm] = stack.sample()
    finally:
        for stack in stacks.values():
            stack.stop()
    return {"workload": asdict(wl), "model": model.name if model else None, "model_offloaded_bytes": model_bytes,
            "runs": [asdict(r) for r in runs], "proxies": samples}


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
    """rpcguard alone: peak RSS of serve and connect for small vs huge tensors, one fresh pair each."""
    cases = [
        ("idle (started, no session yet)", None, None),
        ("load ~413 MB model, tensors <= 5.8 MB", "load400", None),
        ("load ~440 MB model, three 134 MB tensors", "bigtensor", None),
        ("synthetic: 512 MiB as 256 MiB SET_TENSOR frames", None, 256 * MIB),
    ]
    print("\n== rss: rpcguard peak RSS (VmHWM) per process, fresh pair per case", flush=True)
    out = []
    for i, (label, model_name, frame) in enumerate(cases):
        stack = start_arm_retry("rpcguard", work, pki, args, f"rss{i}-")
        detail: dict = {}
        try:
            detail = _rss_case(stack.endpoint, model_name, frame)
        except Exception as exc:
            detail = {"error": str(exc)}
        finally:
            detail["proxies"] = stack.sample()
            stack.stop()
        if model_name or frame:  # the same case without a proxy, for the MB/s column
            direct = armlib.start_arm("direct", work, pki)
            try:
                detail["direct_mb_s"] = _rss_case(direct.endpoint, model_name, frame).get("mb_s")
            except Exception as exc:
                detail["direct_error"] = str(exc)
            finally:
                direct.stop()
        hwm = {k: v.get("vmhwm_mb") for k, v in detail.get("proxies", {}).items()}
        print(f"   {label:50s} " + "  ".join(f"{k} {fmt(v, 'MB')} MB" for k, v in hwm.items())
              + (f"  FAILED: {detail['error']}" if detail.get("error") else ""), flush=True)
        out.append({"case": label, "model": model_name, "frame_bytes": frame, **detail})
    return {"workload": asdict(WORKLOADS["rss"]), "cases": out}


# ------------------------------------------------------------------------------------ report
def report(results: dict) -> tuple[list[str], list[tuple[str, bool, str]]]:
    lines: list[str] = []
    checks: list[tuple[str, bool, str]] = []
    for name, res in results["workloads"].items():
        wl = WORKLOADS[name]
        if name == "rss":
            lines.append(f"\n### {wl.title}\n")
            lines.append("| case | serve peak RSS MB | connect peak RSS MB | MB/s via rpcguard | MB/s direct |")
            lines.append("|---|---|---|---|---|")
            for c in res["cases"]:
                p = c.get("proxies", {})
                lines.append(f"| {c['case']} | {fmt(p.get('serve', {}).get('vmhwm_mb'), 'MB')} | "
                             f"{fmt(p.get('connect', {}).get('vmhwm_mb'), 'MB')} | "
                             f"{fmt(c.get('mb_s'), 'MB/s') if c.get('mb_s') else '-'} | "
                             f"{fmt(c.get('direct_mb_s'), 'MB/s') if c.get('direct_mb_s') else '-'} |")
                if c.get("model") and p:
                    worst = max(v.get("vmhwm_mb", 0) for v in p.values())
                    checks.append((f"rpcguard peak RSS, {c['case']}", worst <= RSS_TARGET_MB,
                                   f"max {worst:.1f} MB (target <= {RSS_TARGET_MB:.0f} MB)"))
            continue
        by_arm: dict[str, list[dict]] = {}
        for r in res["runs"]:
            by_arm.setdefault(r["arm"], []).append(r)
        stats = {arm: summarize([r["value"] for r in rs if r["value"] is not None]) for arm, rs in by_arm.items()}
        ref_tokens = None
        if wl.kind == "client":
            first = by_arm.get("direct") or next(iter(by_arm.values()), [])
            ref_tokens = next((r["extra"].get("tokens") for r in first if r["value"] is not None), None)
        direct = stats.get("direct", {}).get("median")
        better = "higher" if wl.higher_better else "lower"
        lines.append(f"\n### {wl.title}\n")
        lines.append(f"| arm | median {wl.unit} | min-max | x direct ({better} is better) | x direct, best runs | "
                     "tokens = direct | failed | peak RSS MB per proxy process | proxy CPU s (all reps) |")
        lines.append("|---|---|---|---|---|---|---|---|---|")
        best_of = max if wl.higher_better else min
        direct_best = best_of([r["value"] for r in by_arm.get("direct", []) if r["value"] is not None], default=None)
        for arm, rs in by_arm.items():
            s = stats[arm]
            ratio = s["median"] / direct if direct and s.get("median") else None
            vals = [r["value"] for r in rs if r["value"] is not None]
            best_ratio = best_of(vals) / direct_best if vals and direct_best else None
            if wl.kind == "client":
                same = all(r["extra"].get("tokens") == ref_tokens for r in rs if r["value"] is not None)
                tok = "yes" if same and ref_tokens else "NO"
                checks.append((f"tokens identical, {name}, {arm}", tok == "yes", f"{len(rs)} run(s)"))
            else:
                tok = "n/a"
            failed = sum(1 for r in rs if r["value"] is None)
            if failed:
                checks.append((f"no failed runs, {name}, {arm}", False, rs[[r["value"] for r in rs].index(None)]
                               ["error"][:200]))
            procs = res["proxies"].get(arm, {})
            rss = " / ".join(f"{k} {fmt(v.get('vmhwm_mb'), 'MB')}" for k, v in procs.items()) or "-"
            cpu = " / ".join(f"{v.get('cpu_s_delta', v.get('cpu_s', 0)):.2f}" for v in procs.values()) or "-"
            lines.append(f"| {arm} | {fmt(s.get('median'), wl.unit)} | "
                         f"{fmt(s.get('min'), wl.unit)}-{fmt(s.get('max'), wl.unit)} | "
                         f"{f'{ratio:.2f}' if ratio else '-'} | {f'{best_ratio:.2f}' if best_ratio else '-'} | "
                         f"{tok} | {failed} | {rss} | {cpu} |")
            if arm == "rpcguard" and wl.target is not None:
                checks.append((f"rpcguard/direct, {name}", bool(ratio and ratio >= wl.target),
                               f"{ratio:.2f} (target >= {wl.target})" if ratio else "no ratio"))
            if arm == "rpcguard" and name == "load" and procs:
                worst = max(v.get("vmhwm_mb", 0) for v in procs.values())
                checks.append(("rpcguard peak RSS during the ~413 MB loads", worst <= RSS_TARGET_MB,
                               f"max {worst:.1f} MB (target <= {RSS_TARGET_MB:.0f} MB)"))
        las = [r["loadavg"] for r in res["runs"]]
        if las:
            lines.append(f"\nload average (1 min) during this workload: {min(las):.2f}-{max(las):.2f}")
    for arm, ok in results.get("mtls_checks", {}).items():
        checks.append((f"{arm}: TLS 1.3 only, client certificate required", all(ok.values()), str(ok)))
    return lines, checks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 repetitions per workload (3 for the tiny model)")
    ap.add_argument("--arms", default=",".join(armlib.ARMS), help="comma list, in run order (default: all four)")
    ap.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS),
                    help=f"comma list of {', '.join(WORKLOADS)} (default: all)")
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

    if args.nice:
        os.nice(args.nice)  # children inherit it: client, server and every proxy alike
    started = dt.datetime.now(dt.timezone.utc)
    deadline = time.monotonic() + args.max_minutes * 60
    work = Path(tempfile.mkdtemp(prefix="rpcguard-bench-"))
    pki = Pki(work / "pki")
    uname = platform.uname()
    results: dict = {
        "started": started.isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, "bench/run.py", *(argv if argv is not None else sys.argv[1:])]),
        "machine": {"host": uname.node, "kernel": uname.release, "cpus": os.cpu_count(),
                    "cpu_model": _cpu_model(), "python": platform.python_version(),
                    "loadavg_start": os.getloadavg()},
        "git": _git_commit(), "tools": armlib.tool_versions(), "arms": arm_names, "nice": os.nice(0),
        "workloads": {},
        "mtls_checks": {},
    }
    print(f"rpcguard bench {results['started']} on {uname.node} ({os.cpu_count()} CPUs, "
          f"load avg {os.getloadavg()[0]:.2f}, nice {os.nice(0)}); work dir {work}", flush=True)
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
        results["machine"]["loadavg_end"] = os.getloadavg()
        out = args.json or RESULTS / f"{started.strftime('%Y%m%dT%H%M%SZ')}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        lines, checks = report(results)
        results["checks"] = [{"check": c, "ok": ok, "detail": d} for c, ok, d in checks]
        out.write_text(json.dumps(results, indent=1) + "\n")
        print("\n".join(lines))
        print("\n### checks (issue 4 targets; ratios from this run)\n")
        for c, ok, d in checks:
            print(f"- {'PASS' if ok else 'FAIL'} {c}: {d}")
        print(f"\nraw results: {out}\nload avg at start {results['machine']['loadavg_start'][0]:.2f}, "
              f"at end {results['machine']['loadavg_end'][0]:.2f}")
        if args.keep:
            print(f"work dir kept: {work}")
        else:
            subprocess.run(["rm", "-rf", str(work)])
    if status == 0 and not all(ok for _, ok, _ in checks):
        status = 1
    return status


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


if __name__ == "__main__":
    sys.exit(main())
