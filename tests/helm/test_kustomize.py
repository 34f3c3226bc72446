"""deploy/kustomize: the Kustomize base beside the chart, for llm-d and other Kustomize users.

The base is the chart's own output (``scripts/render-kustomize-base --check`` fails when
the chart changed and the base did not); the example overlay builds with ``kubectl
kustomize`` into valid Kubernetes objects, with the image and namespace the overlay sets,
wired to the names deploy/vllm uses.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from ._chart import DEPLOY, REPO, Manifest, container, env_map

pytestmark = pytest.mark.helm

KUSTOMIZE = DEPLOY / "kustomize"
OVERLAY = KUSTOMIZE / "overlays" / "example"
K8S_VERSIONS = ["1.28.0", kubernetes_validate.latest_version()]
UNSET_IMAGE = "broker-lookup-image-not-set/broker-lookup"


@pytest.fixture(scope="module")
def kubectl(helm: str) -> str:
    """kubectl beside helm (get-helm installs both), or on PATH."""
    beside = Path(helm).parent / "kubectl"
    found = str(beside) if os.access(beside, os.X_OK) else shutil.which("kubectl")
    if found is None:
        message = "kubectl not found: run `../shared/tools/get-helm .tools/bin`"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return found


@pytest.fixture(scope="module")
def built(kubectl: str) -> list[Manifest]:
    done = subprocess.run(
        [kubectl, "kustomize", str(OVERLAY)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def test_the_base_is_what_the_chart_renders(helm: str) -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "render-kustomize-base"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "BROKER_LOOKUP_HELM": helm},
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("k8s_version", K8S_VERSIONS)
def test_the_overlay_builds_valid_objects(built: list[Manifest], k8s_version: str) -> None:
    kinds = {d["kind"] for d in built}
    assert kinds == {"ConfigMap", "Deployment", "NetworkPolicy", "Service", "StatefulSet"}
    for doc in built:
        kubernetes_validate.validate(doc, k8s_version, strict=True)


def test_the_overlay_sets_namespace_and_image(built: list[Manifest]) -> None:
    assert {d["metadata"]["namespace"] for d in built} == {"inference"}
    text = yaml.safe_dump_all(built)
    assert UNSET_IMAGE not in text
    exporter = container(_get(built, "Deployment", "bl-broker-lookup-exporter"), "exporter")
    assert exporter["image"] == "registry.example.com/ml/broker-lookup:0.1.0"
    assert "helm.sh/chart" not in text and "managed-by" not in text


def test_the_base_without_an_overlay_names_no_pullable_image() -> None:
    base = (KUSTOMIZE / "base" / "broker-lookup.yaml").read_text()
    assert f"image: {UNSET_IMAGE}:" in base
    assert UNSET_IMAGE in (KUSTOMIZE / "base" / "kustomization.yaml").read_text()


def test_the_vllm_manifests_fit_the_base(built: list[Manifest]) -> None:
    """deploy/vllm applies unchanged beside it: the same Service, Secret and user."""
    redis = _get(built, "Service", "bl-broker-lookup-redis")
    exporter_env = env_map(
        container(_get(built, "Deployment", "bl-broker-lookup-exporter"), "exporter")
    )
    secret = exporter_env["BROKER_LOOKUP_REDIS_PASSWORD"]["secretKeyRef"]["name"]
    vllm_docs = [d for d in yaml.safe_load_all((DEPLOY / "vllm" / "deployment.yaml").read_text())]
    vllm = container(_get([d for d in vllm_docs if d], "Deployment", "vllm"), "vllm")
    env = env_map(vllm)
    assert env["BROKER_LOOKUP_REDIS_URL"] == f"redis://{redis['metadata']['name']}:6379/0"
    assert env["BROKER_LOOKUP_REDIS_PASSWORD"]["secretKeyRef"]["name"] == secret
    acl = _get(built, "ConfigMap", "bl-broker-lookup-redis-acl")
    assert f"user {env['BROKER_LOOKUP_REDIS_USERNAME']} " in yaml.safe_dump(acl["data"])


def _get(docs: list[Manifest], kind: str, name: str) -> Manifest:
    (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found
