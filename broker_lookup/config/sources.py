"""Parsing config sources: environment variable values and YAML/TOML files."""

from __future__ import annotations

import tomllib
import typing
from pathlib import Path
from typing import Any

import yaml

from broker_lookup.errors import ConfigError

__all__ = ["ENV_PREFIX", "env_name", "parse_env", "parse_file"]

#: Environment variables are ``BROKER_LOOKUP_<FIELD>``.
ENV_PREFIX = "BROKER_LOOKUP_"


def env_name(field: str) -> str:
    """Environment variable that sets ``field``."""
    return ENV_PREFIX + field.upper()


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
