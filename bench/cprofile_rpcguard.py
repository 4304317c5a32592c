#!/usr/bin/env python3
"""Run ``rpcguard`` under cProfile with a CPU-time clock (``bench/run.py --profiler cprofile``).

Usage: ``python bench/cprofile_rpcguard.py OUT.cprofile serve|connect ARGS...``

``python -m cProfile`` times functions with the wall clock, so a ``write`` that wakes the peer
and gets the process preempted looks expensive. This wrapper uses ``time.thread_time_ns``
(CPU time of the event-loop thread) instead, so the profile shows where CPU goes. rpcguard
exits cleanly on SIGTERM; the profile is written when ``main`` returns.
"""

from __future__ import annotations

import cProfile
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # appended: a tree on PYTHONPATH (a --baseline arm) comes first
    sys.path.append(str(ROOT))


def main() -> int:
    out, args = sys.argv[1], sys.argv[2:]
    from rpcguard.cli import main as rpcguard_main

    prof = cProfile.Profile(time.thread_time_ns, 1e-9)
    try:
        return prof.runcall(rpcguard_main, args)
    finally:
        prof.dump_stats(out)


if __name__ == "__main__":
    sys.exit(main())
