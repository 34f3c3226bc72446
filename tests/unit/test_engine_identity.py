"""One engine, one namespace, however vLLM launches it; never one for two engines.

vLLM is not installed here, so its config is a recording of vLLM 0.32's: the field names
and defaults the derivation reads (``vllm/config/parallel.py``, ``vllm/config/kv_transfer.py``),
``VllmConfig.__post_init__`` drawing ``instance_id = f"{time.time_ns()}"`` in every process
that builds one, and what each launcher does with it: spawn and Ray pickle the one config
to the EngineCore and every worker; ``--headless`` (another node) builds its own; a
data-parallel EngineCore appends ``_dp<k>`` to ``kv_transfer_config.engine_id`` and sets
``data_parallel_index``. Each test builds every process of the launch and checks the
namespaces they derive (the vLLM leg runs the two-node case for real).
"""

from __future__ import annotations

import copy
import itertools
import logging
import pickle
import sys
import time
import uuid
from dataclasses import dataclass, field
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from broker_lookup.errors import ConfigError
from broker_lookup.integrations import lmcache
from broker_lookup.integrations.identity import (
    ENV_INSTANCE,
    EngineIdentity,
    engine_identity,
)
from broker_lookup.protocol.keys import configured_of

ENGINE = "vllm-engine"
_last_draw = itertools.count()


@dataclass
class ParallelConfig:
    """vLLM 0.32's ``ParallelConfig`` fields the derivation reads, at vLLM's defaults."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    data_parallel_rank_local: int | None = None
    data_parallel_index: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29501
    nnodes: int = 1
    node_rank: int = 0
    distributed_executor_backend: str | None = None


@dataclass
class KVTransferConfig:
    """vLLM's ``KVTransferConfig``: a fresh uuid per config when no engine id is given."""

    engine_id: str | None = None

    def __post_init__(self) -> None:
        if self.engine_id is None:
            self.engine_id = str(uuid.uuid4())


@dataclass
class VllmConfig:
    """vLLM 0.32's ``VllmConfig``: each process that builds one draws its own instance id."""

    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    kv_transfer_config: KVTransferConfig = field(default_factory=KVTransferConfig)
    instance_id: str = ""

    def __post_init__(self) -> None:
        # time.time_ns() as vLLM draws it; the counter only rules out two equal draws,
        # which two processes would not make either.
        self.instance_id = f"{time.time_ns() + next(_last_draw)}"


def build(engine_id: str | None = ENGINE, **parallel: Any) -> VllmConfig:
    """What ``vllm serve`` (or ``run_headless``) builds from its arguments on one node."""
    return VllmConfig(ParallelConfig(**parallel), KVTransferConfig(engine_id))


def ship(config: VllmConfig) -> VllmConfig:
    """What spawn (EngineCore, workers) and Ray (every actor, every node) hand a process."""
    shipped: VllmConfig = pickle.loads(pickle.dumps(config))
    return shipped


def dp_engine(
    config: VllmConfig,
    dp_rank: int,
    local_dp_rank: int,
    *,
    moe: bool = False,
    suffix: int | None = None,
) -> VllmConfig:
    """vLLM 0.32's ``run_engine_core`` for one data-parallel engine (its workers get a
    ship()): ``_dp<global rank>`` on the engine id (``suffix``: what older vLLM appended,
    the local rank), and a dense model's engine reset to DP size 1."""
    engine = copy.deepcopy(config)
    parallel = engine.parallel_config
    parallel.data_parallel_rank_local = local_dp_rank
    kv = engine.kv_transfer_config
    kv.engine_id = f"{kv.engine_id}_dp{dp_rank if suffix is None else suffix}"
    parallel.data_parallel_index = dp_rank
    if moe:
        parallel.data_parallel_rank = dp_rank
    else:  # reconfigure_for_independent_dp_rank()
        parallel.data_parallel_size, parallel.data_parallel_rank = 1, 0
    return engine


def derive(config: VllmConfig | None, env: dict[str, str] | None = None) -> EngineIdentity:
    engine_id = config.kv_transfer_config.engine_id if config else ENGINE
    assert engine_id is not None
    return engine_identity(engine_id, config, env or {})


def namespaces(*configs: VllmConfig, env: dict[str, str] | None = None) -> set[str]:
    return {derive(c, env).namespace for c in configs}


def one_engine(head: VllmConfig, world: int) -> list[VllmConfig]:
    """The scheduler (EngineCore) and ``world`` workers of one node, all shipped one config."""
    return [ship(head) for _ in range(world + 1)]


def test_one_node_engine_shares_the_config_instance_id() -> None:
    head = build(tensor_parallel_size=2)
    (found,) = namespaces(*one_engine(head, 2))
    assert found == f"{ENGINE}@{head.instance_id}"
    assert derive(head).source == "VllmConfig.instance_id"


def test_replicas_of_one_manifest_never_share() -> None:
    first, second = build(), build()
    assert namespaces(*one_engine(first, 1)).isdisjoint(namespaces(*one_engine(second, 1)))
    assert {configured_of(n) for n in namespaces(first, second)} == {ENGINE}


def test_a_two_node_engine_is_one_namespace() -> None:
    """``--nnodes 2 --node-rank 0`` on one node, ``--node-rank 1 --headless`` on the other:
    two configs, two instance ids, one rendezvous address."""
    args: dict[str, Any] = {"tensor_parallel_size": 2, "nnodes": 2, "master_addr": "10.0.0.5"}
    head, headless = build(ENGINE, **args, node_rank=0), build(ENGINE, **args, node_rank=1)
    assert head.instance_id != headless.instance_id  # what split the engine before
    processes = [*one_engine(head, 1), ship(headless)]
    (found,) = namespaces(*processes)
    assert found.startswith(ENGINE + "@mn-")
    assert "10.0.0.5:29501" in derive(headless).source


def test_two_multi_node_engines_never_share() -> None:
    """Two replicas of one multi-node manifest: each head is its own rendezvous address."""
    a = [build(nnodes=2, master_addr="10.0.0.5", node_rank=r) for r in (0, 1)]
    b = [build(nnodes=2, master_addr="10.0.0.9", node_rank=r) for r in (0, 1)]
    assert len(namespaces(*a)) == len(namespaces(*b)) == 1
    assert namespaces(*a) != namespaces(*b)


def test_ray_ships_one_config_to_every_node() -> None:
    head = build(tensor_parallel_size=4, distributed_executor_backend="ray")
    (found,) = namespaces(*[ship(head) for _ in range(5)])
    assert found == f"{ENGINE}@{head.instance_id}"


def test_each_data_parallel_engine_has_its_own_namespace() -> None:
    """DP 2 on one node: one config, two EngineCores with ``_dp<k>`` engine ids; the
    configured id stays the operator's (its ACL users match both)."""
    head = build(data_parallel_size=2)
    engines = [dp_engine(head, k, k) for k in (0, 1)]
    per_engine = [namespaces(*one_engine(e, 1)) for e in engines]
    assert all(len(found) == 1 for found in per_engine)
    assert per_engine[0] != per_engine[1]
    assert [derive(e).namespace for e in engines] == [
        f"{ENGINE}@{head.instance_id}-dp0",
        f"{ENGINE}@{head.instance_id}-dp1",
    ]
    assert {derive(e).configured for e in engines} == {ENGINE}


def test_data_parallel_over_two_nodes_keeps_engines_apart() -> None:
    """DP 2, one engine per node (node 1 ``--headless --data-parallel-start-rank 1``); with
    vLLM before 0.32, which suffixed the local rank (``_dp0`` on both nodes), too."""
    head = build(data_parallel_size=2)
    other = build(data_parallel_size=2, data_parallel_rank=1)
    for suffixes in ((0, 1), (0, 0)):
        engines = [
            dp_engine(head, 0, 0, suffix=suffixes[0]),
            dp_engine(other, 1, 0, suffix=suffixes[1]),
        ]
        assert len(namespaces(*engines)) == 2
        assert {derive(e).configured for e in engines} == {ENGINE}


def test_moe_data_parallel_engines_keep_their_dp_size() -> None:
    head = build(data_parallel_size=2)
    engines = [dp_engine(head, k, k, moe=True) for k in (0, 1)]
    assert [derive(e).namespace for e in engines] == [
        f"{ENGINE}@{head.instance_id}-dp0",
        f"{ENGINE}@{head.instance_id}-dp1",
    ]


def test_an_id_ending_like_a_dp_suffix_is_kept_without_data_parallel() -> None:
    config = build(engine_id="shard_dp0")
    assert derive(config).configured == "shard_dp0"


def test_newer_vllm_suffixing_the_instance_id_too_changes_nothing() -> None:
    head = build(data_parallel_size=2)
    engine = dp_engine(head, 1, 1)
    engine.instance_id += "_dp1"  # newer vLLM (_apply_dp_identity_suffix)
    assert derive(engine).namespace == f"{ENGINE}@{head.instance_id}-dp1"


def test_a_leaderworkerset_group_is_one_namespace_and_groups_differ() -> None:
    """Every pod of one LWS group holds the group's leader address; each pod builds its own
    config (a leader and a headless worker pod)."""

    def group(index: int) -> set[str]:
        env = {
            "LWS_LEADER_ADDRESS": f"vllm-{index}.vllm.inference",
            "LWS_GROUP_SIZE": "2",
        }
        pods = [
            build(nnodes=2, master_addr=f"vllm-{index}.vllm.inference", node_rank=r) for r in (0, 1)
        ]
        return {
            derive(ship(p), {**env, "LWS_WORKER_INDEX": str(r)}).namespace
            for r, p in enumerate(pods)
        }

    first, second = group(0), group(1)
    assert len(first) == len(second) == 1 and first != second
    (found,) = first
    assert found.startswith(ENGINE + "@lws-")


def test_the_users_setting_is_the_answer_and_data_parallel_still_splits_it() -> None:
    env = {ENV_INSTANCE: "blue-7"}
    a, b = build(), build()
    assert namespaces(a, b, env=env) == {f"{ENGINE}@blue-7"}
    assert derive(a, env).source == f"the setting env {ENV_INSTANCE}"
    head = build(data_parallel_size=2)
    assert namespaces(*(dp_engine(head, k, k) for k in (0, 1)), env=env) == {
        f"{ENGINE}@blue-7-dp0",
        f"{ENGINE}@blue-7-dp1",
    }
    with pytest.raises(ConfigError, match=ENV_INSTANCE):
        derive(a, {ENV_INSTANCE: " "})


def test_where_processes_share_nothing_the_derivation_says_so() -> None:
    spmd = build(distributed_executor_backend="external_launcher")
    assert ENV_INSTANCE in (derive(spmd).warning or "")
    generated = build(engine_id=None, nnodes=2)  # each node would draw its own uuid
    warning = derive(generated).warning or ""
    assert "kv_transfer_config.engine_id" in warning and "every node" in warning
    assert derive(build(nnodes=2)).warning is None


def test_outside_vllm_the_configured_id_is_the_namespace() -> None:
    alone = derive(None)
    assert (alone.namespace, alone.configured) == (ENGINE, ENGINE)


def test_configured_ids_holding_the_instance_mark_are_refused_with_their_source() -> None:
    with pytest.raises(ConfigError, match=r"kv_transfer_config\.engine_id='a@b'.*reserved"):
        engine_identity("a@b", build(), {})


def test_the_plugin_finds_the_config_however_deep_the_stack() -> None:
    """The stack walk went 24 frames up; a deeper caller lost the config (and the engine
    its namespace). 60 frames of recursion between vLLM's config and LMCache's factory."""
    head = build()

    def descend(depth: int) -> object | None:
        return lmcache.vllm_config_on_stack() if depth == 0 else descend(depth - 1)

    def service_factory(vllm_config: VllmConfig) -> object | None:
        return descend(60)

    assert service_factory(head) is head


def test_a_lone_namespace_under_vllm_is_a_warning(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "vllm", ModuleType("vllm"))
    identity = engine_identity(ENGINE, None, {})
    with caplog.at_level(logging.INFO, logger="broker_lookup"):
        lmcache._log_identity(identity, "scheduler")
    (record,) = caplog.records
    assert record.levelno == logging.WARNING and ENV_INSTANCE in record.getMessage()


def test_the_plugin_metadata_carries_the_derived_namespace() -> None:
    values: dict[str, Any] = dict.fromkeys(lmcache.LMCACHE_FIELDS)
    values.update(chunk_size=256, save_unfull_chunk=False, lookup_timeout_ms=3000)
    values.update(enable_async_loading=False, enable_scheduler_bypass_lookup=False)
    values.update(enable_chunk_statistics=False, pre_caching_hash_algorithm="builtin")
    extra = {"lookup_broker_url": "redis://127.0.0.1:1/0", "lookup_broker_instance_id": "x1"}
    lmc = SimpleNamespace(**values, extra_config=extra)
    meta = SimpleNamespace(engine_id=f"{ENGINE}_dp1", world_size=2, worker_id=1)
    head = dp_engine(build(data_parallel_size=2), 1, 1)
    _, ours, identity = lmcache._convert(lmc, meta, head, {})
    assert (ours.engine_id, ours.configured_engine_id) == (f"{ENGINE}@x1-dp1", ENGINE)
    assert identity.source.startswith("the setting extra_config lookup_broker_instance_id")
