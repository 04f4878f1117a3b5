"""vLLM's shared-memory step queues wake a sleeping reader with a ZMQ ping; ours must not drop it.

Two real processes talk over vLLM's MessageQueue the way an engine core and its worker do (two
messages per step, one answer), with no spin, so every read sleeps and depends on its ping. A
lost ping leaves the reader asleep until its re-check, set here far beyond the test's timeout:
the test fails instead of waiting. Without compat.keep_queue_pings most such rounds lose one.
"""

from __future__ import annotations

import multiprocessing as mp

import pytest

ROUNDS = 200
RECHECK_MS = 600_000  # a lost ping would sleep this long
ROUND_TIMEOUT_S = 60


def _queues_as_in_an_engine():
    from vllm.distributed.device_communicators import shm_broadcast

    from pdcluster import compat

    compat.set_queue_reader_spin(0, RECHECK_MS)  # never spin: every read waits for its ping
    compat.keep_queue_pings()
    assert compat.queue_reader_spin() == (0, RECHECK_MS) and compat.queue_pings_kept()
    return shm_broadcast


def _worker_side(steps_handle, answers_handles):
    shm_broadcast = _queues_as_in_an_engine()
    steps = shm_broadcast.MessageQueue.create_from_handle(steps_handle, 0)
    answers = shm_broadcast.MessageQueue(1, 1)
    answers_handles.put(answers.export_handle())
    answers.wait_until_ready()
    steps.wait_until_ready()
    while (execute := steps.dequeue(timeout=ROUND_TIMEOUT_S)) is not None:
        sample = steps.dequeue(timeout=ROUND_TIMEOUT_S)
        answers.enqueue((execute, sample))


def test_a_sleeping_reader_gets_every_ping(monkeypatch):
    import inspect

    import zmq
    from vllm.distributed.device_communicators import shm_broadcast as vllm_queues

    # This process's vLLM queues get vLLM's spin, re-check and SpinCondition back afterwards.
    monkeypatch.setattr(vllm_queues, "SHM_READER_RECHECK_INTERVAL_MS", vllm_queues.SHM_READER_RECHECK_INTERVAL_MS)
    monkeypatch.setattr(vllm_queues.SpinCondition, "__init__", vllm_queues.SpinCondition.__init__)
    init = inspect.unwrap(vllm_queues.SpinCondition.__init__)
    monkeypatch.setattr(init, "__defaults__", init.__defaults__)
    shm_broadcast = _queues_as_in_an_engine()

    steps = shm_broadcast.MessageQueue(1, 1)
    assert steps._spin_condition.local_notify_socket.getsockopt(zmq.SNDHWM) > 1
    spawn = mp.get_context("spawn")
    handles = spawn.Queue()
    worker = spawn.Process(target=_worker_side, args=(steps.export_handle(), handles), daemon=True)
    worker.start()
    try:
        answers = shm_broadcast.MessageQueue.create_from_handle(handles.get(timeout=120), 0)
        steps.wait_until_ready()
        answers.wait_until_ready()
        for step in range(ROUNDS):
            steps.enqueue(("execute", step))
            steps.enqueue(("sample", step))
            try:
                answer = answers.dequeue(timeout=ROUND_TIMEOUT_S)
            except TimeoutError:
                pytest.fail(f"round {step}: a wake-up ping was lost (no answer in {ROUND_TIMEOUT_S} s)")
            assert answer == (("execute", step), ("sample", step))
        steps.enqueue(None)
        worker.join(timeout=60)
        assert worker.exitcode == 0
    finally:
        if worker.is_alive():
            worker.kill()
