#!/usr/bin/env python3
"""The Markdown report and the pass/fail checks of a bench/run.py result.

Usage: ``bench/report.py bench/results/<ts>.json`` prints the report of a stored run again.

How this works: ``report(results)`` reads only the results dictionary that bench/run.py writes
as JSON (each workload carries its own definition), so a stored run renders exactly as it did
live. Per workload it prints one table row per arm (median, spread, ratio to direct, tokens,
peak RSS per proxy process with ``!`` above 80 MB, exact CPU per unit of work per process),
then a CPU table per process (user, system, exact total, ratio to HAProxy's process on the same
side), then, with a baseline arm, the working tree against the baseline. A run is summarized
by ``checks``: (name, ok, detail) for the targets of issues 4, 10 and 12; issue 12's CPU and
ratio targets are expected to fail until that work lands.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

__all__ = ["report", "header", "fmt", "speed_ratio", "paired_ratios", "RSS_TARGET_MB", "CPU_VS_HAPROXY_MAX"]

RSS_TARGET_MB = 80.0  # peak RSS per rpcguard process (issues 4 and 12)
CPU_VS_HAPROXY_MAX = 1.5  # issue 12: CPU per generated token of each rpcguard process <= 1.5x HAProxy's
RATIO_WORKLOADS = ("load", "gen100", "gentiny")  # issue 12: ratio to direct >= best of stunnel and HAProxy
SIDE = {"connect": "client-side", "serve": "server-side", "client-side": "client-side", "server-side": "server-side"}
MICRO_UNITS = ("round trip", "step")  # CPU per unit in microseconds; others in milliseconds


def fmt(v: float | None, unit: str = "") -> str:
    if v is None:
        return "-"
    if unit == "us" or v >= 100:
        return f"{v:.0f}"
    return f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def is_rpcguard(arm: str) -> bool:
    return arm in ("rpcguard", "contained") or arm.startswith("rpcguard@")


def speed_ratio(a: float | None, b: float | None, higher_better: bool) -> float | None:
    """How much faster ``a`` is than ``b`` (> 1: faster), for rates and for latencies alike."""
    if not a or not b:
        return None
    return a / b if higher_better else b / a


def paired_ratios(runs: list[dict], arm: str, other: str, higher_better: bool) -> list[float]:
    """``speed_ratio`` of ``arm`` to ``other`` for each repetition both completed (neighbours in time)."""
    by_rep: dict[int, dict[str, float]] = {}
    for r in runs:
        if r["value"] is not None:
            by_rep.setdefault(r["rep"], {})[r["arm"]] = r["value"]
    out = []
    for rep in sorted(by_rep):
        pair = by_rep[rep]
        ratio = speed_ratio(pair.get(arm), pair.get(other), higher_better)
        if ratio is not None:
            out.append(ratio)
    return out


def _cpu_scale(unit: str) -> tuple[float, str]:
    return (1e6, "us") if unit in MICRO_UNITS else (1e3, "ms")


def _per_unit(slot: dict | None, scale: float) -> dict[str, dict[str, float]]:
    units = (slot or {}).get("units") or 0
    if units <= 0:
        return {}
    return {label: {"user": p["user_s"] * scale / units, "sys": p["sys_s"] * scale / units,
                    "total": p["run_s"] * scale / units}
            for label, p in slot["procs"].items()}


def header(results: dict) -> list[str]:
    m, v = results.get("machine", {}), results.get("versions", {})
    la0, la1 = m.get("loadavg_start") or [], m.get("loadavg_end") or []
    lines = [f"## rpcguard bench, {results.get('started', '?')} -> {results.get('finished', '?')} (UTC)", "",
             f"- machine: {m.get('host')}, {m.get('cpus')} CPUs ({m.get('cpu_model')}), kernel {m.get('kernel')}",
             f"- load average (1/5/15 min): start {' / '.join(map(str, la0))}, end {' / '.join(map(str, la1))}",
             f"- versions: llama-cpp-python {v.get('llama_cpp_python')} (ggml RPC protocol "
             f"{v.get('ggml_rpc_protocol')}), {v.get('stunnel')}, {v.get('haproxy')}, {v.get('openssl')}, "
             f"Python {v.get('python')}, uvloop {v.get('uvloop')}",
             f"- rpcguard (working tree): {v.get('rpcguard_core', 'protocol core: not recorded')}",
             f"- command: `{results.get('command', '')}`, nice {results.get('nice', 0)}"]
    for arm, t in results.get("trees", {}).items():
        lines.append(f"- arm `{arm}`: {t['label']} {t['revision']} at {t['path']} (rpcguard imported from "
                     f"{t['rpcguard_imported_from']}; python {t['python']}; protocol core: {t.get('core', 'not recorded')})"
                     + "".join(f"; {n}" for n in t["notes"]))
    return lines


def _cpu_table(name: str, wl: dict, cpu: dict, checks: list) -> list[str]:
    scale, su = _cpu_scale(wl["cpu_unit"])
    phase, unit = wl["cpu_phase"], wl["cpu_unit"]
    per = {arm: _per_unit(phases.get(phase), scale) for arm, phases in cpu.items()}
    if not any(per.values()):
        return []
    haproxy = per.get("haproxy", {})
    units = {arm: phases.get(phase, {}).get("units", 0) for arm, phases in cpu.items()}
    lines = [f"\nCPU per {unit} ({phase} phase only; {su}; user/sys from /proc/PID/stat ticks, total exact "
             "from the process CPU clock):\n",
             f"| arm | process | {unit}s counted | user {su} | sys {su} | total {su} | x HAProxy (same side) |",
             "|---|---|---|---|---|---|---|"]
    for arm, procs in per.items():
        for label, p in procs.items():
            ref = haproxy.get(SIDE.get(label, label), {}).get("total")
            x = p["total"] / ref if ref and arm != "haproxy" else None
            lines.append(f"| {arm} | {label} | {units[arm]:.0f} | {p['user']:.3f} | {p['sys']:.3f} | "
                         f"{p['total']:.3f} | {f'{x:.2f}' if x else '-'} |")
            if arm == "rpcguard" and phase == "gen" and x is not None:
                checks.append((f"[issue 12] CPU per token of {arm} {label} <= {CPU_VS_HAPROXY_MAX}x HAProxy's, "
                               f"{name}", x <= CPU_VS_HAPROXY_MAX,
                               f"{x:.2f}x ({p['total']:.3f} vs {ref:.3f} {su}/token)"))
    return lines


def _baseline_lines(name: str, wl: dict, res: dict, base: str, tolerance: float, stats: dict,
                    summary: list, checks: list) -> list[str]:
    hb = wl["higher_better"]
    med = speed_ratio(stats.get("rpcguard", {}).get("median"), stats.get(base, {}).get("median"), hb)
    pairs = paired_ratios(res["runs"], "rpcguard", base, hb)
    scale, su = _cpu_scale(wl["cpu_unit"])
    cur = _per_unit(res.get("cpu", {}).get("rpcguard", {}).get(wl["cpu_phase"]), scale)
    old = _per_unit(res.get("cpu", {}).get(base, {}).get(wl["cpu_phase"]), scale)
    cpu = {label: cur[label]["total"] / old[label]["total"] for label in cur
           if old.get(label, {}).get("total")}
    spread = f"{min(pairs):.3f}-{max(pairs):.3f}" if pairs else "-"
    summary.append(f"| {name} | {fmt(stats.get('rpcguard', {}).get('median'), wl['unit'])} | "
                   f"{fmt(stats.get(base, {}).get('median'), wl['unit'])} {wl['unit']} | "
                   f"{f'{med:.3f}' if med else '-'} | "
                   f"{f'{statistics.median(pairs):.3f}' if pairs else '-'} ({spread}, n={len(pairs)}) | "
                   + " / ".join(f"{k} {v:.2f}" for k, v in cpu.items()) + " |")
    if med is not None:
        slower = sum(1 for p in pairs if p < 1)
        checks.append((f"[issue 10] no regression against {base}, {name}", med >= 1 - tolerance,
                       f"speed ratio {med:.3f} (>= {1 - tolerance:.2f}; per-rep {spread}, slower in {slower} of "
                       f"{len(pairs)})"))
    return [f"\nworking tree against {base}: speed ratio of medians {f'{med:.3f}' if med else '-'} "
            f"(> 1: the working tree is faster), per repetition {spread}; CPU per {wl['cpu_unit']} "
            + ", ".join(f"{k} {v:.2f}x" for k, v in cpu.items())]


def _rss_lines(res: dict, checks: list) -> list[str]:
    lines = [f"\n### {res['workload']['title']}\n",
             "| arm | case | serve peak RSS MB | connect peak RSS MB | MB/s via rpcguard | MB/s direct |",
             "|---|---|---|---|---|---|"]
    for c in res["cases"]:
        p, arm = c.get("proxies", {}), c.get("arm", "rpcguard")
        lines.append(f"| {arm} | {c['case']} | {fmt(p.get('serve', {}).get('vmhwm_mb'), 'MB')} | "
                     f"{fmt(p.get('connect', {}).get('vmhwm_mb'), 'MB')} | "
                     f"{fmt(c.get('mb_s'), 'MB/s') if c.get('mb_s') else '-'} | "
                     f"{fmt(c.get('direct_mb_s'), 'MB/s') if c.get('direct_mb_s') else '-'} |")
        if p and arm == "rpcguard":  # the working tree; a baseline is only shown
            worst = max(v.get("vmhwm_mb", 0) for v in p.values())
            checks.append((f"[issues 4, 12] peak RSS per process <= {RSS_TARGET_MB:.0f} MB, {arm}, {c['case']}",
                           worst <= RSS_TARGET_MB, f"max {worst:.1f} MB"))
    return lines


def report(results: dict) -> tuple[list[str], list[tuple[str, bool, str]]]:
    lines: list[str] = header(results)
    checks: list[tuple[str, bool, str]] = []
    base = (results.get("baseline") or {}).get("arm")
    tolerance = (results.get("baseline") or {}).get("tolerance", 0.05)
    summary = ["| workload | rpcguard median | baseline median | speed ratio of medians | "
               "per-rep speed ratios: median (min-max) | CPU per unit, rpcguard / baseline |", "|---|---|---|---|---|---|"]
    for name, res in results["workloads"].items():
        if name == "rss":
            lines += _rss_lines(res, checks)
            continue
        wl = {"cpu_phase": "all", "cpu_unit": "repetition", **res["workload"]}  # older results lack the CPU keys
        by_arm: dict[str, list[dict]] = {}
        for r in res["runs"]:
            by_arm.setdefault(r["arm"], []).append(r)
        stats = {}
        for arm, rs in by_arm.items():
            vals = [r["value"] for r in rs if r["value"] is not None]
            stats[arm] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)} if vals else {}
        ref_tokens = None
        if wl["kind"] == "client":
            first = by_arm.get("direct") or next(iter(by_arm.values()), [])
            ref_tokens = next((r["extra"].get("tokens") for r in first if r["value"] is not None), None)
        direct = stats.get("direct", {}).get("median")
        best_of = max if wl["higher_better"] else min
        direct_best = best_of([r["value"] for r in by_arm.get("direct", []) if r["value"] is not None], default=None)
        scale, su = _cpu_scale(wl["cpu_unit"])
        lines += [f"\n### {wl['title']}\n",
                  f"| arm | median {wl['unit']} | min-max | x direct ({'higher' if wl['higher_better'] else 'lower'} "
                  f"is better) | x direct, best runs | tokens = direct | failed | peak RSS MB per proxy process | "
                  f"CPU {su} per {wl['cpu_unit']} per proxy process |", "|---|---|---|---|---|---|---|---|---|"]
        ratios = {}
        for arm, rs in by_arm.items():
            s = stats[arm]
            ratio = ratios[arm] = s["median"] / direct if direct and s.get("median") else None
            vals = [r["value"] for r in rs if r["value"] is not None]
            best_ratio = best_of(vals) / direct_best if vals and direct_best else None
            tok = "n/a"
            if wl["kind"] == "client":
                same = all(r["extra"].get("tokens") == ref_tokens for r in rs if r["value"] is not None)
                tok = "yes" if same and ref_tokens else "NO"
                checks.append((f"[issues 4, 12] tokens identical, {name}, {arm}", tok == "yes", f"{len(rs)} run(s)"))
            failed = [r for r in rs if r["value"] is None]
            if failed:
                checks.append((f"no failed runs, {name}, {arm}", False, failed[0]["error"][:200]))
            procs = res["proxies"].get(arm, {})
            rss = " / ".join(f"{k} {fmt(v.get('vmhwm_mb'), 'MB')}{'!' if v.get('vmhwm_mb', 0) > RSS_TARGET_MB else ''}"
                             for k, v in procs.items()) or "-"
            per = _per_unit(res.get("cpu", {}).get(arm, {}).get(wl["cpu_phase"]), scale)
            cpu = " / ".join(f"{k} {v['total']:.3f}" for k, v in per.items()) or "-"
            lines.append(f"| {arm} | {fmt(s.get('median'), wl['unit'])} | {fmt(s.get('min'), wl['unit'])}-"
                         f"{fmt(s.get('max'), wl['unit'])} | {f'{ratio:.2f}' if ratio else '-'} | "
                         f"{f'{best_ratio:.2f}' if best_ratio else '-'} | {tok} | {len(failed)} | {rss} | {cpu} |")
            if arm == "rpcguard" and wl.get("target") is not None:
                checks.append((f"[issue 4] rpcguard/direct, {name}", bool(ratio and ratio >= wl["target"]),
                               f"{ratio:.2f} (target >= {wl['target']})" if ratio else "no ratio"))
            if arm == "rpcguard" and procs:  # the working tree; a baseline is only shown
                worst = max(v.get("vmhwm_mb", 0) for v in procs.values())
                checks.append((f"[issues 4, 12] peak RSS per process <= {RSS_TARGET_MB:.0f} MB, {arm}, {name}",
                               worst <= RSS_TARGET_MB, f"max {worst:.1f} MB"))
        if name in RATIO_WORKLOADS and ratios.get("rpcguard") and wl["higher_better"]:
            c_proxies = [ratios[a] for a in ("stunnel", "haproxy") if ratios.get(a)]
            if c_proxies:
                checks.append((f"[issue 12] rpcguard/direct >= best of stunnel and HAProxy, {name}",
                               ratios["rpcguard"] >= max(c_proxies),
                               f"{ratios['rpcguard']:.2f} vs {max(c_proxies):.2f}"))
        lines += _cpu_table(name, wl, res.get("cpu", {}), checks)
        if base and base in stats and "rpcguard" in stats:
            lines += _baseline_lines(name, wl, res, base, tolerance, stats, summary, checks)
        las = [r["loadavg"] for r in res["runs"]]
        if las:
            lines.append(f"\nload average (1 min) during this workload: {min(las):.2f}-{max(las):.2f}")
        if res.get("fresh_every") is not None:
            every = res["fresh_every"]
            lines.append(f"fresh server and proxies for every arm: {f'every {every} repetition(s)' if every else 'once'}")
    if base and len(summary) > 2:
        lines += [f"\n### working tree (`rpcguard`) against `{base}`, same run\n",
                  "Speed ratio > 1: the working tree is faster (rates: rpcguard/baseline; latencies: "
                  "baseline/rpcguard). CPU ratio < 1: the working tree uses less CPU per unit of work.\n", *summary]
    for arm, ok in results.get("mtls_checks", {}).items():
        checks.append((f"{arm}: TLS 1.3 only, client certificate required", all(ok.values()), str(ok)))
    return lines, checks


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: bench/report.py RESULTS.json", file=sys.stderr)
        return 2
    results = json.loads(Path(argv[0]).read_text())
    lines, checks = report(results)
    print("\n".join(lines))
    print("\n### checks\n")
    for c, ok, d in checks:
        print(f"- {'PASS' if ok else 'FAIL'} {c}: {d}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
