"""Run the worker exactly as the chart renders it, against an embedded server.

The chart is rendered for an external Redis (the embedded server, with a
password). The worker container's command, args and env are taken from the
manifest and resolved the way the kubelet would: ``secretKeyRef`` from the
rendered Secret, ``fieldRef`` pod-index from the rank, mounted ConfigMaps written
to a temporary directory (paths rewritten), ``$(VAR)`` expanded. Then:

* the rank's heartbeat key appears;
* the probe endpoints the chart points at (``/healthz``, ``/readyz``) answer 200;
* the ``helm test`` hook's command (``broker-lookup inspect --check``) exits 0;
* SIGTERM ends the worker with exit status 0 within 10 s.

Needs the worker runner (``python -m workers``), ``broker-lookup inspect`` and
``broker_lookup.tools.embedded``.
"""

from __future__ import annotations

import base64
import os
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from helpers import wait_until

from broker_lookup.processes import free_port

from ._chart import REPO, Manifest, Rendered, RenderFn, container

pytestmark = [pytest.mark.helm, pytest.mark.real, pytest.mark.slow]

ENGINE = "chart-exec"
PASSWORD = "chart-test-password"
POD_INDEX = "metadata.labels['apps.kubernetes.io/pod-index']"


@dataclass
class Process:
    argv: list[str]
    env: dict[str, str]


def _secret_value(rendered: Rendered, ref: dict[str, str]) -> str:
    for secret in rendered.of_kind("Secret"):
        if secret["metadata"]["name"] == ref["name"]:
            return base64.b64decode(secret["data"][ref["key"]]).decode()
    raise AssertionError(f"secretKeyRef to a Secret the chart did not render: {ref}")


def _config_map_value(rendered: Rendered, ref: dict[str, str]) -> str:
    for config_map in rendered.of_kind("ConfigMap"):
        if config_map["metadata"]["name"] == ref["name"]:
            value: str = config_map["data"][ref["key"]]
            return value
    raise AssertionError(f"configMapKeyRef to a ConfigMap the chart did not render: {ref}")


def _field_value(workload: Manifest, path: str, rank: int) -> str:
    pod_name = f"{workload['metadata']['name']}-{rank}"
    known: dict[str, str] = {
        POD_INDEX: str(rank),
        "metadata.name": pod_name,
        "metadata.namespace": workload["metadata"]["namespace"],
        "metadata.labels['statefulset.kubernetes.io/pod-name']": pod_name,
    }
    assert path in known, f"no local value for fieldRef {path}"
    return known[path]


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes $(VAR) expansion ($$ escapes; unknown names stay as written)."""

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env[name] if name in env else match.group(0)

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, text)


def _pod_spec(workload: Manifest) -> Manifest:
    spec: Manifest = workload["spec"]
    return spec["template"]["spec"] if "template" in spec else spec


def _mount_volumes(
    rendered: Rendered, workload: Manifest, cont: Manifest, root: Path
) -> dict[str, Path]:
    """mountPath -> local directory: ConfigMaps become files, emptyDirs empty directories."""
    volumes = {v["name"]: v for v in _pod_spec(workload).get("volumes", [])}
    config_maps = {c["metadata"]["name"]: c for c in rendered.of_kind("ConfigMap")}
    mounts: dict[str, Path] = {}
    for mount in cont.get("volumeMounts", []):
        local = root / mount["name"]
        local.mkdir(parents=True, exist_ok=True)
        volume = volumes[mount["name"]]
        if "configMap" in volume:
            for key, value in config_maps[volume["configMap"]["name"]]["data"].items():
                (local / key).write_text(value)
        else:
            assert "emptyDir" in volume, f"cannot emulate volume {volume}"
        mounts[mount["mountPath"]] = local
    return mounts


def _env_value(
    rendered: Rendered, workload: Manifest, item: Manifest, env: dict[str, str], rank: int
) -> str:
    if "value" in item:
        return _expand(str(item["value"]), env)
    source: dict[str, Any] = item["valueFrom"]
    if "secretKeyRef" in source:
        return _secret_value(rendered, source["secretKeyRef"])
    if "configMapKeyRef" in source:
        return _config_map_value(rendered, source["configMapKeyRef"])
    if "fieldRef" in source:
        return _field_value(workload, source["fieldRef"]["fieldPath"], rank)
    raise AssertionError(f"cannot resolve env {item}")


def resolve(rendered: Rendered, workload: Manifest, name: str, rank: int, root: Path) -> Process:
    """The command line and environment the kubelet would start ``name`` with."""
    cont = container(workload, name)
    mounts = _mount_volumes(rendered, workload, cont, root)

    def localize(value: str) -> str:
        for mount_path, local in mounts.items():
            if value == mount_path or value.startswith(mount_path + "/"):
                return str(local) + value[len(mount_path) :]
        return value

    env: dict[str, str] = {}
    for item in cont.get("env", []):
        env[item["name"]] = localize(_env_value(rendered, workload, item, env, rank))

    argv = [localize(_expand(a, env)) for a in [*cont.get("command", []), *cont.get("args", [])]]
    # The image's interpreter and console scripts are this venv's.
    bin_dir = Path(sys.executable).parent
    if argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    elif (bin_dir / argv[0]).exists():
        argv[0] = str(bin_dir / argv[0])
    return Process(argv, env)


def _http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            status: int = response.status
            return status
    except urllib.error.HTTPError as exc:
        return exc.code


def _start(process: Process, log: Path) -> subprocess.Popen[bytes]:
    """Start ``process`` with its output in ``log`` (a pipe nobody reads could block it)."""
    with log.open("wb") as out:
        return subprocess.Popen(
            process.argv,
            env={**os.environ, **process.env},
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=5)


def _wait(what: str, check: Any, proc: subprocess.Popen[bytes], log: Path) -> None:
    """Until ``check`` holds (its connection errors: not yet); fails if the worker exits."""
    errors = (OSError, redis.RedisError)
    wait_until(check, 30, 0.1, what, ignoring=errors, process=proc, log=log)


@pytest.mark.parametrize("rank", [0, 1])
def test_worker_runs_as_rendered(render: RenderFn, tmp_path: Path, rank: int) -> None:
    from broker_lookup.protocol.keys import KeySpace
    from broker_lookup.tools.embedded import EmbeddedServer

    with EmbeddedServer() as server:
        admin = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=5)
        admin.config_set("requirepass", PASSWORD)
        conn = redis.Redis(host="127.0.0.1", port=server.port, password=PASSWORD)
        metrics_port = free_port()
        rendered = render(
            "referenceWorkers.enabled=true",
            "redis.enabled=false",
            f"externalRedis.url=redis://127.0.0.1:{server.port}/0",
            "auth.acl.enabled=false",  # the server has one password (its default user)
            f"auth.password={PASSWORD}",
            f"engine.id={ENGINE}",
            "engine.worldSize=2",
            f"referenceWorkers.metricsPort={metrics_port}",
        )
        worker = resolve(rendered, rendered.worker_sts(), "worker", rank, tmp_path / "worker")
        assert worker.env["BROKER_LOOKUP_RANK"] == str(rank)
        assert worker.env["BROKER_LOOKUP_REDIS_PASSWORD"] == PASSWORD
        assert Path(worker.argv[worker.argv.index("--config") + 1]).is_file()

        log = tmp_path / "worker.log"
        proc = _start(worker, log)
        try:
            heartbeat = KeySpace(ENGINE).heartbeat(rank)
            _wait(f"heartbeat {heartbeat}", lambda: conn.exists(heartbeat) == 1, proc, log)
            base = f"http://127.0.0.1:{metrics_port}"
            _wait("/healthz", lambda: _http_status(base + "/healthz") == 200, proc, log)
            _wait("/readyz", lambda: _http_status(base + "/readyz") == 200, proc, log)
            _wait("/metrics", lambda: _http_status(base + "/metrics") == 200, proc, log)
            if rank == 0:
                _inspect_hook_fails_for_the_missing_rank(rendered, tmp_path)

            proc.send_signal(signal.SIGTERM)
            try:
                returncode = proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pytest.fail("worker did not exit within 10 s of SIGTERM")
            assert returncode == 0, log.read_text(errors="replace")
        finally:
            _stop(proc)


def _run_inspect_hook(rendered: Rendered, tmp_path: Path) -> subprocess.CompletedProcess[bytes]:
    """Run the chart's helm test hook (``broker-lookup inspect``) here, as its pod would."""
    hook = rendered.get("Pod", "-test-inspect")
    inspect = resolve(rendered, hook, "inspect", 0, tmp_path / "inspect")
    assert inspect.argv[1:3] == ["inspect", "--redis-url"]
    return subprocess.run(
        inspect.argv,
        env={**os.environ, **inspect.env},
        cwd=REPO,
        capture_output=True,
        timeout=60,
        check=False,
    )


def _inspect_hook_fails_for_the_missing_rank(rendered: Rendered, tmp_path: Path) -> None:
    """worldSize=2 with only rank 0 running: the helm test hook must report failure."""
    result = _run_inspect_hook(rendered, tmp_path)
    output = (result.stdout + result.stderr).decode(errors="replace")
    assert result.returncode != 0, output
    assert "Traceback" not in output, "inspect crashed instead of reporting the dead rank"


def test_helm_test_hook_passes_when_every_rank_runs(render: RenderFn, tmp_path: Path) -> None:
    from broker_lookup.protocol.keys import KeySpace
    from broker_lookup.tools.embedded import EmbeddedServer

    with EmbeddedServer() as server:
        conn = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=5)
        rendered = render(
            "referenceWorkers.enabled=true",
            "redis.enabled=false",
            f"externalRedis.url=redis://127.0.0.1:{server.port}/0",
            "auth.enabled=false",
            f"engine.id={ENGINE}",
            "engine.worldSize=2",
            f"referenceWorkers.metricsPort={free_port()}",
        )
        sts = rendered.worker_sts()
        procs: list[subprocess.Popen[bytes]] = []
        logs = [tmp_path / f"worker-{rank}.log" for rank in range(2)]
        try:
            for rank in range(2):
                worker = resolve(rendered, sts, "worker", rank, tmp_path / f"worker-{rank}")
                # Pods have their own network namespace; locally each rank needs its own port.
                worker.env["BROKER_LOOKUP_METRICS_PORT"] = str(free_port())
                procs.append(_start(worker, logs[rank]))
            keys = KeySpace(ENGINE)
            for rank, proc in enumerate(procs):
                key = keys.heartbeat(rank)
                _wait(f"rank {rank}", lambda k=key: conn.exists(k) == 1, proc, logs[rank])
            result = _run_inspect_hook(rendered, tmp_path)
            assert result.returncode == 0, result.stdout + result.stderr
            for proc in procs:
                proc.send_signal(signal.SIGTERM)
            for proc, log in zip(procs, logs, strict=True):
                assert proc.wait(timeout=10) == 0, log.read_text(errors="replace")
        finally:
            for proc in procs:
                _stop(proc)
