"""KV cache events of one engine, relayed to the router over the engine's authenticated HTTP app.

vLLM publishes what its prefix cache stores and evicts (`kv_events_config`: a ZMQ PUB socket and a
ROUTER socket that replays recent batches). ZMQ sockets take no credentials, so the engine binds
them to IPC paths in a directory only this user can enter (0700), and the relay, a thread in the
engine's host process, is their only reader:
  - it applies every batch to the engine's cached-block sets (per KV cache group), so it can hand
    a subscriber the whole state at once: a snapshot, then each batch after it;
  - a gap in vLLM's sequence numbers is filled from vLLM's replay socket; a gap replay no longer
    covers leaves the state unknown ("stale", told to subscribers) until vLLM clears the cache;
  - it keeps one root block (no parent) with its tokens, the probe a subscriber checks its own
    hashing against.
`GET /pdcluster/kv_events` (engine key required, like every engine path) streams NDJSON lines:
  {"type": "snapshot", "epoch", "seq", "block_size", "hash_algo", "drops_last_block", "synced", "probe",
   "groups": {group: [hash, ...]}}   (a hash as often as blocks hold it: CachedBlocks)
  {"type": "batch", "seq", "ops": [["s", group, [hash, ...]], ["r", group, [...]], ["c"]]}
  {"type": "heartbeat", "seq"}          (every HEARTBEAT_S without a batch)
  {"type": "stale", "seq"}              (events were lost: the state is unknown)
A subscriber that falls more than LOG_BATCHES behind has its stream ended and resubscribes: its
next snapshot is current. Hashes are the low 64 bits vLLM's events carry.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import threading
import uuid
from collections import Counter, deque
from collections.abc import AsyncIterator
from typing import Any

from pdcluster.compat import external_hash
from pdcluster.pidfds import private_dir

logger = logging.getLogger(__name__)

EVENTS_PATH = "/pdcluster/kv_events"
HEARTBEAT_S = 2.0
LOG_BATCHES = 4096  # batches a subscriber may lag before its stream ends (it resubscribes)
REPLAY_TIMEOUT_MS = 2000
TIERS = (None, "GPU")  # vLLM's device-cache tier (named GPU on every device); offload tiers are not ours


def events_config(directory: str) -> dict[str, Any]:
    """vLLM's KVEventsConfig fields: PUB and replay sockets on private IPC paths."""
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"ipc://{directory}/pub",
        "replay_endpoint": f"ipc://{directory}/replay",
        "topic": "kv",
    }


def decode_batch(payload: bytes) -> list[list[Any]]:
    """One vLLM KVEventBatch (msgpack `[ts, events, dp_rank]`, each event a map tagged "type") as
    our ops; blocks of offload tiers are left out, hashes made ints."""
    import msgspec

    batch = msgspec.msgpack.decode(payload)
    ops: list[list[Any]] = []
    for event in batch[1]:
        kind = event.get("type")
        if kind == "AllBlocksCleared":
            ops.append(["c"])
            continue
        if event.get("medium") not in TIERS:
            continue
        group = event.get("group_idx") or 0
        hashes = [external_hash(h) for h in event.get("block_hashes", ())]
        if kind == "BlockStored":
            op = ["s", group, hashes]
            plain = not any(event.get("extra_keys") or ()) and not event.get("lora_name")
            if event.get("parent_block_hash") is None and plain:
                size = event["block_size"]
                op.append(event["token_ids"][:size])  # a root block's tokens: the probe
            ops.append(op)
        elif kind == "BlockRemoved":
            ops.append(["r", group, hashes])
    return ops


class CachedBlocks:
    """What an engine's prefix cache holds, per KV cache group: `decode_batch`'s ops applied in
    order. vLLM reports physical blocks: BlockStored when one is cached, BlockRemoved when one is
    evicted, and two blocks may carry one hash (an MTP or EAGLE engine recomputes the last block
    of a hit into a new block). So each hash is counted, and held while its count is positive.
    The relay keeps one for its engine, the router one per replica (cache_index.py)."""

    def __init__(self, groups: dict[str, list[int]] | None = None):
        self.groups: dict[int, Counter[int]] = {int(g): Counter(hashes) for g, hashes in (groups or {}).items()}

    def apply(self, op: list[Any]) -> None:
        if op[0] == "c":
            self.groups.clear()
        elif op[0] == "s":
            self.groups.setdefault(op[1], Counter()).update(op[2])
        elif op[0] == "r" and op[1] in self.groups:
            held = self.groups[op[1]]
            for h in op[2]:
                if held[h] > 1:
                    held[h] -= 1
                else:
                    held.pop(h, None)

    def holds(self, h: int, group: int = 0) -> bool:
        return h in self.groups.get(group, ())

    def leading(self, hashes: list[int]) -> int:
        """How many of `hashes` (a prompt's blocks, in order) every group holds from the start:
        a block's hash covers its whole prefix, and vLLM's hit is the least over groups."""
        if not self.groups:
            return 0
        return min(count_leading(hashes, held) for held in self.groups.values())

    def blocks(self) -> int:
        """Physical blocks held (the largest group)."""
        return max((sum(held.values()) for held in self.groups.values()), default=0)

    def to_json(self) -> dict[str, list[int]]:
        return {str(g): sorted(held.elements()) for g, held in self.groups.items()}


def count_leading(hashes: list[int], held) -> int:
    """How many of `hashes` are in `held`, counted from the first until one is not."""
    n = 0
    for h in hashes:
        if h not in held:
            break
        n += 1
    return n


class KVEventRelay:
    """Reads one engine's KV events and serves them to subscribers (see the module docstring)."""

    def __init__(self):
        self.block_size = 0  # the engine's, known once its config is (start)
        self.hash_algo = ""
        self.drops_last_block = False
        self.epoch = uuid.uuid4().hex  # a new relay (engine) is a new history
        # 0700: only this user connects; room for events_config's socket names
        self.directory = private_dir("pdcluster-kvev-", "KV events directory", room=len("replay"))
        self.synced = True
        self.probe: list[Any] | None = None  # [hash, tokens] of a root block
        self._cached = CachedBlocks()
        self._log: deque[tuple[int, list]] = deque(maxlen=LOG_BATCHES)
        self._seq = 0  # our sequence: batches applied
        self._engine_seq = -1  # vLLM's sequence number of the latest batch applied
        self._lock = threading.Lock()
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()
        self._stop = threading.Event()
        self._ending = False  # end_streams: every subscriber's stream ends
        self._thread = threading.Thread(target=self._run, name="kv-event-relay", daemon=True)

    def config(self) -> dict[str, Any]:
        return events_config(self.directory)

    def start(self, block_size: int, hash_algo: str, drops_last_block: bool = False) -> None:
        """`drops_last_block`: the engine recomputes the last block of a hit (MTP, EAGLE)."""
        self.block_size, self.hash_algo, self.drops_last_block = block_size, hash_algo, drops_last_block
        self._thread.start()

    def end_streams(self) -> None:
        """End every subscriber's stream now (the HTTP server is stopping: it waits for every
        open response, and a stream of ours never ends by itself)."""
        with self._lock:
            self._ending = True
            waiters = list(self._waiters)
        for loop, event in waiters:
            loop.call_soon_threadsafe(event.set)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        shutil.rmtree(self.directory, ignore_errors=True)  # its IPC socket files

    # -- reading vLLM's sockets (relay thread) ----------------------------------------------

    def _run(self) -> None:
        import zmq

        ctx = zmq.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(self.config()["endpoint"])
        try:
            while not self._stop.is_set():
                if not sub.poll(200):
                    continue
                _topic, seq_bytes, payload = sub.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq > self._engine_seq + 1:
                    self._fill(ctx, self._engine_seq + 1, seq)
                if seq > self._engine_seq:
                    self._take(seq, payload)
        except Exception:  # noqa: BLE001 - the relay must not take the engine down; subscribers see it stale
            logger.exception("KV event relay stopped; routing to this engine falls back to request history")
            self._mark_stale()
        finally:
            sub.close(linger=0)

    def _fill(self, ctx, start: int, until: int) -> None:
        """Batches [start, until) from vLLM's replay socket; what it no longer holds is lost."""
        import zmq

        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.config()["replay_endpoint"])
        try:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while dealer.poll(REPLAY_TIMEOUT_MS):
                frames = dealer.recv_multipart()
                seq = int.from_bytes(frames[-2], "big", signed=True)
                if seq < 0:
                    break
                if self._engine_seq < seq < until:
                    if seq != self._engine_seq + 1:
                        break  # replay starts past what we miss
                    self._take(seq, frames[-1])
        finally:
            dealer.close(linger=0)
        if self._engine_seq + 1 < until:
            logger.warning(
                "KV events %d-%d of this engine are lost (not in vLLM's replay buffer); its cache state is "
                "unknown until vLLM clears it",
                self._engine_seq + 1,
                until - 1,
            )
            self._mark_stale()

    def _take(self, seq: int, payload: bytes) -> None:
        ops = decode_batch(payload)
        with self._lock:
            self._engine_seq = seq
            for op in ops:
                self._apply(op)
            self._seq += 1
            self._log.append((self._seq, ops))
        self._wake()

    def _apply(self, op: list[Any]) -> None:
        self._cached.apply(op)
        if op[0] == "c":
            self.synced = True  # an empty cache is a known state again
        elif op[0] == "s" and self.probe is None and len(op) > 3 and len(op[3]) == self.block_size:
            self.probe = [op[2][0], op[3]]

    def _mark_stale(self) -> None:
        with self._lock:
            self.synced = False
            self._seq += 1
            self._log.append((self._seq, [["stale"]]))
        self._wake()

    def _wake(self) -> None:
        for waiter in list(self._waiters):
            loop, event = waiter
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # its event loop has closed: nobody reads that stream any more
                self._waiters.discard(waiter)

    # -- serving subscribers (the HTTP app's event loop) -----------------------------------

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "type": "snapshot",
                "epoch": self.epoch,
                "seq": self._seq,
                "block_size": self.block_size,
                "hash_algo": self.hash_algo,
                "drops_last_block": self.drops_last_block,
                "synced": self.synced,
                "probe": self.probe,
                "groups": self._cached.to_json(),
            }

    def since(self, seq: int) -> list[tuple[int, list]] | None:
        """Batches after `seq`; None when the log no longer reaches back that far."""
        with self._lock:
            if self._seq == seq:
                return []
            if not self._log or self._log[0][0] > seq + 1:
                return None
            return [entry for entry in self._log if entry[0] > seq]

    async def stream(self) -> AsyncIterator[bytes]:
        waiter = (asyncio.get_running_loop(), asyncio.Event())
        self._waiters.add(waiter)
        try:
            snapshot = self.snapshot()
            last = snapshot["seq"]
            yield _line(snapshot)
            while not self._ending:
                try:
                    async with asyncio.timeout(HEARTBEAT_S):
                        await waiter[1].wait()
                except asyncio.TimeoutError:
                    yield _line({"type": "heartbeat", "seq": last})
                    continue
                waiter[1].clear()
                if self._ending:
                    return
                batches = self.since(last)
                if batches is None:
                    return  # fell behind: the subscriber resubscribes and gets a fresh snapshot
                for seq, ops in batches:
                    last = seq
                    yield _line({"type": "stale" if ops == [["stale"]] else "batch", "seq": seq, "ops": ops})
        finally:
            self._waiters.discard(waiter)


def _line(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"
