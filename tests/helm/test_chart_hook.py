"""``helm test`` on the default install (a vLLM fleet, the chart's Redis with its ACL users):
the hook's command, resolved as its pod would run it, against a real server loaded with the
rendered ACL.

* a fresh install, nothing serving yet: exit 0 (the operator user reads the engine's keys);
* two serving vLLM instances of the configured id (``<id>@a``, ``<id>@b``; rank and
  scheduler as the chart's ``vllm-<id>`` user): exit 0;
* a split (a scheduler in one namespace, its rank in another): exit 1, naming it.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
from helpers import wait_until

from broker_lookup import LookupConfig, LookupMetadata, RedisAsyncLookupClient
from broker_lookup.processes import free_port
from broker_lookup.stub_engine import StubEngine
from workers.server import RedisAsyncLookupServer

from ._chart import REPO, Rendered, RenderFn
from ._server import running_server, server_binary
from .test_chart_acl import _build_acl, _secret
from .test_chart_executes import resolve

pytestmark = [pytest.mark.helm, pytest.mark.real, pytest.mark.slow]

ENGINE = "vllm-engine"  # the chart's default engine id
#: Short timers: a rank is seen alive within a second.
FAST: dict[str, Any] = {"block_ms": 50, "heartbeat_interval_ms": 100, "heartbeat_ttl_ms": 1500}


@contextmanager
def _chart_redis(rendered: Rendered, root: Path) -> Iterator[int]:
    """The chart's Redis config and rendered ACL users on a local server: its port."""
    acl_file = _build_acl(rendered, root)
    conf = rendered.get("ConfigMap", "-redis")["data"]["valkey.conf"]
    conf = conf.replace("aclfile /acl/users.acl", f"aclfile {acl_file}")
    conf = conf.replace("\ndir /data\n", f"\ndir {root}\n")
    (root / "valkey.conf").write_text(conf)
    port = free_port()
    argv = [server_binary(), str(root / "valkey.conf"), "--port", str(port)]
    with running_server(argv, port, root / "server.log"):
        yield port


def _hook(rendered: Rendered, port: int, root: Path) -> subprocess.CompletedProcess[str]:
    """The hook pod's command, its in-cluster Redis service replaced by the local server."""
    hook = resolve(rendered, rendered.get("Pod", "-test-inspect"), "inspect", 0, root / "hook")
    service = hook.env["BROKER_LOOKUP_REDIS_URL"]
    assert service.startswith("redis://") and service.endswith("/0"), service
    local = f"redis://127.0.0.1:{port}/0"
    argv = [local if a == service else a for a in hook.argv]
    assert local in argv, "the hook names no --redis-url"
    env = {**os.environ, **hook.env, "BROKER_LOOKUP_REDIS_URL": local}
    assert env["BROKER_LOOKUP_REDIS_USERNAME"] == f"operator-{ENGINE}"
    return subprocess.run(
        argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=60, check=False
    )


class _Fleet:
    """In-process vLLM-like processes as the chart's ``vllm-<id>`` user: ranks and
    schedulers, each in its own namespace."""

    def __init__(self, rendered: Rendered, port: int, stack: ExitStack) -> None:
        user = f"vllm-{ENGINE}"
        self.config = LookupConfig(
            redis_url=f"redis://{user}@127.0.0.1:{port}/0",
            redis_password=_secret(rendered)[user],
            **FAST,
        )
        self.stack = stack

    def rank(self, namespace: str) -> None:
        """Rank 0 of ``namespace``, once it reads its group and has written a heartbeat."""
        meta = LookupMetadata(engine_id=namespace, world_size=1, worker_id=0)
        server = RedisAsyncLookupServer(StubEngine(), meta, self.config)
        self.stack.callback(server.close)
        wait_until(
            lambda: server.ready and bool(server.stats().last_heartbeat),
            30,
            0.05,
            f"rank 0 of {namespace} ready and beating",
        )

    def scheduler(self, namespace: str) -> RedisAsyncLookupClient:
        meta = LookupMetadata(engine_id=namespace, world_size=1)
        client = RedisAsyncLookupClient(self.config, meta)
        self.stack.callback(client.close)
        return client


def _serving(client: RedisAsyncLookupClient) -> None:
    """Until the scheduler holds its lease and sees its rank alive."""

    def ready() -> bool:
        return client.lease.held() and not client.stats().dead_ranks

    wait_until(ready, 30, 0.05, "the scheduler serving with its rank alive")


def test_hook_passes_on_a_fresh_install_and_a_serving_fleet(
    render: RenderFn, tmp_path: Path
) -> None:
    rendered = render()  # the default install: a vLLM fleet, no reference workers
    assert not rendered.has("StatefulSet", "-worker")
    with _chart_redis(rendered, tmp_path) as port, ExitStack() as stack:
        fresh = _hook(rendered, port, tmp_path)
        assert fresh.returncode == 0, fresh.stdout + fresh.stderr
        assert "nothing to check" in fresh.stdout

        fleet = _Fleet(rendered, port, stack)
        for instance in ("a", "b"):
            fleet.rank(f"{ENGINE}@{instance}")
            _serving(fleet.scheduler(f"{ENGINE}@{instance}"))
        serving = _hook(rendered, port, tmp_path)
        assert serving.returncode == 0, serving.stdout + serving.stderr
        assert f"2 namespace(s) of engine {ENGINE}" in serving.stdout, serving.stdout
        assert "CHECK OK" in serving.stdout


def test_hook_fails_on_a_split_engine(render: RenderFn, tmp_path: Path) -> None:
    rendered = render()
    with _chart_redis(rendered, tmp_path) as port, ExitStack() as stack:
        fleet = _Fleet(rendered, port, stack)
        # A two-node launch whose nodes drew different instance ids: the scheduler of one
        # waits for a rank that serves the other.
        head = fleet.scheduler(f"{ENGINE}@node0")
        fleet.rank(f"{ENGINE}@node1")
        wait_until(lambda: head.lease.held(), 30, 0.05, "the scheduler's lease")
        split = _hook(rendered, port, tmp_path)
        output = split.stdout + split.stderr
        assert split.returncode == 1, output
        assert "is split" in output and f"{ENGINE}@node1" in output, output
        assert "Traceback" not in output
