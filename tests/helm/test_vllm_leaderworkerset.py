"""deploy/vllm/multinode: one vLLM engine over two nodes (tensor parallel 2) per
LeaderWorkerSet group, two groups, wired to the chart's defaults like deploy/vllm.

kubernetes-validate does not know the LeaderWorkerSet CRD, so the LWS object is checked
for the fields this example relies on, and each of its pod templates is validated as a
Pod. The engine identity every pod derives from what LWS gives it proves one namespace
per group and none shared between the groups (replicas of one manifest).
"""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
import yaml

from broker_lookup.integrations.identity import ENV_INSTANCE, engine_identity

from ._chart import DEPLOY, Manifest, RenderFn, env_map
from .test_vllm_manifests import ENGINE, K8S_VERSIONS, _wired_to_the_chart, get, kv_transfer

pytestmark = pytest.mark.helm

LWS_FILE = DEPLOY / "vllm" / "multinode" / "leaderworkerset.yaml"


def documents() -> list[Manifest]:
    return [d for d in yaml.safe_load_all(LWS_FILE.read_text()) if d]


def lws() -> Manifest:
    (found,) = [d for d in documents() if d["kind"] == "LeaderWorkerSet"]
    return found


def templates() -> dict[str, Manifest]:
    spec = lws()["spec"]["leaderWorkerTemplate"]
    return {"leader": spec["leaderTemplate"], "worker": spec["workerTemplate"]}


def vllm(template: Manifest) -> Manifest:
    found: list[Manifest] = [c for c in template["spec"]["containers"] if c["name"] == "vllm"]
    (container,) = found
    return container


def flags(container: Manifest) -> dict[str, str]:
    """``--name=value`` arguments (``--headless`` as ``""``)."""
    out: dict[str, str] = {}
    for arg in container["args"]:
        if arg.startswith("--"):
            name, _, value = arg.partition("=")
            out[name] = value
    return out


def test_the_leaderworkerset_has_the_fields_this_example_relies_on() -> None:
    doc = lws()
    assert doc["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    assert doc["metadata"]["namespace"] == "inference"
    assert doc["spec"]["replicas"] == 2  # two engines from one manifest
    group = doc["spec"]["leaderWorkerTemplate"]
    assert group["size"] == 2
    assert group["restartPolicy"] == "RecreateGroupOnPodRestart"


@pytest.mark.parametrize("k8s_version", K8S_VERSIONS)
def test_every_pod_template_and_the_service_validate(k8s_version: str) -> None:
    for role, template in templates().items():
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"vllm-mn-{role}", **template["metadata"]},
            "spec": template["spec"],
        }
        kubernetes_validate.validate(pod, k8s_version, strict=True)
    (service,) = [d for d in documents() if d["kind"] == "Service"]
    kubernetes_validate.validate(service, k8s_version, strict=True)
    assert (
        service["spec"]["selector"].items() <= templates()["leader"]["metadata"]["labels"].items()
    )


def test_one_engine_over_two_nodes_with_vllms_multi_node_launcher() -> None:
    leader, worker = (flags(vllm(t)) for t in templates().values())
    for args in (leader, worker):
        assert args["--tensor-parallel-size"] == "2"
        assert args["--nnodes"] == "$(LWS_GROUP_SIZE)"
        assert args["--master-addr"] == "$(LWS_LEADER_ADDRESS)"
    assert leader["--master-port"] == worker["--master-port"]
    assert leader["--node-rank"] == "0" and "--headless" not in leader
    assert worker["--node-rank"] == "$(LWS_WORKER_INDEX)" and "--headless" in worker
    configs = [kv_transfer(vllm(t)["args"]) for t in templates().values()]
    assert configs[0] == configs[1] and configs[0]["engine_id"] == ENGINE
    for template in templates().values():
        gpus = vllm(template)["resources"]["limits"]["nvidia.com/gpu"]
        assert gpus == "1"  # one rank per node


def test_every_pod_is_wired_to_the_charts_defaults(render: RenderFn) -> None:
    chart = render()
    for template in templates().values():
        env = env_map(vllm(template))
        assert ENV_INSTANCE not in env  # one value for both groups would merge them
        _wired_to_the_chart(env, template["metadata"]["labels"], chart)
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        assert get("ConfigMap", volumes["lmcache"]["configMap"]["name"])


def _pod_env(group: int, worker: int) -> dict[str, Any]:
    """What LWS puts in the pods of group ``group``: its leader's address, its size."""
    return {
        "LWS_LEADER_ADDRESS": f"vllm-mn-{group}.vllm-mn.inference",
        "LWS_GROUP_SIZE": "2",
        "LWS_WORKER_INDEX": str(worker),
    }


def test_each_group_is_one_namespace_and_the_groups_never_share() -> None:
    """Each pod builds its own vLLM config (its own instance id): the namespace is keyed
    on the group's leader address, the same in every pod of the group only."""
    per_group = []
    for group in (0, 1):
        found = set()
        for worker in (0, 1):
            config = _Config(f"17966{group}{worker}")  # every pod draws its own
            identity = engine_identity(ENGINE, config, _pod_env(group, worker))
            found.add(identity.namespace)
        per_group.append(found)
    assert all(len(found) == 1 for found in per_group)
    assert per_group[0].isdisjoint(per_group[1])
    assert all(n.startswith(ENGINE + "@lws-") for found in per_group for n in found)


class _Config:
    """A vLLM config as each pod builds it (the fields the identity reads)."""

    def __init__(self, instance_id: str) -> None:
        self.instance_id = instance_id
        self.parallel_config = type(
            "Parallel", (), {"nnodes": 2, "master_addr": "x", "master_port": 29501}
        )()
