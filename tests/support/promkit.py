"""A real Prometheus for the tests: scrape the exporter, run the dashboard's queries and
the alert rules against it.

Debian's ``prometheus`` package (``prometheus`` and ``promtool`` on PATH, or
``BROKER_LOOKUP_TEST_PROMETHEUS`` naming the binary). Without it the tests that need it
skip, except under ``CI``, where they fail (``.ci/run`` installs it).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import wait_until

from broker_lookup.processes import free_port

__all__ = [
    "ALERTS",
    "ALERT_TESTS",
    "DASHBOARD",
    "Prometheus",
    "alert_exprs",
    "check_shipped_queries",
    "dashboard_exprs",
    "firing",
    "grafana_regex",
    "metric_names",
    "promtool",
    "require_prometheus",
    "rules_with_for",
    "wait_for",
]

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "broker-lookup.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yaml"
#: promtool unit tests of ALERTS (``promtool test rules``).
ALERT_TESTS = ROOT / "deploy" / "prometheus" / "alerts_test.yaml"
BINARY_ENV = "BROKER_LOOKUP_TEST_PROMETHEUS"
#: What Grafana puts for ``$__rate_interval``: at least 4 scrapes of the tests' 1 s interval.
RATE_INTERVAL = "30s"
RATE_VAR = "$__rate_interval"
ENGINE_VAR = "$engine"
_METRIC_RE = re.compile(r"\bbroker_lookup_[a-z_]+\b")


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def require_prometheus() -> str:
    """The ``prometheus`` binary; skip without one (fail under CI)."""
    binary = os.environ.get(BINARY_ENV) or shutil.which("prometheus")
    if binary and shutil.which("promtool", path=str(Path(binary).parent)):
        return binary
    reason = "no prometheus/promtool on PATH (Debian: apt-get install prometheus)"
    if _in_ci():
        pytest.fail(f"CI is set, so the Prometheus tests must run, but {reason}", pytrace=False)
    pytest.skip(reason)


def promtool(binary: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``promtool ARGS`` beside ``binary``."""
    tool = shutil.which("promtool", path=str(Path(binary).parent))
    assert tool
    return subprocess.run([tool, *args], capture_output=True, text=True, timeout=60, check=False)


def metric_names(expr: str) -> set[str]:
    """The broker_lookup series names an expression reads."""
    return set(_METRIC_RE.findall(expr))


def grafana_regex(value: str) -> str:
    """``value`` as Grafana puts one selected value of a multi-value variable into a
    ``=~"..."`` matcher: regex metacharacters escaped (``.`` -> ``\\\\.``, the
    backslash doubled for the PromQL string)."""
    return re.sub(r"([\\^$*+?.()|{}\[\]])", r"\\\\\1", value)


def dashboard_exprs(engine: str | None = None) -> list[tuple[str, str]]:
    """(panel title, expr) of every query of the shipped Grafana dashboard, with the
    variables as Grafana sets them: ``$engine`` for All (``.*``, the variable's allValue)
    or for ``engine`` alone, ``$__rate_interval`` for a 1 s scrape interval.

    Raises:
        AssertionError: a query does not read ``$engine`` (it would show every engine).
    """
    data = json.loads(DASHBOARD.read_text())
    panels = [p for top in data["panels"] for p in (top, *top.get("panels", []))]
    value = ".*" if engine is None else grafana_regex(engine)
    out: list[tuple[str, str]] = []
    for p in panels:
        for t in p.get("targets", []):
            expr = t["expr"]
            assert ENGINE_VAR in expr, f"panel {p['title']!r} ignores {ENGINE_VAR}: {expr}"
            out.append(
                (p["title"], expr.replace(ENGINE_VAR, value).replace(RATE_VAR, RATE_INTERVAL))
            )
    return out


def alert_exprs() -> list[tuple[str, str]]:
    """(alert name, expr) of every rule of the shipped alerts file."""
    data = yaml.safe_load(ALERTS.read_text())
    return [(r["alert"], r["expr"]) for g in data["groups"] for r in g["rules"]]


def rules_with_for(work: Path, hold: str) -> Path:
    """A copy of ALERTS in ``work`` with every rule's ``for`` set to ``hold`` (a test cannot
    wait the shipped minutes; what each rule fires on stays as shipped)."""
    data = yaml.safe_load(ALERTS.read_text())
    for group in data["groups"]:
        for rule in group["rules"]:
            rule["for"] = hold
    path = work / "alerts.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@dataclass
class Prometheus:
    """A Prometheus server scraping ``targets`` every ``interval`` (rules evaluated as
    often), with a storage dir of its own."""

    binary: str
    targets: list[str]
    work: Path
    rules: Path | None = None
    interval: str = "1s"
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 60.0) -> Prometheus:
        """Start it; return once it answers ready."""
        self.port = free_port()
        config = self.work / "prometheus.yml"
        settings: dict[str, Any] = {
            "global": {"scrape_interval": self.interval, "evaluation_interval": self.interval},
            "scrape_configs": [
                {"job_name": "broker-lookup", "static_configs": [{"targets": self.targets}]}
            ],
        }
        if self.rules is not None:
            settings["rule_files"] = [str(self.rules)]
        config.write_text(yaml.safe_dump(settings))
        log = (self.work / "prometheus.log").open("wb")
        self.proc = subprocess.Popen(
            [
                self.binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={self.work / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--web.enable-lifecycle",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        wait_until(self._ready, timeout=timeout_s, interval=0.1, message="Prometheus ready")
        return self

    def _ready(self) -> bool:
        assert self.proc is not None and self.proc.poll() is None, self.log()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def log(self) -> str:
        """The tail of its log."""
        path = self.work / "prometheus.log"
        return path.read_bytes()[-4000:].decode(errors="replace") if path.exists() else ""

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector (or scalar, as one sample) of ``expr`` now.

        Raises:
            AssertionError: Prometheus refused the expression.
        """
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode(
            {"query": expr}
        )
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"Prometheus refused {expr!r}: {exc.read()!r}") from None
        assert body["status"] == "success", (expr, body)
        data = body["data"]
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        result: list[dict[str, Any]] = data["result"]
        return result

    def values(self, expr: str) -> dict[frozenset[tuple[str, str]], float]:
        """{labels: value} of ``expr`` now."""
        return {frozenset(s["metric"].items()): float(s["value"][1]) for s in self.query(expr)}

    def scraped(self) -> bool:
        """Whether the last scrape of every target succeeded."""
        up = self.values('up{job="broker-lookup"}')
        return len(up) == len(self.targets) and all(v == 1.0 for v in up.values())

    def stop(self) -> None:
        """Stop it (SIGTERM, then SIGKILL) and wait."""
        proc = self.proc
        if proc is None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        self.proc = None


def firing(prom: Prometheus, alert: str) -> list[dict[str, str]]:
    """The labels of each firing instance of ``alert`` now."""
    found = prom.query(f'ALERTS{{alertname="{alert}",alertstate="firing"}}')
    return [s["metric"] for s in found]


def check_shipped_queries(prom: Prometheus, engine: str, timeout_s: float = 60.0) -> set[str]:
    """Every dashboard query returns data with the engine variable at All and at
    ``engine`` alone (then every series that keeps the ``engine`` label is that engine's),
    every alert rule evaluates, and every series an alert reads exists; returns the
    engines the All queries showed.

    Waits (up to ``timeout_s``) for the rates to have two samples in their window.
    """
    shown: set[str] = set()
    for selected in (None, engine):
        for title, expr in dashboard_exprs(selected):
            found = _answer(prom, expr, timeout_s, f"the dashboard panel {title!r}")
            engines = {s["metric"]["engine"] for s in found if "engine" in s["metric"]}
            if selected is None:
                shown |= engines
            else:
                assert engines <= {engine}, f"{title!r} at {engine!r} shows {engines}: {expr}"
    for name, expr in alert_exprs():
        prom.query(expr)  # evaluates (a quiet fleet fires nothing: empty is right)
        for series in metric_names(expr):
            assert prom.query(f"count({series})"), f"{name} reads {series}: no such series"
    return shown


def _answer(prom: Prometheus, expr: str, timeout_s: float, what: str) -> list[dict[str, Any]]:
    """The non-empty answer to ``expr``, once there is one."""

    def answered() -> list[dict[str, Any]]:
        return prom.query(expr)

    found = wait_until(
        answered, timeout=timeout_s, interval=0.5, message=f"data for {what}: {expr}"
    )
    assert isinstance(found, list)
    return found


def wait_for(prom: Prometheus, expr: str, want: float, timeout_s: float = 60.0) -> None:
    """Until ``expr`` is one sample equal to ``want``."""

    def there() -> bool:
        found = list(prom.values(expr).values())
        return found == [want]

    wait_until(there, timeout=timeout_s, interval=0.5, message=f"{expr} == {want}")
