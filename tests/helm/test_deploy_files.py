"""Static checks of deploy/: Dockerfile, server config, ACL users, dashboard, alert rules."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from broker_lookup.ops.metrics import METRIC_NAMES

from ._acl import EXPECTED_COMMANDS, SHIPPED_ENGINE, AclUser, parse_acl
from ._chart import DEPLOY

pytestmark = pytest.mark.helm

METRIC_RE = re.compile(r"broker_lookup_[a-z_]+")

# ---------------------------------------------------------------- Dockerfile --


@dataclass
class Stage:
    base: str
    name: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def args_of(self, keyword: str) -> list[str]:
        return [rest for kw, rest in self.instructions if kw == keyword]


def parse_dockerfile(path: Path) -> tuple[dict[str, str], list[Stage]]:
    """(global ARG defaults, stages) with continuation lines joined and comments dropped."""
    logical: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        logical.append(pending + stripped)
        pending = ""
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in logical:
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            parts = rest.split()
            base = re.sub(
                r"\$\{(\w+)\}", lambda m: global_args.get(m.group(1), m.group(0)), parts[0]
            )
            name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else ""
            stages.append(Stage(base, name))
        elif not stages:
            if keyword == "ARG" and "=" in rest:
                key, _, value = rest.partition("=")
                global_args[key.strip()] = value.strip()
        else:
            stages[-1].instructions.append((keyword, rest))
    return global_args, stages


@pytest.fixture(scope="module")
def dockerfile() -> list[Stage]:
    return parse_dockerfile(DEPLOY / "Dockerfile")[1]


def test_dockerfile_is_multi_stage(dockerfile: list[Stage]) -> None:
    assert len(dockerfile) >= 2
    builder, final = dockerfile[0], dockerfile[-1]
    assert builder.name == "builder"
    assert final.base == "python:3.11-slim"
    assert builder.base == final.base, "the venv's interpreter path must exist in the final stage"


def test_dockerfile_builder_builds_the_wheel_and_torch(dockerfile: list[Stage]) -> None:
    runs = " ".join(dockerfile[0].args_of("RUN"))
    assert "python -m venv /opt/venv" in runs
    assert "torch==" in runs and "--index-url" in runs
    assert "build --wheel" in runs and "/wheels/*.whl" in runs


def test_dockerfile_final_stage(dockerfile: list[Stage]) -> None:
    final = dockerfile[-1]
    users = final.args_of("USER")
    assert users, "final stage must set USER"
    uid = users[-1].split(":")[0]
    assert uid == "10001"
    (entrypoint,) = final.args_of("ENTRYPOINT")
    assert json.loads(entrypoint) == ["python", "-m", "workers"]
    # USER comes before ENTRYPOINT and nothing after it switches back.
    keywords = [kw for kw, _ in final.instructions]
    assert keywords.index("USER") < keywords.index("ENTRYPOINT")
    copies = final.args_of("COPY")
    assert copies == ["--from=builder /opt/venv /opt/venv"], "final stage copies only the venv"


def test_dockerfile_final_stage_has_no_compilers(dockerfile: list[Stage]) -> None:
    final = dockerfile[-1]
    text = " ".join(rest for _, rest in final.instructions).lower()
    for forbidden in ("gcc", "g++", "build-essential", "apt-get install", "pip install", "clang"):
        assert forbidden not in text, forbidden
    for run in final.args_of("RUN"):
        argv = shlex.split(run)
        assert "apt-get" not in argv and "apk" not in argv


def test_dockerignore_keeps_the_context_small() -> None:
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    assert "**" in ignore  # deny by default
    allowed = {line[1:] for line in ignore if line.startswith("!")}
    assert allowed == {"pyproject.toml", "README.md", "broker_lookup/**", "workers/**"}


# ----------------------------------------------------------- server config --


def parse_server_config(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition(" ")
            out.setdefault(key.lower(), []).append(value.strip())
    return out


def test_valkey_conf() -> None:
    text = (DEPLOY / "valkey.conf").read_text()
    config = parse_server_config(text)
    assert config["maxmemory-policy"] == ["noeviction"]
    assert config["save"] == ['""']
    assert config["appendonly"] == ["no"]
    assert config["protected-mode"] == ["yes"]
    assert "requirepass" not in config
    assert "aclfile" not in config, "the ACL example stays commented out"
    assert re.search(r"^# aclfile \S+users\.acl$", text, re.M)


# ------------------------------------------------------------------- ACL --


@pytest.fixture(scope="module")
def acl() -> dict[str, AclUser]:
    return parse_acl(DEPLOY / "users.acl")


def test_acl_default_user_is_off(acl: dict[str, AclUser]) -> None:
    default = acl["default"]
    assert not default.enabled
    assert default.allowed == set()
    assert "nopass" not in default.rules


def test_acl_roles(acl: dict[str, AclUser]) -> None:
    assert set(acl) == {"default", "scheduler", "worker", "vllm", "operator", "admin", "router"}


@pytest.mark.parametrize("role", ["scheduler", "worker", "vllm", "operator", "admin", "router"])
def test_acl_least_privilege(acl: dict[str, AclUser], role: str) -> None:
    user = acl[role]
    assert user.enabled
    rules = user.rules
    # Reset first, then deny everything, then grant.
    first_grant = min(i for i, r in enumerate(rules) if r.startswith("+"))
    assert rules.index("resetkeys") < first_grant
    assert rules.index("resetchannels") < first_grant
    assert rules.index("-@all") < first_grant
    # One engine's keys and its vLLM instances' (the admin's SCRIPT KILL needs none).
    scoped = [
        f"~bl:{{{SHIPPED_ENGINE}}}:*",
        f"~bl:{{{SHIPPED_ENGINE}@*}}:*",
        f"~bl:members:{{{SHIPPED_ENGINE}}}",
    ]
    if role == "router":  # its engine's probes, answers, epochs and heartbeats alone
        scoped = [
            f"~bl:{{{engine}}}:{tail}"
            for tail in ("epochs", "hb:*", "probes", "probe:*")
            for engine in (SHIPPED_ENGINE, SHIPPED_ENGINE + "@*")
        ]
    assert user.key_patterns == ([] if role == "admin" else scoped)
    assert user.allowed == EXPECTED_COMMANDS[role]
    for broad in ("allkeys", "~*", "+@all", "allcommands", "allchannels", "&*", "nopass"):
        assert broad not in rules, broad
    assert not [r for r in rules if r.startswith("+@")], "no category grants"
    (password,) = user.passwords
    assert password.startswith(">changeme-") or re.fullmatch(r"#[0-9a-f]{64}", password)


def test_acl_operator_is_read_only(acl: dict[str, AclUser]) -> None:
    writes = {"set", "del", "hset", "xadd", "xack", "xtrim", "expire", "pexpire", "eval"}
    assert not acl["operator"].allowed & writes
    assert not acl["admin"].allowed & writes


# ----------------------------------------------------- dashboard and alerts --


def metric_names(expr: str) -> set[str]:
    return set(METRIC_RE.findall(expr))


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((DEPLOY / "grafana" / "broker-lookup.json").read_text())
    return data


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def _exprs(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in _panels(dashboard) for t in p.get("targets", [])]


def test_dashboard_metrics_exist(dashboard: dict[str, Any]) -> None:
    exprs = _exprs(dashboard)
    assert exprs
    for expr in exprs:
        names = metric_names(expr)
        assert names, f"no broker_lookup metric in {expr!r}"
        assert names <= METRIC_NAMES, f"unknown metrics {names - METRIC_NAMES} in {expr!r}"


def test_dashboard_covers_the_signals(dashboard: dict[str, Any]) -> None:
    exprs = _exprs(dashboard)
    used = set().union(*(metric_names(e) for e in exprs))
    for name in (
        "broker_lookup_client_lookups_total",
        "broker_lookup_client_latency_seconds_bucket",
        "broker_lookup_client_inflight",
        "broker_lookup_worker_group_lag",
        "broker_lookup_worker_group_pending",
        "broker_lookup_worker_heartbeat_age_seconds",
        "broker_lookup_worker_dead_letters_total",
        "broker_lookup_worker_reports_dropped_total",
    ):
        assert name in used, name
    assert any("by (engine, outcome)" in e and "lookups_total" in e for e in exprs)
    for quantile in ("0.5", "0.99"):
        assert any(
            f"histogram_quantile({quantile}," in e and "client_latency_seconds_bucket" in e
            for e in exprs
        ), quantile
    assert any("by (engine, rank)" in e and "group_lag" in e for e in exprs)


#: A series selector of the dashboard: a metric name and its label matchers, if any.
SELECTOR_RE = re.compile(r"\b(broker_lookup_[a-z_]+)(\{[^}]*\})?")
ENGINE_FILTER = 'engine=~"$engine"'


def unfiltered(expr: str) -> list[str]:
    """The series selectors of ``expr`` without the dashboard's engine filter."""
    return [
        m.group(0) for m in SELECTOR_RE.finditer(expr) if ENGINE_FILTER not in (m.group(2) or "")
    ]


def test_every_dashboard_query_filters_by_the_engine_variable(dashboard: dict[str, Any]) -> None:
    """On a fleet a query without the filter would sum every engine whatever is selected."""
    for expr in _exprs(dashboard):
        assert not unfiltered(expr), f"{unfiltered(expr)} in {expr!r} lack {ENGINE_FILTER}"
    engine = {v["name"]: v for v in dashboard["templating"]["list"]}["engine"]
    assert engine["type"] == "query" and engine["multi"] and engine["includeAll"]
    # All is ".*", not the list of engines seen: it keeps series without an engine label
    # (a process scraped directly) and engines that appeared since the list was read.
    assert engine["allValue"] == ".*"
    assert engine["datasource"]["uid"] == "${datasource}"
    names = metric_names(engine["query"]["query"])
    assert names <= METRIC_NAMES and "engine)" in engine["query"]["query"]


def test_the_filter_check_catches_a_query_without_it() -> None:
    one = 'sum(rate(broker_lookup_client_lookups_total{engine=~"$engine"}[5m]))'
    assert not unfiltered(one)
    assert unfiltered(one + " / sum(rate(broker_lookup_client_lookups_total[5m]))") == [
        "broker_lookup_client_lookups_total"
    ]
    assert unfiltered('broker_lookup_worker_group_lag{rank="0"}') == [
        'broker_lookup_worker_group_lag{rank="0"}'
    ]


def test_dashboard_structure(dashboard: dict[str, Any]) -> None:
    assert dashboard["uid"] == "broker-lookup"
    panels = _panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}"
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24
        mine = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not cells & mine, f"panel {panel['title']!r} overlaps another"
        cells |= mine


@pytest.fixture(scope="module")
def alert_rules() -> list[dict[str, Any]]:
    data = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yaml").read_text())
    assert set(data) == {"groups"}
    rules: list[dict[str, Any]] = []
    for group in data["groups"]:
        assert group["name"] and group["rules"]
        rules.extend(group["rules"])
    return rules


DURATION_RE = re.compile(r"([0-9]+(ms|s|m|h|d|w|y))+")


def test_alert_rules_are_well_formed(alert_rules: list[dict[str, Any]]) -> None:
    names = [r["alert"] for r in alert_rules]
    assert len(names) == len(set(names))
    for rule in alert_rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations", "keep_firing_for"}
        assert rule["alert"].startswith("BrokerLookup")
        assert rule["labels"]["severity"] in ("critical", "warning", "info")
        assert rule["annotations"]["summary"]
        assert rule["annotations"]["description"]
        if "for" in rule:
            assert DURATION_RE.fullmatch(rule["for"]), rule["for"]
        assert rule["expr"].count("(") == rule["expr"].count(")")


def test_alert_metrics_exist(alert_rules: list[dict[str, Any]]) -> None:
    for rule in alert_rules:
        names = metric_names(rule["expr"])
        assert names, rule["alert"]
        assert names <= METRIC_NAMES, f"{rule['alert']}: unknown {names - METRIC_NAMES}"


def test_alerts_cover_the_failure_modes(alert_rules: list[dict[str, Any]]) -> None:
    by_metric: dict[str, list[str]] = {}
    for rule in alert_rules:
        for name in metric_names(rule["expr"]):
            by_metric.setdefault(name, []).append(rule["expr"])
    assert "broker_lookup_worker_heartbeat_age_seconds" in by_metric  # stale heartbeat
    assert "broker_lookup_client_dead_ranks" in by_metric  # a dead rank, lookups or not
    assert "broker_lookup_worker_group_lag" in by_metric  # lag
    assert "broker_lookup_worker_dead_letters_total" in by_metric  # dead letters
    assert any('outcome="timeout"' in e for e in by_metric["broker_lookup_client_lookups_total"])
    assert "broker_lookup_client_redis_errors_total" in by_metric
    assert "broker_lookup_worker_redis_errors_total" in by_metric
    # Redis down for everyone (the exporter still answers), and no exporter at all.
    assert any("== 0" in e for e in by_metric["broker_lookup_redis_up"])
    assert any("absent(broker_lookup_redis_up)" in e for e in by_metric["broker_lookup_redis_up"])
    # A scheduler cut off from Redis cannot publish its breaker: ranks without a scheduler.
    assert any("unless on (engine)" in e for e in by_metric["broker_lookup_client_owner"])


# An aggregation, with its grouping if any: "sum(", "max by (engine) (", "count by(a, b)(".
AGGREGATION_RE = re.compile(r"\b(sum|max|min|avg|count|topk|bottomk)\s*(?:by\s*\(([^)]*)\))?\s*\(")
# A vector match, with its labels: "on ()", "on (engine)", "ignoring (rank)".
MATCHING_RE = re.compile(r"\b(on|ignoring)\s*\(([^)]*)\)")


def fleet_problems(expr: str) -> list[str]:
    """What in ``expr`` would add engines together or match one engine against another.

    On one Prometheus for a fleet, an alert must say which engine it is about: every
    aggregation keeps ``engine`` in its ``by``, no ``scalar()`` folds engines into one
    number, and every ``on`` matches by engine (``histogram_quantile`` keeps what its
    inner ``sum by`` kept).
    """
    problems = []
    for op, grouping in AGGREGATION_RE.findall(expr):
        labels = {x.strip() for x in grouping.split(",")} if grouping else set()
        if "engine" not in labels:
            problems.append(f"{op} without engine in its by")
    if "scalar(" in expr:
        problems.append("scalar() folds every engine into one number")
    for kind, labels in MATCHING_RE.findall(expr):
        if kind == "on" and "engine" not in {x.strip() for x in labels.split(",")}:
            problems.append(f"on ({labels}) matches across engines")
    return problems


#: Alerts about the server and the exporter themselves: every engine at once, no engine label.
SERVER_WIDE = {"BrokerLookupRedisDown", "BrokerLookupExporterDown"}


def test_every_alert_says_which_engine(alert_rules: list[dict[str, Any]]) -> None:
    assert SERVER_WIDE <= {r["alert"] for r in alert_rules}
    for rule in alert_rules:
        if rule["alert"] in SERVER_WIDE:
            assert "engine" not in rule["expr"], rule["alert"]
            continue
        assert not fleet_problems(rule["expr"]), (rule["alert"], fleet_problems(rule["expr"]))
        text = rule["annotations"]["summary"] + rule["annotations"]["description"]
        assert "$labels.engine" in text, f"{rule['alert']} does not name the engine"


def test_the_fleet_check_catches_an_alert_that_adds_engines_together() -> None:
    assert fleet_problems("sum(rate(x[5m])) > 0") == ["sum without engine in its by"]
    assert fleet_problems("sum by (rank) (x) / scalar(sum by (engine) (x))") == [
        "sum without engine in its by",
        "scalar() folds every engine into one number",
    ]
    assert fleet_problems("x and on() y") == ["on () matches across engines"]
    assert fleet_problems("sum by (engine, rank) (x) / on (engine) group_left () y") == []
    assert fleet_problems("histogram_quantile(0.99, sum by (engine, le) (rate(b[5m])))") == []


def test_metric_regex_catches_unknown_names() -> None:
    """The checks above would notice a renamed metric."""
    names = metric_names('sum(rate(broker_lookup_client_lookups_totl{outcome="hit"}[5m]))')
    assert names == {"broker_lookup_client_lookups_totl"}
    assert not names <= METRIC_NAMES
