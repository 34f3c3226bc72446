"""vLLM replicas from one manifest never share a namespace: under the vLLM plugin the
engine id is ``<configured engine id>@<instance>``, the same for an
instance's scheduler and its ranks (vLLM ships one config to both), and the configured id
stays visible. vLLM itself is not needed: its config is a stand-in with the same names."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from broker_lookup.config import LookupMetadata
from broker_lookup.errors import ConfigError
from broker_lookup.integrations.lmcache import (
    LMCACHE_FIELDS,
    config_from_lmcache,
    vllm_config_on_stack,
    vllm_instance_id,
)
from broker_lookup.protocol.keys import configured_of, instance_engine_id, validate_engine_id

URL = "redis://127.0.0.1:1/0"


def _lmcache_config() -> SimpleNamespace:
    """LMCache's config fields at LMCache's defaults, asking for the broker."""
    values: dict[str, Any] = dict.fromkeys(LMCACHE_FIELDS)
    values.update(chunk_size=256, save_unfull_chunk=False, lookup_timeout_ms=3000)
    values.update(enable_async_loading=False, enable_scheduler_bypass_lookup=False)
    values.update(enable_chunk_statistics=False, pre_caching_hash_algorithm="builtin")
    return SimpleNamespace(**values, extra_config={"lookup_broker_url": URL})


def _lmcache_metadata(engine_id: str, worker_id: int = 0) -> SimpleNamespace:
    return SimpleNamespace(engine_id=engine_id, world_size=2, worker_id=worker_id)


class ServiceFactory:
    """Stands in for LMCache's ``VllmServiceFactory``: holds vLLM's config, and calls
    LMCache's factory (here: the conversion the patched factory makes) from a method."""

    def __init__(self, engine_id: str, instance_id: str, role: str) -> None:
        kv = SimpleNamespace(engine_id=engine_id)
        self.vllm_config = SimpleNamespace(instance_id=instance_id, kv_transfer_config=kv)
        self.worker_id = 0 if role == "scheduler" else 1

    def maybe_create_lookup(self) -> LookupMetadata:
        engine_id = self.vllm_config.kv_transfer_config.engine_id
        meta = _lmcache_metadata(engine_id, self.worker_id)
        return _lmcache_factory(_lmcache_config(), meta)


def _lmcache_factory(config: Any, metadata: Any) -> LookupMetadata:
    """What the patched ``create_lookup_client``/``create_lookup_server`` do first."""
    return config_from_lmcache(config, metadata, vllm_config_on_stack(), environ={})[1]


def test_the_instance_engine_id_joins_both_and_stays_valid() -> None:
    assert instance_engine_id("llama-70b", "3f2a1") == "llama-70b@3f2a1"
    assert instance_engine_id("llama-70b", "3f2a1_dp1") == "llama-70b@3f2a1_dp1"  # vLLM DP
    assert instance_engine_id("e", "a b{c}@") == "e@a-b-c--"  # never braces, one @
    longest = instance_engine_id("x" * 128, "3f2a1")
    assert longest == "x" * 128 + "@3f2a1"  # the configured id is never cut
    assert validate_engine_id(longest) == longest and configured_of(longest) == "x" * 128
    long_instance = instance_engine_id("e", "i" * 100)
    assert len(long_instance) == 2 + 64 and long_instance != instance_engine_id("e", "i" * 99)
    with pytest.raises(ConfigError, match="instance_id"):
        instance_engine_id("e", "")
    with pytest.raises(ConfigError, match="engine_id"):
        instance_engine_id("bad{id}", "3f2a1")
    with pytest.raises(ConfigError, match="reserved"):
        instance_engine_id("a@b", "3f2a1")  # an instance's namespace is not a configured id


def test_replicas_of_one_manifest_get_their_own_namespace() -> None:
    """Two instances, one ``kv_transfer_config.engine_id``: each instance's scheduler and
    ranks share a namespace, and the two instances do not."""
    first = [
        ServiceFactory("llama-70b", "3f2a1", r).maybe_create_lookup()
        for r in ("scheduler", "worker")
    ]
    second = [
        ServiceFactory("llama-70b", "9c0d4", r).maybe_create_lookup()
        for r in ("scheduler", "worker")
    ]
    assert {m.engine_id for m in first} == {"llama-70b@3f2a1"}
    assert {m.engine_id for m in second} == {"llama-70b@9c0d4"}
    assert {m.configured_engine_id for m in first + second} == {"llama-70b"}
    assert [m.worker_id for m in first] == [0, 1]


def test_without_vllm_the_configured_engine_id_is_used() -> None:
    """LMCache alone (no vLLM config on the stack): nothing to derive from."""
    assert vllm_instance_id() is None
    meta = _lmcache_factory(_lmcache_config(), _lmcache_metadata("alone"))
    assert (meta.engine_id, meta.configured_engine_id) == ("alone", None)


def test_the_broker_engine_id_of_extra_config_is_derived_too() -> None:
    config = _lmcache_config()
    config.extra_config["lookup_broker_engine_id"] = "shared-7"
    vllm_config = SimpleNamespace(instance_id="3f2a1")
    _, meta = config_from_lmcache(config, _lmcache_metadata("ignored"), vllm_config, {})
    assert (meta.engine_id, meta.configured_engine_id) == ("shared-7@3f2a1", "shared-7")


def test_a_local_vllm_config_is_found_too() -> None:
    """LMCache's connector takes ``vllm_config`` as an argument: a local of that name counts."""

    def connector_init(vllm_config: Any) -> str | None:
        assert vllm_config is not None
        return vllm_instance_id()

    assert connector_init(SimpleNamespace(instance_id="abcde")) == "abcde"
    assert connector_init(SimpleNamespace(instance_id="")) is None  # empty: not an identity


def test_an_object_whose_attributes_raise_does_not_stop_the_search() -> None:
    class Proxy:
        def __getattr__(self, name: str) -> object:
            raise RuntimeError(f"no {name} here")

    def behind_a_proxy(self: Proxy) -> str | None:
        return vllm_instance_id()

    factory = ServiceFactory("e", "abcde", "worker")

    def from_factory(self: ServiceFactory) -> str | None:
        return behind_a_proxy(Proxy())

    assert from_factory(factory) == "abcde"
