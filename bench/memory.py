"""Resident memory of an idle ``rpcguard serve`` and ``rpcguard connect``, by mapping, against a baseline.

Usage::

    python bench/memory.py                      # the working tree alone
    python bench/memory.py --baseline main      # and the code of git revision main, same run

How this works: one private CA (node and client certificates) and one real ``ggml-rpc-server``
on loopback serve every tree. For each tree (the working tree, then ``--baseline REV`` extracted
by bench/baseline.py, its compiled core built unless ``--pure``), serve and connect are started
from quick-start configs (one listener, one tunnel, an allow-list, metrics on loopback, as
config/*.example.yaml), each from its tree as bench/run.py starts its arms. connect's start-up
check makes one probe session through serve (a TLS handshake and a HELLO on each side); then
``/metrics`` of each is read once, as Prometheus would, and after ``--settle`` seconds idle the
memory is read from ``/proc/PID/smaps``: RSS and PSS of each mapping, grouped as ``anon`` (heap
and anonymous mappings), ``[stack]``, each shared library by file name, and the other files.
The table prints each group per tree and the ratio working tree / baseline; a group below
``--min-kb`` in every column goes into ``(small)``. Memory is read, not timed: the figures do not
depend on the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

import baseline as baselib  # noqa: E402
from workloads import CACHE  # noqa: E402

from tests.support.guard import Pki  # noqa: E402
from tests.support.realpeer import Proc, free_port, start_rpc_server  # noqa: E402

READY = "ready:"
CHECKED = "check:"
START_TIMEOUT_S = 60.0
_HEADER = re.compile(r"^[0-9a-f]+-[0-9a-f]+ ")


def read_smaps(pid: int) -> dict[str, dict[str, int]]:
    """kB of ``Rss`` and ``Pss`` per mapping group of process ``pid`` (see the module doc)."""
    groups: dict[str, dict[str, int]] = {}
    group = "anon"
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            if _HEADER.match(line):
                parts = line.split(None, 5)
                path = parts[5].strip() if len(parts) > 5 else ""
                group = _group(path)
                continue
            key, _, rest = line.partition(":")
            if key in ("Rss", "Pss"):
                g = groups.setdefault(group, {"Rss": 0, "Pss": 0})
                g[key] += int(rest.split()[0])
    return groups


def _group(path: str) -> str:
    if not path or path == "[heap]" or path.startswith("[anon"):
        return "anon"
    if path.startswith("["):
        return path
    name = os.path.basename(path)
    if ".so" in name:
        return re.sub(r"\.cpython-[^.]*|\.abi3", "", name)  # one name for every build of an extension
    return "(other files)"


def rollup(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("Rss", "Pss", "Anonymous"):
                out[key] = int(rest.split()[0])
    return out


def _configs(d: Path, pki: Pki, upstream: int) -> tuple[Path, Path, int, int]:
    listen, tunnel, m_serve, m_connect = free_port(), free_port(), free_port(), free_port()
    tls = {"ca": pki.path("ca")}
    serve = {"metrics": {"listen": f"127.0.0.1:{m_serve}"},
             "tls": dict(tls, cert=pki.path(pki.node), key=pki.path(pki.node, "key")),
             "allow": {"cn": [pki.client]},
             "listeners": [{"name": "gpu0", "listen": f"127.0.0.1:{listen}", "upstream": f"127.0.0.1:{upstream}"}]}
    connect = {"metrics": {"listen": f"127.0.0.1:{m_connect}"},
               "tls": dict(tls, cert=pki.path(pki.client), key=pki.path(pki.client, "key")),
               "tunnels": [{"name": "node1-gpu0", "listen": f"127.0.0.1:{tunnel}", "server": f"127.0.0.1:{listen}",
                            "server_name": pki.node}]}
    paths = d / "serve.yaml", d / "connect.yaml"
    for path, cfg in zip(paths, (serve, connect)):
        path.write_text(json.dumps(cfg, indent=1))  # JSON is YAML
    return paths[0], paths[1], m_serve, m_connect


def _wait(proc, needle: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while needle not in proc.output():
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited: {proc.output()[-600:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{proc.name}: no {needle!r} line in {START_TIMEOUT_S} s: {proc.output()[-600:]}")
        time.sleep(0.05)


def measure(tree: baselib.Tree, d: Path, pki: Pki, upstream: int, settle: float) -> dict:
    """Start serve and connect of ``tree``, let them idle, read their memory; stop them."""
    serve_cfg, connect_cfg, m_serve, m_connect = _configs(d, pki, upstream)
    env = tree.env()
    procs: list[Proc] = []
    out: dict = {"tree": tree.describe()}
    try:
        for role, cfg, needle in (("serve", serve_cfg, READY), ("connect", connect_cfg, CHECKED)):
            with open(d / f"{role}.log", "wb") as log:  # cwd: the tree, so its rpcguard is imported first
                popen = subprocess.Popen([tree.python, "-m", "rpcguard", role, "--config", str(cfg)], cwd=tree.path,
                                         env=dict(os.environ, **env), stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
            p = Proc(popen, d / f"{role}.log", f"{tree.label} {role}")
            procs.append(p)
            _wait(p, needle)
        for port in (m_serve, m_connect):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                r.read()
        time.sleep(settle)
        for role, p in zip(("serve", "connect"), procs):
            pid = p.popen.pid
            with open(f"/proc/{pid}/maps") as f:
                crypto = any("cryptography" in line for line in f)
            out[role] = {"rollup": rollup(pid), "groups": read_smaps(pid), "cryptography_mapped": crypto}
    finally:
        for p in procs:
            p.stop()
    return out


def _row(name: str, cells: list[float | None], ratio: bool) -> str:
    text = "".join(f"{c / 1024:10.1f}" if c is not None else f"{'-':>10}" for c in cells)
    if ratio and len(cells) == 2 and cells[0] is not None and cells[1]:
        text += f"{cells[0] / cells[1]:9.2f}"
    return f"  {name:<32}{text}"


def report(results: list[dict], min_kb: int) -> list[str]:
    lines = []
    labels = [r["tree"]["label"] + f" ({r['tree']['core']})" for r in results]
    for role in ("serve", "connect"):
        lines.append(f"{role}: MB " + " | ".join(labels) + ("  | ratio" if len(results) == 2 else ""))
        for key in ("Rss", "Pss", "Anonymous"):
            lines.append(_row(f"total {key}", [r[role]["rollup"].get(key) for r in results], len(results) == 2))
        names = sorted({g for r in results for g in r[role]["groups"]},
                       key=lambda g: -max(r[role]["groups"].get(g, {}).get("Rss", 0) for r in results))
        small = [0] * len(results)
        for g in names:
            cells = [r[role]["groups"].get(g, {}).get("Rss", 0) for r in results]
            if max(cells) < min_kb:
                small = [a + b for a, b in zip(small, cells)]
                continue
            lines.append(_row(f"RSS {g}", [float(c) for c in cells], len(results) == 2))
        lines.append(_row("RSS (small)", [float(c) for c in small], len(results) == 2))
        lines.append("  cryptography mapped: " + ", ".join(str(r[role]["cryptography_mapped"]) for r in results))
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", metavar="REV", help="also measure the code of git revision REV (bench/baseline.py)")
    ap.add_argument("--pure", action="store_true", help="run the baseline as pure Python (no compiled core built)")
    ap.add_argument("--settle", type=float, default=3.0, help="seconds idle before reading (default 3)")
    ap.add_argument("--min-kb", type=int, default=512, help="groups smaller than this in every column: (small)")
    ap.add_argument("--json", metavar="FILE", help="write the raw readings here")
    args = ap.parse_args(argv)
    trees = [baselib.working_tree()]
    if args.baseline:
        cache = CACHE / "memory-pure" if args.pure else CACHE
        trees.append(baselib.prepare(args.baseline, cache, compile_core=not args.pure))
    for t in trees:
        t.verify()
    results = []
    with tempfile.TemporaryDirectory(prefix="rpcguard-memory-") as tmp:
        d = Path(tmp)
        pki = Pki(d / "pki")
        server, upstream = start_rpc_server(d)
        try:
            for i, t in enumerate(trees):
                run_dir = d / f"tree{i}"
                run_dir.mkdir()
                results.append(measure(t, run_dir, pki, upstream, args.settle))
        finally:
            server.stop()
    for t in trees:
        print(f"{t.label}: {t.revision} ({t.core}); " + "; ".join(t.notes))
    print("\n".join(report(results, args.min_kb)))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
