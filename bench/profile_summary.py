#!/usr/bin/env python3
"""Summarize the profiles that ``bench/run.py --profile DIR [--profiler perf]`` writes.

Usage: ``python bench/profile_summary.py DIR/*.pyspy.txt DIR/*.perf.data``

``*.perf.data`` (``perf record -e cpu-clock``, on-CPU samples only): share of CPU per library,
grouped as kernel (sockets, TCP loopback, scheduler), TLS (libcrypto/libssl), Python interpreter
(relay, session, firewall, ``ssl.py`` and asyncio glue; CPython 3.11 has no perf trampolines, so
Python functions are not told apart here), uvloop and libc (copies, malloc), plus the top symbols.

``*.cprofile`` (rpcguard under bench/cprofile_rpcguard.py, CPU-time clock): Python functions by
own CPU time, and
own time grouped by where the code lives (rpcguard protocol, relay, transports' ``write`` (TLS
encryption and the send syscall happen inside it), ``ssl.py``, the rest). cProfile's overhead
inflates Python code relative to C.

``*.pyspy.txt`` (``py-spy record --native --format raw``, wall-clock samples):

How this works: each line of a raw profile is one collapsed stack (root first, ``;``-separated)
and a sample count. A sample's category is the first frame, scanning from the leaf toward the
root, that matches a rule in ``CATEGORIES`` (so encryption inside ``transport.write`` counts as
TLS, not as relay code). Then the top self (leaf) frames and the top inclusive rpcguard
functions are listed. Only samples where the process was on CPU are recorded (py-spy drops idle
samples by default), so percentages are shares of the process's busy time.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

# (category, regex on one frame); the first rule that matches a frame wins for that frame.
IDLE = re.compile(r"^epoll_(p)?wait|^epoll_wait")  # a leaf here is the loop waiting, not work

CATEGORIES = [
    ("TLS decrypt (SSLObject.read)", re.compile(r"SSLObject\.read|_ssl__SSLSocket_read|SSL_read")),
    ("TLS encrypt (SSLObject.write)", re.compile(r"SSLObject\.write|_ssl__SSLSocket_write|SSL_write")),
    ("TLS other (libssl/libcrypto, BIO)", re.compile(r"libssl|libcrypto|MemoryBIO|_ssl\.c")),
    ("socket syscalls (send/recv/write/read)",
     re.compile(r"^(__libc_)?(send|recv|sendmsg|recvmsg|write|writev|read|__send|__recv|__write|__read)\b"
                r"|\(libc\.so\.6\)$|entry_SYSCALL")),
    ("rpcguard protocol (parse/validate)", re.compile(r"rpcguard/protocol/")),
    ("rpcguard relay glue", re.compile(r"rpcguard/(relay|endpoint)\.py")),
    ("rpcguard other (metrics, server)", re.compile(r"rpcguard/")),
    ("event loop (uvloop/libuv)", re.compile(r"uvloop|loop\.c|\(core\.c|stream\.c|linux\.c|uv_|uv__")),
]


def frame_name(frame: str) -> str:
    """``func (file:line)`` -> ``func (file)``; native ``0xADDR (lib)`` -> ``? (lib)``."""
    frame = re.sub(r":\d+\)$", ")", frame)
    return re.sub(r"^0x[0-9a-f]+ ", "? ", frame)


def load(path: Path) -> Counter:
    stacks: Counter = Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            stacks[stack] += int(count)
    return stacks


def categorize(frames: list[str]) -> str:
    for frame in reversed(frames):
        for name, rx in CATEGORIES:
            if rx.search(frame):
                return name
    return "other (interpreter, GC, startup)"


def summarize(path: Path, top: int = 12) -> str:
    stacks = load(path)
    cats: Counter = Counter()
    leaves: Counter = Counter()
    inclusive: Counter = Counter()
    idle = 0
    for stack, n in list(stacks.items()):
        if IDLE.search(stack.split(";")[-1]):
            idle += n
            del stacks[stack]
    total = sum(stacks.values()) or 1
    for stack, n in stacks.items():
        frames = stack.split(";")
        cats[categorize(frames)] += n
        leaves[frame_name(frames[-1])] += n
        for f in {frame_name(f) for f in frames if "rpcguard/" in f}:
            inclusive[f] += n
    out = [f"## {path.name}: {total} busy samples (+{idle} in epoll_wait, left out)", "",
           "| category | % of busy |", "|---|---|"]
    out += [f"| {c} | {100 * n / total:.1f} |" for c, n in cats.most_common()]
    out += ["", "| top self frames | % |", "|---|---|"]
    out += [f"| `{f}` | {100 * n / total:.1f} |" for f, n in leaves.most_common(top)]
    out += ["", "| top inclusive rpcguard functions | % |", "|---|---|"]
    out += [f"| `{f}` | {100 * n / total:.1f} |" for f, n in inclusive.most_common(top)]
    return "\n".join(out) + "\n"


PERF_GROUPS = [
    ("kernel (syscalls, TCP loopback, scheduler)", re.compile(r"\[kernel")),
    ("TLS (libcrypto, libssl, _ssl)", re.compile(r"libcrypto|libssl|_ssl\.cpython")),
    ("Python interpreter (relay, session, firewall, ssl.py, asyncio glue)", re.compile(r"libpython|python3|_struct")),
    ("uvloop / libuv", re.compile(r"uvloop|loop\.cpython")),
    ("libc (memcpy/memset, malloc)", re.compile(r"libc\.so")),
]


def _perf_rows(path: Path, sort: str) -> list[tuple[float, str]]:
    p = subprocess.run(["perf", "report", "-i", str(path), "--no-children", "--sort", sort, "--stdio",
                        "-g", "none", "--percent-limit", "0.3"], capture_output=True, text=True, timeout=300)
    rows = []
    for line in p.stdout.splitlines():
        m = re.match(r"\s*([0-9.]+)%\s+(.*\S)", line)
        if m and not line.lstrip().startswith("#"):
            rows.append((float(m.group(1)), re.sub(r"\s+", " ", m.group(2))))
    return rows


def summarize_perf(path: Path, top: int = 12) -> str:
    groups: Counter = Counter()
    for pct, dso in _perf_rows(path, "dso"):
        name = next((g for g, rx in PERF_GROUPS if rx.search(dso)), f"other ({dso})")
        groups[name] += pct
    out = [f"## {path.name}: on-CPU samples by library", "", "| group | % of CPU |", "|---|---|"]
    out += [f"| {g} | {pct:.1f} |" for g, pct in groups.most_common()]
    out += ["", "| top symbols | % |", "|---|---|"]
    out += [f"| `{sym}` | {pct:.1f} |" for pct, sym in _perf_rows(path, "dso,sym")[:top]]
    return "\n".join(out) + "\n"


CPROFILE_GROUPS = [
    ("rpcguard protocol (session, framing, firewall, tensor, graph)", re.compile(r"rpcguard/protocol/")),
    ("rpcguard relay (Link, Endpoint)", re.compile(r"rpcguard/(relay|endpoint)\.py")),
    ("rpcguard other (metrics, server, audit)", re.compile(r"rpcguard/")),
    ("transport write/writelines (TLS encrypt + send syscall inside)",
     re.compile(r"method '(write|writelines)' of 'uvloop")),
    ("ssl.py (SSLObject.read/write wrappers, called from uvloop)", re.compile(r"ssl\.py")),
    ("struct / memoryview / builtins", re.compile(r"^~|built-in|method '")),
]


def summarize_cprofile(path: Path, top: int = 15) -> str:
    import pstats

    st = pstats.Stats(str(path))
    rows = []
    for (file, line, func), (cc, nc, tt, ct, callers) in st.stats.items():  # type: ignore[attr-defined]
        where = f"{func}" if file == "~" else f"{Path(file).parent.name}/{Path(file).name}:{func}"
        rows.append((tt, ct, nc, where, file if file != "~" else func))
    # the event loop's own wait (epoll inside uvloop's run) is the run() call's own time: leave it out
    busy = [r for r in rows if not re.search(r"run_until_complete|run_forever|Runner\.run|uvloop/__init__", r[3])]
    total = sum(r[0] for r in busy) or 1.0
    groups: Counter = Counter()
    for tt, _ct, _nc, where, key in busy:
        name = next((g for g, rx in CPROFILE_GROUPS if rx.search(key) or rx.search(where)), "other Python")
        groups[name] += tt
    out = [f"## {path.name}: {total:.2f} s of profiled CPU time (start-up included)", "",
           "| group | % |", "|---|---|"]
    out += [f"| {g} | {100 * t / total:.1f} |" for g, t in groups.most_common()]
    out += ["", "| function | calls | own s | cumulative s | us per call |", "|---|---|---|---|---|"]
    for tt, ct, nc, where, _ in sorted(busy, reverse=True)[:top]:
        out.append(f"| `{where}` | {nc} | {tt:.3f} | {ct:.3f} | {1e6 * tt / max(nc, 1):.1f} |")
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    for p in argv:
        if p.endswith(".perf.data"):
            print(summarize_perf(Path(p)))
        elif p.endswith(".cprofile"):
            print(summarize_cprofile(Path(p)))
        else:
            print(summarize(Path(p)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
