"""``BrokerLookupEngineSplit`` fires, with ``promtool test rules`` (Prometheus's own rule
engine), for each half of a split engine as the exporter exports it, and not for a whole
one."""

from __future__ import annotations

from pathlib import Path

import yaml
from promkit import ALERTS, promtool, require_prometheus

SERIES = "broker_lookup_engine_split{{engine={engine!r},configured_engine_id='mn'}}"


def _alert(engine: str) -> dict[str, object]:
    """The alert as it fires for ``engine``: its labels and its annotations filled in."""
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    (rule,) = [r for g in groups for r in g["rules"] if r["alert"] == "BrokerLookupEngineSplit"]
    filled = {
        name: text.replace("{{ $labels.engine }}", engine).replace(
            "{{ $labels.configured_engine_id }}", "mn"
        )
        for name, text in rule["annotations"].items()
    }
    labels = {"severity": "critical", "engine": engine, "configured_engine_id": "mn"}
    return {"exp_labels": labels, "exp_annotations": filled}


def test_a_split_engine_fires_for_both_halves_and_a_whole_one_does_not(tmp_path: Path) -> None:
    binary = require_prometheus()
    halves, whole = ["mn@1796611254403740308", "mn@1796611254717787091"], "mn@1796611254999"
    series = [{"series": SERIES.format(engine=e), "values": "1x10"} for e in halves]
    series.append({"series": SERIES.format(engine=whole), "values": "0x10"})
    tests = {
        "rule_files": [str(ALERTS)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": series,
                "alert_rule_test": [
                    {"eval_time": "1m", "alertname": "BrokerLookupEngineSplit", "exp_alerts": []},
                    {
                        "eval_time": "3m",
                        "alertname": "BrokerLookupEngineSplit",
                        "exp_alerts": [_alert(e) for e in halves],
                    },
                ],
            }
        ],
    }
    path = tmp_path / "split-test.yaml"
    path.write_text(yaml.safe_dump(tests))
    done = promtool(binary, "test", "rules", str(path))
    assert done.returncode == 0, done.stdout + done.stderr
