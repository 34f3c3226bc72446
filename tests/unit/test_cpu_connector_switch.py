"""The try-out CPU connector is a product setting: ``BROKER_LOOKUP_CPU_CONNECTOR=1`` has the
vLLM plugin put it in LMCache's place (a stand-in ``lmcache.v1.gpu_connector`` here: the
plugin must work without LMCache's own connector module loaded by us), and nothing else
does."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from types import ModuleType

import pytest

from broker_lookup.config import env_name
from broker_lookup.integrations import cpu_connector
from broker_lookup.integrations.import_hook import forget
from broker_lookup.integrations.lmcache import vllm_plugin

MODULE = "lmcache.v1.gpu_connector"


def _lmcaches_own(*args: object, **kwargs: object) -> object:
    raise AssertionError("LMCache's own CreateGPUConnector")


@pytest.fixture
def gpu_connector(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """LMCache's connector module, already imported; the plugin's switches unset."""
    module = ModuleType(MODULE)
    module.CreateGPUConnector = _lmcaches_own  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, MODULE, module)
    for name in ("lmcache", "cpu_connector"):
        monkeypatch.delenv(env_name(name), raising=False)
    forget(cpu_connector.__name__)
    yield module
    forget(cpu_connector.__name__)


def test_the_setting_installs_the_connector(
    gpu_connector: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert cpu_connector.ENV_SWITCH == "BROKER_LOOKUP_CPU_CONNECTOR"
    monkeypatch.setenv(cpu_connector.ENV_SWITCH, "1")
    vllm_plugin()
    assert gpu_connector.CreateGPUConnector is cpu_connector.create


@pytest.mark.parametrize("value", [None, "0"])
def test_without_the_setting_lmcaches_connector_stays(
    gpu_connector: ModuleType, monkeypatch: pytest.MonkeyPatch, value: str | None
) -> None:
    if value is not None:
        monkeypatch.setenv(cpu_connector.ENV_SWITCH, value)
    vllm_plugin()
    assert gpu_connector.CreateGPUConnector is _lmcaches_own
