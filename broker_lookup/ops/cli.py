"""``broker-lookup``: the command line (``demo``, ``inspect``, ``worker``; more register alike).

A subcommand is one :class:`Subcommand` in :data:`COMMANDS`: a function that adds its
arguments to its parser and a function that runs it and returns the exit code. Adding
one is a new entry, without touching the others::

    COMMANDS["acl"] = Subcommand("print ACL users ...", _setup_acl, _run_acl)

This module and the subcommands' modules are the only places logging is configured
on the scheduler side; ``broker_lookup`` never imports ``workers``: ``worker`` execs
``python -m workers``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from broker_lookup.processes import ExitCode, child_env, python_module

__all__ = ["COMMANDS", "Subcommand", "build_parser", "main"]


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


def _run_demo(args: argparse.Namespace) -> int:
    from broker_lookup.tools.demo import run_demo

    if args.ranks < 1 or args.chunk_size < 1:
        print("broker-lookup demo: --ranks and --chunk-size must be >= 1", file=sys.stderr)
        return ExitCode.USAGE
    return run_demo(
        redis_url=args.redis_url,
        ranks=args.ranks,
        chunk_size=args.chunk_size,
        environ=os.environ,
        startup_timeout_s=args.startup_timeout,
    )


# -- inspect ------------------------------------------------------------------------


def _setup_inspect(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis-url", help="Redis URL (default: BROKER_LOOKUP_REDIS_URL)")
    p.add_argument(
        "--engine-id", help="engine whose keys to show (default: every engine on the server)"
    )
    p.add_argument("--world-size", type=int, help="ranks expected (default: from the groups)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--watch", type=float, metavar="SECONDS", help="repeat until Ctrl-C")
    p.add_argument("--limit", type=int, default=50, help="in-flight lookups shown (default 50)")
    p.add_argument(
        "--recent",
        type=int,
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


def _run_inspect(args: argparse.Namespace) -> int:
    from broker_lookup.config import LookupConfig, env_name
    from broker_lookup.errors import ConfigError
    from broker_lookup.ops.inspect import run_inspect

    overrides = {env_name("redis_url"): args.redis_url} if args.redis_url else {}
    try:
        return run_inspect(
            LookupConfig.load(environ={**os.environ, **overrides}),
            args.engine_id,
            world_size=args.world_size,
            as_json=args.json,
            watch_s=args.watch,
            check=args.check,
            limit=args.limit,
            recent=args.recent,
        )
    except ConfigError as exc:
        print(f"broker-lookup inspect: {exc}", file=sys.stderr)
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
    p.add_argument("--engine-id", help="scope the users to this engine (and its vLLM instances)")
    p.add_argument(
        "--role",
        choices=("scheduler", "worker", "operator", "admin"),
        help="print this role's user only (default: a whole file, every role)",
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

    try:
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


#: Every subcommand, by name.
COMMANDS: dict[str, Subcommand] = {
    "demo": Subcommand(
        "start an embedded server and worker ranks, run FULL/PARTIAL/ZERO/CANCEL lookups",
        _setup_demo,
        _run_demo,
    ),
    "inspect": Subcommand(
        "show in-flight lookups, rank liveness, group lag/pending and dead letters",
        _setup_inspect,
        _run_inspect,
    ),
    "worker": Subcommand(
        "run worker ranks (same as python -m workers)", _setup_worker, _run_worker, True
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
