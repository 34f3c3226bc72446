"""The LMCache layout table and the look-up that runs none of LMCache's code (no LMCache needed)."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import pytest

from broker_lookup.integrations.lmcache_layout import (
    FACTORY,
    LAYOUTS,
    SERVICE_FACTORY,
    TESTED_VERSIONS,
    expected,
    hook_modules,
    module_exists,
)


def test_both_layouts_are_hooked_and_named_in_messages() -> None:
    assert {lo.package for lo in LAYOUTS} == {"lmcache", "lmcache.inprocess"}
    assert set(hook_modules()) == {
        "lmcache.v1.lookup_client.factory",
        "lmcache.integration.vllm.vllm_service_factory",
        "lmcache.inprocess.v1.lookup_client.factory",
        "lmcache.inprocess.integration.vllm.vllm_service_factory",
    }
    assert {lo.module(SERVICE_FACTORY) for lo in LAYOUTS} <= set(hook_modules())
    for layout in LAYOUTS:
        assert layout.module(FACTORY) in expected()
    assert set(TESTED_VERSIONS) == {"0.5.6", "0.5.7rc2"}


def test_module_exists_runs_no_package_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = "bllayout_" + uuid.uuid4().hex[:8]
    boom = "raise RuntimeError('imported')\n"
    for package in (name, f"{name}/inner", f"{name}/inner/deeper"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text(boom)
    (tmp_path / name / "inner" / "deeper" / "factory.py").write_text(boom)
    (tmp_path / name / "plain.py").write_text(boom)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert module_exists(f"{name}.inner.deeper.factory")
    assert module_exists(f"{name}.inner.deeper")
    assert not module_exists(f"{name}.inner.missing.factory")
    assert not module_exists(f"{name}.plain.sub")  # a module is no package
    assert not module_exists(f"{name}_absent.v1")
    assert not [k for k in sys.modules if k.split(".")[0] == name]  # nothing was imported
