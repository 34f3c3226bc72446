"""One order of config sources on every path: the same setting given in two sources wins
the same way through ``LookupConfig.load`` and under vLLM (the LMCache integration's
``config_from_lmcache``, with an LMCache-like config object), and a field LMCache acts on
itself is never changed by another source."""

from __future__ import annotations

import argparse
import itertools
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from broker_lookup.config import LookupConfig, env_name
from broker_lookup.config.env import CONFIG_FILE_ENV
from broker_lookup.errors import ConfigError
from broker_lookup.integrations.lmcache import (
    LMCACHE_FIELDS,
    broker_requested,
    config_from_lmcache,
    lmcache_source,
)

URL = "redis://cache:6379/0"
#: The sources, each overriding the ones before it (docs/configuration.md).
ORDER = ("file", "lmcache", "env", "flag", "keyword")
#: The sources a vLLM engine's config has (no command line, no keywords).
UNDER_VLLM = ("file", "lmcache", "env")
#: A broker field each source sets to its own value.
FIELD = "socket_timeout_ms"
VALUES = {source: 6001 + n for n, source in enumerate(ORDER)}


def _lmcache_config(extra: dict[str, Any] | None = None, **fields: Any) -> SimpleNamespace:
    """LMCache's config fields at LMCache's defaults, asking for the broker."""
    values: dict[str, Any] = dict.fromkeys(LMCACHE_FIELDS)
    values.update(chunk_size=256, save_unfull_chunk=False, lookup_timeout_ms=3000)
    values.update(enable_async_loading=False, enable_scheduler_bypass_lookup=False)
    values.update(enable_chunk_statistics=False, pre_caching_hash_algorithm="builtin")
    values.update(fields)
    return SimpleNamespace(**values, extra_config={"lookup_broker_url": URL, **(extra or {})})


def _metadata() -> SimpleNamespace:
    return SimpleNamespace(engine_id="vllm-0", world_size=2, worker_id=0)


def _sources(
    given: tuple[str, ...], tmp_path: Path, field: str = FIELD, value: Any = None
) -> tuple[dict[str, str], SimpleNamespace, dict[str, str], dict[str, Any]]:
    """The environment (with the file's variable), the LMCache config, the flags and the
    keywords that set ``field`` in each of the ``given`` sources (each its own value)."""

    def of(source: str) -> Any:
        return VALUES[source] if value is None else value

    env: dict[str, str] = {}
    if "file" in given:
        path = tmp_path / "bl.yaml"
        path.write_text(f"{field}: {of('file')}\n")
        env[CONFIG_FILE_ENV] = str(path)
    if "env" in given:
        env[env_name(field)] = str(of("env"))
    extra = {"lookup_broker_" + field: of("lmcache")} if "lmcache" in given else {}
    flags = {field: str(of("flag"))} if "flag" in given else {}
    keywords = {field: of("keyword")} if "keyword" in given else {}
    return env, _lmcache_config(extra), flags, keywords


def _load(given: tuple[str, ...], tmp_path: Path) -> LookupConfig:
    env, lmc, flags, keywords = _sources(given, tmp_path)
    lmcache = lmcache_source(lmc, env) if "lmcache" in given else None
    return LookupConfig.load(environ=env, lmcache=lmcache, flags=flags, **keywords)


@pytest.mark.parametrize("pair", list(itertools.combinations(ORDER, 2)), ids="<".join)
def test_the_later_source_of_each_pair_wins(pair: tuple[str, str], tmp_path: Path) -> None:
    earlier, later = pair
    assert getattr(_load(pair, tmp_path), FIELD) == VALUES[later]
    assert getattr(_load((later, earlier), tmp_path), FIELD) == VALUES[later]
    assert getattr(_load((earlier,), tmp_path), FIELD) == VALUES[earlier]


@pytest.mark.parametrize("pair", list(itertools.combinations(UNDER_VLLM, 2)), ids="<".join)
def test_each_pair_wins_the_same_way_under_vllm(pair: tuple[str, str], tmp_path: Path) -> None:
    env, lmc, _, _ = _sources(pair, tmp_path)
    under_vllm, _ = config_from_lmcache(lmc, _metadata(), environ=env)
    assert getattr(under_vllm, FIELD) == getattr(_load(pair, tmp_path), FIELD) == VALUES[pair[1]]


@pytest.mark.parametrize("source", ["env", "flag", "keyword"])
def test_lmcaches_own_fields_are_never_changed_later(source: str, tmp_path: Path) -> None:
    env, _, flags, keywords = _sources((source,), tmp_path, "chunk_size", 512)
    lmc = _lmcache_config(chunk_size=256)
    refused = r"chunk_size=512 \(.+\) does not go with chunk_size=256 \(LMCache config chunk_"
    with pytest.raises(ConfigError, match=refused):
        LookupConfig.load(environ=env, lmcache=lmcache_source(lmc, env), flags=flags, **keywords)
    if source in UNDER_VLLM:
        with pytest.raises(ConfigError, match=refused):
            config_from_lmcache(lmc, _metadata(), environ=env)
    same = lmcache_source(_lmcache_config(chunk_size=512), env)
    assert LookupConfig.load(environ=env, lmcache=same, flags=flags, **keywords).chunk_size == 512


def test_a_file_under_lmcache_takes_lmcaches_own_fields(tmp_path: Path) -> None:
    env, lmc, _, _ = _sources(("file",), tmp_path, "chunk_size", 512)
    assert LookupConfig.load(environ=env).chunk_size == 512
    assert LookupConfig.load(environ=env, lmcache=lmcache_source(lmc, env)).chunk_size == 256
    assert config_from_lmcache(lmc, _metadata(), environ=env)[0].chunk_size == 256


def test_an_lmcache_value_names_its_key(tmp_path: Path) -> None:
    lmc = _lmcache_config({"lookup_broker_socket_timeout_ms": -1})
    where = r"socket_timeout_ms=-1 \(LMCache extra_config lookup_broker_socket_timeout_ms\)"
    with pytest.raises(ConfigError, match=where):
        config_from_lmcache(lmc, _metadata(), environ={})
    with pytest.raises(ConfigError, match=r"lookup_timeout_ms=0 \(LMCache config lookup_timeout"):
        config_from_lmcache(_lmcache_config(lookup_timeout_ms=0), _metadata(), environ={})


def test_the_switch_takes_the_url_from_the_config_file(tmp_path: Path) -> None:
    path = tmp_path / "bl.toml"
    path.write_text(f'redis_url = "{URL}"\n')
    plain = SimpleNamespace(extra_config={})
    switch = {env_name("lmcache"): "1"}
    assert not broker_requested(plain, {CONFIG_FILE_ENV: str(path)})
    assert not broker_requested(plain, switch)
    assert broker_requested(plain, {**switch, CONFIG_FILE_ENV: str(path)})
    assert broker_requested(plain, {**switch, env_name("redis_url"): URL})


def test_every_path_reads_the_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from broker_lookup import cli
    from workers.runtime.runner import build_parser, resolve

    env, lmc, _, _ = _sources(("file",), tmp_path)
    for name in [n for n in os.environ if n.startswith("BROKER_LOOKUP_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv(CONFIG_FILE_ENV, env[CONFIG_FILE_ENV])
    configs = {
        "LookupConfig.load": LookupConfig.load(environ=env),
        "broker-lookup": cli._config(argparse.Namespace(redis_url=None)),
        "python -m workers": resolve(
            build_parser().parse_args(["--engine-id", "e", "--world-size", "1", "--rank", "0"]), env
        ).base.config,
        "the vLLM plugin": config_from_lmcache(lmc, _metadata(), environ=env)[0],
    }
    found = {path: getattr(config, FIELD) for path, config in configs.items()}
    assert found == dict.fromkeys(configs, VALUES["file"])
