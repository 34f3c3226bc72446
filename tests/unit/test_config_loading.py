"""LookupConfig loading: environment variables, YAML and TOML files, unknown keys."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from broker_lookup.config import LookupConfig, env_name
from broker_lookup.config.env import OTHER_VARIABLES
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
        ("v.yaml", "chunk_size: 0\n", r"chunk_size=0 \(file .*v\.yaml\) is invalid"),
        ("t.yaml", "chunk_size: abc\n", r"chunk_size='abc' \(file .*t\.yaml\) has the wrong"),
    ],
)
def test_bad_files_are_refused(tmp_path: Path, name: str, text: str, match: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=match) as err:
        LookupConfig.from_file(path)
    # The file is where the value came from: no variable is named as if it had been set.
    assert "BROKER_LOOKUP_" not in str(err.value)


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        LookupConfig.from_file(tmp_path / "absent.yaml")


def test_unknown_mapping_keys_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"unknown config field.*lookup_backoff_time"):
        LookupConfig.from_mapping({"lookup_backoff_time": 0.01})


def test_a_misspelt_file_key_names_the_nearest_field(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("chunk_sze: 16\n")
    with pytest.raises(ConfigError, match=r"chunk_sze \(did you mean chunk_size\?\)"):
        LookupConfig.load(path, environ={})


# -- where a bad value came from -----------------------------------------------------------

_URL_TEXT = "127.0.0.1:16379"


def test_a_bad_flag_is_named_as_the_flag_not_the_variable() -> None:
    with pytest.raises(ConfigError) as err:
        LookupConfig.load(environ={}, flags={"redis_url": _URL_TEXT})
    text = str(err.value)
    assert f"redis_url='{_URL_TEXT}' (flag --redis-url) is invalid" in text, text
    assert "BROKER_LOOKUP_REDIS_URL" not in text and "environment" not in text
    assert f"e.g. redis://{_URL_TEXT}/0" in text  # the fix, spelled out


def test_a_bad_variable_is_named_as_the_variable() -> None:
    with pytest.raises(ConfigError, match=r"redis_url='h:1' \(env BROKER_LOOKUP_REDIS_URL\)"):
        LookupConfig.load(environ={"BROKER_LOOKUP_REDIS_URL": "h:1"})


def test_a_bad_value_in_a_named_file_is_named_as_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("lookup_server_worker_ids = [0, -1]\n")
    with pytest.raises(ConfigError, match=rf"\(file {path}\) is invalid") as err:
        LookupConfig.load(environ={"BROKER_LOOKUP_CONFIG_FILE": str(path)})
    assert "BROKER_LOOKUP_" not in str(err.value)


def test_a_bad_flag_list_is_named_as_the_flag() -> None:
    with pytest.raises(ConfigError, match=r"\(flag --lookup-server-worker-ids\)"):
        LookupConfig.load(environ={}, flags={"lookup_server_worker_ids": "0,x"})


def test_flags_override_variables_override_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("chunk_size: 16\nlookup_timeout_ms: 900\nredis_url: redis://file/0\n")
    env = {"BROKER_LOOKUP_LOOKUP_TIMEOUT_MS": "1200", "BROKER_LOOKUP_REDIS_URL": "redis://env/0"}
    cfg = LookupConfig.load(path, env, flags={"redis_url": "redis://flag/0"})
    assert (cfg.chunk_size, cfg.lookup_timeout_ms, cfg.redis_url) == (16, 1200, "redis://flag/0")


def test_file_and_variables_are_validated_together(tmp_path: Path) -> None:
    # block_ms must stay 1000 ms under socket_timeout_ms: valid only once both are applied.
    path = tmp_path / "c.yaml"
    path.write_text("block_ms: 5000\nheartbeat_ttl_ms: 6000\n")
    cfg = LookupConfig.load(path, {"BROKER_LOOKUP_SOCKET_TIMEOUT_MS": "10000"})
    assert (cfg.block_ms, cfg.socket_timeout_ms) == (5000, 10000)


def test_a_cross_field_failure_names_the_origin_of_the_field_at_fault() -> None:
    env = {"BROKER_LOOKUP_SOCKET_TIMEOUT_MS": "1000"}
    with pytest.raises(
        ConfigError,
        match=r"block_ms=200 \(the default\) does not go with socket_timeout_ms=1000 "
        r"\(env BROKER_LOOKUP_SOCKET_TIMEOUT_MS\)",
    ):
        LookupConfig.load(environ=env)


# -- unknown variables ---------------------------------------------------------------------

_MISSPELT = "BROKER_LOOKUP_" + "CHUNK_SZE"  # spelt in two parts: the repository scan skips it


def test_a_misspelt_variable_is_refused_with_the_nearest_name() -> None:
    for load in (LookupConfig.load, LookupConfig.from_env):
        with pytest.raises(ConfigError) as err:
            load(environ={_MISSPELT: "16"})
        assert f"{_MISSPELT} (did you mean BROKER_LOOKUP_CHUNK_SIZE?)" in str(err.value)


def test_variables_that_are_not_fields_are_not_refused() -> None:
    env = dict.fromkeys(OTHER_VARIABLES, "1")
    env["BROKER_LOOKUP_CONFIG_FILE"] = ""
    assert LookupConfig.load(environ=env) == LookupConfig()


def test_kubernetes_service_links_are_not_refused() -> None:
    svc = "BROKER_LOOKUP_" + "REDIS"  # in two parts: the repository scan skips it
    # A service named broker-lookup-redis in the namespace: every pod gets these.
    env = {
        svc + "_SERVICE_HOST": "10.0.0.7",
        svc + "_SERVICE_PORT": "6379",
        svc + "_SERVICE_PORT_REDIS": "6379",
        svc + "_PORT": "tcp://10.0.0.7:6379",
        svc + "_PORT_6379_TCP": "tcp://10.0.0.7:6379",
        svc + "_PORT_6379_TCP_ADDR": "10.0.0.7",
        svc + "_PORT_6379_TCP_PORT": "6379",
        svc + "_PORT_6379_TCP_PROTO": "tcp",
    }
    assert LookupConfig.load(environ=env) == LookupConfig()


_REPO = Path(__file__).resolve().parents[2]
_SCANNED = (".py", ".md", ".yaml", ".yml", ".tpl", ".txt", ".toml", ".sh", ".cfg", "")
#: Names in the repository that look like variables and are not: a test's constant, and the
#: README's examples of a misspelling and of a Kubernetes service link.
_NOT_VARIABLES = {"BROKER_LOOKUP_ALL", "BROKER_LOOKUP_CHUNK_SZE", "BROKER_LOOKUP_REDIS_PORT"}


def test_every_variable_the_repository_uses_is_a_field_or_listed() -> None:
    fields = {env_name(f) for f in LookupConfig.__struct_fields__}
    used: dict[str, str] = {}
    for root in ("broker_lookup", "workers", "tests", "helm", "deploy", "docs", ".ci"):
        for path in (_REPO / root).rglob("*"):
            if path.is_file() and path.suffix in _SCANNED and "__pycache__" not in path.parts:
                text = path.read_text("utf-8", "replace")
                # Spelt out, or made by env_name("<name>") as the code makes them.
                made = re.findall(r"env_name\(\s*[\"'](\w+)[\"']\s*\)", text)
                for name in re.findall(r"BROKER_LOOKUP_[A-Z0-9_]*[A-Z0-9]", text) + [
                    env_name(n) for n in made
                ]:
                    used.setdefault(name, str(path.relative_to(_REPO)))
    for name in re.findall(r"BROKER_LOOKUP_[A-Z0-9_]*[A-Z0-9]", (_REPO / "README.md").read_text()):
        used.setdefault(name, "README.md")
    stray = {
        name: where
        for name, where in used.items()
        if name not in fields and name not in OTHER_VARIABLES and name not in _NOT_VARIABLES
    }
    assert not stray, f"add these to config.env.OTHER_VARIABLES (or make them fields): {stray}"


# -- credentials and keyword overrides -----------------------------------------------------

PASSWORD = env_name("redis_password")
USERNAME = env_name("redis_username")


def test_a_config_built_from_keywords_takes_the_credentials_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(PASSWORD, "from-env")
    monkeypatch.setenv(USERNAME, "worker")
    cfg = LookupConfig(redis_url="redis://cache:6379/0")
    assert (cfg.redis_username, cfg.redis_password) == ("worker", "from-env")
    assert "from-env" not in repr(cfg)
    assert LookupConfig.from_mapping({}).redis_password == "from-env"


@pytest.mark.parametrize(
    "given",
    [
        {"redis_password": "keyword"},
        {"redis_url": "redis://:in-url@cache:6379/0"},
        {"redis_url": "unix:///run/redis.sock?db=0&password=in-url"},
    ],
    ids=["keyword", "url", "url-query"],
)
def test_a_password_given_is_kept_over_the_environment(
    monkeypatch: pytest.MonkeyPatch, given: dict[str, str]
) -> None:
    monkeypatch.setenv(PASSWORD, "from-env")
    cfg = LookupConfig(
        redis_url=given.get("redis_url", "redis://cache:6379/0"),
        redis_password=given.get("redis_password"),
    )
    assert cfg.redis_password == given.get("redis_password")


def test_an_environment_given_to_a_loader_is_the_only_one_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(PASSWORD, "process-env")
    assert LookupConfig.from_env(environ={}).redis_password is None
    assert LookupConfig.load(environ={PASSWORD: "given"}).redis_password == "given"


def test_load_takes_fields_as_keywords_over_everything_else() -> None:
    env = {PASSWORD: "from-env", env_name("chunk_size"): "16"}
    cfg = LookupConfig.load(environ=env, redis_url="redis://cache:6379/0", chunk_size=32)
    assert (cfg.redis_url, cfg.chunk_size, cfg.redis_password) == (
        "redis://cache:6379/0",
        32,
        "from-env",
    )


def test_load_names_a_bad_or_unknown_keyword() -> None:
    with pytest.raises(ConfigError, match=r"chunk_size=0 \(LookupConfig.load\(chunk_size=...\)\)"):
        LookupConfig.load(environ={}, chunk_size=0)
    with pytest.raises(ConfigError, match=r"redis_ulr.*redis_url"):
        LookupConfig.load(environ={}, redis_ulr="redis://cache:6379/0")
