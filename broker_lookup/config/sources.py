"""Where config values come from: ``BROKER_LOOKUP_*`` environment variables and files.

This is the one module that reads settings from the process environment:
``LookupConfig.from_env``/``load`` and the LMCache integration's switch go through
:func:`environment`. (Other modules look at ``os.environ`` for other reasons: the
hasher checks ``PYTHONHASHSEED``, process helpers build a child's environment.) What a
valid config is lives in :mod:`broker_lookup.config.model`.
"""

from __future__ import annotations

import difflib
import os
import re
import tomllib
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import msgspec
import yaml

from broker_lookup.errors import ConfigError

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
    "file_origin",
    "flag_origin",
    "nearest",
    "parse_env",
    "parse_file",
    "read_file",
    "unknown_variables",
]

#: Environment variables are ``BROKER_LOOKUP_<FIELD>``.
ENV_PREFIX = "BROKER_LOOKUP_"


def env_name(name: str) -> str:
    """The environment variable of ``name``: a config field's (it sets that field), or
    one of :data:`OTHER_VARIABLES`' (``env_name("rank")``: ``BROKER_LOOKUP_RANK``). Every
    variable name is made here, never spelt by hand."""
    return ENV_PREFIX + name.upper()


#: Names a YAML or TOML file that ``LookupConfig.load`` reads before the variables.
CONFIG_FILE_ENV = env_name("config_file")


#: Every ``BROKER_LOOKUP_*`` variable that is not a config field, and what reads it. Any
#: other ``BROKER_LOOKUP_*`` variable is refused as a misspelling (a new variable is
#: added here; a test checks that every name the repository uses is a field or listed).
OTHER_VARIABLES: dict[str, str] = {
    CONFIG_FILE_ENV: "a YAML/TOML file of config fields, read before the variables",
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
    env_name("demo_cpu_connector"): "demo --vllm: 1 in its vLLM child: the CPU connector",
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


def flag_origin(field: str) -> str:
    """Where a value given as the command-line flag of ``field`` came from."""
    return "flag --" + field.replace("_", "-")


def file_origin(path: str | os.PathLike[str]) -> str:
    """Where a value read from the config file ``path`` came from."""
    return f"file {path}"


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


def parse_env(field: str, raw: str, kind: object, origin: str | None = None) -> object:
    """A raw text value (a variable's, a flag's) as the field's type expects it; an error
    names ``origin`` (default: the field's variable)."""
    # none/null/empty only for Optional fields, yes/no only for bools: a str stays a str.
    text = raw.strip()
    if type(None) in typing.get_args(kind) and text.lower() in ("", "none", "null"):
        return None
    if field == "lookup_server_worker_ids":
        try:
            return tuple(int(x) for x in text.replace(" ", "").split(",") if x)
        except ValueError:
            where = origin or env_origin(field)
            raise ConfigError(
                f"{field}={raw!r} ({where}) is invalid: expected comma-separated ranks like 0,1"
            ) from None
    if kind is bool and text.lower() in ("true", "yes", "on"):
        return True
    if kind is bool and text.lower() in ("false", "no", "off"):
        return False
    return text


def read_file(path: Path) -> dict[str, Any]:
    """The mapping in a YAML (``.yaml``/``.yml``) or TOML (``.toml``) config file."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
    return parse_file(path, text)


def parse_file(path: Path, text: str) -> dict[str, Any]:
    """The mapping in a YAML or TOML config file."""
    try:
        data: object = tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot parse config file {path}: {exc}") from None
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of field: value")
    return data
