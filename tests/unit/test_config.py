"""LookupConfig / LookupMetadata: defaults, validation, ranks, secrets (env/files: *_loading)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from broker_lookup.config import (
    LookupConfig,
    LookupMetadata,
    env_name,
    expected_ranks,
    redact_url,
)
from broker_lookup.errors import ConfigError

#: LMCache 0.5.6 defaults (reference section 9) for the fields that carry LMCache's names.
LMCACHE_DEFAULTS = {
    "chunk_size": 256,
    "save_unfull_chunk": False,
    "lookup_timeout_ms": 3000,
    "lookup_server_worker_ids": None,
    "enable_async_loading": False,
    "enable_scheduler_bypass_lookup": False,
    "external_lookup_client": None,
    "hit_miss_ratio": None,
    "enable_chunk_statistics": False,
    "pre_caching_hash_algorithm": "builtin",
}


def meta(world_size: int = 4, **kw: object) -> LookupMetadata:
    return LookupMetadata(engine_id="e", world_size=world_size, **kw)  # type: ignore[arg-type]


# -- defaults and keyword construction ---------------------------------------------------


def test_defaults_equal_lmcache() -> None:
    cfg = LookupConfig()
    assert {k: getattr(cfg, k) for k in LMCACHE_DEFAULTS} == LMCACHE_DEFAULTS


def test_keyword_construction_defaults_every_other_field() -> None:
    cfg = LookupConfig(redis_url="redis://h:6380/1", lookup_timeout_ms=1500)
    assert cfg.redis_url == "redis://h:6380/1" and cfg.lookup_timeout_ms == 1500
    assert cfg.chunk_size == 256 and cfg.block_ms == 200
    assert cfg.key_ttl_ms == cfg.longest_timeout_ms + cfg.key_grace_ms
    m = LookupMetadata(engine_id="vllm-0", world_size=2)
    assert (m.worker_id, m.use_mla, m.kv_connector_extra_config) == (0, False, None)


def test_config_is_frozen_and_comparable() -> None:
    cfg = LookupConfig()
    with pytest.raises(AttributeError):
        cfg.chunk_size = 16  # type: ignore[misc]
    assert cfg == LookupConfig() and hash(cfg) == hash(LookupConfig())


def test_positional_construction_is_refused() -> None:
    with pytest.raises(TypeError):
        LookupConfig(256)  # type: ignore[call-arg]


# -- wrong types and bad values -----------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("chunk_size", "256"),
        ("chunk_size", True),
        ("chunk_size", 2.5),
        ("save_unfull_chunk", 1),
        ("hit_miss_ratio", "0.5"),
        ("redis_url", 6379),
        ("lookup_server_worker_ids", "0,1"),
    ],
)
def test_wrong_type_names_field_env_and_value(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as err:
        LookupConfig(**{field: value})  # type: ignore[arg-type]
    text = str(err.value)
    assert field in text and env_name(field) in text and repr(value) in text
    assert "wrong type" in text


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("chunk_size", 0),
        ("lookup_timeout_ms", -1),
        ("block_ms", 0),
        ("max_pending", 0),
        ("redis_retries", 0),
        ("key_grace_ms", -5),
        ("hit_miss_ratio", 1.5),
        ("hit_miss_ratio", -0.1),
        ("redis_url", "http://localhost:6379"),
        ("lookup_server_worker_ids", (0, -1)),
    ],
)
def test_bad_value_names_field_env_and_value(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as err:
        LookupConfig(**{field: value})  # type: ignore[arg-type]
    text = str(err.value)
    assert field in text and env_name(field) in text and repr(value) in text
    assert "is invalid" in text


def test_config_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        LookupConfig(chunk_size=0)


@pytest.mark.parametrize("ratio", [0.0, 0.5, 1, 1.0])
def test_hit_miss_ratio_bounds_are_inclusive(ratio: float) -> None:
    assert LookupConfig(hit_miss_ratio=ratio).hit_miss_ratio == ratio


# -- cross-field checks ---------------------------------------------------------------------


def test_block_must_stay_a_second_under_the_socket_timeout() -> None:
    LookupConfig(block_ms=4000, socket_timeout_ms=5000, heartbeat_ttl_ms=6000)
    with pytest.raises(ConfigError, match=r"block_ms=4001 .*socket_timeout_ms=5000"):
        LookupConfig(block_ms=4001, socket_timeout_ms=5000, heartbeat_ttl_ms=6000)
    with pytest.raises(ConfigError, match="block_ms"):
        LookupConfig(socket_timeout_ms=1000)  # default block_ms=200 no longer fits


def test_heartbeat_ttl_must_cover_three_intervals() -> None:
    LookupConfig(heartbeat_interval_ms=100, heartbeat_ttl_ms=300)
    with pytest.raises(ConfigError, match=r"heartbeat_ttl_ms=299 .*heartbeat_interval_ms=100"):
        LookupConfig(heartbeat_interval_ms=100, heartbeat_ttl_ms=299)


# -- combinations that cannot keep a lease: both values and both sources named ---------------


def test_a_blocking_read_longer_than_a_heartbeat_lives_is_refused_naming_both_sources(
    tmp_path: Path,
) -> None:
    LookupConfig(block_ms=1499, heartbeat_ttl_ms=1500, heartbeat_interval_ms=100)
    path = tmp_path / "bl.yaml"
    path.write_text("heartbeat_ttl_ms: 1500\nheartbeat_interval_ms: 100\n")
    env = {"BROKER_LOOKUP_BLOCK_MS": "1500", "BROKER_LOOKUP_CONFIG_FILE": str(path)}
    with pytest.raises(ConfigError) as info:
        LookupConfig.load(environ=env)
    assert str(info.value) == (
        f"block_ms=1500 (env BROKER_LOOKUP_BLOCK_MS) does not go with heartbeat_ttl_ms=1500 "
        f"(file {path}): block_ms must be under heartbeat_ttl_ms (a loop blocked in one read "
        "longer than a heartbeat lives sees its ranks die between two reads)"
    )


def test_a_lease_shorter_than_three_beats_is_refused_naming_both_sources() -> None:
    LookupConfig(owner_lease_ms=1500, heartbeat_interval_ms=500)
    env = {"BROKER_LOOKUP_OWNER_LEASE_MS": "1499"}
    with pytest.raises(ConfigError) as info:
        LookupConfig.load(environ=env)
    text = str(info.value)
    assert text.startswith(
        "owner_lease_ms=1499 (env BROKER_LOOKUP_OWNER_LEASE_MS) does not go with "
        "heartbeat_interval_ms=500 (the default): the owner lease must be at least 3 times"
    )
    env["BROKER_LOOKUP_HEARTBEAT_INTERVAL_MS"] = "499"
    assert LookupConfig.load(environ=env).lease_ms == 1499


def test_a_blocking_read_at_the_socket_timeout_is_refused_naming_both_sources() -> None:
    env = {"BROKER_LOOKUP_BLOCK_MS": "4500"}
    with pytest.raises(ConfigError) as info:
        LookupConfig.load(environ=env)
    assert str(info.value).startswith(
        "block_ms=4500 (env BROKER_LOOKUP_BLOCK_MS) does not go with socket_timeout_ms=5000 "
        "(the default): block_ms must be at least 1000 ms under socket_timeout_ms"
    )


def test_engine_ttl_bounds_every_key_of_the_engine() -> None:
    """Above the heartbeat's and every lookup hash's TTL, at most 1 h; 10 min by default."""
    assert LookupConfig().engine_ttl_ms == 600_000
    LookupConfig(engine_ttl_ms=3_600_000)
    LookupConfig(engine_ttl_ms=3000, key_grace_ms=500, lookup_timeout_ms=1500, chunk_size=4)
    for ttl in (3_600_001, 2000, 0):
        with pytest.raises(
            ConfigError, match=rf"engine_ttl_ms={ttl} .*BROKER_LOOKUP_ENGINE_TTL_MS"
        ):
            LookupConfig(engine_ttl_ms=ttl)
    with pytest.raises(ConfigError, match=r"engine_ttl_ms=22000 .*lookup hash TTL \(22000 ms"):
        LookupConfig(engine_ttl_ms=22_000)  # the default lookup hash lives 22 s
    assert LookupConfig.from_env({"BROKER_LOOKUP_ENGINE_TTL_MS": "60000"}).engine_ttl_ms == 60_000


# -- metadata ------------------------------------------------------------------------------


@pytest.mark.parametrize("engine_id", ["", "a{b}", "has space", "x" * 129, "ü"])
def test_metadata_rejects_engine_ids_that_cannot_be_a_hash_tag(engine_id: str) -> None:
    with pytest.raises(ConfigError, match="engine_id"):
        LookupMetadata(engine_id=engine_id, world_size=1)


def test_metadata_checks_world_size_and_worker_id() -> None:
    with pytest.raises(ConfigError, match=r"world_size=0 .*BROKER_LOOKUP_WORLD_SIZE"):
        LookupMetadata(engine_id="e", world_size=0)
    with pytest.raises(ConfigError, match=r"worker_id=2 .*world_size=2"):
        LookupMetadata(engine_id="e", world_size=2, worker_id=2)
    with pytest.raises(ConfigError, match=r"world_size='2'.*wrong type"):
        LookupMetadata(engine_id="e", world_size="2")  # type: ignore[arg-type]
    extra = {"lmcache_rpc_port": 5555, "nested": {"a": [1]}}
    assert meta(kv_connector_extra_config=extra).kv_connector_extra_config == extra


# -- expected_ranks: LMCache's get_lookup_server_worker_ids ----------------------------------


def test_expected_ranks_default_is_every_rank_or_rank_zero_with_mla() -> None:
    cfg = LookupConfig()
    assert expected_ranks(cfg, meta(4)) == (0, 1, 2, 3)
    assert expected_ranks(cfg, meta(4, use_mla=True)) == (0,)
    assert expected_ranks(LookupConfig(lookup_server_worker_ids=()), meta(2)) == (0, 1)


def test_expected_ranks_explicit_list_is_used_even_with_mla() -> None:
    cfg = LookupConfig(lookup_server_worker_ids=(3, 1, 1))
    assert expected_ranks(cfg, meta(4)) == (1, 3)
    assert expected_ranks(cfg, meta(4, use_mla=True)) == (1, 3)


def test_expected_ranks_explicit_list_is_checked_against_world_size() -> None:
    cfg = LookupConfig(lookup_server_worker_ids=(0, 4))
    with pytest.raises(ConfigError, match=r"lookup_server_worker_ids.*\[4\].*world_size=4"):
        expected_ranks(cfg, meta(4))


# -- secrets -------------------------------------------------------------------------------


def test_repr_and_str_hide_passwords() -> None:
    cfg = LookupConfig(
        redis_url="redis://alice:hunter2@redis:6379/0",
        redis_password="s3cret",
        redis_username="alice",
    )
    for text in (repr(cfg), str(cfg), f"{cfg}"):
        assert "hunter2" not in text and "s3cret" not in text
        assert "redis://alice:***@redis:6379/0" in text and "alice" in text
        assert "redis_password='***'" in text


def test_repr_hides_passwords_of_sentinel_urls_and_password_only_urls() -> None:
    text = repr(LookupConfig(redis_url="redis+sentinel://:pw1@h1:26379,h2:26379/mymaster"))
    assert "pw1" not in text and ":***@h1" in text
    assert "redis_password=None" in repr(LookupConfig())


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        # redis-py splits the netloc at its last '@': all before it is the password.
        ("redis://alice:pa@ss@redis:6379/0", "redis://alice:***@redis:6379/0"),
        ("redis://:p@ss:w@rd@h/0", "redis://:***@h/0"),
        ("rediss://u:a@b@c@h1:6380", "rediss://u:***@h1:6380"),
        (
            "redis+sentinel://:x@y@h1:26379,h2:26379/mymaster",
            "redis+sentinel://:***@h1:26379,h2:26379/mymaster",
        ),
        ("unix://:p@w@/tmp/redis.sock?db=1", "unix://:***@/tmp/redis.sock?db=1"),
        ("redis://alice@redis:6379/0", "redis://alice@redis:6379/0"),  # no password
        ("redis://u:pa/ss@h/0", "redis://u:***@h/0"),  # redis-py refuses it; still hidden
        ("redis://redis:6379/0?name=a@b", "redis://redis:***@b"),  # too much, never too little
        ("redis://:pw@h:6379/0?name=a@b", "redis://:***@h:6379/0?name=a@b"),
        ("unix:///run/a@b.sock", "unix:///run/a@b.sock"),
        ("redis://redis:6379/0", "redis://redis:6379/0"),
        ("not a url", "not a url"),
        # redis-py reads ?password= on every scheme; the unix form documents it.
        ("unix:///tmp/r.sock?db=0&password=S3cr3t", "unix:///tmp/r.sock?db=0&password=***"),
        ("redis://h:6379/0?password=S3cr3t&db=1", "redis://h:6379/0?password=***&db=1"),
        ("redis://:a@h/0?Password=b", "redis://:***@h/0?Password=***"),
        ("rediss://h/0?sentinel_password=S3cr3t", "rediss://h/0?sentinel_password=***"),
    ],
)
def test_redact_url_hides_the_whole_password(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    if "://" in url:
        try:
            text = repr(LookupConfig(redis_url=url))
        except ConfigError as exc:  # a URL redis-py cannot read is refused, hidden alike
            text = str(exc)
        assert shown in text


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("redis://cache:99999/0", "the port of the host is out of range 0-65535"),
        ("rediss://[::1]:70000/0", "the port of the host is out of range 0-65535"),
        ("redis://cache:63x9/0", "the port of the host is not a number"),
        ("redis://u:12345678/S3cr3t@h/0", "the port of the host is out of range 0-65535"),
        ("redis+cluster://h1:7000,h2:99999", "the port of host 2 is out of range 0-65535"),
        ("redis+sentinel://u:S3/cr3t@h:1/m", "host 1 is not host:port"),
        (
            "redis+sentinel://h:26379/m?password=S3cr3t",
            "option password is not one of ssl, sentinel_auth with a value of true or false",
        ),
        ("redis+cluster://h:7000?ssl=maybe", "option ssl='maybe' is not one of ssl"),
        ("redis://:S3cr3t@[::1/0", "Invalid IPv6 URL"),
    ],
)
def test_a_url_no_connection_can_use_is_refused_in_one_line_without_secrets(
    url: str, problem: str
) -> None:
    with pytest.raises(ConfigError) as err:
        LookupConfig.load(environ={env_name("redis_url"): url})
    text = str(err.value)
    assert f"(env {env_name('redis_url')}) is invalid: {problem}" in text
    assert "S3" not in text and "12345678" not in text and "\n" not in text


def test_errors_hide_passwords() -> None:
    with pytest.raises(ConfigError) as err:
        LookupConfig(redis_password=1234)  # type: ignore[arg-type]
    assert "1234" not in str(err.value) and "***" in str(err.value)


def test_the_deadline_scales_with_the_prompt_up_to_its_ceiling() -> None:
    cfg = LookupConfig(lookup_timeout_ms=3000, lookup_timeout_per_1k_tokens_ms=10)
    assert cfg.lookup_budget_ms(1_000) == 3010
    assert cfg.lookup_budget_ms(128_000) == 4280  # a 128k prompt waits 1.28 s longer
    assert cfg.longest_timeout_ms == 12_000  # 4 x the base, under the pin TTL
    assert cfg.lookup_budget_ms(4_000_000) == 12_000
    assert cfg.key_ttl_ms == 12_000 + cfg.key_grace_ms
    flat = LookupConfig(lookup_timeout_per_1k_tokens_ms=0)
    assert flat.lookup_budget_ms(128_000) == flat.lookup_timeout_ms


def test_the_default_ceiling_fits_a_short_pin_ttl() -> None:
    cfg = LookupConfig(lookup_timeout_ms=500, worker_pin_ttl_ms=2000)
    assert cfg.longest_timeout_ms == 1250  # halfway between the base and the pin TTL
    assert cfg.retention_ms == 750  # what the pins leave after the longest deadline
    ceiling = LookupConfig(lookup_timeout_ms=500, lookup_timeout_max_ms=800)
    assert ceiling.lookup_budget_ms(10**6) == 800


def test_partial_answers_wait_counts_in_the_longest_deadline() -> None:
    cfg = LookupConfig(partial_answers=True, partial_answer_wait_ms=300)
    assert cfg.longest_timeout_ms == 12_000 + 300
    assert cfg.lookup_budget_ms(10**7) == 12_000  # the wait comes after the deadline
    with pytest.raises(ConfigError, match=r"worker_pin_ttl_ms=600 .*partial_answer_wait_ms"):
        LookupConfig(partial_answers=True, lookup_timeout_ms=500, worker_pin_ttl_ms=600)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("lookup_timeout_per_1k_tokens_ms", -1),
        ("lookup_timeout_max_ms", 100),  # under lookup_timeout_ms
        ("lookup_timeout_max_ms", 60_000),  # not under the pin TTL
        ("rank_spread_warn_share", 0.0),
        ("rank_spread_warn_share", 1.5),
        ("partial_answer_wait_ms", 0),
        ("rank_insights_max_per_s", -1.0),
        ("rank_insights_max_per_s", float("inf")),
    ],
)
def test_issue_13_fields_are_validated_by_name(field: str, value: Any) -> None:
    values: dict[str, Any] = {field: value}
    with pytest.raises(ConfigError, match=f"{field}={value!r}"):
        LookupConfig(**values)


def test_a_flat_deadline_is_its_own_longest() -> None:
    flat = LookupConfig(
        lookup_timeout_ms=5000, worker_pin_ttl_ms=6500, lookup_timeout_per_1k_tokens_ms=0
    )
    assert flat.longest_timeout_ms == 5000 and flat.retention_ms == 1500
    small = LookupConfig(chunk_size=4, max_chunks_per_request=1000)  # 4,000 tokens at most
    assert small.longest_timeout_ms == 3000 + 40
