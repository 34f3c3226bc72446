"""Every entry point ``pyproject.toml`` declares names something that exists: a module
moved (the CLI to the top of the package) takes its console script with it."""

from __future__ import annotations

import importlib
import tomllib
from pathlib import Path

import pytest

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def _declared() -> list[tuple[str, str]]:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    found = [(f"script {name}", target) for name, target in project["scripts"].items()]
    for group, points in project["entry-points"].items():
        found += [(f"{group} {name}", target) for name, target in points.items()]
    return found


@pytest.mark.parametrize(("name", "target"), _declared(), ids=[n for n, _ in _declared()])
def test_each_entry_point_resolves_to_a_callable(name: str, target: str) -> None:
    module, _, attr = target.partition(":")
    assert callable(getattr(importlib.import_module(module), attr)), name


def test_the_console_script_is_the_cli_at_the_top_of_the_package() -> None:
    scripts = tomllib.loads(PYPROJECT.read_text())["project"]["scripts"]
    assert scripts == {"broker-lookup": "broker_lookup.cli:main"}
