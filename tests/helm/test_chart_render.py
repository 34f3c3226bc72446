"""`helm template` output: Kubernetes validity, wiring, labels, probes, security, options."""

from __future__ import annotations

import base64
from typing import Any

import kubernetes_validate
import pytest
import yaml

from ._chart import (
    CHART,
    IMAGE_SET,
    NAMESPACE,
    RELEASE,
    TEST_IMAGE,
    Manifest,
    Rendered,
    RenderFailFn,
    RenderFn,
    container,
    env_map,
    run_helm,
)

pytestmark = pytest.mark.helm

FULL = f"{RELEASE}-broker-lookup"
CI = CHART / "ci"
#: Oldest supported Kubernetes and the newest kubernetes-validate ships schemas for.
K8S_VERSIONS = ["1.28.0", kubernetes_validate.latest_version()]
#: Custom resources: kubernetes-validate carries only built-in API schemas, so these
#: are checked structurally in test_service_monitor_* instead.
CRD_KINDS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
}
#: The reference-engine workers, off by default (a vLLM fleet's pods host their ranks).
REF = "referenceWorkers.enabled=true"
#: One password for the default user, no ACL users (an existing server's Secret).
NOACL = "auth.acl.enabled=false"

SCENARIOS: dict[str, dict[str, Any]] = {
    "default": {},  # a vLLM fleet's: Redis with ACL users, the exporter, NetworkPolicy
    "reference-workers": {"sets": [REF]},
    "no-acl": {"sets": ["auth.acl.enabled=false", REF]},
    "all-features": {"values_files": [CI / "all-features-values.yaml"]},
    "external-redis": {"values_files": [CI / "external-redis-values.yaml"]},
    "auth-disabled": {"sets": ["auth.enabled=false", REF]},
    "persistence": {"sets": ["redis.persistence.enabled=true"]},
    "existing-secret": {"sets": ["auth.existingSecret=my-redis"]},
    "pdb-min-available": {
        "sets": [REF, "pdb.enabled=true", "engine.worldSize=3", "pdb.minAvailable=2"],
        "extra": ["--set-json", "pdb.maxUnavailable=null"],
    },
    "network-policy": {"sets": ["networkPolicy.enabled=true", REF]},
    "query-endpoint": {"sets": ["queryEndpoint.enabled=true", "queryEndpoint.tokenizer=gpt2"]},
    "service-monitor-capability": {
        "sets": ["serviceMonitor.enabled=true"],
        "extra": ["--api-versions", "monitoring.coreos.com/v1"],
    },
    "no-probes-no-tests": {
        "sets": [
            REF,
            "referenceWorkers.startupProbe.enabled=false",
            "referenceWorkers.livenessProbe.enabled=false",
            "referenceWorkers.readinessProbe.enabled=false",
            "tests.enabled=false",
        ]
    },
}

STANDARD_LABELS = (
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/version",
    "app.kubernetes.io/managed-by",
    "helm.sh/chart",
)


def _render_scenario(render: RenderFn, name: str) -> Rendered:
    sc = SCENARIOS[name]
    return render(
        *sc.get("sets", []), values_files=sc.get("values_files", []), extra=sc.get("extra", [])
    )


def _pod_templates(rendered: Rendered) -> list[tuple[Manifest, dict[str, Any]]]:
    """(object, pod metadata+spec) for every workload and bare Pod."""
    out: list[tuple[Manifest, dict[str, Any]]] = []
    for doc in rendered:
        if doc["kind"] in ("StatefulSet", "Deployment", "DaemonSet", "Job"):
            out.append((doc, doc["spec"]["template"]))
        elif doc["kind"] == "Pod":
            out.append((doc, doc))
    return out


def _containers(rendered: Rendered) -> list[tuple[str, Manifest]]:
    return [
        (f"{doc['kind']}/{doc['metadata']['name']}/{c['name']}", c)
        for doc, pod in _pod_templates(rendered)
        for c in pod["spec"]["containers"]
    ]


# ---------------------------------------------------------------- validity --


@pytest.mark.parametrize("k8s_version", K8S_VERSIONS)
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_every_object_validates(render: RenderFn, scenario: str, k8s_version: str) -> None:
    rendered = _render_scenario(render, scenario)
    assert len(rendered) > 0
    errors: list[str] = []
    for doc in rendered:
        if (doc["apiVersion"], doc["kind"]) in CRD_KINDS:
            continue
        try:
            kubernetes_validate.validate(doc, k8s_version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = "/".join(str(p) for p in exc.path)
            errors.append(f"{doc['kind']}/{doc['metadata']['name']} at {path}: {exc.message}")
    assert errors == []


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_names_fit_dns_labels(render: RenderFn, scenario: str) -> None:
    for doc in _render_scenario(render, scenario):
        name = doc["metadata"]["name"]
        assert len(name) <= 63 and name == name.lower(), name
        if doc["kind"] == "StatefulSet":
            # Pod names add "-<ordinal>"; the controller-revision label adds a hash.
            assert len(name) <= 52, name


def test_long_release_name_is_truncated(helm: str) -> None:
    release = "a-very-long-release-name-that-goes-on-and-on-and-on-x"  # 53, the maximum
    result = run_helm(helm, "template", release, str(CHART), *IMAGE_SET, check=True)
    for doc in (d for d in yaml.safe_load_all(result.stdout) if d):
        assert len(doc["metadata"]["name"]) <= 63, doc["metadata"]["name"]
        if doc["kind"] == "StatefulSet":
            assert len(doc["metadata"]["name"]) <= 52, doc["metadata"]["name"]


# ------------------------------------------------------------------ labels --


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_standard_labels_on_every_object(render: RenderFn, scenario: str) -> None:
    for doc in _render_scenario(render, scenario):
        labels = doc["metadata"].get("labels", {})
        for key in STANDARD_LABELS:
            assert key in labels, f"{doc['kind']}/{doc['metadata']['name']} lacks {key}"
        assert labels["app.kubernetes.io/name"] == "broker-lookup"
        assert labels["app.kubernetes.io/instance"] == RELEASE
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        assert doc["metadata"]["namespace"] == NAMESPACE


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_selectors_match_pod_labels(render: RenderFn, scenario: str) -> None:
    rendered = _render_scenario(render, scenario)
    pods = _pod_templates(rendered)
    for doc, pod in pods:
        for key in STANDARD_LABELS:
            assert key in pod["metadata"]["labels"], doc["metadata"]["name"]
        if doc["kind"] == "StatefulSet":
            selector = doc["spec"]["selector"]["matchLabels"]
            assert set(selector) == {
                "app.kubernetes.io/name",
                "app.kubernetes.io/instance",
                "app.kubernetes.io/component",
            }
            assert selector.items() <= pod["metadata"]["labels"].items()
    for svc in rendered.of_kind("Service"):
        selector = svc["spec"]["selector"]
        targets = [
            d["metadata"]["name"]
            for d, pod in pods
            if d["kind"] != "Pod" and selector.items() <= pod["metadata"]["labels"].items()
        ]
        assert len(targets) == 1, f"Service {svc['metadata']['name']} selects {targets}"


def test_common_labels(render: RenderFn) -> None:
    for doc in render("commonLabels.team=inference"):
        assert doc["metadata"]["labels"]["team"] == "inference"


# ------------------------------------------------------------------ worker --


@pytest.mark.parametrize("world_size", [1, 2, 8])
def test_replicas_equal_world_size(render: RenderFn, world_size: int) -> None:
    rendered = render(REF, f"engine.worldSize={world_size}")
    sts = rendered.worker_sts()
    assert sts["spec"]["replicas"] == world_size
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    assert (
        sts["spec"]["serviceName"]
        == rendered.get("Service", "-worker-headless")["metadata"]["name"]
    )
    assert env_map(rendered.worker_container())["BROKER_LOOKUP_WORLD_SIZE"] == str(world_size)


def test_rank_comes_from_pod_index_label(render: RenderFn) -> None:
    env = env_map(render(REF).worker_container())
    assert env["BROKER_LOOKUP_RANK"] == {
        "fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}
    }


def test_chart_requires_kubernetes_with_pod_index(helm: str) -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2"
    assert chart["kubeVersion"].startswith(">=1.28")
    result = run_helm(helm, "template", RELEASE, str(CHART), "--kube-version", "1.27.0", *IMAGE_SET)
    assert result.returncode != 0
    assert "kubeVersion" in result.stderr or "kubernetes version" in result.stderr.lower()


def test_worker_command_env_and_config(render: RenderFn) -> None:
    rendered = render(REF, "engine.id=llama-tp2", "engine.worldSize=2")
    worker = rendered.worker_container()
    assert worker["command"] == ["python", "-m", "workers"]
    assert worker["args"][:2] == ["--config", "/etc/broker-lookup/config.yaml"]
    env = env_map(worker)
    assert env["BROKER_LOOKUP_ENGINE_ID"] == "llama-tp2"
    assert env["BROKER_LOOKUP_REDIS_URL"] == f"redis://{FULL}-redis:6379/0"
    assert env["BROKER_LOOKUP_METRICS_PORT"] == "9400"
    # The engine's worker user, its password from the Secret's key of its name.
    assert env["BROKER_LOOKUP_REDIS_USERNAME"] == "worker-llama-tp2"
    assert env["BROKER_LOOKUP_REDIS_PASSWORD"] == {
        "secretKeyRef": {"name": f"{FULL}-redis-auth", "key": "worker-llama-tp2"}
    }
    # The password never appears in args, the URL or a plain env value.
    assert not any("PASSWORD" in a for a in worker["args"])
    assert worker["ports"] == [{"name": "metrics", "containerPort": 9400, "protocol": "TCP"}]
    mounts = {m["mountPath"]: m for m in worker["volumeMounts"]}
    assert mounts["/etc/broker-lookup"]["readOnly"] is True
    volumes = {v["name"]: v for v in rendered.worker_sts()["spec"]["template"]["spec"]["volumes"]}
    assert volumes[mounts["/etc/broker-lookup"]["name"]]["configMap"]["name"] == f"{FULL}-worker"
    assert "emptyDir" in volumes[mounts["/tmp"]["name"]]


def test_worker_config_file(render: RenderFn) -> None:
    rendered = render(
        REF,
        "referenceWorkers.config.chunk_size=128",
        "referenceWorkers.config.heartbeat_interval_ms=500",
        "referenceWorkers.extraConfig.enable_chunk_statistics=true",
    )
    config = yaml.safe_load(rendered.get("ConfigMap", "-worker")["data"]["config.yaml"])
    assert config == {
        "chunk_size": 128,
        "save_unfull_chunk": False,
        "pre_caching_hash_algorithm": "builtin",
        "lookup_timeout_ms": 3000,
        "heartbeat_interval_ms": 500,
        "enable_chunk_statistics": True,
    }


def test_worker_config_default_leaves_nulls_out(render: RenderFn) -> None:
    config = yaml.safe_load(render(REF).get("ConfigMap", "-worker")["data"]["config.yaml"])
    assert "heartbeat_interval_ms" not in config and "stream_maxlen" not in config
    assert config["chunk_size"] == 256 and config["save_unfull_chunk"] is False


def test_extra_config_cannot_shadow_config(render_fails: RenderFailFn) -> None:
    assert "referenceWorkers.config.chunk_size" in render_fails(
        REF, "referenceWorkers.extraConfig.chunk_size=64"
    )


def test_config_change_rolls_pods(render: RenderFn) -> None:
    def checksum(r: Rendered) -> str:
        value: str = r.worker_sts()["spec"]["template"]["metadata"]["annotations"][
            "checksum/config"
        ]
        return value

    assert checksum(render(REF)) == checksum(render(REF))
    assert checksum(render(REF)) != checksum(
        render(REF, "referenceWorkers.config.lookup_timeout_ms=1500")
    )


def test_probes(render: RenderFn) -> None:
    worker = render(REF).worker_container()
    assert worker["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert worker["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert worker["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}


def test_probes_can_be_disabled(render: RenderFn) -> None:
    worker = _render_scenario(render, "no-probes-no-tests").worker_container()
    assert not {"readinessProbe", "livenessProbe", "startupProbe"} & worker.keys()


def test_image_tag_and_digest(render: RenderFn) -> None:
    assert render(REF).worker_container()["image"] == f"{TEST_IMAGE}:0.1.0"
    assert render(REF, "image.tag=1.2.3").worker_container()["image"] == f"{TEST_IMAGE}:1.2.3"
    digest = "sha256:" + "ab" * 32
    rendered = render(REF, f"image.digest={digest}", "image.repository=ghcr.io/x/bl")
    assert rendered.worker_container()["image"] == f"ghcr.io/x/bl@{digest}"
    redis = container(rendered.get("StatefulSet", "-redis"), "redis")
    assert redis["image"] == "valkey/valkey:8.1"
    assert redis["imagePullPolicy"] == "IfNotPresent"


# ---------------------------------------------------------------- security --

RESTRICTED = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_every_container_is_restricted(render: RenderFn, scenario: str) -> None:
    rendered = _render_scenario(render, scenario)
    for doc, pod in _pod_templates(rendered):
        pod_sc = pod["spec"]["securityContext"]
        assert pod_sc["runAsNonRoot"] is True, doc["metadata"]["name"]
        assert pod_sc["seccompProfile"] == {"type": "RuntimeDefault"}
        assert pod["spec"]["automountServiceAccountToken"] is False
        assert pod["spec"]["enableServiceLinks"] is False
        volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
        for cont in pod["spec"]["containers"]:
            sc = cont["securityContext"]
            assert RESTRICTED.items() <= sc.items(), cont["name"]
            tmp = [m for m in cont["volumeMounts"] if m["mountPath"] == "/tmp"]
            assert tmp and "emptyDir" in volumes[tmp[0]["name"]], "read-only root needs /tmp"


def test_worker_security_context(render: RenderFn) -> None:
    rendered = render(REF)
    sc = rendered.worker_container()["securityContext"]
    assert sc["runAsNonRoot"] is True
    assert sc["runAsUser"] == 10001
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert sc["readOnlyRootFilesystem"] is True
    pod_sc = rendered.worker_sts()["spec"]["template"]["spec"]["securityContext"]
    assert pod_sc["runAsUser"] == 10001


def test_resources_from_values(render: RenderFn) -> None:
    worker = render(
        REF,
        "referenceWorkers.resources.limits.nvidia\\.com/gpu=1",
        "referenceWorkers.resources.requests.cpu=2",
    ).worker_container()
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert worker["resources"]["requests"]["cpu"] == 2


# ------------------------------------------------------------------- redis --


def test_bundled_redis(render: RenderFn) -> None:
    rendered = render(NOACL)
    sts = rendered.get("StatefulSet", "-redis")
    assert sts["spec"]["replicas"] == 1
    redis = container(sts, "redis")
    assert redis["command"] == [
        "valkey-server",
        "/etc/valkey/valkey.conf",
        "--requirepass",
        "$(REDIS_PASSWORD)",
    ]
    assert env_map(redis)["REDIS_PASSWORD"] == {
        "secretKeyRef": {"name": f"{FULL}-redis-auth", "key": "redis-password"}
    }
    assert "$REDIS_PASSWORD" not in " ".join(redis["readinessProbe"]["exec"]["command"][:2])
    assert "tcpSocket" in redis["livenessProbe"]
    headless = rendered.get("Service", "-redis-headless")
    assert headless["spec"]["clusterIP"] == "None"
    assert sts["spec"]["serviceName"] == headless["metadata"]["name"]
    regular = rendered.get("Service", f"{FULL}-redis")
    assert regular["spec"]["ports"][0]["port"] == 6379
    assert "volumeClaimTemplates" not in sts["spec"]


def _server_config(rendered: Rendered) -> dict[str, str]:
    text = rendered.get("ConfigMap", "-redis")["data"]["valkey.conf"]
    out: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition(" ")
            out[key] = value
    return out


def test_redis_config_defaults(render: RenderFn) -> None:
    config = _server_config(render())
    assert config["maxmemory-policy"] == "noeviction"
    assert config["save"] == '""'
    assert config["appendonly"] == "no"
    assert config["protected-mode"] == "yes"
    assert config["maxmemory"] == "768mb"
    assert "requirepass" not in config  # ACL users, or the Secret via the command line
    assert config["aclfile"] == "/acl/users.acl"
    assert "aclfile" not in _server_config(render(NOACL))


def test_redis_persistence(render: RenderFn) -> None:
    rendered = render("redis.persistence.enabled=true", "redis.persistence.size=5Gi")
    assert _server_config(rendered)["appendonly"] == "yes"
    sts = rendered.get("StatefulSet", "-redis")
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "data"
    assert claim["spec"]["resources"]["requests"]["storage"] == "5Gi"
    volumes = [v["name"] for v in sts["spec"]["template"]["spec"]["volumes"]]
    assert "data" not in volumes


def test_auth_disabled(render: RenderFn) -> None:
    rendered = _render_scenario(render, "auth-disabled")
    assert not rendered.of_kind("Secret")
    assert "BROKER_LOOKUP_REDIS_PASSWORD" not in env_map(rendered.worker_container())
    redis = container(rendered.get("StatefulSet", "-redis"), "redis")
    assert "--requirepass" not in redis["command"]
    assert _server_config(rendered)["protected-mode"] == "no"


# ------------------------------------------------------------------ secret --


def test_generated_secret(render: RenderFn) -> None:
    secret = render(NOACL).get("Secret", "-redis-auth")
    password = base64.b64decode(secret["data"]["redis-password"]).decode()
    assert len(password) == 32 and password.isalnum()


def test_explicit_password(render: RenderFn) -> None:
    secret = render(NOACL, "auth.password=s3cret").get("Secret", "-redis-auth")
    assert base64.b64decode(secret["data"]["redis-password"]).decode() == "s3cret"


def test_existing_secret_wiring(render: RenderFn) -> None:
    rendered = render(
        REF, NOACL, "auth.existingSecret=shared-redis", "auth.existingSecretPasswordKey=password"
    )
    assert not rendered.of_kind("Secret")
    expected = {"secretKeyRef": {"name": "shared-redis", "key": "password"}}
    assert env_map(rendered.worker_container())["BROKER_LOOKUP_REDIS_PASSWORD"] == expected
    redis = container(rendered.get("StatefulSet", "-redis"), "redis")
    assert env_map(redis)["REDIS_PASSWORD"] == expected
    test_pod = rendered.get("Pod", "-test-inspect")
    assert env_map(container(test_pod, "inspect"))["BROKER_LOOKUP_REDIS_PASSWORD"] == expected


def test_existing_secret_default_key(render: RenderFn) -> None:
    env = env_map(render(REF, NOACL, "auth.existingSecret=bitnami-redis").worker_container())
    assert env["BROKER_LOOKUP_REDIS_PASSWORD"]["secretKeyRef"]["key"] == "redis-password"


# ---------------------------------------------------------- external redis --


def test_external_redis_renders_no_server(render: RenderFn) -> None:
    rendered = _render_scenario(render, "external-redis")
    assert not rendered.has("StatefulSet", "-redis")
    assert not rendered.has("Service", "-redis") and not rendered.has("Service", "-redis-headless")
    assert not rendered.has("ConfigMap", "-redis")
    assert not rendered.of_kind("Secret")
    env = env_map(rendered.worker_container())
    assert env["BROKER_LOOKUP_REDIS_URL"] == "redis://redis-master.cache.svc.cluster.local:6379/0"
    assert env["BROKER_LOOKUP_REDIS_PASSWORD"] == {
        "secretKeyRef": {"name": "redis", "key": "redis-password"}
    }


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["redis.enabled=false"], "externalRedis.url"),
        (
            ["redis.enabled=false", "externalRedis.url=redis://:hunter2@r:6379/0"],
            "must not contain a password",
        ),
        (["redis.enabled=false", "externalRedis.url=redis://r:6379/0"], "auth.existingSecret"),
        (["externalRedis.url=redis://r:6379/0"], "not both"),
    ],
)
def test_external_redis_misconfiguration_fails(
    render_fails: RenderFailFn, sets: list[str], message: str
) -> None:
    assert message in render_fails(*sets)


def test_external_redis_without_auth(render: RenderFn) -> None:
    rendered = render(
        REF, "redis.enabled=false", "externalRedis.url=rediss://r:6380/0", "auth.enabled=false"
    )
    env = env_map(rendered.worker_container())
    assert env["BROKER_LOOKUP_REDIS_URL"] == "rediss://r:6380/0"
    assert "BROKER_LOOKUP_REDIS_PASSWORD" not in env


@pytest.mark.parametrize(
    "url",
    ["redis+sentinel://s1:26379,s2:26379/mymaster/0", "redis+cluster://n1:6379,n2:6379"],
)
def test_external_sentinel_and_cluster_urls_reach_the_workers(render: RenderFn, url: str) -> None:
    escaped = url.replace(",", "\\,")  # helm --set splits on unescaped commas
    rendered = render(
        REF, "redis.enabled=false", f"externalRedis.url={escaped}", "auth.enabled=false"
    )
    assert env_map(rendered.worker_container())["BROKER_LOOKUP_REDIS_URL"] == url


# -------------------------------------------------------------------- PDB --


def test_pdb_off_by_default(render: RenderFn) -> None:
    assert not render(REF, "engine.worldSize=4").of_kind("PodDisruptionBudget")


def test_pdb_on(render: RenderFn) -> None:
    rendered = render(REF, "pdb.enabled=true", "engine.worldSize=4")
    pdb = rendered.get("PodDisruptionBudget")
    assert pdb["apiVersion"] == "policy/v1"
    assert pdb["spec"]["maxUnavailable"] == 1
    assert "minAvailable" not in pdb["spec"]
    assert (
        pdb["spec"]["selector"]["matchLabels"]
        == rendered.worker_sts()["spec"]["selector"]["matchLabels"]
    )


def test_pdb_min_available(render: RenderFn) -> None:
    pdb = _render_scenario(render, "pdb-min-available").get("PodDisruptionBudget")
    assert pdb["spec"] == {**pdb["spec"], "minAvailable": 2}
    assert "maxUnavailable" not in pdb["spec"]


def test_pdb_not_rendered_for_one_rank(render: RenderFn) -> None:
    assert not render(REF, "pdb.enabled=true").of_kind("PodDisruptionBudget")


def test_pdb_both_bounds_fail(render_fails: RenderFailFn) -> None:
    stderr = render_fails("pdb.enabled=true", "engine.worldSize=2", "pdb.minAvailable=1")
    assert "only one of minAvailable and maxUnavailable" in stderr


# --------------------------------------------------------- NetworkPolicy --


def test_network_policy_on_by_default(render: RenderFn) -> None:
    names = [p["metadata"]["name"] for p in render().of_kind("NetworkPolicy")]
    assert names == [f"{FULL}-redis", f"{FULL}-exporter"]
    assert not render("networkPolicy.enabled=false").of_kind("NetworkPolicy")


def _labels_match(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert "matchExpressions" not in selector
    match: dict[str, str] = selector.get("matchLabels", {})
    return match.items() <= labels.items()


def test_network_policy_redis_ingress(render: RenderFn) -> None:
    rendered = _render_scenario(render, "network-policy")
    policy = rendered.get("NetworkPolicy", "-redis")
    redis_pod = rendered.get("StatefulSet", "-redis")["spec"]["template"]["metadata"]["labels"]
    worker_pod = rendered.worker_sts()["spec"]["template"]["metadata"]["labels"]
    test_pod = rendered.get("Pod", "-test-inspect")["metadata"]["labels"]
    exporter_pod = rendered.get("Deployment", "-exporter")["spec"]["template"]["metadata"]
    vllm_pod = {"broker-lookup/client": "true", "app": "vllm"}
    stranger = {"app": "something-else"}

    assert _labels_match(policy["spec"]["podSelector"], redis_pod)
    assert not _labels_match(policy["spec"]["podSelector"], worker_pod)
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 6379}]
    peers = rule["from"]
    assert all("namespaceSelector" not in p for p in peers)  # same namespace only

    def allowed(labels: dict[str, str]) -> bool:
        return any(_labels_match(p["podSelector"], labels) for p in peers)

    assert allowed(vllm_pod)
    assert allowed(exporter_pod["labels"])
    assert allowed(worker_pod)
    assert allowed(test_pod)
    assert not allowed(stranger)
    assert not allowed(redis_pod)


def test_network_policy_worker_metrics(render: RenderFn) -> None:
    rendered = _render_scenario(render, "network-policy")
    policy = rendered.get("NetworkPolicy", "-worker")
    worker_pod = rendered.worker_sts()["spec"]["template"]["metadata"]["labels"]
    assert _labels_match(policy["spec"]["podSelector"], worker_pod)
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 9400}]
    assert rule["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}},
        {
            "podSelector": {
                "matchLabels": {**_selector_labels(), "app.kubernetes.io/component": "test"}
            }
        },
    ]
    exporter = rendered.get("NetworkPolicy", "-exporter")
    exporter_pod = rendered.get("Deployment", "-exporter")["spec"]["template"]["metadata"]
    assert _labels_match(exporter["spec"]["podSelector"], exporter_pod["labels"])
    assert exporter["spec"]["ingress"][0]["from"] == rule["from"]


def _selector_labels() -> dict[str, str]:
    return {"app.kubernetes.io/name": "broker-lookup", "app.kubernetes.io/instance": RELEASE}


def test_network_policy_custom_selectors(render: RenderFn) -> None:
    rendered = render(REF, values_files=[CI / "all-features-values.yaml"])
    peers = rendered.get("NetworkPolicy", "-redis")["spec"]["ingress"][0]["from"]
    assert peers[0] == {
        "podSelector": {"matchLabels": {"broker-lookup/client": "true"}},
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "inference"}},
    }
    assert {"podSelector": {"matchLabels": {"app": "redis-debug"}}} in peers
    custom = render(
        REF,
        "networkPolicy.enabled=true",
        "networkPolicy.clientPodSelector.matchLabels.app=vllm-router",
        "networkPolicy.metricsNamespaceSelector.matchLabels.team=obs",
    )
    peers = custom.get("NetworkPolicy", "-redis")["spec"]["ingress"][0]["from"]
    assert peers[0]["podSelector"]["matchLabels"] == {
        "broker-lookup/client": "true",
        "app": "vllm-router",
    }
    metrics = custom.get("NetworkPolicy", "-worker")["spec"]["ingress"][0]["from"]
    assert metrics[0]["namespaceSelector"]["matchLabels"]["team"] == "obs"


def test_network_policy_scrapers_are_configurable(render: RenderFn) -> None:
    """kube-prometheus-stack's Prometheus pods only, in its namespace; or the release's own
    namespace (metricsNamespaceSelector null) plus an extra peer."""
    prom = {"app.kubernetes.io/name": "prometheus"}
    rendered = render(
        REF, "networkPolicy.metricsPodSelector.matchLabels.app\\.kubernetes\\.io/name=prometheus"
    )
    for component in ("-exporter", "-worker"):
        peers = rendered.get("NetworkPolicy", component)["spec"]["ingress"][0]["from"]
        assert peers[0] == {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
            "podSelector": {"matchLabels": prom},
        }
    own = render(
        extra=[
            "--set-json",
            "networkPolicy.metricsNamespaceSelector=null",
            "--set-json",
            'networkPolicy.metricsPodSelector={"matchLabels":{"app":"prom"}}',
            "--set-json",
            'networkPolicy.extraMetricsClients=[{"ipBlock":{"cidr":"10.0.0.0/8"}}]',
        ]
    )
    peers = own.get("NetworkPolicy", "-exporter")["spec"]["ingress"][0]["from"]
    assert peers[:2] == [
        {"podSelector": {"matchLabels": {"app": "prom"}}},
        {"ipBlock": {"cidr": "10.0.0.0/8"}},
    ]
    assert peers[2]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "test"


def test_network_policy_external_redis(render: RenderFn) -> None:
    rendered = render(
        REF, "networkPolicy.enabled=true", values_files=[CI / "external-redis-values.yaml"]
    )
    names = [p["metadata"]["name"] for p in rendered.of_kind("NetworkPolicy")]
    assert names == [f"{FULL}-exporter", f"{FULL}-worker"]


# ------------------------------------------------ metrics, ServiceMonitor --


def test_service_monitor_on_by_default_where_the_crd_is(render: RenderFn) -> None:
    rendered = render(REF, extra=["--api-versions", "monitoring.coreos.com/v1"])
    names = [m["metadata"]["name"] for m in rendered.of_kind("ServiceMonitor")]
    assert names == [f"{FULL}-exporter", f"{FULL}-worker"]
    off = render(
        REF, "serviceMonitor.enabled=false", extra=["--api-versions", "monitoring.coreos.com/v1"]
    )
    assert not off.of_kind("ServiceMonitor")
    assert not off.has("Service", "-worker-metrics")


def test_service_monitor_needs_the_crd(render: RenderFn) -> None:
    """Enabled, but the cluster has no monitoring.coreos.com/v1: nothing that would fail."""
    rendered = render(REF, "serviceMonitor.enabled=true")
    assert not rendered.of_kind("ServiceMonitor")
    assert not rendered.has("Service", "-worker-metrics")


@pytest.mark.parametrize(
    "how",
    [
        {"sets": ["serviceMonitor.enabled=true", "serviceMonitor.force=true"]},
        {
            "sets": ["serviceMonitor.enabled=true"],
            "extra": ["--api-versions", "monitoring.coreos.com/v1"],
        },
    ],
    ids=["force", "capability"],
)
def test_service_monitor_on(render: RenderFn, how: dict[str, list[str]]) -> None:
    rendered = render(REF, *how["sets"], extra=how.get("extra", []))
    monitor = rendered.get("ServiceMonitor", "-worker")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    assert endpoint["interval"] == "30s"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    service = rendered.get("Service", "-worker-metrics")
    assert _labels_match(monitor["spec"]["selector"], service["metadata"]["labels"])
    # Exactly one Service matches, or every target would be scraped twice.
    matching = [
        s["metadata"]["name"]
        for s in rendered.of_kind("Service")
        if _labels_match(monitor["spec"]["selector"], s["metadata"]["labels"])
    ]
    assert matching == [service["metadata"]["name"]]
    assert service["spec"]["ports"][0]["name"] == "metrics"
    # The exporter's: every engine's metrics, from one Service.
    exporter = rendered.get("ServiceMonitor", "-exporter")
    matching = [
        s["metadata"]["name"]
        for s in rendered.of_kind("Service")
        if _labels_match(exporter["spec"]["selector"], s["metadata"]["labels"])
    ]
    assert matching == [f"{FULL}-exporter"]
    assert exporter["spec"]["endpoints"][0]["port"] == "metrics"


def test_service_monitor_options(render: RenderFn) -> None:
    rendered = render(
        "serviceMonitor.enabled=true",
        "serviceMonitor.force=true",
        "serviceMonitor.namespace=monitoring",
        "serviceMonitor.interval=15s",
        "serviceMonitor.additionalLabels.release=prom",
        extra=["--set-json", 'serviceMonitor.relabelings=[{"action":"labeldrop","regex":"x"}]'],
    )
    monitor = rendered.get("ServiceMonitor")
    assert monitor["metadata"]["namespace"] == "monitoring"
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["endpoints"][0]["interval"] == "15s"
    assert monitor["spec"]["endpoints"][0]["relabelings"] == [{"action": "labeldrop", "regex": "x"}]


def test_the_exporter_stays_scraped_while_redis_is_down(render: RenderFn) -> None:
    """Its probes never read Redis: a not-ready exporter leaves its Service's endpoints,
    so its ``broker_lookup_redis_up 0`` would never be scraped and BrokerLookupRedisDown
    could not fire (BrokerLookupExporterDown would, naming the wrong thing)."""
    exporter = container(render().get("Deployment", "-exporter"), "exporter")
    for probe in ("readinessProbe", "livenessProbe"):
        assert exporter[probe].get("tcpSocket") == {"port": "metrics"}, probe
        assert "httpGet" not in exporter[probe]


def test_prometheus_rule_carries_the_release_label_kube_prometheus_stack_selects(
    render: RenderFn,
) -> None:
    rendered = render(
        "prometheusRule.enabled=true",
        "prometheusRule.force=true",
        "prometheusRule.additionalLabels.release=kube-prometheus-stack",
        "serviceMonitor.force=true",
        "serviceMonitor.additionalLabels.release=kube-prometheus-stack",
    )
    rule = rendered.get("PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert (
        rule["spec"]["groups"]
        == yaml.safe_load((CHART / "files" / "alerts.yaml").read_text())["groups"]
    )
    for monitor in rendered.of_kind("ServiceMonitor"):
        assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_metrics_service_alone(render: RenderFn) -> None:
    rendered = render(REF, "metricsService.enabled=true")
    service = rendered.get("Service", "-worker-metrics")
    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["selector"] == rendered.worker_sts()["spec"]["selector"]["matchLabels"]
    assert not rendered.of_kind("ServiceMonitor")


# -------------------------------------------------------------- helm test --


def test_helm_test_hook(render: RenderFn) -> None:
    rendered = render(REF, "engine.worldSize=4", "engine.id=e1")
    pod = rendered.get("Pod", "-test-inspect")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert pod["spec"]["restartPolicy"] == "Never"
    inspect = container(pod, "inspect")
    assert inspect["command"] == ["broker-lookup"]
    assert inspect["args"][0] == "inspect" and "--check" in inspect["args"]
    args = inspect["args"]
    assert "--allow-absent" not in args  # reference workers are part of the release
    assert args[args.index("--redis-url") + 1] == "$(BROKER_LOOKUP_REDIS_URL)"
    assert args[args.index("--engine-id") + 1] == "$(BROKER_LOOKUP_ENGINE_ID)"
    assert args[args.index("--world-size") + 1] == "$(BROKER_LOOKUP_WORLD_SIZE)"
    # Same Redis/engine wiring as the workers, as the engine's read-only operator.
    worker_env = env_map(rendered.worker_container())
    test_env = env_map(inspect)
    for name in ("BROKER_LOOKUP_REDIS_URL", "BROKER_LOOKUP_ENGINE_ID", "BROKER_LOOKUP_WORLD_SIZE"):
        assert test_env[name] == worker_env[name], name
    assert test_env["BROKER_LOOKUP_REDIS_USERNAME"] == "operator-e1"
    assert test_env["BROKER_LOOKUP_REDIS_PASSWORD"]["secretKeyRef"]["key"] == "operator-e1"
    assert inspect["image"] == rendered.worker_container()["image"]


def test_helm_test_hooks_of_a_vllm_fleet(render: RenderFn) -> None:
    """No reference workers: inspect checks each vLLM instance's namespace (their ranks are
    vLLM's: no --world-size) and passes with none yet (--allow-absent), and the exporter's
    /metrics is scraped."""
    rendered = render("engine.id=e1")
    inspect = container(rendered.get("Pod", "-test-inspect"), "inspect")
    assert "--check" in inspect["args"] and "--allow-absent" in inspect["args"]
    assert "--world-size" not in inspect["args"]
    scrape = container(rendered.get("Pod", "-test-exporter"), "scrape")
    assert scrape["args"][-1] == f"http://{FULL}-exporter:9400/metrics"
    assert not render("exporter.enabled=false").has("Pod", "-test-exporter")


def test_helm_test_hook_can_be_disabled(render: RenderFn) -> None:
    assert not _render_scenario(render, "no-probes-no-tests").of_kind("Pod")


# ------------------------------------------------- renderers, new engines --

DEPLOY_DOC = CHART.parents[1] / "docs" / "deploy.md"


def _without_secrets(rendered: Rendered) -> list[Manifest]:
    return [d for d in rendered if d["kind"] != "Secret"]


def test_renderers_get_new_passwords_unless_pinned_and_the_docs_say_so(render: RenderFn) -> None:
    """A render without a cluster (Argo CD's ``helm template``) generates new passwords each
    time; ``auth.existingSecret`` makes two renders identical."""
    first, second = render(fresh=True), render(fresh=True)
    assert first.get("Secret")["data"] != second.get("Secret")["data"]
    pinned = [render("auth.existingSecret=fleet-redis", fresh=True) for _ in range(2)]
    assert not pinned[0].of_kind("Secret")
    assert pinned[0].docs == pinned[1].docs
    doc = " ".join(DEPLOY_DOC.read_text().split())
    assert "Argo CD" in doc and "pin the passwords" in doc
    assert "`auth.existingSecret`" in doc.split("pin the passwords", 1)[1][:900]


def test_adding_an_engine_restarts_valkey_and_the_docs_say_so(render: RenderFn) -> None:
    def annotations(rendered: Rendered) -> dict[str, str]:
        pod = rendered.get("StatefulSet", "-redis")["spec"]["template"]["metadata"]
        return dict(pod["annotations"])

    before = annotations(render())
    after = annotations(render("auth.acl.extraEngines={llama-70b}"))
    assert before["checksum/acl"] != after["checksum/acl"]  # a new pod template: a restart
    assert before["checksum/config"] == after["checksum/config"]
    doc = " ".join(DEPLOY_DOC.read_text().split())
    assert "Adding an engine restarts Valkey" in doc
    assert "restarts the only Valkey pod" in doc


# ------------------------------------------------------------------ NOTES --


def test_notes(helm: str) -> None:
    """The notes name everything a vLLM pod needs, as the pod spec's own YAML."""

    def notes(*sets: str) -> str:
        args = ["install", RELEASE, str(CHART), "--dry-run=client", "--namespace", NAMESPACE]
        args += IMAGE_SET
        result = run_helm(helm, *args, *[a for s in sets for a in ("--set", s)], check=True)
        return result.stdout.split("NOTES:", 1)[1]

    fleet = notes("engine.id=e1")
    for text in (
        '--kv-transfer-config \'{"kv_connector":"LMCacheConnectorV1",'
        '"kv_role":"kv_both","engine_id":"e1"}\'',
        '- name: BROKER_LOOKUP_LMCACHE\n      value: "1"',
        '- name: PYTHONHASHSEED\n      value: "0"',
        f'- name: BROKER_LOOKUP_REDIS_URL\n      value: "redis://{FULL}-redis:6379/0"',
        '- name: BROKER_LOOKUP_REDIS_USERNAME\n      value: "vllm-e1"',
        f"secretKeyRef:\n          name: {FULL}-redis-auth\n          key: vllm-e1",
        "chunk_size: 256",
        "save_unfull_chunk: false",
        "pre_caching_hash_algorithm: builtin",
        "enable_async_loading: false",
        'broker-lookup/client: "true"',
        f"http://{FULL}-exporter.{NAMESPACE}.svc:9400/metrics",
    ):
        assert text in fleet, text
    assert "reference-engine workers" not in fleet
    assert "KEYS " not in fleet
    assert "reference-engine workers" in notes("referenceWorkers.enabled=true")
    single = notes("auth.acl.enabled=false")
    assert "BROKER_LOOKUP_REDIS_USERNAME" not in single
    assert f"name: {FULL}-redis-auth\n          key: redis-password" in single


@pytest.mark.parametrize("scenario", ["reference-workers", "all-features"])
def test_worker_config_loads_as_lookup_config(render: RenderFn, scenario: str) -> None:
    """Every field the chart writes is a LookupConfig field with a valid value."""
    from broker_lookup.config import LookupConfig

    rendered = _render_scenario(render, scenario)
    values = yaml.safe_load(rendered.get("ConfigMap", "-worker")["data"]["config.yaml"])
    config = LookupConfig.from_mapping(values, source="the chart's config.yaml")
    for key, value in values.items():
        assert getattr(config, key) == value


def test_worker_config_defaults_match_the_code(render: RenderFn) -> None:
    """The chart's defaults are LookupConfig's (LMCache's) defaults, not different ones."""
    from broker_lookup.config import LookupConfig

    values = yaml.safe_load(render(REF).get("ConfigMap", "-worker")["data"]["config.yaml"])
    defaults = LookupConfig()
    for key, value in values.items():
        assert getattr(defaults, key) == value, key
