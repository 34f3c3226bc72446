"""Helpers for the chart and deploy/ tests: find helm, render the chart, pick objects.

helm is looked up at ``$BROKER_LOOKUP_HELM``, then ``.tools/bin/helm`` (installed by
``../shared/tools/get-helm .tools/bin``), then ``PATH``. Without it the helm tests
skip locally and fail when ``CI`` is set, so CI can never pass by skipping them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "broker-lookup"
DEPLOY = REPO / "deploy"
RELEASE = "bl"
NAMESPACE = "inference"
#: Oldest Kubernetes the chart supports (pod-index label) and the one helm renders for.
KUBE_VERSION = "1.28.0"
#: The broker-lookup image the tests render with (the chart requires one: no public
#: registry serves it); a later ``--set image.repository=...`` overrides it.
TEST_IMAGE = "registry.example.com/ml/broker-lookup"
IMAGE_SET = ("--set", f"image.repository={TEST_IMAGE}")

Manifest = dict[str, Any]


def find_helm() -> str | None:
    """Path of a helm binary, or None."""
    candidates = [os.environ.get("BROKER_LOOKUP_HELM", ""), str(REPO / ".tools" / "bin" / "helm")]
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return shutil.which("helm")


@dataclass(frozen=True)
class HelmResult:
    returncode: int
    stdout: str
    stderr: str


def run_helm(helm: str, *args: str, check: bool = False) -> HelmResult:
    proc = subprocess.run(
        [helm, *args], capture_output=True, text=True, timeout=60, cwd=REPO, check=False
    )
    result = HelmResult(proc.returncode, proc.stdout, proc.stderr)
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{proc.stderr}")
    return result


def template_args(
    *,
    sets: Iterable[str] = (),
    values_files: Iterable[Path] = (),
    extra: Iterable[str] = (),
    kube_version: str = KUBE_VERSION,
) -> list[str]:
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    args += ["--kube-version", kube_version, *IMAGE_SET]
    for path in values_files:
        args += ["-f", str(path)]
    for item in sets:
        args += ["--set", item]
    args += list(extra)
    return args


class Rendered:
    """The objects of one ``helm template`` run, with lookup helpers."""

    def __init__(self, docs: list[Manifest]) -> None:
        self.docs = docs

    def __iter__(self) -> Iterator[Manifest]:
        return iter(self.docs)

    def __len__(self) -> int:
        return len(self.docs)

    def kinds(self) -> list[str]:
        return sorted(str(d["kind"]) for d in self.docs)

    def of_kind(self, kind: str) -> list[Manifest]:
        return [d for d in self.docs if d["kind"] == kind]

    def get(self, kind: str, name_suffix: str = "") -> Manifest:
        found = [d for d in self.of_kind(kind) if d["metadata"]["name"].endswith(name_suffix)]
        assert len(found) == 1, f"expected one {kind} named *{name_suffix}, got {self.names()}"
        return found[0]

    def names(self) -> list[str]:
        return sorted(f"{d['kind']}/{d['metadata']['name']}" for d in self.docs)

    def has(self, kind: str, name_suffix: str = "") -> bool:
        return any(d["metadata"]["name"].endswith(name_suffix) for d in self.of_kind(kind))

    def worker_sts(self) -> Manifest:
        return self.get("StatefulSet", "-worker")

    def worker_container(self) -> Manifest:
        return container(self.worker_sts(), "worker")


def container(workload: Manifest, name: str) -> Manifest:
    spec = workload["spec"]
    pod_spec = spec["template"]["spec"] if "template" in spec else spec
    matches = [c for c in pod_spec["containers"] if c["name"] == name]
    assert len(matches) == 1, f"no container {name!r} in {workload['metadata']['name']}"
    result: Manifest = matches[0]
    return result


def env_map(cont: Manifest) -> dict[str, Any]:
    """Container env as name -> value (a str) or valueFrom (a dict)."""
    out: dict[str, Any] = {}
    for item in cont.get("env", []):
        out[item["name"]] = item["value"] if "value" in item else item["valueFrom"]
    return out


RenderFn = Callable[..., Rendered]
RenderFailFn = Callable[..., str]
