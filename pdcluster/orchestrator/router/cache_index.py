"""What each replica's KV cache holds, as the router knows it: the input of cache-aware routing
(orchestrator/policies.py, `cache_aware`).

Two sources, per replica:
  - **events** (precise): the replica's engine relays vLLM's KV cache events (engine/kv_events.py);
    a follower task keeps one authenticated stream per replica, starts from the relay's snapshot,
    applies every batch, and resubscribes (a fresh snapshot) on a gap in the sequence, a broken
    stream or silence longer than STALE_S. The index of a replica that leaves the table is dropped.
  - **history** (approximate): the blocks of the prompts the router itself sent the replica, the
    latest HISTORY_BLOCKS of them. Used while the replica's events are not in sync (not yet
    connected, reconnecting, stale) or when the router's hashes fail the relay's probe.
A prompt's blocks are hashed once per request, with vLLM's own function (compat.block_hasher)
over the prompt's token ids; a replica holds the prompt's leading blocks up to the first one it
lacks (a block's hash covers its whole prefix). Its hit counts as vLLM's KV cache manager counts
it (Prompt.cached_cap): whole blocks short of the prompt's last token, one fewer where the engine
recomputes a hit's last block for its drafter (MTP, EAGLE).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx

from pdcluster.engine.kv_events import EVENTS_PATH, HEARTBEAT_S, CachedBlocks, count_leading

logger = logging.getLogger(__name__)

HISTORY_BLOCKS = 65536  # per replica: ~1M prompt tokens at vLLM's default block size of 16
STALE_S = 5 * HEARTBEAT_S  # a stream silent this long is reopened
RETRY_S = (0.2, 5.0)  # reconnect pause: first, longest (doubling)
INLINE_HASH_TOKENS = 4096  # longer prompts are hashed off the event loop
# Hashing for history when no replica publishes events: vLLM's default block size and algorithm.
HISTORY_ONLY = {"block_size": 16, "hash_algo": "history"}  # no engine's: history_hashes below


def history_hashes(token_ids: list[int], block_size: int, cache_salt: str | None = None) -> list[int]:
    """Chained hashes of the prompt's full blocks for matching the router's own request history
    (while no replica publishes events): only compared with each other, so any stable chained
    hash serves, and vLLM's (which costs a vLLM import) is not needed. A cache_salt starts the
    chain (as the engine's, its blocks match only the same salt's)."""
    hashes, parent = [], hashlib.sha256(cache_salt.encode()).digest() if cache_salt else b""
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hashlib.sha256(parent + array("q", token_ids[start : start + block_size]).tobytes()).digest()
        hashes.append(int.from_bytes(parent[:8], "little"))
    return hashes


@dataclass
class Prompt:
    """One request's prompt as cache-aware routing sees it: its token ids (None when the router
    cannot know them exactly: several prompts, multimodal parts, no tokenizer), their count, and
    its block hashes once CacheIndex.prepare computed them."""

    ids: list[int] | None
    count: int
    hashes: list[int] = field(default_factory=list)
    block_size: int = 0
    cache_salt: str | None = None  # the request's: part of its first block's hash

    def cached_cap(self, blocks: int, drops_last_block: bool = False) -> int:
        """Prompt tokens an engine holding `blocks` leading blocks would not compute, as vLLM's
        KV cache manager counts its hit: whole blocks within all but the last prompt token (which
        is always computed), less the last one for engines that recompute it (MTP, EAGLE)."""
        usable = min(blocks, (self.count - 1) // self.block_size) if self.block_size else 0
        if drops_last_block and usable:
            usable -= 1
        return usable * self.block_size


@dataclass
class ReplicaCache:
    """One replica's cached blocks (see the module docstring)."""

    replica_id: str
    cached: CachedBlocks = field(default_factory=CachedBlocks)
    synced: bool = False  # events state current (snapshot applied, no gap since)
    epoch: str = ""
    seq: int = 0
    probe: list[Any] | None = None  # [hash, tokens] of a root block, from the relay
    verified: bool | None = None  # whether our hashing gives the probe's hash (None: not checked)
    history: OrderedDict[int, None] = field(default_factory=OrderedDict)
    events: bool = True  # False: the replica's engine publishes none (404)
    drops_last_block: bool = False  # its engine recomputes a hit's last block (MTP, EAGLE)

    def apply(self, message: dict[str, Any]) -> bool:
        """Apply one line of the relay's stream; False when it cannot be applied in order (a gap:
        the caller resubscribes for a fresh snapshot)."""
        kind = message.get("type")
        if kind == "snapshot":
            if message["epoch"] != self.epoch:
                self.verified = None
            self.epoch, self.seq = message["epoch"], message["seq"]
            self.cached = CachedBlocks(message["groups"])
            self.probe = message.get("probe") or self.probe
            self.drops_last_block = bool(message.get("drops_last_block"))
            self.synced = bool(message["synced"])
            return True
        if kind == "heartbeat":
            return message["seq"] == self.seq
        if message.get("seq") != self.seq + 1:
            self.synced = False
            return False
        self.seq += 1
        if kind == "stale":
            self.synced = False
            return True
        for op in message["ops"]:
            self.cached.apply(op)
            if op[0] == "c":
                self.synced = True
            elif op[0] == "s" and self.probe is None and len(op) > 3:
                self.probe = [op[2][0], op[3]]
        return True

    def remember(self, hashes: Iterable[int]) -> None:
        for h in hashes:
            self.history[h] = None
            self.history.move_to_end(h)
        while len(self.history) > HISTORY_BLOCKS:
            self.history.popitem(last=False)

    def source(self) -> str:
        """Where this replica's matches come from now: `events` or `history`."""
        return "events" if self.synced and self.verified is not False and self.events else "history"

    def leading(self, hashes: list[int]) -> int:
        """How many of the prompt's leading blocks this replica holds."""
        if self.source() == "events":
            return self.cached.leading(hashes)
        return count_leading(hashes, self.history)


class CacheIndex:
    """Every replica's ReplicaCache, their event followers, and prompt hashing."""

    def __init__(self) -> None:
        self.replicas: dict[str, ReplicaCache] = {}
        self._followers: dict[str, tuple[str, asyncio.Task]] = {}
        self.block_size = 0  # the cluster's (KV-compatible engines share it), from a snapshot
        self.hash_algo = ""
        self._provisional = False  # block size and algorithm are HISTORY_ONLY's, not an engine's
        self._hasher: Callable[..., list[int]] | None = None  # (ids, block size, cache salt) -> hashes
        self._hasher_loading: asyncio.Future | None = None
        self.http: httpx.AsyncClient | None = None  # the router's client: it carries the engine key

    @property
    def hashing(self) -> str:
        """The hash algorithm prompts are matched with ("" until the hasher has loaded)."""
        return self.hash_algo if self._hasher is not None else ""

    # -- membership ------------------------------------------------------------------------

    def follow(self, rows: list[dict[str, Any]]) -> None:
        """Follow the events of every replica in the table that has a URL; stop following and
        drop the index of those that left (or changed URL: a new engine)."""
        wanted = {row["replica_id"]: row["url"] for row in rows if row.get("url")}
        for rid, (url, task) in list(self._followers.items()):
            if wanted.get(rid) != url:
                task.cancel()
                del self._followers[rid]
                self.replicas.pop(rid, None)
        for rid, url in wanted.items():
            if rid not in self._followers and self.http is not None:
                cache = self.replicas.setdefault(rid, ReplicaCache(rid))
                self._followers[rid] = (url, asyncio.ensure_future(self._follow(cache, url)))
        for rid in list(self.replicas):
            if rid not in wanted:
                del self.replicas[rid]

    async def close(self) -> None:
        tasks = [task for _, task in self._followers.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._followers.clear()

    async def _follow(self, cache: ReplicaCache, url: str) -> None:
        """Keep `cache` in step with the replica's relay until cancelled."""
        assert self.http is not None
        pause, reported = RETRY_S[0], False
        timeout = httpx.Timeout(STALE_S, connect=5.0)
        while True:
            try:
                async with self.http.stream("GET", url + EVENTS_PATH, timeout=timeout) as resp:
                    if resp.status_code == 404:
                        cache.events = False
                        logger.info(
                            "replica %s publishes no KV events: cache-aware routing uses history", cache.replica_id
                        )
                        self._learn(HISTORY_ONLY, provisional=True)
                        return
                    if resp.status_code != 200:
                        raise httpx.HTTPStatusError(f"HTTP {resp.status_code}", request=resp.request, response=resp)
                    async for line in resp.aiter_lines():
                        message = json.loads(line)
                        if message.get("type") == "snapshot":
                            self._learn(message)
                        if not cache.apply(message):
                            break  # a gap: resubscribe for a fresh snapshot
                        if cache.synced:
                            pause, reported = RETRY_S[0], False
            except Exception as exc:  # noqa: BLE001 - a malformed event too: the follower must outlive it
                if not reported:
                    logger.warning(
                        "KV events of replica %s interrupted (%s: %s); resubscribing, history meanwhile",
                        cache.replica_id,
                        type(exc).__name__,
                        exc,
                    )
                    reported = True
            cache.synced = False
            await asyncio.sleep(pause)  # reconnect backoff
            pause = min(pause * 2, RETRY_S[1])

    def _learn(self, snapshot: dict[str, Any], provisional: bool = False) -> None:
        """The cluster's block size and hash algorithm, from the first snapshot (history alone
        works with any: HISTORY_ONLY until a snapshot comes); the hasher (vLLM's own,
        compat.block_hasher) loads in a thread: importing vLLM takes seconds."""
        if self.hash_algo and (provisional or not self._provisional):
            return
        self._provisional = provisional
        self.block_size = int(snapshot["block_size"])
        if provisional:  # no engine's hashes to equal: no vLLM import for history alone
            self.hash_algo, self._hasher = str(snapshot["hash_algo"]), history_hashes
            return
        self.hash_algo, self._hasher = str(snapshot["hash_algo"]), None
        self._hasher_loading = asyncio.get_running_loop().run_in_executor(None, self._load_hasher)

    def _load_hasher(self) -> None:
        from pdcluster import compat

        try:
            self._hasher = compat.block_hasher(self.hash_algo)
        except (compat.VLLMShapeError, compat.UntestedVLLMError, ValueError, ImportError) as exc:
            logger.warning("router cannot hash prompts as the engines do (%s): cache-aware routing is off", exc)

    # -- matching --------------------------------------------------------------------------

    async def prepare(self, prompt: Prompt) -> None:
        """Hash the prompt's blocks (no-op until the hasher is loaded or for unknown ids)."""
        if self._hasher is None or prompt.ids is None:
            return
        prompt.block_size = self.block_size
        if len(prompt.ids) <= INLINE_HASH_TOKENS:
            prompt.hashes = self._hasher(prompt.ids, self.block_size, prompt.cache_salt)
        else:
            prompt.hashes = await asyncio.to_thread(self._hasher, prompt.ids, self.block_size, prompt.cache_salt)

    def cached_tokens(self, replica_id: str, prompt: Prompt | None) -> int:
        """Tokens of `prompt` the replica would not compute (its prefix-cache hit)."""
        cache = self.replicas.get(replica_id)
        if cache is None or prompt is None or not prompt.hashes:
            return 0
        self._verify(cache)
        return prompt.cached_cap(cache.leading(prompt.hashes), cache.drops_last_block)

    def sent(self, replica_id: str, prompt: Prompt | None) -> None:
        """The prompt goes to this replica: its blocks join the replica's history."""
        cache = self.replicas.get(replica_id)
        if cache is not None and prompt is not None and prompt.hashes:
            cache.remember(prompt.hashes)

    def _verify(self, cache: ReplicaCache) -> None:
        if cache.verified is not None or cache.probe is None or self._hasher is None:
            return
        digest, tokens = cache.probe
        cache.verified = self._hasher(tokens, len(tokens)) == [digest]
        if not cache.verified:
            logger.warning(
                "replica %s hashes its cache blocks differently from the router (hash seed or algorithm): "
                "its matches come from request history",
                cache.replica_id,
            )

    def summary(self) -> dict[str, dict[str, Any]]:
        """Per replica: where matches come from, blocks known, history size (status, /metrics)."""
        return {
            rid: {"source": c.source(), "blocks": c.cached.blocks(), "history": len(c.history), "synced": c.synced}
            for rid, c in self.replicas.items()
        }
