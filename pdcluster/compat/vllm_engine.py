"""vLLM engine internals: the CPU worker and executor choice (engine/single_process.py), the
scheduler's Request (kv_transfer/scheduler.py), and the stat-logger interface (engine/stats.py).
"""

from __future__ import annotations

import inspect
from typing import Any

from pdcluster.compat.guard import (
    VLLMShapeError,
    expect_attributes,
    expect_parameters,
    require_tested_vllm,
    resolve,
)

# -- the CPU worker and the executor (engine/single_process.py) -----------------------------

CPU_WORKER = "vllm.v1.worker.cpu_worker"


def cpu_worker_base() -> type:
    """vLLM's CPU worker class, for SingleProcessCPUWorker to subclass.

    Upstream: `vllm.v1.worker.cpu_worker.CPUWorker.init_device`, which binds the OpenMP threads
    and then replaces `torch.set_num_threads` with a no-op. Why: a single-process engine binds
    the engine-core thread and sets torch's thread count itself, so it must do that before
    CPUWorker.init_device runs; we check that init_device still disables set_num_threads, the
    ordering our subclass relies on."""
    worker = resolve(CPU_WORKER, "CPUWorker")
    symbol = f"{CPU_WORKER}.CPUWorker.init_device"
    if "init_device" not in worker.__dict__:
        raise VLLMShapeError(f"{symbol} is not defined on CPUWorker itself")
    try:
        source = inspect.getsource(worker.init_device)
    except (OSError, TypeError) as exc:
        raise VLLMShapeError(f"{symbol}: source unavailable to check its ordering ({exc})") from exc
    if "torch.set_num_threads =" not in source:
        raise VLLMShapeError(f"{symbol} no longer replaces torch.set_num_threads")
    return worker


def cpu_worker_name() -> str:
    """The `worker_cls` string vLLM's CPU platform means by its own CPU worker."""
    worker = cpu_worker_base()
    return f"{worker.__module__}.{worker.__qualname__}"


def parse_cpu_list(mask: str) -> list[int]:
    """Cores of a core list ('0-2,4'), read as vLLM reads VLLM_CPU_OMP_THREADS_BIND.

    Upstream: `vllm.utils.cpu_resource_utils.parse_id_list` (a vLLM utility, no API promise).
    Why: the single-process engine must bind exactly the cores vLLM's worker would have.
    Raises ValueError for an unreadable list."""
    parse = resolve("vllm.utils.cpu_resource_utils", "parse_id_list")
    expect_parameters(parse, "vllm.utils.cpu_resource_utils.parse_id_list", ["raw_str"])
    return parse(mask)


def expect_executor_backend(value: str) -> None:
    """VLLMShapeError unless `value` is one of vLLM's distributed executor backends."""
    from typing import get_args

    backends = get_args(resolve("vllm.config.parallel", "DistributedExecutorBackend"))
    if value not in backends:
        raise VLLMShapeError(f"vllm.config.parallel.DistributedExecutorBackend has no {value!r}: {backends}")


def executor_choice(vllm_config: Any) -> tuple[int, str | None, str]:
    """(world_size, distributed_executor_backend, worker_cls) of a finished engine config.

    Upstream: `vllm.config.ParallelConfig` fields, as the platform left them in
    `AsyncEngineArgs.create_engine_config` (the CPU platform sets backend "mp")."""
    parallel = vllm_config.parallel_config
    expect_attributes(
        parallel, "vllm.config.ParallelConfig", ["world_size", "distributed_executor_backend", "worker_cls"]
    )
    return parallel.world_size, parallel.distributed_executor_backend, parallel.worker_cls


def run_model_in_engine_core(vllm_config: Any, worker_cls: str) -> None:
    """Switch a finished engine config to vLLM's in-process executor with `worker_cls`.

    Upstream: `ParallelConfig.distributed_executor_backend = "uni"` (UniProcExecutor: the worker
    runs in the engine-core process) and `ParallelConfig.worker_cls`, changed after the platform's
    `check_and_update_config` already ran; vLLM reads them only when the engine core builds its
    executor. Why: see engine/single_process.py."""
    expect_executor_backend("uni")
    executor_choice(vllm_config)
    vllm_config.parallel_config.distributed_executor_backend = "uni"
    vllm_config.parallel_config.worker_cls = worker_cls


# -- the scheduler's request (kv_transfer/scheduler.py) -------------------------------------

_REQUEST_FIELDS = ("prompt_token_ids", "_all_token_ids", "num_prompt_tokens", "max_tokens")


def truncate_prompt(request: Any, n: int) -> None:
    """Drop the last `n` prompt tokens of a waiting request and make it stop after one token.

    Upstream: `vllm.v1.request.Request.prompt_token_ids`, `._all_token_ids` (the private list
    behind `all_token_ids` and `num_tokens`), `.num_prompt_tokens` and `.max_tokens`, mutated
    exactly as vLLM's own `NixlBaseConnectorScheduler._truncate_request_for_prefill` does.
    Why: the MTP prefill backoff (scheduler `_truncate_for_prefill`): with a multi-module MTP
    drafter the prefill engine must stop short of the drafter's lookahead window, whose KV would
    otherwise hold unverified drafts; the decode engine recomputes those tokens. A Request has
    no API to be shortened."""
    require_tested_vllm()
    expect_attributes(request, "vllm.v1.request.Request", _REQUEST_FIELDS)
    if not isinstance(request._all_token_ids, list) or not isinstance(request.prompt_token_ids, list):
        raise VLLMShapeError("vllm.v1.request.Request: prompt_token_ids / _all_token_ids are not lists")
    del request.prompt_token_ids[-n:]
    del request._all_token_ids[-n:]
    request.num_prompt_tokens -= n
    request.max_tokens = 1


def extend_prompt(request: Any, token_id: int) -> None:
    """Append one token to the prompt of a request that has computed nothing yet.

    Upstream: `vllm.v1.request.Request.prompt_token_ids`, `._all_token_ids` (the private list
    behind `all_token_ids` and `num_tokens`), `.num_prompt_tokens` and `update_block_hashes()`
    (the hash of a block the token completes), the same fields `truncate_prompt` shortens.
    Why: a decode request admitted before its prefill answered (router.decode_ahead) carries
    the prompt; the prefill's first token arrives with the lease and becomes the last prompt
    token, so that decode computes its KV and samples the second token. The model runner reads
    prompt_token_ids when the request is first scheduled, which is after this."""
    require_tested_vllm()
    expect_attributes(request, "vllm.v1.request.Request", (*_REQUEST_FIELDS, "num_computed_tokens", "prompt_embeds"))
    if not isinstance(request._all_token_ids, list) or not isinstance(request.prompt_token_ids, list):
        raise VLLMShapeError("vllm.v1.request.Request: prompt_token_ids / _all_token_ids are not lists")
    if request.prompt_embeds is not None or len(request._all_token_ids) != request.num_prompt_tokens:
        raise VLLMShapeError("extend_prompt: the request has prompt embeddings or output tokens")
    request.prompt_token_ids.append(int(token_id))
    request._all_token_ids.append(int(token_id))
    request.num_prompt_tokens += 1
    request.update_block_hashes()


def blocks_and_local_hit(blocks: Any) -> tuple[list[int], int]:
    """A request's block ids in token order (one KV cache group: unpacking raises on more) and
    how many leading ones its local prefix cache supplied.

    Upstream: `vllm.v1.core.kv_cache_manager.KVCacheBlocks.blocks` and `KVCacheBlock.block_id /
    block_hash / is_null`, as the connector hook `update_state_after_alloc` receives them, and
    vLLM's scheduler delaying the caching of an asynchronous load's blocks (`delay_cache_blocks`):
    the blocks of the local hit are hashed then, the newly allocated ones not yet. vLLM's NIXL
    connector reads its hit the same way. Why: the hit is known without remembering what
    `get_num_new_matched_tokens` was asked, which must have no side effects."""
    (group,) = blocks.blocks
    cached = 0
    for block in group:
        if block.block_hash is None or block.is_null:
            break
        cached += 1
    return [block.block_id for block in group], cached


def check_blocks_shape() -> None:
    """blocks_and_local_hit on real vLLM blocks: one hashed, one fresh."""
    block_cls = resolve("vllm.v1.core.kv_cache_utils", "KVCacheBlock")
    blocks_cls = resolve("vllm.v1.core.kv_cache_manager", "KVCacheBlocks")
    hashed, fresh = block_cls(7), block_cls(9)
    expect_attributes(
        hashed, "vllm.v1.core.kv_cache_utils.KVCacheBlock", ("block_id", "block_hash", "is_null", "set_block_hash")
    )
    hashed.set_block_hash(b"pdcluster-shape-check")
    if blocks_and_local_hit(blocks_cls(([hashed, fresh],))) != ([7, 9], 1):
        raise VLLMShapeError("KVCacheBlocks / KVCacheBlock: the local hit is not read off the blocks as expected")


def check_request_shape() -> None:
    """truncate_prompt on a real vLLM Request: it must come out shortened."""
    request_cls = resolve("vllm.v1.request", "Request")
    sampling = resolve("vllm.sampling_params", "SamplingParams")
    request = request_cls(
        request_id="pdcluster-shape-check",
        prompt_token_ids=[1, 2, 3, 4],
        sampling_params=sampling(max_tokens=8),
        pooling_params=None,
    )
    truncate_prompt(request, 2)
    if list(request.all_token_ids) != [1, 2] or request.num_prompt_tokens != 2 or request.max_tokens != 1:
        raise VLLMShapeError("vllm.v1.request.Request: truncating its token lists no longer shortens it")


def check_extend_shape() -> None:
    """extend_prompt on a real vLLM Request with a block hasher: one more prompt token, and the
    block it completes hashed."""
    request_cls = resolve("vllm.v1.request", "Request")
    sampling = resolve("vllm.sampling_params", "SamplingParams")

    def hasher(request: Any) -> list[int]:  # one "hash" per full block of 2 not yet hashed
        full = len(request.all_token_ids) // 2
        return list(range(len(request.block_hashes), full))

    request = request_cls(
        request_id="pdcluster-shape-check",
        prompt_token_ids=[1, 2, 3],
        sampling_params=sampling(max_tokens=8),
        pooling_params=None,
        block_hasher=hasher,
    )
    extend_prompt(request, 4)
    if list(request.all_token_ids) != [1, 2, 3, 4] or request.num_prompt_tokens != 4 or len(request.block_hashes) != 2:
        raise VLLMShapeError("vllm.v1.request.Request: extending its token lists no longer lengthens it")


# -- stats (engine/stats.py) ---------------------------------------------------------------

STAT_LOGGER = "vllm.v1.metrics.loggers.StatLoggerBase"
SCHEDULER_STATS_FIELDS = (
    "num_running_reqs",
    "num_waiting_reqs",
    "num_skipped_waiting_reqs",
    "kv_cache_usage",
    "spec_decoding_stats",
    "kv_connector_stats",
    "prefix_cache_stats",
)
SPEC_STATS_FIELDS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
PREFIX_STATS_FIELDS = ("queries", "hits")


def stat_logger_base() -> type:
    """vLLM's stat-logger base class, for EngineStatsRecorder to subclass.

    Upstream: `vllm.v1.metrics.loggers.StatLoggerBase.record(scheduler_stats, iteration_stats,
    mm_cache_stats, engine_idx)` and the `SchedulerStats` / `SpecDecodingStats` fields we read
    (vLLM says these stats classes are not stable). Why: AsyncLLM's `stat_loggers` is how an
    engine host sees its engine's gauges and connector stats after every step."""
    import dataclasses

    base = resolve("vllm.v1.metrics.loggers", "StatLoggerBase")
    expect_parameters(
        base.record,
        f"{STAT_LOGGER}.record",
        ["self", "scheduler_stats", "iteration_stats", "mm_cache_stats", "engine_idx"],
    )
    expect_attributes(base, STAT_LOGGER, ["log_engine_initialized"])
    for name, fields in (
        ("SchedulerStats", SCHEDULER_STATS_FIELDS),
        ("SpecDecodingStats", SPEC_STATS_FIELDS),
        ("PrefixCacheStats", PREFIX_STATS_FIELDS),
    ):
        cls = resolve("vllm.v1.metrics.stats", name)
        found = {f.name for f in dataclasses.fields(cls)}
        missing = [f for f in fields if f not in found]
        if missing:
            raise VLLMShapeError(f"vllm.v1.metrics.stats.{name}: missing fields {missing}")
    return base
