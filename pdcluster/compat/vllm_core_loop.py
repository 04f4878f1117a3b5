"""vLLM's engine-core loop between steps: wait for the KV connector instead of stepping every 1 ms.

A step that ran no model while the scheduler still holds requests is followed by a 1 ms sleep
and the next step. An engine whose requests all wait on the connector (a decode request admitted
ahead of its prefill waits the whole prefill, hundreds of ms; a finished prefill holds its blocks
until decode releases them) steps ~1,000 times a second meanwhile, each step scheduling nothing,
calling the connector and sending the front end a stats message: a core's worth of work on a
host where the prefill beside it needs every cycle. Applied by our plugin (pdcluster/vllm_plugin.py)
in engine processes pdcluster launched; whether an engine may wait, and what wakes it, is the
connector's (kv_transfer/colocated.py). The same hook tells the connector when a step's outputs
are queued, the moment it wakes the consumers of the leases that step filed.
"""

from __future__ import annotations

import functools
import inspect
import queue
from collections.abc import Callable
from typing import Any

from pdcluster.compat.guard import VLLMShapeError, expect_attributes, expect_parameters, resolve

CORE = "vllm.v1.engine.core"


def check_core_loop() -> Callable:
    """Shape check of what wait_between_idle_steps relies on; returns the original post_step."""
    core, proc = resolve(CORE, "EngineCore"), resolve(CORE, "EngineCoreProc")
    post_step = inspect.unwrap(core.post_step)
    expect_parameters(post_step, f"{CORE}.EngineCore.post_step", ["self", "model_executed"])
    step = inspect.getsource(inspect.unwrap(proc._process_engine_step))
    at_post, at_sleep = step.find("self.post_step(model_executed)"), step.find("time.sleep(0.001)")
    at_put = step.find("self.output_queue.put_nowait(")
    if at_post < 0 or at_sleep < at_post or "self.scheduler.has_requests()" not in step:
        raise VLLMShapeError(f"{CORE}.EngineCoreProc._process_engine_step: no post_step before its 1 ms idle sleep")
    if at_put < 0 or at_put > at_post:
        raise VLLMShapeError(f"{CORE}.EngineCoreProc._process_engine_step: its outputs are not queued before post_step")
    expect_attributes(proc, f"{CORE}.EngineCoreProc", ["_handle_client_request"])
    if not hasattr(resolve("vllm.v1.engine", "EngineCoreRequestType"), "WAKEUP"):
        raise VLLMShapeError("vllm.v1.engine.EngineCoreRequestType has no WAKEUP")
    status = resolve("vllm.v1.request", "RequestStatus")
    expect_attributes(status, "vllm.v1.request.RequestStatus", ["WAITING_FOR_REMOTE_KVS", "is_finished"])
    return post_step


@functools.cache
def _request_status() -> Any:
    return resolve("vllm.v1.request", "RequestStatus")


def only_awaiting_kv(scheduler: Any) -> bool:
    """Does every request the scheduler holds wait on the KV connector alone: loading its KV
    (WAITING_FOR_REMOTE_KVS, its load not yet reported) or finished, its blocks held for a
    consumer? Nothing else may be pending (finished ids to tell the workers, reported loads).

    Upstream: `Scheduler.running`, `.requests`, `.finished_req_ids`,
    `.finished_recving_kv_req_ids`, `.failed_recving_kv_req_ids`; `Request.status`;
    `RequestStatus.WAITING_FOR_REMOTE_KVS` and `RequestStatus.is_finished`."""
    if (
        scheduler.running
        or scheduler.finished_req_ids
        or scheduler.finished_recving_kv_req_ids
        or scheduler.failed_recving_kv_req_ids
    ):
        return False
    status = _request_status()
    return all(
        r.status == status.WAITING_FOR_REMOTE_KVS or status.is_finished(r.status) for r in scheduler.requests.values()
    )


def wait_between_idle_steps(
    wait_for: Callable[[Any, Any], float | None], outputs_queued: Callable[[], None] | None = None
) -> None:
    """After a step that ran no model while the scheduler holds requests, wait on the engine
    core's input queue up to `wait_for(scheduler, input_queue)` seconds (None: not at all) before vLLM's own
    1 ms sleep and the next step; an item that arrives meanwhile (a request, an abort, the
    connector's `wakeup_item`) ends the wait and is handled as the loop would. `outputs_queued`
    is called after every step, its outputs already queued for the front end. Idempotent.

    Upstream: `EngineCore.post_step(self, model_executed)`, which
    `EngineCoreProc._process_engine_step` calls right after putting the step's outputs on
    `output_queue` and right before `time.sleep(0.001)` when no model
    ran and `scheduler.has_requests()`; `EngineCore.scheduler`, `EngineCoreProc.input_queue` and
    `_handle_client_request` (how the loop takes an item). Why: see the module docstring."""
    post_step = check_core_loop()
    core = resolve(CORE, "EngineCore")
    if getattr(core.post_step, "_pdcluster_idle_wait", False):
        return

    @functools.wraps(post_step)
    def patched(self, model_executed: bool) -> None:
        post_step(self, model_executed)
        if outputs_queued is not None:
            outputs_queued()
        if model_executed or not hasattr(self, "input_queue") or not self.scheduler.has_requests():
            return
        timeout = wait_for(self.scheduler, self.input_queue)
        if timeout is None:
            return
        try:
            item = self.input_queue.get(timeout=timeout)
        except queue.Empty:
            return
        self._handle_client_request(*item)

    patched._pdcluster_idle_wait = True  # type: ignore[attr-defined]
    core.post_step = patched


@functools.cache
def wakeup_item() -> tuple[Any, None]:
    """The input-queue item that only wakes the engine core (`EngineCoreRequestType.WAKEUP`,
    vLLM's own no-op item: the loop takes it and does nothing)."""
    return (resolve("vllm.v1.engine", "EngineCoreRequestType").WAKEUP, None)
