"""Which namespace a vLLM engine's processes share, however vLLM launches it.

Every process of one engine (its scheduler, every TP/PP rank on every node) must land in
one namespace without any setting, and no two engines (replicas of one manifest,
data-parallel engines) may share one. Each process decides alone, so the instance part
of the namespace (``<configured>@<instance>``) is keyed on something all processes of
one engine hold alike and no other engine holds:

=============================  ===============================================================
launch                         instance part
=============================  ===============================================================
explicit setting               ``BROKER_LOOKUP_INSTANCE_ID`` or ``extra_config``
                               ``lookup_broker_instance_id``, as given
LeaderWorkerSet                ``lws-`` + digest of ``LWS_LEADER_ADDRESS`` (one per group)
multi-node, multiprocessing    ``mn-`` + digest of ``master_addr:master_port`` (``--nnodes``
(``--nnodes N``, headless)     > 1: the torch.distributed rendezvous every node dials)
one node, or Ray               ``VllmConfig.instance_id``: built once and shipped to the
                               EngineCore and every worker (Ray pickles it to every node)
=============================  ===============================================================

Data parallel adds ``-dp<k>`` (the global DP rank) to any of these, so each DP engine has
its own namespace; vLLM's own ``_dp<k>`` suffix on ``kv_transfer_config.engine_id`` is
taken off the configured id, so the ACL users of that id still match.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass

from broker_lookup.config import env_name
from broker_lookup.errors import ConfigError
from broker_lookup.protocol.keys import instance_engine_id, validate_configured_id
from broker_lookup.transport.members import LWS_PREFIX, RENDEZVOUS_PREFIX

__all__ = [
    "ENV_INSTANCE",
    "LWS_LEADER",
    "EngineIdentity",
    "engine_identity",
]

#: The user's answer where the engine's processes share nothing this module can key on.
ENV_INSTANCE = env_name("instance_id")
#: Set by LeaderWorkerSet in every pod of one group: the group's leader's DNS name.
LWS_LEADER = "LWS_LEADER_ADDRESS"
LWS_SIZE = "LWS_GROUP_SIZE"
#: vLLM appends this to ``kv_transfer_config.engine_id`` (and, newer, to ``instance_id``)
#: in each data-parallel engine.
_DP_SUFFIX = re.compile(r"_dp\d+$")
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


@dataclass(frozen=True)
class EngineIdentity:
    """The namespace one process derived, and why: logged, so that a split says its cause."""

    configured: str  #: the operator's engine id
    namespace: str  #: the broker's engine id (``<configured>@<instance>``, or ``configured``)
    source: str  #: what the instance part is keyed on, in words
    warning: str | None = None  #: why this may not be what the other processes derive


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:12]


def _get(owner: object, name: str) -> object:
    """``owner.name`` or None; a config stand-in or proxy must never fail an engine's start."""
    try:
        return getattr(owner, name, None)
    except Exception:
        return None


def _int(owner: object, name: str, default: int) -> int:
    value = _get(owner, name)
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _dp_rank(parallel: object) -> int | None:
    """The global data-parallel rank of this engine; None without data parallel.

    vLLM sets ``data_parallel_index`` (the global rank) and ``data_parallel_rank_local``
    in every DP engine, and then resets a dense model's DP engine to
    ``data_parallel_size=1`` (its engines are independent): either marks data parallel.
    """
    index = _get(parallel, "data_parallel_index")
    if not isinstance(index, int) or isinstance(index, bool):
        index = _int(parallel, "data_parallel_rank", 0)  # before data_parallel_index
    if _int(parallel, "data_parallel_size", 1) > 1 or index > 0:
        return index
    local = _get(parallel, "data_parallel_rank_local")
    return index if isinstance(local, int) and not isinstance(local, bool) else None


def _instance(
    vllm_config: object, environ: Mapping[str, str], explicit: tuple[str, str] | None
) -> tuple[str | None, str, str | None]:
    """(instance part, its source, a warning) before the DP tag."""
    if environ.get(ENV_INSTANCE) is not None:  # env first, as for every setting
        explicit = (environ[ENV_INSTANCE], f"env {ENV_INSTANCE}")
    if explicit is not None:
        value, origin = explicit
        if not value.strip():
            raise ConfigError(f"{origin}={value!r} is empty: give this engine's instance id")
        return value.strip(), f"the setting {origin}", None
    leader = environ.get(LWS_LEADER, "").strip()
    if leader:
        size = environ.get(LWS_SIZE, "?")
        return LWS_PREFIX + _digest(leader), f"LeaderWorkerSet group {leader} (size {size})", None
    if vllm_config is None:
        return None, "no vLLM config found", None
    parallel = _get(vllm_config, "parallel_config")
    if _int(parallel, "nnodes", 1) > 1:
        address = f"{_get(parallel, 'master_addr')}:{_get(parallel, 'master_port')}"
        source = f"the multi-node rendezvous {address} (--nnodes {_int(parallel, 'nnodes', 1)})"
        return RENDEZVOUS_PREFIX + _digest(address), source, None
    instance = _get(vllm_config, "instance_id")
    if not isinstance(instance, str) or not instance:
        return None, "no VllmConfig.instance_id", None
    warning = None
    if _get(parallel, "distributed_executor_backend") == "external_launcher":
        warning = (
            "vLLM's external launcher builds one config per process, so its processes "
            f"share no instance id: set {ENV_INSTANCE} to one value in every process"
        )
    return _DP_SUFFIX.sub("", instance), "VllmConfig.instance_id", warning


def engine_identity(
    engine_id: str,
    vllm_config: object | None,
    environ: Mapping[str, str],
    *,
    engine_id_origin: str = "kv_transfer_config.engine_id",
    explicit: tuple[str, str] | None = None,
) -> EngineIdentity:
    """The namespace of this process's engine (see the module's table).

    ``engine_id`` is the configured id as LMCache hands it over (vLLM's
    ``kv_transfer_config.engine_id``, with vLLM's ``_dp<k>`` under data parallel, or
    ``extra_config lookup_broker_engine_id``), named ``engine_id_origin`` in errors;
    ``vllm_config`` is vLLM's config object, None outside vLLM; ``environ`` the process's
    environment (``BROKER_LOOKUP_INSTANCE_ID``, ``LWS_*``); ``explicit`` the user's
    instance setting from elsewhere (a config file) and where it came from.

    Raises:
        ConfigError: the configured id or the explicit instance is unusable.
    """
    parallel = _get(vllm_config, "parallel_config")
    dp_rank = _dp_rank(parallel)
    configured = engine_id
    if dp_rank is not None and engine_id_origin == "kv_transfer_config.engine_id":
        # vLLM's own DP suffix (the global rank; the local one before 0.32): not the
        # operator's id, whose ACL users must still match.
        local = _get(parallel, "data_parallel_rank_local")
        for suffix in {f"_dp{dp_rank}", f"_dp{local}"}:
            if engine_id.endswith(suffix) and engine_id != suffix:
                configured = engine_id[: -len(suffix)]
                break
    validate_configured_id(configured, engine_id_origin)
    instance, source, warning = _instance(vllm_config, environ, explicit)
    if instance is None:
        return EngineIdentity(configured, configured, source, warning)
    if dp_rank is not None:
        instance, source = f"{instance}-dp{dp_rank}", f"{source}, data-parallel rank {dp_rank}"
    if (
        warning is None
        and _int(parallel, "nnodes", 1) > 1
        and not source.startswith("the setting")
        and _UUID.fullmatch(configured)
    ):
        warning = (
            f"{engine_id_origin}={configured!r} looks drawn by vLLM (a fresh uuid per start): "
            "each node draws its own, so set kv_transfer_config.engine_id on every node"
        )
    return EngineIdentity(configured, instance_engine_id(configured, instance), source, warning)
