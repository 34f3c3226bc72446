"""``python -m benchmarks.bench --cluster`` smoke: both topologies start, lookups flow, a table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.real, pytest.mark.slow, pytest.mark.long]


def test_cluster_bench_measures_one_node_and_a_cluster(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    args = ["--engines", "1", "--duration", "0.3", "--out", str(out)]
    code = "import sys; from benchmarks.bench import cluster as b\nsys.exit(b.main(sys.argv[1:]))"
    done = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(out.read_text())
    for kind in ("single", "cluster"):
        assert set(results[kind]) == {"1"}
        assert all(cell["lookups_per_s"] > 0 for cell in results[kind].values())
    assert len(results["cluster"]["1"]["server_cpu"]) == 3
    assert "cluster lookups/s" in done.stdout
