"""Test scaffolding: read our client's and server's ``stats()`` out of vLLM's processes.

The lookup client lives in vLLM's EngineCore process and each lookup server in a
worker process; the test's driver process sees neither. With ``BL_TEST_PROBE_DIR``
set, every process keeps weak references to the broker objects it creates and runs
a daemon thread that answers "probe" requests through files in that directory:
:func:`request` writes ``request`` (a sequence number), each process writes
``<seq>-<pid>.json`` with its objects' stats, the CPU seconds of our threads and the
CPU connector's counters. ``<dir>/delay_ms`` (when present) delays the worker's
engine call by that many milliseconds, so a test can abort a lookup while in flight.
"""

from __future__ import annotations

import json
import os
import threading
import time
import weakref
from pathlib import Path
from typing import Any

PROBE_ENV = "BL_TEST_PROBE_DIR"
LIVE: weakref.WeakSet[Any] = weakref.WeakSet()
_POLL_S = 0.05


def _track(cls: type) -> None:
    original = cls.__init__  # type: ignore[misc]

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        LIVE.add(self)

    cls.__init__ = init  # type: ignore[misc]


def _thread_cpu() -> dict[str, float]:
    """CPU seconds of each live thread of ours (``broker-lookup-*``), by thread name."""
    out: dict[str, float] = {}
    for thread in threading.enumerate():
        if not thread.name.startswith("broker-lookup") or thread.ident is None:
            continue
        try:
            clock = time.pthread_getcpuclockid(thread.ident)
            out[thread.name] = out.get(thread.name, 0.0) + time.clock_gettime(clock)
        except OSError:
            continue
    return out


def snapshot() -> dict[str, Any]:
    """This process's broker objects and counters, as one JSON-able dict."""
    import cpu_connector

    from broker_lookup.protocol.stats import as_json_object

    clients: list[dict[str, Any]] = []
    servers: list[dict[str, Any]] = []
    for obj in list(LIVE):
        if getattr(obj, "_closed", False):
            continue
        entry = {"class": type(obj).__name__, **as_json_object(obj.stats())}
        (servers if hasattr(obj, "send_response_to_scheduler") else clients).append(entry)
    return {
        "pid": os.getpid(),
        "clients": clients,
        "servers": servers,
        "connector": dict(cpu_connector.COUNTS),
        "thread_cpu_s": _thread_cpu(),
        "process_cpu_s": time.process_time(),
    }


def _serve(directory: Path) -> None:
    seen = ""
    while True:
        time.sleep(_POLL_S)
        try:
            seq = (directory / "request").read_text().strip()
        except OSError:
            continue
        if not seq or seq == seen:
            continue
        seen = seq
        data = snapshot()
        if not data["clients"] and not data["servers"]:
            continue  # a process of no interest (API server, tokenizer, ...)
        tmp = directory / f".{seq}-{os.getpid()}.tmp"
        tmp.write_text(json.dumps(data))
        tmp.replace(directory / f"{seq}-{os.getpid()}.json")


def _delay_engine(module: Any) -> None:
    adapter = module.LMCacheEngineAdapter
    original = adapter.async_lookup_and_prefetch
    directory = Path(os.environ[PROBE_ENV])

    def delayed(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            time.sleep(int((directory / "delay_ms").read_text()) / 1000)
        except (OSError, ValueError):
            pass
        return original(self, *args, **kwargs)

    adapter.async_lookup_and_prefetch = delayed


def install_lazily() -> None:
    """Track the broker classes (when imported) and start the probe thread."""
    from broker_lookup.integrations.import_hook import when_imported

    directory = Path(os.environ[PROBE_ENV])
    when_imported(["broker_lookup.client"], lambda m: _track(m.RedisAsyncLookupClient))
    when_imported(["workers.server"], lambda m: _track(m.RedisAsyncLookupServer))
    when_imported(["broker_lookup.integrations.lmcache_adapter"], _delay_engine)
    threading.Thread(target=_serve, args=(directory,), name="probe", daemon=True).start()


def request(directory: Path, seq: int, want: int, timeout_s: float = 20.0) -> list[dict[str, Any]]:
    """Ask every probed process for a snapshot; wait for ``want`` answers."""
    (directory / "request").write_text(str(seq))
    deadline = time.monotonic() + timeout_s
    while True:
        found = sorted(directory.glob(f"{seq}-*.json"))
        if len(found) >= want or time.monotonic() > deadline:
            return [json.loads(p.read_text()) for p in found]
        time.sleep(_POLL_S)
