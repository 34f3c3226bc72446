"""The installed LMCache release (0.5.6 or 0.5.7rc2): the plugin finds its layout, patches
it through the import hook, and says so loudly when LMCache builds its own lookup."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import fakeredis
import pytest

from broker_lookup import RedisAsyncLookupClient
from broker_lookup.integrations import lmcache as integration
from broker_lookup.integrations import lmcache_guard, lmcache_layout
from broker_lookup.lmcache_version import running_lmcache_version

pytestmark = pytest.mark.lmcache

ROOT = Path(__file__).resolve().parents[2]
BROKER = {"lookup_broker_url": "redis://unused.invalid:6379/0", "lookup_broker_block_ms": 50}

#: A fresh process: vLLM loads the plugin, then LMCache's own code imports its factory.
CHILD = """
import json, sys
from broker_lookup.integrations import lmcache as m
m.vllm_plugin()
at_load = sorted(k for k in sys.modules if k.split(".")[0] in ("lmcache", "torch"))
import importlib
factory = importlib.import_module(sys.argv[1]).LookupClientFactory
print("REPORT " + json.dumps({
    "at_load": at_load,
    "patched": m.is_installed(),
    "ours": factory.create_lookup_client is m._create_lookup_client,
}))
"""


def test_the_installed_release_has_a_known_layout(lmc: SimpleNamespace) -> None:
    assert lmcache_layout.find_layout() == lmc.layout
    assert lmc.version in lmc.layout.versions
    assert running_lmcache_version() == lmc.version
    assert lmc.Factory.__module__ == lmc.layout.module(lmcache_layout.FACTORY)
    others = [lo for lo in lmcache_layout.LAYOUTS if lo != lmc.layout]
    for other in others:  # no aliases: the other layout's factory is not there
        assert not lmcache_layout.module_exists(other.module(lmcache_layout.FACTORY))


def test_import_hook_patches_this_layout_in_a_fresh_process(lmc: SimpleNamespace) -> None:
    env = dict(os.environ, BROKER_LOOKUP_LMCACHE="1", PYTHONPATH=str(ROOT))
    env.pop("BROKER_LOOKUP_REDIS_URL", None)
    factory = lmc.layout.module(lmcache_layout.FACTORY)
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, factory],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("REPORT "))
    report = json.loads(line[len("REPORT ") :])
    assert report == {"at_load": [], "patched": True, "ours": True}
    assert f"on import of {factory}" in proc.stderr
    assert not [x for x in proc.stderr.splitlines() if x.startswith(("ERROR", "WARNING"))]


@pytest.fixture
def service_factory(lmc: SimpleNamespace) -> Iterator[ModuleType]:
    """A stand-in for LMCache's vLLM service factory module (it imports fastapi, which the CPU
    install lacks): its two lookup methods call LMCache's factory as LMCache's do."""
    module = ModuleType(lmc.layout.module(lmcache_layout.SERVICE_FACTORY))

    class VllmServiceFactory:
        def __init__(self, config: Any, metadata: Any, role: str, **kwargs: Any) -> None:
            self.lmcache_config, self.metadata, self.role = config, metadata, role
            self.kwargs = kwargs  # connection_factory, for our classes only

        def maybe_create_lookup_client(self) -> Any:
            if self.role != "scheduler":
                return None
            return lmc.Factory.create_lookup_client(
                self.lmcache_config, self.metadata, None, **self.kwargs
            )

        def maybe_create_lookup_server(self) -> Any:
            if self.role != "worker":
                return None
            engine = SimpleNamespace(config=self.lmcache_config)
            return lmc.Factory.create_lookup_server(engine, self.metadata, **self.kwargs)

    module.VllmServiceFactory = VllmServiceFactory  # type: ignore[attr-defined]
    lmcache_guard.forget()
    assert lmcache_guard.watch_service_factory(module, integration.broker_requested)
    assert not lmcache_guard.watch_service_factory(module, integration.broker_requested)
    yield module
    lmcache_guard.unwatch_service_factory(module)
    lmcache_guard.forget()


def _errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def test_lmcache_own_client_for_a_broker_config_is_one_error(
    lmc: SimpleNamespace,
    installed: Any,
    service_factory: Any,
    make_metadata: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    broker = lmc.Config.from_defaults(chunk_size=16, extra_config=BROKER)
    plain = lmc.Config.from_defaults(chunk_size=16)
    meta = make_metadata()
    caplog.set_level(logging.DEBUG, logger=lmcache_guard.__name__)

    def build(config: Any) -> type:
        # One at a time: LMCache's sync clients share a ZMQ context that close() terminates.
        client = service_factory.VllmServiceFactory(config, meta, "scheduler")
        built = client.maybe_create_lookup_client()
        built.close()
        return type(built)

    assert build(plain) is lmc.SyncClient  # LMCache's, as asked: no ERROR
    assert _errors(caplog) == []
    integration.uninstall()  # as if something put LMCache's own functions back
    try:
        assert [build(broker), build(broker)] == [lmc.SyncClient] * 2
    finally:
        integration.install()  # the fixture uninstalls
    [error] = _errors(caplog)
    assert f"LMCache {lmc.version}" in error and "for a config that asks for the broker" in error
    assert f"{lmc.SyncClient.__module__}.LMCacheLookupClient" in error
    assert lmc.layout.module(lmcache_layout.FACTORY) in error  # what was expected


def test_our_client_and_server_pass_the_check(
    lmc: SimpleNamespace,
    installed: Any,
    service_factory: Any,
    make_metadata: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = fakeredis.FakeServer(server_type="redis", version=(7, 2))
    fake = {"connection_factory": lambda: fakeredis.FakeRedis(server=server)}
    broker = lmc.Config.from_defaults(chunk_size=16, enable_async_loading=True, extra_config=BROKER)
    meta = make_metadata()
    caplog.set_level(logging.DEBUG, logger=lmcache_guard.__name__)
    made = [
        service_factory.VllmServiceFactory(broker, meta, role, **fake)
        for role in ("scheduler", "worker")
    ]
    client = made[0].maybe_create_lookup_client()
    try:
        rank = made[1].maybe_create_lookup_server()
        try:
            assert type(client) is RedisAsyncLookupClient
            assert type(rank).__name__ == "LMCacheBrokerLookupServer"
        finally:
            rank.close()
    finally:
        client.close()
    assert not [r for r in caplog.records if r.name == lmcache_guard.__name__]  # not even DEBUG
