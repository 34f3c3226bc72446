"""`helm lint --strict` and the values schema (unknown keys, bad values, values/schema parity)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from ._chart import CHART, IMAGE_SET, KUBE_VERSION, RenderFailFn, run_helm

pytestmark = pytest.mark.helm

CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))


def _lint(helm: str, *args: str) -> None:
    result = run_helm(helm, "lint", "--strict", str(CHART), "--kube-version", KUBE_VERSION, *args)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


def test_lint_strict_default_values(helm: str) -> None:
    """The defaults plus the one value they lack: the image no public registry serves
    (helm lint itself passes over the chart's ``fail``)."""
    _lint(helm, *IMAGE_SET)


def test_without_an_image_the_chart_refuses_and_says_how_to_get_one(
    helm: str, render_fails: RenderFailFn
) -> None:
    result = run_helm(helm, "template", "bl", str(CHART))  # the defaults, as `helm install`
    assert result.returncode != 0
    for stderr in (result.stderr, render_fails("image.repository=")):
        assert "image.repository is not set" in stderr, stderr
        assert "deploy/Dockerfile" in stderr and "push" in stderr
    # Nothing renders the image: nothing needs one.
    off = run_helm(
        helm,
        "template",
        "bl",
        str(CHART),
        "--set",
        "exporter.enabled=false,tests.enabled=false",
        check=True,
    )
    assert 'image: "valkey/valkey' in off.stdout


@pytest.mark.parametrize("values_file", CI_VALUES, ids=[p.name for p in CI_VALUES])
def test_lint_strict_ci_values(helm: str, values_file: Path) -> None:
    _lint(helm, "-f", str(values_file))


def test_lint_strict_every_feature_on_via_set(helm: str) -> None:
    _lint(
        helm,
        *IMAGE_SET,
        "--set",
        "engine.worldSize=2,pdb.enabled=true,networkPolicy.enabled=true,"
        "metricsService.enabled=true,serviceMonitor.enabled=true,serviceMonitor.force=true,"
        "redis.persistence.enabled=true,serviceAccount.create=true,referenceWorkers.enabled=true,"
        "prometheusRule.enabled=true,prometheusRule.force=true,grafanaDashboard.enabled=true,"
        "auth.acl.extraEngines={e2,e3}",
    )


def test_ci_values_cover_all_features() -> None:
    values = yaml.safe_load((CHART / "ci" / "all-features-values.yaml").read_text())
    for key in (
        "pdb",
        "networkPolicy",
        "metricsService",
        "serviceMonitor",
        "referenceWorkers",
        "prometheusRule",
        "grafanaDashboard",
    ):
        assert values[key]["enabled"] is True, key
    assert values["redis"]["persistence"]["enabled"] is True
    assert values["auth"]["acl"]["extraEngines"]


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ("iamge.tag=1", "iamge"),
        ("engine.worldsize=2", "worldsize"),
        ("referenceWorkers.config.chunk_sise=128", "chunk_sise"),
        ("referenceWorkers.securityContext.readOnlyRootFileSystem=true", "readOnlyRootFileSystem"),
        ("redis.persistence.enabeld=true", "enabeld"),
        ("serviceMonitor.intervall=10s", "intervall"),
        ("networkPolicy.clientPodSelector.matchLabel.app=x", "matchLabel"),
    ],
)
def test_schema_rejects_unknown_key(render_fails: RenderFailFn, setting: str, named: str) -> None:
    stderr = render_fails(setting)
    assert "additional properties" in stderr
    assert f"'{named}'" in stderr, stderr


@pytest.mark.parametrize(
    "setting",
    [
        "engine.id={bad}",
        "engine.worldSize=0",
        "referenceWorkers.metricsPort=0",
        "redis.maxmemoryPolicy=allkeys-lru",
        "image.pullPolicy=Sometimes",
        "image.digest=latest",
        "externalRedis.url=http://redis:6379",
        "referenceWorkers.config.lookup_timeout_ms=-1",
        "auth.acl.extraEngines={bad:id}",
        "exporter.port=0",
    ],
)
def test_schema_rejects_bad_value(render_fails: RenderFailFn, setting: str) -> None:
    stderr = render_fails(setting)
    key = setting.split("=", 1)[0].rsplit(".", 1)[-1]
    assert key in stderr, stderr


#: Kubernetes API types passed through verbatim: the schema closes them (typos fail),
#: but values.yaml sets only some of their fields.
K8S_TYPES = {
    "securityContext",
    "podSecurityContext",
    "resources",
    "affinity",
    "clientPodSelector",
    "clientNamespaceSelector",
    "metricsNamespaceSelector",
    "metricsPodSelector",
    "routerPodSelector",
    "routerNamespaceSelector",
}


def _schema_paths(schema: dict[str, Any], prefix: str = "") -> set[str]:
    """Dotted paths of every chart-owned property under objects that close their key set."""
    paths: set[str] = set()
    for name, sub in schema.get("properties", {}).items():
        path = f"{prefix}{name}"
        paths.add(path)
        if name in K8S_TYPES:
            continue
        branches = [sub, *sub.get("oneOf", [])]
        for branch in branches:
            if branch.get("additionalProperties") is False:
                paths |= _schema_paths(branch, path + ".")
    return paths


def _values_paths(values: Any, schema: dict[str, Any], prefix: str = "") -> set[str]:
    paths: set[str] = set()
    if not isinstance(values, dict):
        return paths
    for name, sub in values.items():
        path = f"{prefix}{name}"
        paths.add(path)
        sub_schema = schema.get("properties", {}).get(name, {})
        closed = [sub_schema, *sub_schema.get("oneOf", [])]
        if name not in K8S_TYPES and any(b.get("additionalProperties") is False for b in closed):
            chosen = next(b for b in closed if b.get("additionalProperties") is False)
            paths |= _values_paths(sub, chosen, path + ".")
    return paths


def test_every_schema_object_is_closed() -> None:
    """Every object with declared properties rejects undeclared ones."""
    schema = json.loads((CHART / "values.schema.json").read_text())

    def walk(node: Any, where: str) -> None:
        if isinstance(node, dict):
            if node.get("type") == "object" and "properties" in node:
                assert node.get("additionalProperties") is False, where
            for key, sub in node.items():
                walk(sub, f"{where}/{key}")
        elif isinstance(node, list):
            for i, sub in enumerate(node):
                walk(sub, f"{where}[{i}]")

    walk(schema, "")
    assert schema["additionalProperties"] is False


def test_values_and_schema_declare_the_same_keys() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    in_values = _values_paths(values, schema)
    in_schema = _schema_paths(schema) - {"global"}
    assert in_schema - in_values == set(), "declared in the schema, missing from values.yaml"
    assert in_values - in_schema == set(), "in values.yaml, not declared in the schema"
