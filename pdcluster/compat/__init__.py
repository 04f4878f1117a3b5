"""Every reach into vLLM's (and torch's) unpromised internals, in one place, behind a version check.

pdcluster calls vLLM's public interfaces (AsyncLLM, AsyncEngineArgs, KVConnectorBase_V1, the
`vllm.general_plugins` entry point, ...) directly. Whatever else it needs of vLLM -- a private
attribute, a module global, a signature or an ordering vLLM does not promise to keep -- goes
through one function of this package, and callers import it from here. Each such function
- names in its docstring the upstream symbol(s) it depends on and why pdcluster needs it;
- runs only on a tested vLLM (`TESTED_VLLM`, checked once per process by `require_tested_vllm`;
  another version raises `UntestedVLLMError` unless PDCLUSTER_ALLOW_UNTESTED_VLLM=1 makes it a
  logged warning);
- checks the symbol's shape (attributes, parameters) and raises `VLLMShapeError` naming the
  symbol when it differs, instead of patching something that is no longer what we fixed.
`shape_problems()` runs every shape check against the installed vLLM (tests/unit/test_vllm_compat.py).

Process-level patches (vLLM's step queues) are applied only in processes pdcluster launches:
`EngineSpec.env()` sets ENGINE_MARKER_ENV for every engine, the engine-core and worker processes
vLLM starts inherit it, and our plugin (`vllm_plugin.register`) does nothing without it, so a
stock `vllm serve` in the same venv stays stock.

The reaches, by module:
  vllm_queues    set_queue_reader_spin, keep_queue_pings   (shm_broadcast.SpinCondition, its
                 SHM_READER_RECHECK_INTERVAL_MS): vllm_plugin.py
  vllm_core_loop wait_between_idle_steps, only_awaiting_kv, wakeup_item (EngineCore.post_step,
                 EngineCoreProc.input_queue / output_queue / _handle_client_request, EngineCoreRequestType.WAKEUP,
                 the Scheduler's request sets, RequestStatus): vllm_plugin.py, kv_transfer/colocated.py
  vllm_engine    cpu_worker_base, parse_cpu_list, executor_choice, run_model_in_engine_core
                 (CPUWorker.init_device, parse_id_list, ParallelConfig): engine/single_process.py,
                 engine/cpu_bind.py;
                 truncate_prompt, extend_prompt (Request._all_token_ids ...), blocks_and_local_hit
                 (KVCacheBlocks.blocks, KVCacheBlock.block_hash): kv_transfer/scheduler.py;
                 stat_logger_base (StatLoggerBase.record, SchedulerStats): engine/stats.py
  vllm_prefix    block_hasher (kv_cache_utils.hash_block_tokens, resolve_none_hash_seed,
                 hashing.get_hash_fn_by_name): orchestrator/router/cache_index.py;
                 drops_last_cached_block (SpeculativeConfig.use_eagle_block_drop): engine/host.py
  vllm_frontend  openai_frontend_args, build_openai_app, attach_server (launchers' make_arg_parser,
                 build_app, init_app_state, app.state.server), platform_device (current_platform): engine/host.py;
                 answer_vllm_version_lookup (cli.main's version lookup): vllm_cli.py
  vllm_sampling  fix_cpu_spec_sampling (rejection_sampler.expand_batch_to_tokens,
                 apply_sampling_constraints): vllm_plugin.py
  torch_dist     gloo_pair_group, nccl_pair_group, hccl_pair_group (ProcessGroup*._Options /
                 Options, _timeout, _devices): kv_transfer/transports/collective.py
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pdcluster.compat.guard import (
    ALLOW_UNTESTED_ENV,
    ENGINE_MARKER_ENV,
    TESTED_VLLM,
    UntestedVLLMError,
    VLLMShapeError,
    check_vllm_version,
    installed_vllm_version,
    is_pdcluster_engine_process,
    require_tested_vllm,
)
from pdcluster.compat.torch_dist import gloo_options, gloo_pair_group, hccl_pair_group, nccl_pair_group
from pdcluster.compat.vllm_core_loop import check_core_loop, only_awaiting_kv, wait_between_idle_steps, wakeup_item
from pdcluster.compat.vllm_engine import (
    blocks_and_local_hit,
    check_blocks_shape,
    check_extend_shape,
    check_request_shape,
    cpu_worker_base,
    cpu_worker_name,
    executor_choice,
    expect_executor_backend,
    extend_prompt,
    parse_cpu_list,
    run_model_in_engine_core,
    stat_logger_base,
    truncate_prompt,
)
from pdcluster.compat.vllm_frontend import (
    answer_vllm_version_lookup,
    app_builders,
    attach_server,
    build_openai_app,
    check_attach_server,
    cli_main,
    openai_frontend_args,
    platform_device,
)
from pdcluster.compat.vllm_prefix import block_hasher, check_block_hasher, drops_last_cached_block, external_hash
from pdcluster.compat.vllm_queues import (
    PING_HWM,
    keep_queue_pings,
    queue_pings_kept,
    queue_reader_spin,
    set_queue_reader_spin,
)
from pdcluster.compat.vllm_sampling import check_spec_sampling, fix_cpu_spec_sampling


def _parse_check() -> None:
    if parse_cpu_list("2,0-1") != [0, 1, 2]:
        raise VLLMShapeError("vllm.utils.cpu_resource_utils.parse_id_list('2,0-1') != [0, 1, 2]")


def shape_checks() -> dict[str, Callable[[], Any]]:
    """Each reach's shape check against the installed vLLM / torch (none patches anything)."""
    return {
        "vllm version": require_tested_vllm,
        "set_queue_reader_spin / keep_queue_pings": queue_reader_spin,
        "wait_between_idle_steps / only_awaiting_kv / wakeup_item": check_core_loop,
        "cpu_worker_base": cpu_worker_base,
        "parse_cpu_list": _parse_check,
        "run_model_in_engine_core": lambda: expect_executor_backend("uni"),
        "truncate_prompt": check_request_shape,
        "extend_prompt": check_extend_shape,
        "blocks_and_local_hit": check_blocks_shape,
        "stat_logger_base": stat_logger_base,
        "openai_frontend_args": lambda: openai_frontend_args(["--model", "m", "--port", "0"]),
        "build_openai_app": app_builders,
        "attach_server": check_attach_server,
        "platform_device": platform_device,
        "answer_vllm_version_lookup": cli_main,
        "gloo_pair_group": gloo_options,
        "block_hasher": check_block_hasher,
        "fix_cpu_spec_sampling": check_spec_sampling,
    }


def shape_problems() -> dict[str, str]:
    """Reach name -> what differs, for every shape check that fails (empty: all fit)."""
    problems = {}
    for name, check in shape_checks().items():
        try:
            check()
        except (VLLMShapeError, UntestedVLLMError) as exc:
            problems[name] = str(exc)
    return problems


__all__ = [
    "ALLOW_UNTESTED_ENV",
    "ENGINE_MARKER_ENV",
    "PING_HWM",
    "TESTED_VLLM",
    "UntestedVLLMError",
    "VLLMShapeError",
    "answer_vllm_version_lookup",
    "attach_server",
    "block_hasher",
    "blocks_and_local_hit",
    "build_openai_app",
    "check_vllm_version",
    "drops_last_cached_block",
    "cli_main",
    "cpu_worker_base",
    "cpu_worker_name",
    "executor_choice",
    "extend_prompt",
    "external_hash",
    "fix_cpu_spec_sampling",
    "gloo_pair_group",
    "hccl_pair_group",
    "installed_vllm_version",
    "is_pdcluster_engine_process",
    "keep_queue_pings",
    "nccl_pair_group",
    "only_awaiting_kv",
    "openai_frontend_args",
    "parse_cpu_list",
    "platform_device",
    "queue_pings_kept",
    "queue_reader_spin",
    "require_tested_vllm",
    "run_model_in_engine_core",
    "set_queue_reader_spin",
    "shape_checks",
    "shape_problems",
    "stat_logger_base",
    "truncate_prompt",
    "wait_between_idle_steps",
    "wakeup_item",
]
