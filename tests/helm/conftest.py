"""Fixtures for the chart tests (see _chart.py for how helm is found)."""

from __future__ import annotations

import copy
import os
from collections.abc import Iterable
from pathlib import Path

import pytest
import yaml

from ._chart import (
    KUBE_VERSION,
    Manifest,
    Rendered,
    RenderFailFn,
    RenderFn,
    find_helm,
    run_helm,
    template_args,
)


@pytest.fixture(scope="session")
def helm() -> str:
    path = find_helm()
    if path is None:
        message = (
            "helm not found: set BROKER_LOOKUP_HELM, or run "
            "`../shared/tools/get-helm .tools/bin` from the repository root"
        )
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


@pytest.fixture(scope="session")
def render(helm: str) -> RenderFn:
    """render(*sets, values_files=(), extra=(), kube_version=..., fresh=False) -> Rendered.

    The chart does not change during a session, so a render is run once per set of
    arguments and values files' contents (half the suite's renders repeat one), and each
    caller gets its own copy to change. ``fresh=True`` runs helm again: what the chart
    generates per render (passwords) differs between two fresh renders.
    """
    done: dict[tuple[str, ...], list[Manifest]] = {}

    def _render(
        *sets: str,
        values_files: Iterable[Path] = (),
        extra: Iterable[str] = (),
        kube_version: str = KUBE_VERSION,
        fresh: bool = False,
    ) -> Rendered:
        files = list(values_files)
        args = template_args(sets=sets, values_files=files, extra=extra, kube_version=kube_version)
        key = (*args, *(path.read_text() for path in files))
        if fresh or key not in done:
            result = run_helm(helm, *args, check=True)
            done[key] = [d for d in yaml.safe_load_all(result.stdout) if d]
        return Rendered(copy.deepcopy(done[key]))

    return _render


@pytest.fixture(scope="session")
def render_fails(helm: str) -> RenderFailFn:
    """render_fails(*sets, ...) -> stderr; asserts that helm template fails."""

    def _render_fails(
        *sets: str, values_files: Iterable[Path] = (), extra: Iterable[str] = ()
    ) -> str:
        args = template_args(sets=sets, values_files=values_files, extra=extra)
        result = run_helm(helm, *args)
        assert result.returncode != 0, f"helm template unexpectedly succeeded with {sets}"
        return result.stderr

    return _render_fails
