"""``broker-lookup demo --vllm`` as a user runs it: a real vLLM engine on the broker, the
same prompt twice, the hit shown with the exporter's series and inspect's report."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from vllm_harness import ROOT

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]


def test_demo_vllm_shows_the_hit_and_where_to_see_it(vllm_installed: None) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "broker_lookup.cli", "demo", "--vllm"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr[-4000:]
    assert "256 tokens found through the broker" in out, out
    assert 'broker_lookup_client_lookups_total{engine="demo-vllm@' in out, out
    assert 'outcome="hit",role="scheduler"} 1' in out, out
    assert "broker_lookup_worker_requests_total" in out, out
    assert "RANKS (world size 1)" in out, out  # inspect's report
    assert "broker-lookup exporter --redis-url" in out and "broker-lookup inspect" in out, out
