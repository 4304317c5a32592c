"""Large graphs validated off the event loop, on a few threads, fairly between client identities.

How this works: a link whose session deferred a large GRAPH_COMPUTE (``Session.validate_deferred``,
the lifecycle's VALIDATE action) hands the validation here with its client identity. At most
``workers`` validations run at once, on threads (the per-node rules run as interpreted Python, so
the loop thread gets the GIL back every switch interval). The others wait in one queue per
identity, and the next job is taken from the identity with the fewest running, then the one
served longest ago: one certificate's flood of costly graphs delays another tenant's graph by at
most the validations already running, not by the whole flood. The
``done`` callback runs on the loop thread with the finished future.

The graph validator's CPU budget (policy ``max_graph_cpu_s``) reads its clock from here: the
protocol core is sans-IO, so the clock and the garbage collector's accounting live on this side
(``cpu_clock``, installed by ``install_clock`` when the pool is made: for the validations on these
threads and for the small graphs validated on the loop thread alike).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import threading
from collections import deque
from time import thread_time
from typing import Callable

from rpcguard.protocol import graph

__all__ = ["Validators", "WORKERS", "cpu_clock", "install_clock"]

# Two threads: many sessions' validations queue instead of all contending with the loop for the GIL.
WORKERS = 2

# The validation budget is the validating thread's CPU time less the time spent in the garbage
# collector: a collection that a validation happens to trigger pays for every object the process
# holds (hundreds of ms in a large process), not for the graph, and must not refuse a valid one.
# Per thread: a large graph is validated on a worker thread while the loop thread may collect, and
# a collection only stops the thread that runs it.
_gc_time = threading.local()  # .spent: seconds of this thread in collections; .start: the current one's start


def _on_gc(phase: str, info: dict[str, int]) -> None:
    if phase == "start":
        _gc_time.start = thread_time()
    else:
        now = thread_time()
        _gc_time.spent = getattr(_gc_time, "spent", 0.0) + now - getattr(_gc_time, "start", now)


def cpu_clock() -> float:
    """CPU seconds of this thread outside the garbage collector (graph.Clock)."""
    return thread_time() - getattr(_gc_time, "spent", 0.0)


def install_clock() -> None:
    """Count collections (a process-wide gc callback, added once) and make ``cpu_clock`` the
    graph validators' clock (graph.set_clock)."""
    if _on_gc not in gc.callbacks:
        gc.callbacks.append(_on_gc)
    graph.set_clock(cpu_clock)


Job = Callable[[], None]
Done = Callable[["asyncio.Future[None]"], None]


class Validators:
    """A bounded pool of validation threads with one FIFO per identity, served in turn."""

    def __init__(self, workers: int = WORKERS) -> None:
        install_clock()
        self.workers = workers
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rpcguard-graph")
        self._running = 0
        # identity -> (queued jobs, [running jobs, when last served]) while it has a job queued or
        # running; the next job is the queued identity's with the fewest running, then the one
        # served longest ago (a newcomer first)
        self._queues: dict[str, tuple[deque[tuple[Job, Done]], list[int]]] = {}
        self._served = 0

    @property
    def waiting(self) -> int:
        return sum(len(q) for q, _ in self._queues.values())

    def submit(self, identity: str, job: Job, done: Done) -> None:
        """Run ``job`` on a worker thread once it is ``identity``'s turn; then ``done(future)``."""
        if identity not in self._queues:
            self._queues[identity] = (deque(), [0, 0])
        self._queues[identity][0].append((job, done))
        self._start()

    def _run(self, job: Job) -> None:
        job()

    def _start(self) -> None:
        loop = asyncio.get_running_loop()
        while self._running < self.workers:
            turns = [(n[0], n[1], i) for i, (q, n) in self._queues.items() if q]
            if not turns:
                return
            identity = min(turns)[2]  # whose turn it is
            queue, running = self._queues[identity]
            self._served += 1
            running[1] = self._served
            job, done = queue.popleft()
            running[0] += 1
            self._running += 1
            future = loop.run_in_executor(self._pool, self._run, job)
            future.add_done_callback(self._callback(identity, done))

    def _callback(self, identity: str, done: Done) -> Callable[[asyncio.Future[None]], None]:
        return lambda future: self._finished(future, identity, done)

    def _finished(self, future: asyncio.Future[None], identity: str, done: Done) -> None:
        self._running -= 1
        queue, running = self._queues[identity]
        running[0] -= 1
        if not queue and not running[0]:
            del self._queues[identity]
        try:
            done(future)
        finally:
            self._start()
