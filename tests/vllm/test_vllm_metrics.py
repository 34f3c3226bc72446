"""Metrics from inside vLLM, through Redis: after real requests through vLLM's OpenAI server,
``broker-lookup exporter`` (as a user runs it) serves the scheduler's outcome counters and
the rank's counters, equal to what our client and server in vLLM's processes counted, and a
real Prometheus scraping it answers every query of the shipped dashboard and evaluates
every alert rule over series that exist. No process inside vLLM registers anything or
opens a port: each publishes its snapshot to Redis."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import wait_until
from promkit import (
    ALERTS,
    Prometheus,
    check_shipped_queries,
    dashboard_exprs,
    promtool,
    require_prometheus,
    wait_for,
)
from scenario import prompt_ids
from vllm_harness import ROOT, healthy, post

from broker_lookup.processes import end_group, free_port

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture
def exporter(served: dict[str, Any], tmp_path: Path) -> Iterator[int]:
    """``broker-lookup exporter --engine-id bl-serve`` on a free port; yields the port."""
    port = free_port()
    cmd = [sys.executable, "-m", "broker_lookup.cli", "exporter", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--redis-url", served["redis_url"]]
    cmd += ["--engine-id", served["engine_id"]]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    log = (tmp_path / "exporter.log").open("wb")
    proc = subprocess.Popen(
        cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    log.close()
    try:
        wait_until(lambda: proc.poll() is None and healthy(port, "/readyz"), timeout=60)
        yield port
    finally:
        end_group(proc)


def test_prometheus_scrapes_what_vllm_did(
    served: dict[str, Any], exporter: int, tmp_path: Path
) -> None:
    binary = require_prometheus()
    port, vocab = served["port"], served["vocab"]
    body = {"model": "tiny", "prompt": prompt_ids(21, vocab), "max_tokens": 4, "temperature": 0}
    assert post(port, body)[0] == 200
    assert post(port, body)[0] == 200  # the repeat: its first chunk found through the broker
    assert post(port, {**body, "prompt": prompt_ids(22, vocab)})[0] == 200
    found = served["probe"](2)
    (client,) = [c for p in found for c in p["clients"]]
    (server,) = [s for p in found for s in p["servers"]]
    assert client["outcomes"]["hit"] >= 1, client

    prom = Prometheus(binary, [f"127.0.0.1:{exporter}"], tmp_path).start()
    try:
        sched = 'configured_engine_id="bl-serve",role="scheduler"'
        for outcome, count in client["outcomes"].items():
            wait_for(
                prom, f'broker_lookup_client_lookups_total{{{sched},outcome="{outcome}"}}', count
            )
        wait_for(prom, f"broker_lookup_client_hit_tokens_total{{{sched}}}", client["hit_tokens"])
        wait_for(prom, f"broker_lookup_client_owner{{{sched}}}", 1)
        rank = 'configured_engine_id="bl-serve",role="worker",rank="0"'
        wait_for(
            prom, f"broker_lookup_worker_requests_total{{{rank}}}", server["counts"]["requests"]
        )
        wait_for(prom, f"broker_lookup_worker_owner{{{rank}}}", 1)
        for who in (sched, rank):  # each process says which LMCache it runs
            version = prom.values(f"broker_lookup_lmcache_info{{{who}}}")
            assert [dict(labels)["version"] for labels in version] == ["0.5.6"], who
        assert prom.scraped(), prom.log()
        # The engine label: the key namespace, "bl-serve@<instance>" where vLLM derives it.
        (owner,) = prom.values(f"broker_lookup_client_owner{{{sched}}}")
        engine = dict(owner)["engine"]
        assert engine in check_shipped_queries(prom, engine)
        names = "client_lookups|client_hit_tokens|worker_requests|worker_reports"
        shown = prom.query(f'{{__name__=~"broker_lookup_({names})_total"}} > 0')
        print("\nscraped after the requests (non-zero counters):")
        for sample in sorted(shown, key=lambda s: sorted(s["metric"].items())):
            labels = {
                k: v for k, v in sample["metric"].items() if k not in ("instance", "job", "host")
            }
            print(f"  {labels.pop('__name__')}{labels} {sample['value'][1]}")
        print(f"dashboard queries with data, for All and for {engine}: {len(dashboard_exprs())}")
    finally:
        prom.stop()
    done = promtool(binary, "check", "rules", str(ALERTS))
    assert done.returncode == 0, done.stdout + done.stderr
