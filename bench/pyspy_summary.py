#!/usr/bin/env python3
"""Summarize ``py-spy record --native --format raw`` profiles of rpcguard processes.

Usage: ``python bench/pyspy_summary.py DIR/load-serve.txt [...]`` (files written by
``bench/run.py --profile DIR``).

How this works: each line of a raw profile is one collapsed stack (root first, ``;``-separated)
and a sample count. A sample's category is the first frame, scanning from the leaf toward the
root, that matches a rule in ``CATEGORIES`` (so encryption inside ``transport.write`` counts as
TLS, not as relay code). Then the top self (leaf) frames and the top inclusive rpcguard
functions are listed. Only samples where the process was on CPU are recorded (py-spy drops idle
samples by default), so percentages are shares of the process's busy time.
"""

from __future__ import annotations

import re
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
    ("rpcguard relay glue", re.compile(r"rpcguard/relay\.py")),
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


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    for p in argv:
        print(summarize(Path(p)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
