"""proxy.validators.Validators: at most ``workers`` validations at once, identities served in turn;
and the graph validators' clock it installs (thread CPU time outside the garbage collector)."""

from __future__ import annotations

import asyncio
import gc
import threading
import time

from rpcguard.protocol import graph
from rpcguard.protocol.encode import graph_payload
from rpcguard.protocol.graph import GraphValidator
from rpcguard.protocol.settings import FirewallPolicy
from rpcguard.proxy import validators
from rpcguard.proxy.validators import Validators
from tests.unit.protocol.test_graph import OPS, T, state


def test_one_identitys_flood_does_not_hold_back_another_identitys_graph():
    order: list[str] = []
    gate = threading.Event()

    def job(name: str):
        def run() -> None:
            if name == "a1":
                gate.wait(5)  # the flood's first graph is running when the others arrive
            order.append(name)
        return run

    async def main() -> None:
        v = Validators(workers=1)
        done: list[str] = []
        finished = asyncio.Event()

        def on_done(name: str):
            def cb(future) -> None:
                assert future.exception() is None
                done.append(name)
                if len(done) == 5:
                    finished.set()
            return cb

        for name in ("a1", "a2", "a3", "a4"):
            v.submit("attacker", job(name), on_done(name))
        v.submit("tenant", job("b1"), on_done("b1"))
        assert v.waiting == 4  # a1 runs, one at a time
        gate.set()
        await asyncio.wait_for(finished.wait(), 10)
        assert order == ["a1", "b1", "a2", "a3", "a4"]  # the tenant's turn came right after a1
        assert done == order and v.waiting == 0

    asyncio.run(main())


def test_a_failing_validation_is_handed_to_its_callback_and_the_next_one_runs():
    async def main() -> None:
        v = Validators(workers=1)
        results: list[object] = []
        finished = asyncio.Event()

        def boom() -> None:
            raise RuntimeError("bug")

        def cb(future) -> None:
            results.append(future.exception())
            if len(results) == 2:
                finished.set()

        v.submit("a", boom, cb)
        v.submit("a", lambda: None, cb)
        await asyncio.wait_for(finished.wait(), 10)
        assert isinstance(results[0], RuntimeError) and results[1] is None

    asyncio.run(main())


def test_the_pool_installs_the_validators_clock_once():
    graph.set_clock(None)
    gc.callbacks[:] = [cb for cb in gc.callbacks if cb is not validators._on_gc]
    try:
        Validators(workers=1)
        Validators(workers=1)
        assert graph._CLOCK[0] is validators.cpu_clock
        assert gc.callbacks.count(validators._on_gc) == 1
    finally:
        graph.set_clock(validators.cpu_clock)


def test_a_garbage_collection_during_validation_is_not_charged_to_the_graph():
    # CI once refused a 1-node sigmoid graph "validation took more than 500 ms of CPU": a full
    # collection of the test process's heap ran inside the check. The collector's time is the
    # process's, not the graph's: a collection that burns 0.3 s inside a 0.2 s budget is excluded.
    validators.install_clock()
    leaves = [T(0x10 + i, i) for i in range(4)]
    nodes = [T(0x100000 + j, 4 + j % 4000, op=OPS["ADD"], src=(0x10 + j % 4, 0x10 + (j + 1) % 4)) for j in range(600)]
    payload = memoryview(graph_payload([t.id for t in nodes], leaves + nodes))
    starts = []

    def slow_collection(phase: str, info: dict) -> None:
        if phase == "start":
            starts.append(1)
            if len(starts) == 2000:  # well inside check(), which starts thousands of collections here
                end = time.thread_time() + 0.3
                while time.thread_time() < end:
                    pass

    validator = GraphValidator(FirewallPolicy(max_graph_nodes=1 << 16, max_graph_tensors=1 << 16, max_graph_cpu_s=0.2))
    threshold = gc.get_threshold()
    gc.callbacks.append(slow_collection)  # after the clock's own callback: its burn is inside a collection
    gc.set_threshold(1)  # the first allocation inside check() starts a collection
    try:
        validator.check(payload, state())
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(slow_collection)
    assert len(starts) > 4000  # the slow collection ran inside check(), not at its edges
