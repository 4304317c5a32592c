"""CPU per unit of work of every proxy process, bracketed around the measured work only.

How this works: ``arms.cpu_sample`` gives each proxy process's cumulative user and system CPU
time from ``/proc/PID/stat`` (clock ticks, 10 ms on Linux) and its exact CPU time from the
process CPU-time clock (the kernel's sum of every thread's run time, exited threads included;
the ticks alone would be +-10 ms per reading, as much as HAProxy spends on a whole tiny-model
generation). The harness reads both for every proxy of the arm right before a repetition
starts and at phase marks inside it, so arm start-up, the mTLS check and the time between
repetitions are never counted. A real llama.cpp client repetition has two phases:

* ``load``: from the client's start to its ``load: ...`` line (HELLO, DEVICE_COUNT, buffer
  allocation and every SET_TENSOR of the model);
* ``gen``: from the ``load:`` line to its ``token ids: ...`` line (prompt and generation; the
  client prints it before it closes the connection).

``run_client_phased`` runs the client with ``PYTHONUNBUFFERED=1`` and reads its output line by
line, calling back at each mark. Synthetic repetitions (bench/protoclient.py) have one phase,
``all``. ``Tally`` sums the deltas per arm, process and phase together with the units of work of
that phase (MB offloaded, tokens generated, MB uploaded, round trips, decode steps), and
``per_unit`` turns them into CPU milliseconds per unit: the figure issue 12 compares with
HAProxy's.
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from arms import cpu_sample
from tests.support import realpeer

__all__ = ["MARKS", "snapshot", "delta", "run_client_phased", "Tally", "per_unit"]

# client output line prefix -> phase mark reached when it is printed
MARKS = {"load: ": "loaded", "token ids: ": "generated"}


def snapshot(proxies: dict) -> dict[str, dict | None]:
    """``arms.cpu_sample`` of each proxy process (label -> Proc) right now."""
    return {label: cpu_sample(p.popen.pid) for label, p in proxies.items()}


def delta(before: dict, after: dict) -> dict[str, dict[str, float]]:
    """Per process, the CPU spent between two snapshots: ``user_s`` and ``sys_s`` (tick
    resolution) and ``run_s``, exact. A process gone at either end is left out."""
    out = {}
    for label, b in before.items():
        a = after.get(label)
        if a is None or b is None:
            continue
        out[label] = {"user_s": round(a["user_s"] - b["user_s"], 4), "sys_s": round(a["sys_s"] - b["sys_s"], 4),
                      "run_s": round(a["exact_s"] - b["exact_s"], 6)}
    return out


def run_client_phased(endpoint: str, model: Path, *, n: int, timeout: float,
                      on_mark: Callable[[str], None]) -> realpeer.ClientRun:
    """``realpeer.run_client`` with ``on_mark(name)`` called when the client reaches a phase mark."""
    cmd = [realpeer.realpeer_python(), str(realpeer.REALPEER_DIR / "rpc_client_smoke.py"), endpoint,
           "-m", str(model), "-n", str(n), "--no-precheck"]
    env = dict(os.environ, GGML_NO_BACKTRACE="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    timer = threading.Timer(timeout, proc.kill)  # hang guard, as run_client's timeout
    timer.start()
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            for prefix, mark in MARKS.items():
                if line.startswith(prefix):
                    on_mark(mark)
            lines.append(line)
        rc = proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return parse_client_output(rc, "".join(lines))


def parse_client_output(rc: int, out: str) -> realpeer.ClientRun:
    """The fields ``realpeer.run_client`` extracts, from the same output."""
    m = re.search(r"token ids: \[([0-9, ]*)\]", out)
    tokens = [int(x) for x in m.group(1).split(",") if x.strip()] if m else None
    lm = re.search(r"load: ([0-9.]+) s", out)
    gm = re.search(r"\(([0-9.]+|inf) tok/s after the first\)", out)
    return realpeer.ClientRun(rc, out, tokens, float(lm.group(1)) if lm else None,
                              float(gm.group(1)) if gm else None)


@dataclass
class Tally:
    """Sums of CPU deltas and units of work: arm -> phase -> {"units", "reps", process -> user/sys}."""

    sums: dict[str, dict[str, dict]] = field(default_factory=dict)

    def add(self, arm: str, phase: str, cpu: dict[str, dict[str, float]], units: float) -> None:
        slot = self.sums.setdefault(arm, {}).setdefault(phase, {"units": 0.0, "reps": 0, "procs": {}})
        slot["units"] += units
        slot["reps"] += 1
        for label, d in cpu.items():
            p = slot["procs"].setdefault(label, {"user_s": 0.0, "sys_s": 0.0, "run_s": 0.0})
            for key in p:
                p[key] = round(p[key] + d[key], 6)


def per_unit(slot: dict, scale: float = 1e3) -> dict[str, dict[str, float]]:
    """Process -> CPU per unit of work (ms with the default ``scale``): ``user`` and ``sys`` (tick
    resolution) and ``total``, exact."""
    units = slot.get("units") or 0
    out = {}
    for label, p in slot.get("procs", {}).items():
        if units > 0:
            out[label] = {"user": p["user_s"] * scale / units, "sys": p["sys_s"] * scale / units,
                          "total": p["run_s"] * scale / units}
    return out
