"""proxy.validators.Validators: at most ``workers`` validations at once, identities served in turn."""

from __future__ import annotations

import asyncio
import threading

from rpcguard.proxy.validators import Validators


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
