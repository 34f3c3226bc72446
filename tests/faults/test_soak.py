"""``broker-lookup soak`` for 15 seconds: chaos (rank SIGKILLs, server restarts) and mixed
traffic, with no wrong result, no hang and no key left without a TTL."""

from __future__ import annotations

import pytest

from broker_lookup.cli import main
from broker_lookup.soak import run_soak

pytestmark = [pytest.mark.real, pytest.mark.slow]


def test_soak_fifteen_seconds():
    summary = run_soak(15, 2, seed=7)
    assert summary["wrong"] == 0, summary
    assert summary["hangs"] == 0, summary
    assert summary["leaked_keys"] == 0, summary
    assert summary["right"] > 100 and summary["cancels"] > 0 and summary["reused_ids"] > 0
    # The first fault comes 3 to 8 s in, so 15 s always see at least one.
    assert summary["rank_kills"] + summary["server_restarts"] >= 1, summary
    assert summary["rank_exit_codes"] == [0, 0]  # SIGTERM at the end: ordered exits
    assert all(kb for kb in summary["rss_kb_start"].values()), summary["rss_kb_start"]
    assert all(kb for kb in summary["rss_kb_end"].values()), summary["rss_kb_end"]
    assert summary["p99_latency_ms"] > 0


def test_soak_cli_refuses_bad_arguments(capsys):
    assert main(["soak", "--duration", "0"]) == 2
    assert "--duration" in capsys.readouterr().err
