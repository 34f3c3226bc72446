"""``python -m workers`` (also ``broker-lookup worker``): run worker ranks of one engine.

One rank per process is the production shape (a StatefulSet pod per rank)::

    python -m workers --redis-url redis://redis:6379/0 --engine-id vllm-0 \\
        --world-size 2 --rank 0 --metrics-port 9400

``--ranks all`` (or ``--rank 0 --rank 1``) starts one child process per rank and
supervises them; child ``r`` serves metrics on ``--metrics-port + r``. Flags fall
back to environment variables (the Helm chart sets those); the password comes only
from ``BROKER_LOOKUP_REDIS_PASSWORD``. Exit codes: 0 stopped cleanly, 1 a rank
failed, 2 bad arguments or config (a password Redis refuses included: it is
reported at once, not retried), 3 Redis unreachable at startup, 4 another live
process serves the rank (this one did not get its lease within ``--claim-timeout``).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from broker_lookup.config import LookupConfig, LookupMetadata, env_name
from broker_lookup.config.env import CONFIG_FILE_ENV
from broker_lookup.errors import ConfigError
from broker_lookup.processes import ExitCode, bounded, child_env, long_options
from broker_lookup.protocol.keys import validate_engine_id
from broker_lookup.threads import set_from_signal
from workers.runtime.rank import RankRunner, RankSpec, UsageError
from workers.runtime.supervisor import supervise

__all__ = ["build_parser", "main"]

logger = logging.getLogger(__name__)

#: Flag destination -> environment variable it falls back to.
ENV_FALLBACKS = {
    **{
        dest: env_name(dest)
        for dest in ("redis_url", "engine_id", "world_size", "rank", "metrics_port", "log_level")
    },
    "config": CONFIG_FILE_ENV,
}
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m workers``."""
    p = argparse.ArgumentParser(
        prog="python -m workers", description="Run broker-lookup worker ranks of one engine."
    )
    env = ENV_FALLBACKS
    p.add_argument("--redis-url", help=f"Redis URL (env {env['redis_url']})")
    p.add_argument("--engine-id", help=f"engine id (env {env['engine_id']})")
    p.add_argument("--world-size", help=f"ranks of the engine (env {env['world_size']})")
    p.add_argument("--rank", action="append", help=f"rank to run, repeatable (env {env['rank']})")
    p.add_argument("--ranks", help="'all', or a comma-separated list: one child process per rank")
    p.add_argument("--metrics-port", help=f"HTTP port, 0 = off (env {env['metrics_port']})")
    p.add_argument("--metrics-host", default="0.0.0.0", help="address to bind the HTTP port")
    p.add_argument("--config", help=f"YAML/TOML LookupConfig file (env {env['config']})")
    p.add_argument(
        "--connect-timeout",
        type=bounded(float, 0, above=True),
        default=30.0,
        help="seconds to wait for Redis at startup, then exit 3 (default 30)",
    )
    p.add_argument("--memory-chunks", type=int, default=4096, help="memory tier capacity")
    p.add_argument("--disk-dir", help="disk tier directory (one subdirectory per rank)")
    p.add_argument("--disk-chunks", type=int, default=16384, help="disk tier capacity")
    p.add_argument("--load-delay-ms", type=float, default=0.0, help="simulated disk read latency")
    p.add_argument("--preload", help="JSON file of prompts to store at startup")
    p.add_argument(
        "--claim-timeout",
        type=bounded(float, 0),
        help="seconds a rank may wait for its lease while another process serves it before "
        "it exits with code 4 (default: twice the lease plus 10; 0: wait forever)",
    )
    p.add_argument("--log-level", type=str.upper, choices=_LEVELS, help=f"(env {env['log_level']})")
    return p


def _value(args: argparse.Namespace, env: Mapping[str, str], dest: str) -> str | None:
    given = getattr(args, dest)
    if given is not None:
        return str(given[-1]) if isinstance(given, list) else str(given)
    raw = env.get(ENV_FALLBACKS[dest], "").strip()
    return raw or None


def _flag(dest: str) -> str:
    return f"--{dest.replace('_', '-')} (env {ENV_FALLBACKS[dest]})"


def _origin(args: argparse.Namespace, dest: str) -> str:
    """Where the value of ``dest`` came from: its flag, or else its variable."""
    if getattr(args, dest) is not None:
        return "--" + dest.replace("_", "-")
    return f"env {ENV_FALLBACKS[dest]}"


def _int(args: argparse.Namespace, env: Mapping[str, str], dest: str, lo: int, hi: int) -> int:
    raw = _value(args, env, dest)
    if raw is None:
        raise UsageError(f"{_flag(dest)} is required")
    try:
        value = int(raw)
    except ValueError:
        raise UsageError(f"{_origin(args, dest)}={raw!r} is not an integer") from None
    if not lo <= value <= hi:
        raise UsageError(f"{_origin(args, dest)}={value} must be in [{lo}, {hi}]")
    return value


def _ranks(args: argparse.Namespace, env: Mapping[str, str], world_size: int) -> tuple[int, ...]:
    if args.ranks is not None:
        raw, where = args.ranks, "--ranks"
    elif args.rank:
        raw, where = ",".join(args.rank), "--rank"
    else:
        raw, where = env.get(ENV_FALLBACKS["rank"], ""), f"env {ENV_FALLBACKS['rank']}"
    if not raw.strip():
        raise UsageError(
            f"no rank to run: pass --rank R, --ranks all, or set {ENV_FALLBACKS['rank']}"
        )
    if raw.strip() == "all":
        return tuple(range(world_size))
    try:
        ranks = sorted({int(x) for x in raw.replace(" ", "").split(",") if x})
    except ValueError:
        raise UsageError(f"{where}={raw!r}: use 'all' or ranks like 0,1") from None
    bad = [r for r in ranks if not 0 <= r < world_size]
    if bad or not ranks:
        raise UsageError(f"{where}={raw!r}: ranks must be in [0, world_size={world_size})")
    return tuple(ranks)


@dataclass(frozen=True)
class Plan:
    """What this process runs: the ranks, and the spec shared by all of them."""

    ranks: tuple[int, ...]
    base: RankSpec
    config_path: str | None
    log_level: str

    def spec(self, rank: int) -> RankSpec:
        """The spec of ``rank`` when it runs in this process."""
        meta = replace_metadata(self.base.metadata, rank)
        return replace(self.base, metadata=meta)

    def child_args(self, rank: int) -> list[str]:
        """Arguments of ``python -m workers`` running ``rank`` alone (no secrets on argv)."""
        b = self.base
        args = long_options(
            {
                "engine-id": b.metadata.engine_id,
                "world-size": b.metadata.world_size,
                "rank": rank,
                "metrics-port": b.metrics_port + rank if b.metrics_port else 0,
                "metrics-host": b.metrics_host,
                "connect-timeout": b.connect_timeout_s,
                "memory-chunks": b.memory_chunks,
                "disk-chunks": b.disk_chunks,
                "load-delay-ms": b.load_delay_ms,
                "log-level": self.log_level,
            }
        )
        if b.disk_dir:
            args += ["--disk-dir", os.path.join(b.disk_dir, f"rank-{rank}")]
        if b.preload:
            args += ["--preload", b.preload]
        if b.claim_timeout_s is not None:
            args += ["--claim-timeout", str(b.claim_timeout_s)]
        if self.config_path:
            args += ["--config", self.config_path]
        return args


def replace_metadata(meta: LookupMetadata, rank: int) -> LookupMetadata:
    """``meta`` for another rank (validated)."""
    return LookupMetadata(engine_id=meta.engine_id, world_size=meta.world_size, worker_id=rank)


def resolve(args: argparse.Namespace, env: Mapping[str, str]) -> Plan:
    """Validate flags, environment and config into a :class:`Plan`.

    Raises:
        UsageError: A flag or environment variable is missing or invalid.
        ConfigError: The config file or a ``BROKER_LOOKUP_*`` setting is invalid.
    """
    engine_id = _value(args, env, "engine_id")
    if engine_id is None:
        raise UsageError(f"{_flag('engine_id')} is required")
    try:  # named here, as its flag or its variable (the metadata names only the variable)
        validate_engine_id(engine_id, _origin(args, "engine_id"))
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    world_size = _int(args, env, "world_size", 1, 1 << 16)
    ranks = _ranks(args, env, world_size)
    port = _int(args, env, "metrics_port", 0, 65535) if _value(args, env, "metrics_port") else 9400
    if port and port + ranks[-1] > 65535:
        raise UsageError(f"{_origin(args, 'metrics_port')}={port}: port + rank exceeds 65535")
    config_path = _value(args, env, "config")
    flags = {"redis_url": args.redis_url} if args.redis_url else None
    config = LookupConfig.load(config_path, env, flags=flags)
    meta = LookupMetadata(engine_id=engine_id, world_size=world_size, worker_id=ranks[0])
    spec = RankSpec(
        config=config,
        metadata=meta,
        metrics_host=args.metrics_host,
        metrics_port=port,
        connect_timeout_s=args.connect_timeout,
        memory_chunks=args.memory_chunks,
        disk_dir=args.disk_dir,
        disk_chunks=args.disk_chunks,
        load_delay_ms=args.load_delay_ms,
        preload=args.preload,
        claim_timeout_s=args.claim_timeout,
    )
    level = _value(args, env, "log_level") or "INFO"
    return Plan(ranks, spec, config_path, level.upper())


def _setup_logging(level: str, label: str) -> None:
    logging.basicConfig(
        level=level if level in _LEVELS else "INFO",
        format=f"%(asctime)s %(levelname)s {label} %(name)s: %(message)s",
        stream=sys.stderr,
    )


def _install_signals(stop: threading.Event) -> None:
    if threading.current_thread() is not threading.main_thread():
        return  # embedded use (tests): the caller sets ``stop`` itself

    def on_signal(signum: int, _frame: object) -> None:
        logger.info("%s received: shutting down", signal.Signals(signum).name)
        set_from_signal(stop)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)


def main(
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
    stop: threading.Event | None = None,
) -> int:
    """Entry point; returns the exit code (0 ok, 1 failed, 2 usage, 3 Redis unreachable,
    4 not the owner of the rank)."""
    env = os.environ if environ is None else environ
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help (0) or an argparse usage error (2)
        return exc.code if isinstance(exc.code, int) else ExitCode.USAGE
    try:
        plan = resolve(args, env)
    except (UsageError, ConfigError) as exc:
        _setup_logging("INFO", "[workers]")
        logger.error("%s", exc)
        return ExitCode.USAGE
    label = f"[rank {plan.ranks[0]}]" if len(plan.ranks) == 1 else "[supervisor]"
    _setup_logging(plan.log_level, label)
    stop = stop or threading.Event()
    _install_signals(stop)
    try:
        if len(plan.ranks) == 1:
            return RankRunner(plan.spec(plan.ranks[0]), stop).run()
        commands = {rank: plan.child_args(rank) for rank in plan.ranks}
        child = child_env(env, {env_name("redis_url"): plan.base.config.redis_url})
        return supervise(commands, child, stop)
    except UsageError as exc:
        logger.error("%s", exc)
        return ExitCode.USAGE
