"""config_from_lmcache and LMCacheEngineAdapter, against LMCache's own config and signatures."""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any

import pytest

from broker_lookup import ConfigError, LookupConfig
from broker_lookup.integrations.lmcache import LMCACHE_FIELDS, config_from_lmcache
from broker_lookup.integrations.lmcache_adapter import LMCacheEngineAdapter

pytestmark = pytest.mark.lmcache

URL = "redis://cache:6379/3"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("BROKER_LOOKUP_LMCACHE", "BROKER_LOOKUP_REDIS_URL", "BROKER_LOOKUP_BLOCK_MS"):
        monkeypatch.delenv(name, raising=False)


def convert(lmc: SimpleNamespace, meta: Any, **settings: Any) -> tuple[Any, Any]:
    return config_from_lmcache(lmc.Config.from_defaults(**settings), meta)


# -- config_from_lmcache ---------------------------------------------------------------------------


def test_lmcache_defaults_convert_to_our_defaults(lmc: SimpleNamespace, make_metadata: Any) -> None:
    config, _ = convert(lmc, make_metadata(), extra_config={"lookup_broker_url": URL})
    defaults = LookupConfig()
    for name in LMCACHE_FIELDS:
        assert getattr(config, name) == getattr(defaults, name), name
    assert config.redis_url == URL
    assert config.worker_pin_ttl_ms == 300_000  # LMCache's pin_timeout_sec


def test_every_lmcache_field_is_carried_over(lmc: SimpleNamespace, make_metadata: Any) -> None:
    config, _ = convert(
        lmc,
        make_metadata(world_size=4),
        chunk_size=64,
        save_unfull_chunk=True,
        lookup_timeout_ms=1500,
        lookup_server_worker_ids=[0, 2],
        enable_async_loading=True,
        enable_scheduler_bypass_lookup=True,
        hit_miss_ratio=0.25,
        enable_chunk_statistics=True,
        pre_caching_hash_algorithm="sha256_cbor",
        pin_timeout_sec=60,
        extra_config={"lookup_broker_url": URL},
    )
    assert (config.chunk_size, config.save_unfull_chunk, config.lookup_timeout_ms) == (
        64,
        True,
        1500,
    )
    assert config.lookup_server_worker_ids == (0, 2)
    assert config.enable_async_loading and config.enable_scheduler_bypass_lookup
    assert config.hit_miss_ratio == 0.25 and config.enable_chunk_statistics
    assert config.pre_caching_hash_algorithm == "sha256_cbor"
    assert config.worker_pin_ttl_ms == 60_000


def test_broker_knobs_come_from_prefixed_extra_config(
    lmc: SimpleNamespace, make_metadata: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    extra = {
        "lookup_broker_url": URL,
        "lookup_broker_block_ms": 150,
        "lookup_broker_socket_timeout_ms": "4000",
        "lookup_broker_redis_password": "s3cret",
        "lookup_backoff_time": 0.01,  # LMCache's own extra key: ignored, we never sleep
    }
    config, _ = convert(lmc, make_metadata(), chunk_size=32, extra_config=extra)
    assert config.block_ms == 150 and config.socket_timeout_ms == 4000
    assert config.redis_password == "s3cret" and config.chunk_size == 32
    monkeypatch.setenv("BROKER_LOOKUP_BLOCK_MS", "300")  # the environment comes after LMCache
    config, _ = convert(lmc, make_metadata(), chunk_size=32, extra_config=extra)
    assert config.block_ms == 300 and config.socket_timeout_ms == 4000
    monkeypatch.setenv("BROKER_LOOKUP_CHUNK_SIZE", "8")  # but never changes LMCache's fields
    with pytest.raises(ConfigError, match=r"chunk_size=8 \(env BROKER_LOOKUP_CHUNK_SIZE\) "):
        convert(lmc, make_metadata(), chunk_size=32, extra_config=extra)
    monkeypatch.setenv("BROKER_LOOKUP_CHUNK_SIZE", "32")  # the same value is no conflict
    assert convert(lmc, make_metadata(), chunk_size=32, extra_config=extra)[0].chunk_size == 32


@pytest.mark.parametrize(
    ("key", "match"),
    [
        ("lookup_broker_chunk_size", "not a broker setting"),
        ("lookup_broker_bogus", "not a broker setting"),
    ],
)
def test_unknown_broker_keys_are_refused(
    lmc: SimpleNamespace, make_metadata: Any, key: str, match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        convert(lmc, make_metadata(), extra_config={"lookup_broker_url": URL, key: 1})


def test_bad_broker_values_name_the_field(lmc: SimpleNamespace, make_metadata: Any) -> None:
    extra = {"lookup_broker_url": URL, "lookup_broker_block_ms": "soon"}
    with pytest.raises(ConfigError, match=r"block_ms='soon'"):
        convert(lmc, make_metadata(), extra_config=extra)


def test_lmcache_leniencies_are_kept(lmc: SimpleNamespace, make_metadata: Any) -> None:
    extra = {"lookup_broker_url": URL}
    config, _ = convert(lmc, make_metadata(), hit_miss_ratio=1.5, extra_config=extra)
    assert config.hit_miss_ratio is None  # LMCache wraps only for 0 <= ratio <= 1
    config, _ = convert(lmc, make_metadata(), lookup_server_worker_ids=[], extra_config=extra)
    assert config.lookup_server_worker_ids is None  # empty means LMCache's default rule
    config, _ = convert(
        lmc, make_metadata(), external_lookup_client="mooncakestore://m:1", extra_config=extra
    )
    assert config.external_lookup_client is None  # the broker was asked for
    config, _ = convert(lmc, make_metadata(), external_lookup_client="mooncakestore://m:1")
    assert config.external_lookup_client == "mooncakestore://m:1"  # it was not


def test_metadata_is_carried_over(lmc: SimpleNamespace, make_metadata: Any) -> None:
    extra = {"lmcache_rpc_port": 5555}
    lmc_meta = make_metadata(
        world_size=4, worker_id=3, use_mla=True, kv_connector_extra_config=extra
    )
    _, meta = convert(lmc, lmc_meta, extra_config={"lookup_broker_url": URL})
    assert (meta.engine_id, meta.world_size, meta.worker_id) == (lmc_meta.engine_id, 4, 3)
    assert meta.use_mla is True and meta.kv_connector_extra_config == extra


def test_engine_id_is_required_or_overridden(lmc: SimpleNamespace, make_metadata: Any) -> None:
    with pytest.raises(ConfigError, match="lookup_broker_engine_id"):
        convert(lmc, make_metadata(engine_id=None), extra_config={"lookup_broker_url": URL})
    extra = {"lookup_broker_url": URL, "lookup_broker_engine_id": "shared-7"}
    _, meta = convert(lmc, make_metadata(engine_id=None), extra_config=extra)
    assert meta.engine_id == "shared-7"
    with pytest.raises(ConfigError, match="engine_id"):
        convert(lmc, make_metadata(engine_id="bad{id}"), extra_config={"lookup_broker_url": URL})


# -- LMCacheEngineAdapter over an object with LMCache's engine signatures ------------------------


class SignatureEngine:
    """LMCacheEngine's lookup-side methods, with its exact signatures; records calls."""

    def __init__(self, async_loading: bool = True, hits: int = 0) -> None:
        self.async_loading = async_loading
        self.hits = hits
        self.storage_manager: Any = None
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def post_init(self, **kwargs: Any) -> None:
        self.calls.append(("post_init", kwargs))

    def async_lookup_and_prefetch(
        self,
        lookup_id: str,
        tokens: Any = None,
        hashes: Any = None,
        offsets: Any = None,
        search_range: Any = None,
        pin: bool = False,
        request_configs: Any = None,
    ) -> None:
        self.calls.append(
            (
                "prefetch",
                dict(
                    lookup_id=lookup_id,
                    tokens=tokens,
                    hashes=hashes,
                    offsets=offsets,
                    pin=pin,
                    configs=request_configs,
                ),
            )
        )

    def lookup(
        self,
        tokens: Any = None,
        hashes: Any = None,
        offsets: Any = None,
        search_range: Any = None,
        lookup_id: Any = None,
        pin: bool = False,
        request_configs: Any = None,
    ) -> int:
        self.calls.append(
            ("lookup", dict(tokens=tokens, hashes=hashes, lookup_id=lookup_id, pin=pin))
        )
        return self.hits

    def lookup_unpin(self, lookup_id: str) -> None:
        self.calls.append(("lookup_unpin", {"lookup_id": lookup_id}))

    def cleanup_memory_objs(self, lookup_id: str) -> None:
        self.calls.append(("cleanup", {"lookup_id": lookup_id}))


class Sink:
    def __init__(self) -> None:
        self.reports: list[tuple[str, int]] = []

    def send_response_to_scheduler(self, lookup_id: str, num_hit_tokens: int) -> None:
        self.reports.append((lookup_id, num_hit_tokens))


def test_signatures_match_lmcache_engine(lmc: SimpleNamespace) -> None:
    for name in ("async_lookup_and_prefetch", "lookup", "lookup_unpin", "cleanup_memory_objs"):
        ours = inspect.signature(getattr(SignatureEngine, name)).parameters
        theirs = inspect.signature(getattr(lmc.Engine, name)).parameters
        assert list(ours) == list(theirs), name


def test_adapter_maps_positional_calls_to_lmcache_keywords() -> None:
    engine = SignatureEngine()
    engine.storage_manager = SimpleNamespace(async_lookup_server=None)
    adapter = LMCacheEngineAdapter(engine)
    sink = Sink()
    adapter.post_init(async_lookup_server=sink)
    assert engine.calls == []  # LMCacheEngine.post_init is LMCache's manager's business
    adapter.async_lookup_and_prefetch("r", [11, 22], [16, 16], True, {"lmcache.tag.u": "a"})
    assert engine.calls == [
        (
            "prefetch",
            {
                "lookup_id": "r",
                "tokens": None,
                "hashes": [11, 22],
                "offsets": [16, 16],
                "pin": True,
                "configs": {"lmcache.tag.u": "a"},
            },
        )
    ]
    assert engine.storage_manager.async_lookup_server is sink  # wired before the prefetch
    adapter.cleanup_memory_objs("r")
    assert engine.calls[-1] == ("lookup_unpin", {"lookup_id": "r"})


def test_adapter_rewires_a_recreated_server() -> None:
    engine = SignatureEngine()
    old, new = Sink(), Sink()
    engine.storage_manager = SimpleNamespace(async_lookup_server=old)
    adapter = LMCacheEngineAdapter(engine)
    adapter.post_init(async_lookup_server=new)
    assert engine.storage_manager.async_lookup_server is new  # LMCache D15


def test_adapter_refuses_before_post_init() -> None:
    adapter = LMCacheEngineAdapter(SignatureEngine())
    with pytest.raises(RuntimeError, match="post_init has not run"):
        adapter.async_lookup_and_prefetch("r", [1], [16])


def test_adapter_sync_mode_looks_up_pins_and_reports() -> None:
    engine = SignatureEngine(async_loading=False, hits=16)
    engine.storage_manager = SimpleNamespace(async_lookup_server=None)
    adapter = LMCacheEngineAdapter(engine)
    with pytest.raises(RuntimeError, match="no lookup server"):
        adapter.async_lookup_and_prefetch("r", [1, 2], [16, 16])
    sink = Sink()
    adapter.post_init(async_lookup_server=sink)
    adapter.async_lookup_and_prefetch("r", [1, 2], [16, 16])
    assert sink.reports == [("r", 16)]
    assert engine.calls[-1] == (
        "lookup",
        {"tokens": None, "hashes": [1, 2], "lookup_id": "r", "pin": True},
    )


def test_adapter_bypass_lookup_and_release_without_lookup_unpin() -> None:
    engine = SignatureEngine(hits=32)
    assert LMCacheEngineAdapter(engine).lookup([1, 2], [16, 16], lookup_id="b", pin=True) == 32
    released: list[str] = []
    bare = SimpleNamespace(cleanup_memory_objs=released.append)  # no lookup_unpin
    LMCacheEngineAdapter(bare).cleanup_memory_objs("b")
    assert released == ["b"]
