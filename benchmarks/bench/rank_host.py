"""Rank hosts of ``python -m benchmarks.bench``: import once, fork one process per rank.

A host serves every rank of the engines it is given (``--engine ID:WORLD[:mute]``,
repeatable). It forks after its imports, so N ranks cost one interpreter start (the
worker side imports torch: ~1.5 s and ~300 MB each otherwise). Each rank process runs
``serve(spec, stop)``, which builds its server, calls :func:`ready`, and returns after
``stop`` is set (SIGTERM). The host forwards SIGTERM to its ranks and reaps them; a rank
dies with its host (:func:`broker_lookup.processes.die_with_parent`), and a rank that dies
takes the others down.
Used by ``benchmarks.bench.our_ranks`` (our server) and
``benchmarks.bench.lmcache_side`` (LMCache's).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import NamedTuple

from benchmarks.bench.children import emit
from broker_lookup.processes import ExitCode, die_with_parent
from broker_lookup.threads import set_from_signal

__all__ = ["RankSpec", "Serve", "host_parser", "ready", "run_host"]

logger = logging.getLogger(__name__)

_KILL_AFTER_S = 10.0


class RankSpec(NamedTuple):
    """One rank to serve: its engine, world size, rank, and whether it never answers."""

    engine_id: str
    world_size: int
    rank: int
    mute: bool


#: Runs one rank until ``stop`` is set; returns the rank's exit code.
Serve = Callable[[RankSpec, threading.Event], int]


def _parse_engine(text: str) -> list[RankSpec]:
    parts = text.split(":")
    if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "mute"):
        raise argparse.ArgumentTypeError(f"{text!r}: use ENGINE_ID:WORLD_SIZE[:mute]")
    engine_id = parts[0]
    world = int(parts[1])
    mute = len(parts) == 3
    return [RankSpec(engine_id, world, r, mute) for r in range(world)]


def host_parser(prog: str, description: str | None) -> argparse.ArgumentParser:
    """A parser with the options every host takes: ``--engine`` (repeat) and ``--hit-fraction``."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument(
        "--engine",
        type=_parse_engine,
        action="append",
        required=True,
        metavar="ID:WORLD[:mute]",
        help="an engine whose ranks to serve (repeat for more)",
    )
    p.add_argument("--hit-fraction", type=float, default=1.0, help="share of chunks hit")
    return p


def ready(spec: RankSpec) -> None:
    """Tell the bench this rank is serving."""
    emit("ready", f"{spec.engine_id} {spec.rank} {os.getpid()}")


def _fork_rank(spec: RankSpec, serve: Serve) -> int:
    pid = os.fork()
    if pid:
        return pid
    code: int = ExitCode.FAILED
    try:
        die_with_parent()
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: set_from_signal(stop))
        signal.signal(signal.SIGINT, lambda *_: set_from_signal(stop))
        code = serve(spec, stop)
    except BaseException:  # the child must never return into the host's code
        logger.exception("%s failed", spec)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_host(engines: list[list[RankSpec]], serve: Serve) -> int:
    """Fork a process per rank, wait for all; OK (0) if every rank exited 0, else FAILED."""
    children = [_fork_rank(spec, serve) for specs in engines for spec in specs]
    stopping = threading.Event()

    def signal_all(sig: signal.Signals) -> None:
        for pid in children:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def forward(signum: int, _frame: object) -> None:
        if stopping.is_set():
            return
        stopping.set()
        signal_all(signal.SIGTERM)
        # A rank stuck in its server's close() must not outlive us as an orphan.
        killer = threading.Timer(_KILL_AFTER_S, signal_all, (signal.SIGKILL,))
        killer.daemon = True
        killer.start()

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    worst = ExitCode.OK
    for pid in children:
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            worst = ExitCode.FAILED
        if not stopping.is_set():  # a rank died on its own: take the rest down too
            forward(signal.SIGTERM, None)
    return worst
