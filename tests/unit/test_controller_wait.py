"""The controller's readiness wait (Controller.wait_ready), on the controller object itself (no
Ray: these calls touch only its replica table): `up` returns once nothing is starting, and
`scale --wait` asks again only after the table changed, instead of asking back to back while a
replica drains (nothing starting: the plain wait returns at once)."""

from __future__ import annotations

import asyncio

from pdcluster.config import validate_config
from pdcluster.orchestrator.controller import Controller

CONFIG = validate_config({"model": {"path": "models/pdcluster-tiny-code"}}, "test")


def test_a_wait_for_a_change_returns_only_once_the_replica_table_changed():
    async def scenario() -> tuple[bool, bool, bool]:
        controller = Controller(CONFIG.model_dump_json(), "secret")
        at_once = await asyncio.wait_for(controller.wait_ready(30), timeout=5)  # nothing starting
        waiting = asyncio.create_task(controller.wait_ready(30, change=True))
        for _ in range(20):
            await asyncio.sleep(0)  # the waiter runs up to its wait
        early = waiting.done()
        await controller._publish()  # what a state change does (no router yet: only the waiters)
        return at_once, early, await asyncio.wait_for(waiting, timeout=5)

    at_once, early, after_change = asyncio.run(scenario())
    assert at_once is True
    assert early is False  # nothing changed yet
    assert after_change is True


def test_a_wait_for_a_change_gives_up_at_its_timeout():
    async def scenario() -> bool:
        controller = Controller(CONFIG.model_dump_json(), "secret")
        return await controller.wait_ready(0.2, change=True)

    assert asyncio.run(scenario()) is False
