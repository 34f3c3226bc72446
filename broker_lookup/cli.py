"""``broker-lookup``: the command line (``demo``, ``inspect``, ``exporter``, ``worker``; more
register alike).

A subcommand is one :class:`Subcommand` in :data:`COMMANDS`: a function that adds its
arguments to its parser and a function that runs it and returns the exit code. Adding
one is a new entry, without touching the others::

    COMMANDS["acl"] = Subcommand("print ACL users ...", _setup_acl, _run_acl)

It sits on top of the package: it imports ``ops`` and ``tools`` (each only when its
subcommand runs), nothing in the package imports it. This module and the subcommands'
modules are the only places logging is configured on the scheduler side;
``broker_lookup`` never imports ``workers``: ``worker`` execs ``python -m workers``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from broker_lookup.config import env_name
from broker_lookup.processes import ExitCode, bounded, child_env, python_module

if TYPE_CHECKING:
    from broker_lookup.config import LookupConfig

__all__ = ["COMMANDS", "Subcommand", "build_parser", "main"]

_URL_HELP = f"Redis URL (default: {env_name('redis_url')})"


def _engine_id(text: str) -> str:
    """An argparse ``type``: an engine id that can be a key's hash tag."""
    from broker_lookup.errors import ConfigError
    from broker_lookup.protocol.keys import validate_engine_id

    try:
        return validate_engine_id(text, "--engine-id")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--engine-id=")) from None


#: How long a tool waits for each answer of Redis before it gives up (``--connect-timeout``).
CONNECT_TIMEOUT_S = 5.0


def _add_connect_timeout(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--connect-timeout",
        type=bounded(float, 0, above=True),
        default=CONNECT_TIMEOUT_S,
        metavar="SECONDS",
        help="give up when Redis has not answered within this long, once, not retried: a "
        f"stalled or unreachable server (default {CONNECT_TIMEOUT_S:g})",
    )


@dataclass(frozen=True)
class Subcommand:
    """One ``broker-lookup <name>``: its help line, parser setup and runner.

    ``passthrough`` subcommands get the arguments argparse does not know as ``args.rest``
    (``worker`` forwards them to ``python -m workers``).
    """

    help: str
    setup: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    passthrough: bool = False


def _config(args: argparse.Namespace) -> LookupConfig:
    """The config of a subcommand: file and ``BROKER_LOOKUP_*`` variables, then its flags
    (an error names the flag, the file or the variable its bad value came from).

    Raises:
        ConfigError: A bad value or an unknown ``BROKER_LOOKUP_*`` variable.
    """
    from broker_lookup.config import LookupConfig

    url = getattr(args, "redis_url", None)
    return LookupConfig.load(environ=os.environ, flags={"redis_url": url} if url else None)


# -- demo ---------------------------------------------------------------------------


def _setup_demo(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis-url", help="use this server (default: start an embedded Valkey)")
    p.add_argument("--ranks", type=int, default=2, help="worker rank processes (default 2)")
    p.add_argument("--chunk-size", type=int, default=16, help="tokens per chunk (default 16)")
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=180.0,
        help="seconds to wait for the ranks to start (default 180)",
    )
    p.add_argument(
        "--keep",
        action="store_true",
        help="leave the embedded server running after the demo (and print how to stop it)",
    )
    p.add_argument(
        "--vllm",
        action="store_true",
        help="run a real vLLM engine with LMCache on the broker instead (needs vllm and "
        "lmcache installed): the same prompt twice, the hit, the exporter's metrics",
    )


def _run_demo(args: argparse.Namespace) -> int:
    from broker_lookup.errors import ConfigError
    from broker_lookup.tools.demo import run_demo

    if args.vllm:
        from broker_lookup.tools.vllm_demo import run_vllm_demo

        return run_vllm_demo(args.redis_url, os.environ)
    if args.ranks < 1 or args.chunk_size < 1:
        print("broker-lookup demo: --ranks and --chunk-size must be >= 1", file=sys.stderr)
        return ExitCode.USAGE
    if args.keep and args.redis_url:
        print(
            "broker-lookup demo: --keep keeps the embedded server: not with --redis-url",
            file=sys.stderr,
        )
        return ExitCode.USAGE
    try:
        _config(args)  # the ranks read the same variables: refuse a bad one here, named
    except ConfigError as exc:
        print(f"broker-lookup demo: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    return run_demo(
        redis_url=args.redis_url,
        ranks=args.ranks,
        chunk_size=args.chunk_size,
        environ=os.environ,
        startup_timeout_s=args.startup_timeout,
        keep=args.keep,
    )


# -- server -------------------------------------------------------------------------


def _setup_server(p: argparse.ArgumentParser) -> None:
    from broker_lookup.tools.serve import DEFAULT_PORT

    p.add_argument(
        "--port",
        type=int,
        default=DEFAULT_PORT,
        help=f"TCP port (default {DEFAULT_PORT}, the default redis_url's; 0: a free one)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")


def _run_server(args: argparse.Namespace) -> int:
    from broker_lookup.tools.serve import run_server

    if not 0 <= args.port <= 65535:
        print(f"broker-lookup server: --port {args.port} is not a port", file=sys.stderr)
        return ExitCode.USAGE
    return run_server(args.port, args.host)


# -- inspect ------------------------------------------------------------------------


def _setup_inspect(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis-url", help=_URL_HELP)
    p.add_argument(
        "--engine-id",
        type=_engine_id,
        help="engine whose keys to show (default: every engine on the server)",
    )
    p.add_argument(
        "--world-size", type=bounded(int, 1), help="ranks expected (default: from the groups)"
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--watch",
        type=bounded(float, 0, above=True),
        metavar="SECONDS",
        help="repeat until Ctrl-C",
    )
    p.add_argument(
        "--limit", type=bounded(int, 0), default=50, help="in-flight lookups shown (default 50)"
    )
    p.add_argument(
        "--recent",
        type=bounded(int, 0),
        default=1000,
        metavar="N",
        help="completions read for the per-rank latency and last-to-report share (default 1000)",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="exit 1 unless every expected rank has a heartbeat and a consumer group and no "
        "role (scheduler, rank) has a second process waiting for it; without --engine-id, "
        "exit 1 on any such conflict",
    )
    p.add_argument(
        "--allow-absent",
        action="store_true",
        help="with --engine-id: exit 0 when no process of the engine has written a key yet "
        "(a fresh install; Redis still has to answer this user); default: exit 1",
    )
    _add_connect_timeout(p)


def _run_inspect(args: argparse.Namespace) -> int:
    from broker_lookup.errors import ConfigError
    from broker_lookup.ops.inspect import run_inspect

    try:
        return run_inspect(
            _config(args),
            args.engine_id,
            world_size=args.world_size,
            as_json=args.json,
            watch_s=args.watch,
            check=args.check,
            allow_absent=args.allow_absent,
            limit=args.limit,
            recent=args.recent,
            connect_timeout_s=args.connect_timeout,
        )
    except ConfigError as exc:
        print(f"broker-lookup inspect: {exc}", file=sys.stderr)
        return ExitCode.USAGE


# -- doctor -------------------------------------------------------------------------


def _setup_doctor(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis-url", help=_URL_HELP)
    p.add_argument(
        "--engine-id", type=_engine_id, help="check this engine only (default: every engine)"
    )
    _add_connect_timeout(p)


def _run_doctor(args: argparse.Namespace) -> int:
    from broker_lookup.errors import ConfigError
    from broker_lookup.ops.doctor import run_doctor

    try:
        config = _config(args)
    except ConfigError as exc:
        print(f"broker-lookup doctor: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    return run_doctor(config, args.engine_id, connect_timeout_s=args.connect_timeout)


# -- exporter -----------------------------------------------------------------------

#: The exporter's default port (a rank's own endpoint is 9400 + its rank).
EXPORTER_PORT = 9390


def _setup_exporter(p: argparse.ArgumentParser) -> None:
    p.description = (
        f"{p.description}: /metrics read from the snapshots each process publishes there "
        "(no port per process). Labels: engine, configured_engine_id, role (scheduler, "
        "worker), host, plus each metric's own."
    )
    p.add_argument("--redis-url", help=_URL_HELP)
    p.add_argument(
        "--engine-id",
        type=_engine_id,
        help="this engine and its vLLM instances only (default: all)",
    )
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    p.add_argument(
        "--port",
        type=bounded(int, 0, 65535),
        default=EXPORTER_PORT,
        help=f"port (default {EXPORTER_PORT})",
    )
    p.add_argument("--once", action="store_true", help="print one scrape to stdout and exit")
    _add_connect_timeout(p)


def _run_exporter(args: argparse.Namespace) -> int:
    import signal
    import threading

    from broker_lookup.config import redact_url
    from broker_lookup.errors import REDIS_ERRORS, ConfigError, translated
    from broker_lookup.ops.exporter import FleetCollector, render_once, serve
    from broker_lookup.transport.connection import make_factory

    try:
        config = _config(args)
    except ConfigError as exc:
        print(f"broker-lookup exporter: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    # Each read gives up after --connect-timeout, not retried: a scrape of a stalled server
    # answers 503 within it, and --once exits within it.
    factory = make_factory(config, "bl-exporter", socket_timeout_s=args.connect_timeout)
    collector = FleetCollector(factory, args.engine_id)
    if args.once:
        try:
            sys.stdout.write(render_once(collector).decode())
        except REDIS_ERRORS as exc:
            print(
                f"cannot read {redact_url(config.redis_url)} "
                f"(--connect-timeout {args.connect_timeout:g}s): "
                f"{translated(exc, 'reading the snapshots') or exc}",
                file=sys.stderr,
            )
            return ExitCode.UNREACHABLE
        finally:
            collector.close()
        return ExitCode.OK
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        return serve(collector, args.host, args.port, stop)
    except OSError as exc:
        print(f"broker-lookup exporter: cannot serve --port {args.port}: {exc}", file=sys.stderr)
        return ExitCode.USAGE


# -- worker -------------------------------------------------------------------------


def _setup_worker(p: argparse.ArgumentParser) -> None:
    p.description = "Same as `python -m workers ...`; see `broker-lookup worker --help`."


def _run_worker(args: argparse.Namespace) -> int:
    # exec, not import: broker_lookup never imports workers, and the process becomes the
    # rank itself (signals, exit code, pid) exactly as with `python -m workers`.
    argv = python_module("workers", args.rest)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, argv, child_env(os.environ))
    return ExitCode.FAILED  # pragma: no cover (execve does not return)


# -- acl (broker_lookup/ops/acl.py) --------------------------------------------------------------


def _setup_acl(p: argparse.ArgumentParser) -> None:
    from broker_lookup.ops.acl import ROLES

    p.add_argument(
        "--engine-id",
        type=_engine_id,
        help="scope the users to this engine (and its vLLM instances)",
    )
    p.add_argument(
        "--role",
        choices=ROLES,
        help="print this role's user only (default: a whole file, every role); vllm: a vLLM "
        "pod, whose processes host the scheduler's client and the rank servers",
    )
    p.add_argument("--user", help="the user's name, with --role (default: the role's name)")
    secret = p.add_mutually_exclusive_group()
    secret.add_argument(
        "--password-stdin", action="store_true", help="read the password from stdin; stored hashed"
    )
    secret.add_argument("--password-sha256", help="the password's SHA-256 (64 hex digits)")


def _run_acl(args: argparse.Namespace) -> int:
    from broker_lookup.errors import ConfigError
    from broker_lookup.ops.acl import acl_file, acl_line
    from broker_lookup.protocol.keys import validate_configured_id

    try:
        if args.engine_id is not None:  # a configured id: its users reach its instances
            validate_configured_id(args.engine_id, "--engine-id")
        if args.role is None:
            if args.engine_id is None or args.user or args.password_stdin or args.password_sha256:
                raise ConfigError(
                    "a whole file needs --engine-id and takes no --user or password "
                    "(its passwords are placeholders); use --role for one user"
                )
            sys.stdout.write(acl_file(args.engine_id))
            return ExitCode.OK
        password = sys.stdin.readline().rstrip("\n") if args.password_stdin else None
        line = acl_line(
            args.role,
            args.engine_id,
            user=args.user,
            password=password,
            password_sha256=args.password_sha256,
        )
    except ConfigError as exc:
        print(f"broker-lookup acl: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    print(line)
    return ExitCode.OK


def _setup_query(p: argparse.ArgumentParser) -> None:
    from broker_lookup.ops.query_cli import setup

    setup(p, _URL_HELP)


def _run_query(args: argparse.Namespace) -> int:
    from broker_lookup.ops.query_cli import run

    return run(args)


#: Every subcommand, by name.
COMMANDS: dict[str, Subcommand] = {
    "demo": Subcommand(
        "start an embedded server and worker ranks, run FULL/PARTIAL/ZERO/CANCEL lookups",
        _setup_demo,
        _run_demo,
    ),
    "server": Subcommand(
        "run a local embedded server (Valkey, nothing saved) in the foreground until Ctrl-C",
        _setup_server,
        _run_server,
    ),
    "inspect": Subcommand(
        "show in-flight lookups, rank liveness, group lag/pending and dead letters",
        _setup_inspect,
        _run_inspect,
    ),
    "doctor": Subcommand(
        "check a setup on one screen: server, password, memory policy, ranks, hashing, hits",
        _setup_doctor,
        _run_doctor,
    ),
    "exporter": Subcommand(
        "serve Prometheus metrics of every scheduler and rank on one Redis",
        _setup_exporter,
        _run_exporter,
    ),
    "worker": Subcommand(
        "run worker ranks (same as python -m workers)", _setup_worker, _run_worker, True
    ),
    "query": Subcommand(
        "ask every rank of some engines how much of a prompt they hold (for routers)",
        _setup_query,
        _run_query,
    ),
    "acl": Subcommand(
        "print least-privilege ACL users for one engine (deploy/users.acl's generator)",
        _setup_acl,
        _run_acl,
    ),
}


def build_parser() -> argparse.ArgumentParser:
    """The ``broker-lookup`` parser with every registered subcommand."""
    parser = argparse.ArgumentParser(
        prog="broker-lookup", description="Redis-brokered KV-cache lookup for vLLM + LMCache."
    )
    parser.add_argument(
        "--log-level",
        type=str.upper,
        default="WARNING",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        help="library log level on stderr (default WARNING)",
    )
    subs = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, command in COMMANDS.items():
        sub = subs.add_parser(
            name, help=command.help, description=command.help, add_help=not command.passthrough
        )
        command.setup(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``broker-lookup``; returns the exit code (:class:`~broker_lookup.processes.ExitCode`)."""
    parser = build_parser()
    try:
        args, rest = parser.parse_known_args(argv)
        command = COMMANDS[args.command]
        if rest and not command.passthrough:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
    except SystemExit as exc:  # --help (0) or a usage error (2)
        return exc.code if isinstance(exc.code, int) else ExitCode.USAGE
    args.rest = rest
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return command.run(args)
    except KeyboardInterrupt:
        return ExitCode.INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
