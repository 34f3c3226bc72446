"""Where config values come from: ``BROKER_LOOKUP_*`` environment variables and files.

This is the one module that reads settings from the process environment:
``LookupConfig.from_env``/``load`` and the LMCache integration's switch go through
:func:`environment`. (Other modules look at ``os.environ`` for other reasons: the
hasher checks ``PYTHONHASHSEED``, process helpers build a child's environment.) What a
valid config is lives in :mod:`broker_lookup.config.model`.
"""

from __future__ import annotations

import os
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
    "config_file",
    "env_name",
    "env_settings",
    "environment",
    "parse_env",
    "parse_file",
    "read_file",
]

#: Environment variables are ``BROKER_LOOKUP_<FIELD>``.
ENV_PREFIX = "BROKER_LOOKUP_"
#: Names a YAML or TOML file that ``LookupConfig.load`` reads before the variables.
CONFIG_FILE_ENV = ENV_PREFIX + "CONFIG_FILE"


def env_name(field: str) -> str:
    """Environment variable that sets ``field``."""
    return ENV_PREFIX + field.upper()


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


def parse_env(field: str, raw: str, kind: object) -> object:
    """A raw env value as the field's type expects it."""
    # none/null/empty only for Optional fields, yes/no only for bools: a str stays a str.
    text = raw.strip()
    if type(None) in typing.get_args(kind) and text.lower() in ("", "none", "null"):
        return None
    if field == "lookup_server_worker_ids":
        try:
            return tuple(int(x) for x in text.replace(" ", "").split(",") if x)
        except ValueError:
            raise ConfigError(
                f"{env_name(field)}={raw!r} is invalid: expected comma-separated ranks like 0,1"
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
