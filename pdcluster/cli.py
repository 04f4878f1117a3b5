"""pdcluster command line: up | down | status | scale | config | bench.

Every command prints what the user asked for on stdout; a bad input (config error, unknown
cluster, invalid argument) is one line on stderr and exit code 2; a runtime failure exit code 1.
`parse_args(argv)` is importable so tests drive the same parser.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from pdcluster.errors import ConfigError, PDClusterError, one_line, root_cause

EXIT_BAD_INPUT = 2
EXIT_FAILURE = 1


# The command's own output stream once Ray is connected (ray_connect); None before.
_command_stdout = None
_joined_ray = False  # this process joined Ray as a driver (run() ends it without teardown)


def out(text: str = "") -> None:
    """User-facing output (not logging): the only writer to stdout once Ray is connected."""
    stream = _command_stdout or sys.stdout
    stream.write(text + "\n")
    stream.flush()


def ray_connect(session) -> None:
    """Join the session's Ray as a driver: the local head `up` started with its token, a cluster
    `up` joined with the operator's own Ray settings. Ray's driver prints every cluster-wide error
    (a node marked dead, a worker killed) to sys.stdout from a thread of its own, whatever
    log_to_driver says (ray/_private/worker.py listen_error_messages): from here on sys.stdout is
    stderr, so those lines reach the operator there and stdout carries only out()'s, e.g.
    `status --json`."""
    global _command_stdout, _joined_ray
    import ray

    from pdcluster.orchestrator.session import set_ray_auth

    if session.head_pid is not None:  # ours
        set_ray_auth(os.environ, session.ray_token_path)
        # Ray read its settings (RayConfig) and cached any token as it was imported: read them
        # again with ours, as Ray's own token setup does (authentication_token_setup.py).
        from ray._raylet import AuthenticationTokenLoader, Config

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()

    if _command_stdout is None:
        _command_stdout, sys.stdout = sys.stdout, sys.stderr
    _joined_ray = True
    ray.init(
        address=session.ray_address, namespace=session.namespace, log_to_driver=False, logging_level=logging.WARNING
    )


def _ray_disconnect() -> None:
    """Leave Ray, whose leftover error lines flush on the way out (still to stderr), then give
    sys.stdout back."""
    global _command_stdout
    if _command_stdout is None:
        return
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
    sys.stdout, _command_stdout = _command_stdout, None


class _Parser(argparse.ArgumentParser):
    """An invalid argument is one line, as every bad input is (argparse prints its usage first);
    its subcommands' parsers are of this class too."""

    def error(self, message: str):
        sys.stderr.write(f"{self.prog}: {message} (see {self.prog} --help)\n")
        sys.exit(EXIT_BAD_INPUT)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pdcluster", description="Disaggregated prefill/decode serving on Ray + vLLM.")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="launch a cluster from a YAML file")
    up.add_argument("config", type=Path)
    up.add_argument("--foreground", action="store_true", help="stay attached; Ctrl-C shuts everything down")
    up.add_argument("--timeout", type=float, default=900, help="seconds to wait for readiness")

    down = sub.add_parser("down", help="stop a cluster (router, actors, controller, local Ray head)")
    down.add_argument("--name")

    status = sub.add_parser("status", help="replica table and endpoint")
    status.add_argument("--name")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument(
        "--watch",
        type=_seconds,
        metavar="SECONDS",
        help="print it again whenever it changes, looking at least every SECONDS, until Ctrl-C (--json: a line each)",
    )
    status.add_argument(
        "--timeout", type=_seconds, default=60, metavar="SECONDS", help="give up on a controller that does not answer"
    )

    scale = sub.add_parser("scale", help="set the number of replicas of a role, live")
    scale.add_argument("role", choices=["prefill", "decode", "aggregated"])
    scale.add_argument("replicas", type=int)
    scale.add_argument("--name")
    scale.add_argument("--wait", action="store_true", help="return once the pool has settled")
    scale.add_argument("--timeout", type=float, default=900)

    config = sub.add_parser("config", help="config file tools")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    validate = config_sub.add_parser("validate", help="print 'ok' or the first problems, by YAML path")
    validate.add_argument("file", type=Path)
    config_sub.add_parser("schema", help="print the JSON schema of the cluster YAML")

    bench = sub.add_parser("bench", help="serving benchmark (see pdcluster bench --help)")
    bench.add_argument("args", nargs=argparse.REMAINDER)
    return parser


def _seconds(text: str) -> float:
    with contextlib.suppress(ValueError):
        if float(text) > 0:  # not NaN
            return float(text)
    raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds > 0")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        # Everything after it is bench/serve.py's: argparse's REMAINDER refuses options ("--quick")
        # when nothing precedes them.
        return argparse.Namespace(command="bench", args=argv[1:])
    return build_parser().parse_args(argv)


# -- commands --------------------------------------------------------------------------------


def cmd_config(args: argparse.Namespace) -> int:
    from pdcluster.config import json_schema
    from pdcluster.config_files import load_config

    if args.config_command == "schema":
        out(json.dumps(json_schema(), indent=2))
        return 0
    load_config(args.file)
    out("ok")
    return 0


def _get(ref) -> Any:
    """ray.get of a controller call; a pdcluster error raised by it, or by a call it made in turn,
    reaches the user as its own one line."""
    import ray

    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as exc:
        cause = root_cause(exc)
        if isinstance(cause, PDClusterError):
            raise cause from None
        raise


def _connect(session) -> Any:
    import ray

    from pdcluster.orchestrator.session import controller_name

    if not ray.is_initialized():
        ray_connect(session)
    try:
        return ray.get_actor(controller_name(session.name), namespace=session.namespace)
    except ValueError:
        raise ConfigError(f"cluster {session.name!r} has no controller (stale session; run pdcluster down)") from None


def cmd_up(args: argparse.Namespace) -> int:
    import ray

    from pdcluster.config_files import load_config, new_secret, read_credentials
    from pdcluster.orchestrator.controller import Controller
    from pdcluster.orchestrator.placement import orchestrator_options, orchestrator_placement, unplaceable
    from pdcluster.orchestrator.session import Session, controller_name, start_local_head, state_home, write_ray_token

    config = load_config(args.config)
    existing = state_home() / f"{config.name}.json"
    if existing.exists():
        raise ConfigError(f"cluster {config.name!r} is already up (pdcluster down --name {config.name} first)")
    secret, api_keys = read_credentials(config)  # a missing or empty file stops `up` here, in one line
    secret = secret or new_secret()

    head_pid = token_path = None
    if config.ray.address:
        address = config.ray.address
        out(f"joining Ray cluster at {address}")
    else:
        out("starting a local Ray head ...")
        token_path = write_ray_token(config.name)
        log_path = state_home() / "logs" / f"{config.name}-ray-head.log"
        try:
            address, head_pid = start_local_head(config.ray.num_cpus, log_path, token_path=token_path)
        except BaseException:
            Path(token_path).unlink(missing_ok=True)
            raise
    session = Session(
        config.name,
        address,
        config.ray.namespace,
        head_pid=head_pid,
        config_path=str(args.config),
        ray_token_path=token_path,
    )
    session.save()
    controller = None
    try:
        ray_connect(session)
        # The controller and the router go to the head (or router.placement): a node none can
        # be is refused here, before Ray would queue the controller forever.
        problem = unplaceable(*orchestrator_placement(config.router.placement), ray.nodes())
        if problem:
            raise ConfigError(f"router.placement: {problem}")
        controller = (
            ray.remote(Controller)
            .options(
                name=controller_name(config.name),
                namespace=config.ray.namespace,
                lifetime="detached",
                max_restarts=-1,  # Ray restarts it where it died; it takes its cluster back (recovery.py)
                max_concurrency=100,
                **orchestrator_options(config.router.placement),
            )
            .remote(config.model_dump_json(), secret, api_keys)
        )
        session.endpoint = _get(controller.start.remote())
        session.save()
        # The roles configured with replicas: a disaggregated cluster's decode may serve alone
        needed = {role for role in config.serving_roles() if config.role(role).replicas > 0}
        if not _await_ready(controller, args.timeout, needed):
            raise PDClusterError("cluster did not become ready; see the replica errors above")
    except BaseException:
        _teardown(session, controller_started=controller is not None)
        raise
    out(f"pdcluster {config.name} ready: {session.endpoint}")
    if not args.foreground:
        return 0
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    session.foreground_pid = os.getpid()
    session.save()
    out("serving in the foreground; Ctrl-C (or pdcluster down) stops the cluster")
    stop.wait()
    out("shutting down ...")
    _teardown(session)
    out("stopped")
    return 0


def _await_ready(controller, timeout_s: float, needed: set[str]) -> bool:
    """Await readiness, showing each replica's stage as it changes."""
    import ray

    deadline = time.monotonic() + timeout_s
    shown: dict[str, str] = {}
    started = time.monotonic()
    while True:
        ready = ray.get(controller.wait_ready.remote(2.0))
        status = ray.get(controller.status.remote())
        for row in status["replicas"]:
            label = row["stage"] if row["state"] != "dead" else f"dead: {row['error']}"
            if shown.get(row["replica"]) != label:
                shown[row["replica"]] = label
                out(f"  [{time.monotonic() - started:5.1f}s] {row['replica']:<14} {label}")
        if ready:
            serving = {r["role"] for r in status["replicas"] if r["state"] == "ready"}
            return needed <= serving
        if time.monotonic() > deadline:
            return False


def _teardown(session, controller_started: bool = True) -> None:
    """Stop the cluster's controller (it stops the engines and the router), then the Ray head we
    started, and remove the record; `controller_started=False`: `up` failed before creating one."""
    import ray

    from pdcluster.orchestrator.recovery import end_cluster
    from pdcluster.orchestrator.session import stop_process_group

    log = logging.getLogger(__name__)
    left: BaseException | None = None  # a controller that may still run (on a cluster we joined)
    try:
        if controller_started and session.ray_address and (ray.is_initialized() or session.head_pid is None):
            controller = _connect(session)
            try:
                ray.get(controller.shutdown.remote(), timeout=180)
            except ray.exceptions.RayError as exc:  # failed or hung: killed all the same
                log.warning("controller shutdown: %s; killing it (and then what it left)", exc)
            try:
                ray.kill(controller, no_restart=True)
            except (ray.exceptions.RayError, ConnectionError) as exc:
                left = exc
    except (ConfigError, ray.exceptions.RayError, ConnectionError) as exc:
        log.warning("controller shutdown: %s", exc)
    finally:
        if ray.is_initialized() and session.head_pid is None and left is None:
            end_cluster(session.name, session.namespace)  # detached actors the controller left
        if ray.is_initialized():
            ray.shutdown()
        if session.head_pid is not None:
            stop_process_group(session.head_pid)  # everything on our own head goes with it
        elif left is not None:  # the record stays, for `down` to try again
            raise PDClusterError(f"cluster {session.name!r}: its controller could not be stopped: {left}")
        session.remove()


def notice(text: str) -> None:
    """A one-line notice on stderr (not logging)."""
    sys.stderr.write(f"pdcluster: {text}\n")


def cmd_down(args: argparse.Namespace) -> int:
    from pdcluster.orchestrator.session import Session

    session = Session.load(args.name, notice if args.name is None else None)
    if session.is_stale():
        session.remove()
        out(f"pdcluster {session.name}: its Ray ({session.ray_address}) is gone; removed its record")
        return 0
    if session.foreground_pid is not None and session.stop_foreground(notice):
        out(f"pdcluster {session.name} stopped (its foreground `up` shut it down)")
        return 0
    _connect_quietly(session)
    _teardown(session)
    out(f"pdcluster {session.name} stopped")
    return 0


def _connect_quietly(session) -> None:
    if session.head_pid is not None:
        from pdcluster.pidfds import group_running

        if not group_running(session.head_pid):
            return  # the head is gone already: nothing to connect to
    ray_connect(session)


def cmd_status(args: argparse.Namespace) -> int:
    import ray

    from pdcluster.orchestrator.session import Session
    from pdcluster.orchestrator.status import ask, format_status, watched

    render = (lambda s: json.dumps(s, indent=None if args.watch else 2, default=str)) if args.json else format_status
    session = Session.load(args.name, notice)
    controller = _connect(session)
    if args.watch is None:
        out(render(ask(controller.status.remote, args.timeout)))
        return 0
    try:
        # One connection to Ray for the whole watch (each `status` joins Ray: ~1 CPU-second).
        for text in watched(controller, args.watch, render, args.timeout):
            out(text if args.json else text + "\n")
    except KeyboardInterrupt:
        return 0  # how a watch ends
    except ray.exceptions.RayActorError:
        raise PDClusterError(f"cluster {session.name!r}: its controller is gone (the cluster was stopped)") from None


def cmd_scale(args: argparse.Namespace) -> int:
    import ray

    from pdcluster.orchestrator.session import Session

    if args.replicas < 0:
        raise ConfigError("replicas must be ≥ 0")
    session = Session.load(args.name, notice)
    controller = _connect(session)
    result = _get(controller.scale.remote(args.role, args.replicas))
    out(
        f"{args.role}: {args.replicas} replicas (adding {result['added'] or 'none'}, draining {result['draining'] or 'none'})"
    )
    if result.get("unplaced"):
        notice(f"{args.role}: cannot place a replica now: {result['unplaced']} (added once a node fits)")
    if args.wait:
        deadline = time.monotonic() + args.timeout
        change = False  # the first look at once; then each after the replica table changes
        while True:
            ray.get(controller.wait_ready.remote(2.0, change))
            change = True
            rows = [r for r in ray.get(controller.status.remote())["replicas"] if r["role"] == args.role]
            settled = (
                all(r["state"] in ("ready", "dead") for r in rows)
                and sum(r["state"] == "ready" for r in rows) == args.replicas
            )
            if settled:
                break
            if time.monotonic() > deadline:
                raise PDClusterError(f"{args.role} did not settle at {args.replicas} replicas in time")
        out(f"{args.role}: settled at {args.replicas} ready replicas")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    import runpy

    script = Path(__file__).resolve().parent.parent / "bench" / "serve.py"
    if not script.exists():
        raise ConfigError("bench/serve.py not found (run from a source checkout)")
    bench = runpy.run_path(str(script), run_name="pdcluster_bench")  # its module; main() not run yet
    return bench["main"](args.args, prog="pdcluster bench")  # its usage names the command typed


COMMANDS = {
    "up": cmd_up,
    "down": cmd_down,
    "status": cmd_status,
    "scale": cmd_scale,
    "config": cmd_config,
    "bench": cmd_bench,
}


def main(argv: list[str] | None = None) -> int:
    from pdcluster.logs import setup_logging

    setup_logging("WARNING")
    args = parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except ConfigError as exc:
        sys.stderr.write(f"pdcluster: {exc}\n")
        return EXIT_BAD_INPUT
    except PDClusterError as exc:
        sys.stderr.write(f"pdcluster: {exc}\n")
        return EXIT_FAILURE
    except KeyboardInterrupt:
        sys.stderr.write("pdcluster: interrupted\n")
        return 130
    except Exception as exc:  # noqa: BLE001 - a CLI user gets one line, never a traceback
        sys.stderr.write(f"pdcluster: {args.command} failed: {one_line(exc, 300)}\n")
        logging.getLogger(__name__).debug("%s failed", args.command, exc_info=True)
        return EXIT_FAILURE
    finally:
        _ray_disconnect()


def run() -> None:
    """The `pdcluster` command. After a command that joined Ray the process ends without the
    interpreter's teardown: Ray's metrics harvester (opencensus DeltaProducer, a native thread no
    ray.shutdown() stops) can crash it (SIGSEGV in absl::Mutex::UnlockSlow, ray-project/ray#36885):
    `status` printed its answer, then exited -11. What is written is flushed first."""
    code = main()
    if not _joined_ray:
        sys.exit(code)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
