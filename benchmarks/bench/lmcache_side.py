"""``python -m benchmarks.bench --vs-lmcache``: the same measurements on LMCache 0.5.6's own lookup.

LMCache's ``LMCacheAsyncLookupClient`` runs in this process; its
``LMCacheAsyncLookupServer`` ranks run as processes (``python -m
benchmarks.bench.lmcache_side --engine ID:WORLD``, forked from one host), each with the
same instant :class:`~broker_lookup.stub_engine.StubEngine` as our ranks, whose
``async_lookup_and_prefetch`` calls ``server.send_response_to_scheduler`` at once, as
LMCache's own tests do. Two client
configurations share the ranks: LMCache's default (``lookup_backoff_time`` 10 ms, slept
in ``lookup()`` and in every ``lookup_cache()`` of a pending id) and backoff 0
(``extra_config={"lookup_backoff_time": 0}``). lmcache is imported lazily.
"""

from __future__ import annotations

import glob
import logging
import os
import sys
import threading
import time
from types import SimpleNamespace
from typing import Any

from benchmarks.bench.children import start_rank_host, stop_all
from benchmarks.bench.measure import (
    BenchError,
    BenchOptions,
    Prompts,
    closed_loop,
    cpu_seconds_of,
    idle_cpu,
    sequential_latency,
)
from benchmarks.bench.rank_host import RankSpec, host_parser, ready, run_host
from broker_lookup.processes import ExitCode, python_module
from broker_lookup.stub_engine import StubEngine

__all__ = ["VARIANTS", "bench_lmcache", "main", "require_lmcache", "token_database"]

logger = logging.getLogger(__name__)

LMCACHE_VERSION = "0.5.6"
INSTALL_HINT = "PYTHON=$(which python) ../shared/tools/install-lmcache-cpu"
#: Client configurations compared: name -> lookup_backoff_time (None: LMCache's default).
VARIANTS: dict[str, float | None] = {"default": None, "backoff0": 0.0}
_SOCKET_DIR = "/tmp/vllm_rpc"  # LMCache's ipc:// base without vLLM


def require_lmcache() -> SimpleNamespace:
    """LMCache's classes the bench uses; BenchError (with the install command) if missing."""
    # Its INFO lines, and a WARNING per client about hashing without vLLM, flood stderr.
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")
    try:
        import importlib.metadata

        import msgspec
        import torch
        import zmq
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.lookup_client import async_lookup_message as messages
        from lmcache.v1.lookup_client import lmcache_async_lookup_client as lookup
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.rpc_utils import get_zmq_rpc_path_lmcache
        from lmcache.v1.token_database import ChunkedTokenDatabase

        version = importlib.metadata.version("lmcache")
    except ImportError as exc:
        raise BenchError(
            f"--vs-lmcache needs lmcache {LMCACHE_VERSION} ({exc}); install it with {INSTALL_HINT}"
        ) from None
    if version != LMCACHE_VERSION:
        raise BenchError(f"--vs-lmcache needs lmcache {LMCACHE_VERSION}, found {version}")
    return SimpleNamespace(
        Config=LMCacheEngineConfig,
        Metadata=LMCacheMetadata,
        Client=lookup.LMCacheAsyncLookupClient,
        Server=lookup.LMCacheAsyncLookupServer,
        TokenDatabase=ChunkedTokenDatabase,
        Response=messages.LookupResponseMsg,
        Cleanup=messages.LookupCleanupMsg,
        path=get_zmq_rpc_path_lmcache,
        torch=torch,
        zmq=zmq,
        msgspec=msgspec,
    )


def _config(lm: SimpleNamespace, backoff: float | None) -> Any:
    extra = {} if backoff is None else {"lookup_backoff_time": backoff}
    return lm.Config.from_defaults(
        chunk_size=256, enable_async_loading=True, extra_config=extra or None
    )


def _metadata(lm: SimpleNamespace, engine_id: str, world: int, rank: int) -> Any:
    return lm.Metadata(
        model_name="bench",
        world_size=world,
        local_world_size=world,
        worker_id=rank,
        local_worker_id=rank,
        kv_dtype=lm.torch.bfloat16,
        kv_shape=(1, 2, 256, 1, 1),
        engine_id=engine_id,
        kv_connector_extra_config={"lmcache_rpc_port": 0},
    )


def _close_safely(lm: SimpleNamespace, owner: Any, path: str, wake: Any) -> None:
    """Stop a LMCache client or server whose thread is blocked in ``recv``, then close it.

    LMCache's own ``close()`` closes the sockets while its thread still sits in ``recv``
    on one of them (ZMQ sockets are not thread-safe) and aborts the whole process with
    ``Assertion failed: pfd.revents & POLLIN (src/signaler.cpp)``. So: clear ``running``,
    send the thread one harmless message so its ``recv`` returns, join, then close.
    """
    owner.running = False
    ctx = lm.zmq.Context()
    try:
        sock = ctx.socket(lm.zmq.PUSH)
        sock.setsockopt(lm.zmq.LINGER, 1000)
        sock.connect(f"ipc://{path}")
        sock.send(lm.msgspec.msgpack.encode(wake))
        sock.close()
    finally:
        ctx.term()
    owner.thread.join(5.0)
    if owner.thread.is_alive():  # closing now would abort the process: leak it instead
        logger.warning("LMCache %s thread still in recv; not closing it", type(owner).__name__)
        return
    owner.close()


def _serve(lm: SimpleNamespace, fraction: float, spec: RankSpec, stop: threading.Event) -> int:
    engine = StubEngine("mute" if spec.mute else "instant", fraction=fraction, record=False)
    metadata = _metadata(lm, spec.engine_id, spec.world_size, spec.rank)
    server = lm.Server(engine, metadata)
    # LMCache's server does not wire itself into its engine: its manager calls the engine's
    # post_init(async_lookup_server=...) right after building the server, so we do the same.
    engine.post_init(async_lookup_server=server)
    try:
        ready(spec)
        while not stop.wait(0.5):
            pass
        return ExitCode.OK
    finally:
        path = lm.path(spec.engine_id, "lookup_worker", 0, spec.rank)
        _close_safely(lm, server, path, lm.Cleanup(lookup_id="bench-stop"))


def main(argv: list[str] | None = None) -> int:
    """Host LMCache lookup-server ranks until SIGTERM."""
    args = host_parser("python -m benchmarks.bench.lmcache_side", __doc__).parse_args(argv)
    lm = require_lmcache()
    return run_host(args.engine, lambda spec, stop: _serve(lm, args.hit_fraction, spec, stop))


def _variant_run(
    lm: SimpleNamespace,
    opts: BenchOptions,
    eid: str,
    world: int,
    backoff: float | None,
    pids: list[int],
) -> dict[str, Any]:
    client = lm.Client(_config(lm, backoff), _metadata(lm, eid, world, 0))
    path = lm.path(eid, "lookup_scheduler", 0, 0)
    try:
        time.sleep(0.3)  # the ranks' PUSH sockets reconnect to the new PULL socket
        n = opts.lmcache_slow_lookups if backoff is None else opts.lookups
        prompts = Prompts(opts.tokens)
        cpu0 = (time.process_time(), time.thread_time(), cpu_seconds_of(pids))
        run = sequential_latency(client, prompts, n, opts.warmup, opts.poll_s, f"lat{backoff}")
        run["cpu_per_1000"] = _cpu_per_1000(cpu0, pids, n + opts.warmup)
        if world == opts.throughput_world:
            cpu0 = (time.process_time(), time.thread_time(), cpu_seconds_of(pids))
            tput = closed_loop(client, prompts, opts.window, opts.duration_s, opts.poll_s, "tp")
            tput["cpu_per_1000"] = _cpu_per_1000(cpu0, pids, tput["completed"])
            tput["world"] = world
            run["throughput"] = tput
        return run
    finally:
        _close_safely(lm, client, path, lm.Response(lookup_id="bench-stop", num_hit_tokens=0))


def _idle(
    lm: SimpleNamespace, opts: BenchOptions, eid: str, world: int, rank_pids: list[int]
) -> dict[str, float]:
    """Every rank process and one backoff-0 client, with no lookup (see :func:`idle_cpu`)."""
    client = lm.Client(_config(lm, VARIANTS["backoff0"]), _metadata(lm, eid, world, 0))
    path = lm.path(eid, "lookup_scheduler", 0, 0)
    try:
        time.sleep(0.5)  # past the client's start-up, as for ours
        return idle_cpu(rank_pids, opts.idle_s)
    finally:
        _close_safely(lm, client, path, lm.Response(lookup_id="bench-stop", num_hit_tokens=0))


def _cpu_per_1000(start: tuple[float, float, float], pids: list[int], n: int) -> dict[str, float]:
    now = (time.process_time(), time.thread_time(), cpu_seconds_of(pids))
    k = 1000 / max(1, n)
    process, caller, ranks = ((b - a) * k for a, b in zip(start, now, strict=True))
    return {
        "client_process": process,
        "caller_thread": caller,
        "client_threads": process - caller,
        "ranks": ranks,
    }


def bench_lmcache(opts: BenchOptions, run_id: str) -> dict[str, Any]:
    """Latency per world size and throughput, for each client variant in :data:`VARIANTS`
    (hashing is measured by the caller, in rounds alternating with ours)."""
    lm = require_lmcache()
    ids = {w: f"bench-{run_id}-lm{w}" for w in opts.worlds}
    argv = python_module("benchmarks.bench.lmcache_side")
    for w, eid in ids.items():
        argv += ["--engine", f"{eid}:{w}"]
    out: dict[str, Any] = {name: {"latency": {}} for name in VARIANTS}
    host, pids = start_rank_host(
        "lmcache rank host", argv, dict(os.environ), sum(ids), opts.startup_timeout_s
    )
    try:
        every_rank = [pid for ranks in pids.values() for pid in ranks.values()]
        first = opts.worlds[0]
        out["backoff0"]["idle"] = _idle(lm, opts, ids[first], first, every_rank)
        for w, eid in ids.items():
            for name, backoff in VARIANTS.items():
                run = _variant_run(lm, opts, eid, w, backoff, list(pids[eid].values()))
                if "throughput" in run:
                    out[name]["throughput"] = run.pop("throughput")
                out[name]["latency"][str(w)] = run
    finally:
        stop_all([host])
        _remove_sockets(ids.values())
    return out


def token_database(lm: SimpleNamespace) -> Any:
    """LMCache's ``ChunkedTokenDatabase`` as its default config builds it (for hashing)."""
    return lm.TokenDatabase(_config(lm, None))


def _remove_sockets(engine_ids: Any) -> None:
    for eid in engine_ids:
        for path in glob.glob(f"{_SOCKET_DIR}/engine_{glob.escape(eid)}_*"):
            try:
                os.unlink(path)
            except OSError:
                pass


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchError as exc:  # lmcache missing or of another version
        print(f"bench_lmcache: {exc}", file=sys.stderr)
        sys.exit(ExitCode.USAGE)
