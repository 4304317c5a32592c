"""The one alternating runner of the benchmarks: every arm in turn, the order reversed on every
other repetition, fresh instances every N repetitions, and exact CPU readings around the
measured work only. bench/run.py, bench/paired.py and bench/floor.py all measure through it.

How this works: an arm (bench/arms.py) is a path between the real client and the real server.
``Alternation.run(measure)`` starts every arm (``start``: a fresh real ``ggml-rpc-server`` and the
arm's proxies) before any of them is measured, calls ``on_fresh`` on each new instance (the
mTLS check, a warm-up), then calls ``measure(rep, arm, stack)`` for every arm in ``orders``: the
given order on even repetitions, reversed on odd ones (ABBA), so drift on the machine hits every
arm alike and no arm always follows the same neighbour. Every ``fresh_every`` repetitions
(0: never) each instance is retired (``retire``: read its peak RSS before it stops) and started
afresh: two instances of the same code can differ by up to 1.6x in CPU per operation for their
whole life (docs/performance.md), so one instance per arm would measure the instance, not the
code. No repetition starts after ``deadline`` (``time.monotonic()``). Every instance is stopped
on the way out, whatever happened.

CPU is read with bench/cpuacct.py: ``bracket`` reads each proxy process's exact CPU time right
before and right after one piece of work; ``client_phases`` runs the real llama.cpp client and
reads it at the client's start, its ``load:`` line and its ``token ids:`` line, so start-up, the
mTLS check, warm-ups and the gaps between repetitions are never counted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypeVar

import cpuacct
from arms import ArmStack
from tests.support import realpeer

__all__ = ["orders", "Alternation", "bracket", "client_phases", "ClientPhases"]

T = TypeVar("T")


def orders(arms: list[str], reps: int) -> list[list[str]]:
    """The order of the arms in each repetition: as given, reversed every other one (ABBA)."""
    return [list(arms) if rep % 2 == 0 else list(reversed(arms)) for rep in range(reps)]


@dataclass
class Alternation:
    """Arms measured in turn over ``reps`` repetitions (see the module docstring)."""

    arms: list[str]
    reps: int
    start: Callable[[str], ArmStack | None]  # None: the arm could not start (measure sees None)
    fresh_every: int = 1  # fresh instances of every arm every N repetitions; 0: one per run
    deadline: float | None = None
    on_fresh: Callable[[str, ArmStack | None], None] | None = None  # after each (re)start, before measuring
    retire: Callable[[str, ArmStack], None] | None = None  # before an instance is stopped
    done: int = 0  # repetitions completed

    def _fresh(self, rep: int) -> bool:
        return rep == 0 or bool(self.fresh_every and rep % self.fresh_every == 0)

    def run(self, measure: Callable[[int, str, ArmStack | None], None]) -> int:
        """Measure every repetition; returns how many ran (fewer once the deadline passed)."""
        stacks: dict[str, ArmStack | None] = {}
        try:
            for rep, order in enumerate(orders(self.arms, self.reps)):
                if self.deadline is not None and time.monotonic() > self.deadline:
                    break
                if self._fresh(rep):
                    for arm in order:  # every arm is (re)started before any of them is measured
                        if arm in stacks:
                            self._stop(arm, stacks.pop(arm))
                        stacks[arm] = self.start(arm)
                        if self.on_fresh is not None:
                            self.on_fresh(arm, stacks[arm])
                for arm in order:
                    measure(rep, arm, stacks[arm])
                self.done = rep + 1
            for arm in list(stacks):
                self._stop(arm, stacks.pop(arm))
        finally:
            for stack in stacks.values():
                if stack is not None:
                    stack.stop()
        return self.done

    def _stop(self, arm: str, stack: ArmStack | None) -> None:
        if stack is None:
            return
        try:
            if self.retire is not None:
                self.retire(arm, stack)
        finally:
            stack.stop()


def bracket(proxies: dict, work: Callable[[], T]) -> tuple[T, dict[str, dict[str, float]]]:
    """``work()`` and the CPU each proxy process (label -> Proc) spent during it (cpuacct.delta)."""
    before = cpuacct.snapshot(proxies)
    out = work()
    return out, cpuacct.delta(before, cpuacct.snapshot(proxies))


@dataclass
class ClientPhases:
    """One real client run and the CPU of each proxy process in its two phases (bench/cpuacct.py)."""

    run: realpeer.ClientRun
    load: dict[str, dict[str, float]]  # start -> "load:" line
    gen: dict[str, dict[str, float]]  # "load:" line -> "token ids:" line


def client_phases(stack: ArmStack, model: Path, *, n: int, timeout: float) -> ClientPhases:
    """The real llama.cpp client through ``stack``, CPU read at its start and phase marks.
    Raises RuntimeError if the client failed or printed no phase marks."""
    marks = {"start": cpuacct.snapshot(stack.proxies)}
    r = cpuacct.run_client_phased(stack.endpoint, model, n=n, timeout=timeout,
                                  on_mark=lambda m: marks.__setitem__(m, cpuacct.snapshot(stack.proxies)))
    if not r.ok or r.load_s is None:
        tail = "\n".join(r.output.strip().splitlines()[-5:])
        raise RuntimeError(f"client rc={r.rc}: {tail}")
    if "loaded" not in marks or "generated" not in marks:
        raise RuntimeError(f"client printed no phase marks: {sorted(marks)}")
    return ClientPhases(r, cpuacct.delta(marks["start"], marks["loaded"]),
                        cpuacct.delta(marks["loaded"], marks["generated"]))
