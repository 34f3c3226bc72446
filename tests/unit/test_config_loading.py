"""LookupConfig loading: environment variables, YAML and TOML files, unknown keys."""

from __future__ import annotations

from pathlib import Path

import pytest

from broker_lookup.config import LookupConfig
from broker_lookup.errors import ConfigError

# -- environment ---------------------------------------------------------------------------


def test_from_env_reads_every_kind_of_field() -> None:
    cfg = LookupConfig.from_env(
        environ={
            "BROKER_LOOKUP_CHUNK_SIZE": "16",
            "BROKER_LOOKUP_SAVE_UNFULL_CHUNK": "true",
            "BROKER_LOOKUP_ENABLE_ASYNC_LOADING": "1",
            "BROKER_LOOKUP_ENABLE_CHUNK_STATISTICS": "yes",
            "BROKER_LOOKUP_ENABLE_SCHEDULER_BYPASS_LOOKUP": "off",
            "BROKER_LOOKUP_LOOKUP_SERVER_WORKER_IDS": "0, 2,3",
            "BROKER_LOOKUP_HIT_MISS_RATIO": "0.25",
            "BROKER_LOOKUP_REDIS_URL": "redis://cache:6379/2",
            "UNRELATED": "x",
        }
    )
    assert cfg.chunk_size == 16 and cfg.save_unfull_chunk is True
    assert cfg.enable_async_loading is True and cfg.enable_chunk_statistics is True
    assert cfg.enable_scheduler_bypass_lookup is False
    assert cfg.lookup_server_worker_ids == (0, 2, 3)
    assert cfg.hit_miss_ratio == 0.25 and cfg.redis_url == "redis://cache:6379/2"


@pytest.mark.parametrize("word", ["none", "None", "null", "", "  "])
def test_from_env_none_words_unset_optional_fields(word: str) -> None:
    base = LookupConfig(hit_miss_ratio=0.5, lookup_server_worker_ids=(0,))
    env = {"BROKER_LOOKUP_HIT_MISS_RATIO": word, "BROKER_LOOKUP_LOOKUP_SERVER_WORKER_IDS": word}
    cfg = LookupConfig.from_env(environ=env, base=base)
    assert cfg.hit_miss_ratio is None and cfg.lookup_server_worker_ids is None


def test_from_env_keeps_words_in_str_fields() -> None:
    env = {
        "BROKER_LOOKUP_REDIS_PASSWORD": "no",
        "BROKER_LOOKUP_PRE_CACHING_HASH_ALGORITHM": "true",
    }
    cfg = LookupConfig.from_env(environ=env)
    assert cfg.redis_password == "no" and cfg.pre_caching_hash_algorithm == "true"


def test_from_env_overrides_a_base_and_leaves_the_rest() -> None:
    base = LookupConfig(chunk_size=16, lookup_timeout_ms=900)
    cfg = LookupConfig.from_env(environ={"BROKER_LOOKUP_LOOKUP_TIMEOUT_MS": "1200"}, base=base)
    assert (cfg.chunk_size, cfg.lookup_timeout_ms) == (16, 1200)
    assert LookupConfig.from_env(environ={}) == LookupConfig()


@pytest.mark.parametrize(
    ("var", "raw"),
    [
        ("BROKER_LOOKUP_CHUNK_SIZE", "abc"),
        ("BROKER_LOOKUP_CHUNK_SIZE", "-3"),
        ("BROKER_LOOKUP_ENABLE_ASYNC_LOADING", "maybe"),
        ("BROKER_LOOKUP_HIT_MISS_RATIO", "2"),
        ("BROKER_LOOKUP_LOOKUP_SERVER_WORKER_IDS", "0,x"),
    ],
)
def test_from_env_errors_name_the_variable_and_value(var: str, raw: str) -> None:
    with pytest.raises(ConfigError) as err:
        LookupConfig.from_env(environ={var: raw})
    text = str(err.value)
    assert var in text and (repr(raw) in text or raw in text)


def test_from_env_error_hides_a_password_in_the_url() -> None:
    env = {"BROKER_LOOKUP_REDIS_URL": "http://user:hunter2@h:6379"}
    with pytest.raises(ConfigError) as err:
        LookupConfig.from_env(environ=env)
    assert "hunter2" not in str(err.value) and "***" in str(err.value)


def test_load_reads_the_file_named_in_env_then_env_overrides(tmp_path: Path) -> None:
    path = tmp_path / "broker.yaml"
    path.write_text("chunk_size: 16\nlookup_timeout_ms: 900\n")
    env = {"BROKER_LOOKUP_CONFIG_FILE": str(path), "BROKER_LOOKUP_LOOKUP_TIMEOUT_MS": "1200"}
    cfg = LookupConfig.load(environ=env)
    assert (cfg.chunk_size, cfg.lookup_timeout_ms) == (16, 1200)
    assert LookupConfig.load(environ={}) == LookupConfig()


# -- files ---------------------------------------------------------------------------------


def test_yaml_file(tmp_path: Path) -> None:
    path = tmp_path / "c.yml"
    path.write_text(
        "chunk_size: 16\nsave_unfull_chunk: true\nlookup_server_worker_ids: [0, 1]\n"
        "hit_miss_ratio: 0.5\nredis_url: redis://h:1/0\n"
    )
    cfg = LookupConfig.from_file(path)
    assert cfg.chunk_size == 16 and cfg.save_unfull_chunk is True
    assert tuple(cfg.lookup_server_worker_ids or ()) == (0, 1)
    assert cfg.hit_miss_ratio == 0.5 and cfg.redis_url == "redis://h:1/0"


def test_toml_file(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('chunk_size = 64\nenable_async_loading = true\nredis_url = "unix:///s"\n')
    cfg = LookupConfig.from_file(str(path))
    assert (cfg.chunk_size, cfg.enable_async_loading, cfg.redis_url) == (64, True, "unix:///s")


def test_empty_yaml_file_is_the_defaults(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert LookupConfig.from_file(path) == LookupConfig()


@pytest.mark.parametrize(
    ("name", "text", "match"),
    [
        ("u.yaml", "chunk_size: 16\nchunk_sise: 8\nbogus: 1\n", "unknown.*bogus, chunk_sise"),
        ("u.toml", "nope = 1\n", "unknown.*nope"),
        ("bad.yaml", "chunk_size: [\n", "cannot parse"),
        ("bad.toml", "chunk_size = \n", "cannot parse"),
        ("list.yaml", "- 1\n- 2\n", "mapping"),
        ("v.yaml", "chunk_size: 0\n", r"chunk_size=0 .*BROKER_LOOKUP_CHUNK_SIZE"),
        ("t.yaml", "chunk_size: abc\n", r"chunk_size='abc' .*BROKER_LOOKUP_CHUNK_SIZE"),
    ],
)
def test_bad_files_are_refused(tmp_path: Path, name: str, text: str, match: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        LookupConfig.from_file(path)


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        LookupConfig.from_file(tmp_path / "absent.yaml")


def test_unknown_mapping_keys_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"unknown config field.*lookup_backoff_time"):
        LookupConfig.from_mapping({"lookup_backoff_time": 0.01})
