"""Fixtures unit tests share. The router's: each scenario runs on asyncio's event loop and on
uvloop's (Ray's actors run the router on uvloop). The transports': a producer in another process
(kv_producer.py), one per test module."""

from __future__ import annotations

import asyncio

import pytest

from pdcluster.orchestrator.router import Router
from tests.unit.replica_stand_ins import LOOPS, StandIn, post, row, running


@pytest.fixture(params=sorted(LOOPS))
def run(request):
    """run(scenario, timeout): the coroutine function's result, on each event loop."""

    def run(scenario, timeout: float):
        with asyncio.Runner(loop_factory=LOOPS[request.param]) as runner:
            return runner.run(asyncio.wait_for(scenario(), timeout))

    return run


@pytest.fixture
def serve(run):
    """serve(router, stand_ins, body, rows, path): start the stand-ins, point the router at them
    after `rows` (replicas of equal load are chosen in this order), send one request; nothing
    may be left in flight after it."""

    def serve(
        router: Router, stand_ins: dict[str, StandIn], body: dict, rows: list[dict], path: str = "/v1/completions"
    ):
        async def scenario():
            url = await running(router, *stand_ins.values())
            router.update_replicas(rows + [row(rid, rid.split("-")[0], s.url) for rid, s in stand_ins.items()])
            try:
                return await post(url, path, body)
            finally:
                await router.stop()
                for stand_in in stand_ins.values():
                    stand_in.close()

        response, lines = run(scenario, 60)
        assert all(r.inflight_requests == 0 for r in router.replicas.values())  # nothing leaked
        return response, lines

    return serve


@pytest.fixture(scope="module")
def producer_process():
    """(address, control pipe) of a producer process serving the seeded requests (kv_producer.py)."""
    from tests.unit.kv_producer import running_producer

    with running_producer() as producer:
        yield producer
