"""The router's process freezes its startup heap once it listens (router/app.py, freeze_startup_heap):
a full garbage collection over what its imports left would pause every stream it relays."""

from __future__ import annotations

import gc

from pdcluster.orchestrator.router import RouterSettings
from pdcluster.orchestrator.router.app import RouterActor
from tests.unit.replica_stand_ins import ENGINE_TOKEN


def test_the_router_process_freezes_its_startup_heap(run):
    gc.unfreeze()  # this test process's heap, as a fresh router process's: nothing frozen yet
    actor = RouterActor(RouterSettings(model_name="tiny", engine_token=ENGINE_TOKEN))

    async def scenario():
        try:
            await actor.start("127.0.0.1", 0)
            return gc.get_freeze_count()
        finally:
            await actor.router.stop()

    try:
        assert run(scenario, 60) > 0
    finally:
        gc.unfreeze()  # the next tests' objects stay collectable
