"""The engine-side relay of KV cache events (engine/kv_events.py) against vLLM's own ZMQ
publisher, and the router's per-replica index (cache_index.py) applying what the relay serves."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from pdcluster.engine import kv_events
from pdcluster.engine.kv_events import CachedBlocks, KVEventRelay, decode_batch
from pdcluster.orchestrator.router.cache_index import HISTORY_BLOCKS, Prompt, ReplicaCache

WAIT_S = 20.0


def stored(hashes, parent=None, tokens=None, block_size=4, medium="GPU"):
    from vllm.distributed.kv_events import BlockStored

    tokens = tokens if tokens is not None else list(range(block_size * len(hashes)))
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=block_size,
        lora_id=None,
        medium=medium,
        lora_name=None,
    )


def removed(hashes, medium="GPU"):
    from vllm.distributed.kv_events import BlockRemoved

    return BlockRemoved(block_hashes=hashes, medium=medium)


def batch(*events):
    from vllm.distributed.kv_events import KVEventBatch

    return KVEventBatch(ts=time.time(), events=list(events))


@pytest.fixture
def relay():
    found = KVEventRelay()
    yield found
    found.stop()


def publisher(relay: KVEventRelay, buffer_steps: int = 100):
    from vllm.distributed.kv_events import ZmqEventPublisher

    config = relay.config()
    return ZmqEventPublisher(
        0, endpoint=config["endpoint"], replay_endpoint=config["replay_endpoint"], buffer_steps=buffer_steps, topic="kv"
    )


def until(condition, what: str, within: float = WAIT_S) -> bool:
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            assert within < WAIT_S, f"timed out waiting for {what}"
            return False
        time.sleep(0.01)
    return True


def sent(relay: KVEventRelay, seq: int) -> None:
    """Until vLLM's publisher has sent batch `seq` (it sends a batch, then keeps it for replay):
    asked on its replay socket, as a subscriber would."""
    import zmq

    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(relay.config()["replay_endpoint"])
    try:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            dealer.send_multipart([b"", seq.to_bytes(8, "big")])
            frames = dealer.recv_multipart()
            last = -1
            while int.from_bytes(frames[-2], "big", signed=True) >= 0:
                last = int.from_bytes(frames[-2], "big", signed=True)
                frames = dealer.recv_multipart()
            if last >= seq:
                return
        raise AssertionError(f"vLLM's publisher did not send batch {seq}")
    finally:
        dealer.close(linger=0)


def publish_until_live(pub, relay: KVEventRelay, first_hash: int, published_before: int) -> None:
    """Publish a batch at a time until one reaches the relay live (its SUB connects to the
    publisher's socket in the background: batches before that are not delivered to it), and with
    it whatever the relay fills in before it. `published_before`: batches `pub` sent earlier, so
    the first sent here has that sequence number (a batch replayed from before does not count)."""
    h = first_hash
    for _ in range(int(WAIT_S / 0.2)):
        pub.publish(batch(stored([h])))
        h += 1
        if until(lambda: relay._engine_seq >= published_before, "a live batch", within=0.2):
            return
    raise AssertionError("no batch reached the relay")


def test_vllm_batches_decode_to_ops_without_offload_tiers():
    from msgspec.msgpack import Encoder
    from vllm.distributed.kv_events import AllBlocksCleared

    payload = Encoder().encode(
        batch(
            stored([b"\x00" * 24 + (7).to_bytes(8, "big"), 9], tokens=[1, 2, 3, 4, 5, 6, 7, 8]),
            stored([11], parent=9),
            stored([12], medium="CPU"),
            removed([9]),
            AllBlocksCleared(),
        )
    )
    assert decode_batch(payload) == [
        ["s", 0, [7, 9], [1, 2, 3, 4]],  # a root block: the probe's tokens come along
        ["s", 0, [11]],
        ["r", 0, [9]],
        ["c"],
    ]


def test_the_relay_fills_a_gap_from_vllms_replay_and_serves_a_snapshot(relay):
    """Batches published before the relay's subscription took hold are replayed, in order."""
    pub = publisher(relay)
    try:
        pub.publish(batch(stored([1, 2])))
        pub.publish(batch(stored([3]), removed([1])))
        relay.start(4, "sha256")
        publish_until_live(pub, relay, 100, published_before=2)  # the first two come from vLLM's replay
        snap = relay.snapshot()
        assert snap["synced"] and snap["block_size"] == 4 and snap["hash_algo"] == "sha256"
        held = set(snap["groups"]["0"])
        assert {2, 3} <= held and 1 not in held
        assert snap["probe"] == [1, [0, 1, 2, 3]]
    finally:
        pub.shutdown()


def test_events_replay_no_longer_holds_make_the_relay_stale_until_a_clear(relay):
    from vllm.distributed.kv_events import AllBlocksCleared

    pub = publisher(relay, buffer_steps=2)
    try:
        for h in range(5):
            pub.publish(batch(stored([h])))
        sent(relay, 4)  # all gone by before the relay subscribes: none reaches it live
        relay.start(4, "sha256")
        publish_until_live(pub, relay, 5, published_before=5)  # replay holds only the last 2 of the 5 it missed
        assert not relay.snapshot()["synced"]
        pub.publish(batch(AllBlocksCleared(), stored([42])))
        until(lambda: relay.snapshot()["synced"], "the clear")
        assert relay.snapshot()["groups"] == {"0": [42]}
    finally:
        pub.shutdown()


def test_a_subscriber_gets_a_snapshot_then_batches_and_is_ended_when_it_falls_behind(monkeypatch):
    monkeypatch.setattr(kv_events, "LOG_BATCHES", 3)
    lagging = KVEventRelay()
    pub = publisher(lagging)

    async def scenario():
        lagging.start(4, "sha256")
        stream = lagging.stream()
        first = json.loads(await stream.__anext__())
        assert first["type"] == "snapshot" and first["seq"] == 0
        await asyncio.get_running_loop().run_in_executor(None, publish_until_live, pub, lagging, 1, 0)
        line = json.loads(await asyncio.wait_for(stream.__anext__(), WAIT_S))
        while line["type"] == "heartbeat":
            line = json.loads(await asyncio.wait_for(stream.__anext__(), WAIT_S))
        assert line["type"] == "batch" and line["seq"] == 1 and line["ops"][0][:2] == ["s", 0]
        for h in range(2, 8):  # more than the log holds while this subscriber does not read
            pub.publish(batch(stored([h])))
        last = lagging._engine_seq + 6
        await asyncio.get_running_loop().run_in_executor(
            None, until, lambda: lagging._engine_seq == last, "the batches"
        )
        with pytest.raises(StopAsyncIteration):
            while True:  # what it may still read, then the end: it resubscribes
                json.loads(await asyncio.wait_for(stream.__anext__(), WAIT_S))

    try:
        asyncio.run(scenario())
    finally:
        pub.shutdown()
        lagging.stop()


def test_the_index_applies_in_order_and_refuses_a_gap():
    cache = ReplicaCache("r")
    snap = {"type": "snapshot", "epoch": "e1", "seq": 4, "synced": True, "probe": None, "groups": {"0": [1, 2]}}
    assert cache.apply(snap) and cache.synced and cache.source() == "events"
    assert cache.apply({"type": "heartbeat", "seq": 4})
    assert cache.apply({"type": "batch", "seq": 5, "ops": [["s", 0, [3]], ["r", 0, [1]]]})
    assert cache.cached.to_json() == {"0": [2, 3]}
    assert not cache.apply({"type": "batch", "seq": 7, "ops": [["s", 0, [9]]]})  # 6 is missing
    assert not cache.synced and cache.source() == "history" and not cache.cached.holds(9)
    assert cache.apply({**snap, "seq": 9, "groups": {"0": [9]}})
    assert not cache.apply({"type": "heartbeat", "seq": 8})  # the relay is elsewhere: resubscribe
    assert cache.apply({**snap, "seq": 9, "groups": {"0": [9]}})
    assert cache.apply({"type": "stale", "seq": 10, "ops": [["stale"]]}) and cache.source() == "history"
    assert cache.apply({"type": "batch", "seq": 11, "ops": [["c"], ["s", 0, [5]]]}) and cache.source() == "events"
    assert cache.cached.to_json() == {"0": [5]}


def test_a_hash_two_blocks_carry_stays_held_until_both_are_evicted():
    """vLLM reports each physical block: an MTP engine recomputes a hit's last block into a new
    one with the same hash, and evicting one of the two leaves the other cached."""
    held = CachedBlocks()
    for op in (["s", 0, [1, 2]], ["s", 0, [2]], ["r", 0, [2]]):
        held.apply(op)
    assert held.leading([1, 2]) == 2 and held.blocks() == 2
    held.apply(["r", 0, [2]])
    assert held.leading([1, 2]) == 1 and held.to_json() == {"0": [1]}
    held.apply(["r", 0, [7]])  # a block it never saw stored: nothing to take away
    assert held.to_json() == {"0": [1]}


def test_matching_counts_leading_blocks_held_by_every_group_and_caps_at_the_last_token():
    cache = ReplicaCache("r")
    cache.apply({"type": "snapshot", "epoch": "e", "seq": 0, "synced": True, "probe": None, "groups": {"0": [1, 2, 3]}})
    assert cache.leading([1, 2, 4, 3]) == 2
    cache.cached.apply(["s", 1, [1]])
    assert cache.leading([1, 2, 4, 3]) == 1  # vLLM's hit is the least over KV cache groups
    aligned = Prompt(list(range(256)), 256, [1, 2], block_size=128)
    assert aligned.cached_cap(2) == 128  # the last prompt token is always computed: not its block
    longer = Prompt(list(range(300)), 300, [1, 2], block_size=128)
    assert longer.cached_cap(2) == 256 and longer.cached_cap(1) == 128
    assert longer.cached_cap(2, drops_last_block=True) == 128  # MTP/EAGLE engines recompute one
    assert longer.cached_cap(0, drops_last_block=True) == 0


def test_history_keeps_the_latest_blocks_and_serves_when_events_are_not_in_sync():
    cache = ReplicaCache("r")
    cache.remember(range(HISTORY_BLOCKS + 10))
    assert len(cache.history) == HISTORY_BLOCKS and 0 not in cache.history and HISTORY_BLOCKS + 9 in cache.history
    assert cache.source() == "history" and cache.leading([10, 11, 5]) == 2
    cache.apply({"type": "snapshot", "epoch": "e", "seq": 0, "synced": True, "probe": None, "groups": {}})
    assert cache.source() == "events" and cache.leading([10, 11]) == 0
    cache.verified = False  # our hashing disagrees with the engine's: events cannot be matched
    assert cache.source() == "history"
