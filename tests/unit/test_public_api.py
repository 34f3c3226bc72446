"""The public API is pinned: names, importability, the interface contract, package layering."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import broker_lookup
import workers
from broker_lookup import LookupClientInterface

BROKER_LOOKUP_ALL = [
    "BrokerLookupError",
    "BrokerResponseError",
    "BrokerUnavailable",
    "BypassLookupClient",
    "ChunkStatisticsLookupClient",
    "ChunkedTokenHasher",
    "ConfigError",
    "EngineAnswer",
    "FleetAnswer",
    "FleetClient",
    "HitLimitLookupClient",
    "InvalidRequest",
    "KeySpace",
    "LookupClientFactory",
    "LookupClientInterface",
    "LookupConfig",
    "LookupEngine",
    "LookupMetadata",
    "MalformedMessage",
    "PartialEngine",
    "ProbeEngine",
    "ProgressSink",
    "RedisAsyncLookupClient",
    "RedisLookupClient",
    "ResponseSink",
    "SyncLookupEngine",
    "UnknownScheme",
    "__version__",
]
WORKERS_ALL = ["RedisAsyncLookupServer", "ReferenceEngine"]
PACKAGE_DIR = Path(broker_lookup.__file__).parent


def test_broker_lookup_all_is_pinned_and_sorted() -> None:
    assert broker_lookup.__all__ == BROKER_LOOKUP_ALL
    assert sorted(broker_lookup.__all__) == broker_lookup.__all__


def test_workers_all_is_pinned_and_sorted() -> None:
    assert workers.__all__ == WORKERS_ALL
    assert sorted(workers.__all__) == workers.__all__


@pytest.mark.parametrize(
    ("module", "name"),
    [("broker_lookup", n) for n in BROKER_LOOKUP_ALL] + [("workers", n) for n in WORKERS_ALL],
)
def test_every_public_name_is_importable(module: str, name: str) -> None:
    namespace: dict[str, Any] = {}
    exec(f"from {module} import {name}", namespace)
    assert namespace[name] is getattr(importlib.import_module(module), name)


def test_design_names_come_from_their_documented_modules() -> None:
    from broker_lookup.client import RedisAsyncLookupClient
    from broker_lookup.config import LookupConfig
    from workers.reference.engine import ReferenceEngine
    from workers.server import RedisAsyncLookupServer

    assert broker_lookup.RedisAsyncLookupClient is RedisAsyncLookupClient
    assert broker_lookup.LookupConfig is LookupConfig
    assert workers.RedisAsyncLookupServer is RedisAsyncLookupServer
    assert workers.ReferenceEngine is ReferenceEngine
    assert isinstance(broker_lookup.__version__, str)


# -- LookupClientInterface -------------------------------------------------------------------


def test_interface_is_abstract_in_lookup_and_close() -> None:
    assert LookupClientInterface.__abstractmethods__ == frozenset({"lookup", "close"})
    with pytest.raises(TypeError):
        LookupClientInterface()  # type: ignore[abstract]

    class OnlyLookup(LookupClientInterface):
        def lookup(self, token_ids: Any, lookup_id: str, request_configs: Any = None) -> int:
            return 0

    with pytest.raises(TypeError):
        OnlyLookup()  # type: ignore[abstract]


class Minimal(LookupClientInterface):
    def lookup(self, token_ids: Any, lookup_id: str, request_configs: Any = None) -> int:
        return len(token_ids)

    def close(self) -> None:
        pass


def test_interface_defaults() -> None:
    client = Minimal()
    # -1, not LMCache's None: a client without an override must not stall the scheduler (D1).
    assert client.lookup_cache("any") == -1
    assert client.supports_producer_reuse() is False
    client.clear_lookup_status("any")  # both typed -> None: they only must not raise
    client.cancel_lookup("any")  # LMCache D3: never AttributeError
    assert client.lookup([1, 2, 3], "r") == 3


def test_every_client_class_implements_the_interface() -> None:
    for name in (
        "RedisAsyncLookupClient",
        "RedisLookupClient",
        "BypassLookupClient",
        "HitLimitLookupClient",
        "ChunkStatisticsLookupClient",
    ):
        cls = getattr(broker_lookup, name)
        assert issubclass(cls, LookupClientInterface), name
        assert not getattr(cls, "__abstractmethods__", None), name


def test_error_tree() -> None:
    for name in ("ConfigError", "InvalidRequest", "UnknownScheme"):
        assert issubclass(getattr(broker_lookup, name), ValueError)
    for name in (
        "ConfigError",
        "InvalidRequest",
        "MalformedMessage",
        "BrokerUnavailable",
        "BrokerResponseError",
        "UnknownScheme",
    ):
        assert issubclass(getattr(broker_lookup, name), broker_lookup.BrokerLookupError)


# -- layering: broker_lookup never imports workers --------------------------------------------


def test_importing_broker_lookup_does_not_import_workers() -> None:
    code = (
        "import sys, broker_lookup, broker_lookup.client.factory\n"
        "import broker_lookup.integrations.lmcache\n"
        "bad = [m for m in sys.modules if m == 'workers' or m.startswith('workers.')]\n"
        "assert not bad, bad\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr


# What a scheduler or a rank imports. The tools (demo, local cluster, embedded server) are
# for operators and tests: the library never pays for them, and ``python -m workers`` keeps
# its fast start. (The benchmarks and the fault proxy are not in the package at all.)
_RUNTIME_IMPORTS = """
import importlib, pkgutil, sys
import broker_lookup, broker_lookup.client, broker_lookup.config
import broker_lookup.ops.metrics, broker_lookup.ops.inspect, broker_lookup.integrations.lmcache
import broker_lookup.protocol, broker_lookup.transport
for package in (broker_lookup.protocol, broker_lookup.transport):
    for info in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
        importlib.import_module(info.name)
import workers, workers.server, workers.runtime.runner
bad = sorted(m for m in sys.modules if m.startswith("broker_lookup.tools"))
assert not bad, bad
"""


def test_the_library_and_the_workers_import_no_tool() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _RUNTIME_IMPORTS],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr


_IMPORTS_WORKERS = re.compile(r"^\s*(import\s+workers\b|from\s+workers\b)", re.MULTILINE)


def test_no_broker_lookup_module_imports_workers() -> None:
    sources = sorted(PACKAGE_DIR.rglob("*.py"))
    assert len(sources) > 10
    offenders = [str(p) for p in sources if _IMPORTS_WORKERS.search(p.read_text())]
    assert offenders == []
