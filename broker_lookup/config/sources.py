"""Where a config's values come from, and the one order in which they override each other.

Every path builds its :class:`~broker_lookup.config.model.LookupConfig` with :func:`load`
(``LookupConfig.load`` is this function): the CLI, ``python -m workers``, the Python API
and the LMCache/vLLM plugin. The sources, each overriding the ones before it:

1. the defaults (the fields' own);
2. the file ``path`` names, or else ``BROKER_LOOKUP_CONFIG_FILE`` (YAML or TOML);
3. the LMCache config (under LMCache only: its own fields and its
   ``extra_config["lookup_broker_*"]``, as the integration reads them, a :class:`Given`);
4. the ``BROKER_LOOKUP_*`` environment variables;
5. command-line flags;
6. keywords (``LookupConfig.load(chunk_size=...)``).

The fields LMCache acts on itself (its hashing, its ranks) are the exception: LMCache's
value stands, and a different one from a later source is refused (:attr:`Given.fixed`).
Every error names where its value came from (:func:`flag_origin`, :func:`file_origin`,
``env_origin``, the LMCache config's key). What a valid config is lives in
:mod:`broker_lookup.config.model`; the variables themselves in :mod:`~.env`.
"""

from __future__ import annotations

import os
import re
import tomllib
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
import yaml

from broker_lookup.config.env import (
    config_file,
    env_origin,
    env_settings,
    environment,
    nearest,
    unknown_variables,
)
from broker_lookup.config.model import LookupConfig, _bad, _shown, environment_read
from broker_lookup.errors import ConfigError

__all__ = [
    "Given",
    "file_origin",
    "flag_origin",
    "from_env",
    "from_mapping",
    "load",
    "parse_env",
    "parse_file",
    "read_file",
]

_AT_FIELD = re.compile(r" - at `\$\.([a-z_]+)`")


class Given(NamedTuple):
    """What one source gives: ``values`` (field -> value) and ``origins`` (field -> where
    it came from, as an error names it). ``fixed``: fields whose value here no later
    source may change (LMCache's own: LMCache acts on them too)."""

    values: dict[str, Any]
    origins: dict[str, str]
    fixed: frozenset[str] = frozenset()


def load(
    cls: type[LookupConfig],
    path: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    lmcache: Given | None = None,
    flags: Mapping[str, str] | None = None,
    fields: Mapping[str, Any] | None = None,
) -> LookupConfig:
    """``cls`` from every source, in the module's order; validated once, so an error
    names where its value came from."""
    env = environment(environ)
    keywords = dict(fields or {})
    _refuse_unknown(cls, keywords, "LookupConfig.load()")
    layers = [
        _file(cls, path or config_file(env)),
        lmcache or Given({}, {}),
        _environment(cls, env),
        _flags(cls, flags or {}),
        Given(keywords, {f: f"LookupConfig.load({f}=...)" for f in keywords}),
    ]
    values: dict[str, Any] = {}
    origins: dict[str, str] = {}
    for layer in layers:
        values.update(layer.values)
        origins.update(layer.origins)
    config = _build(cls, values, origins, env_read=True)
    if lmcache is not None:
        _keep_fixed(config, lmcache, origins)
    return config


def from_env(
    cls: type[LookupConfig], environ: Mapping[str, str] | None, base: LookupConfig | None
) -> LookupConfig:
    """``base`` (or the defaults) overridden by every ``BROKER_LOOKUP_<FIELD>`` set."""
    values = msgspec.structs.asdict(base) if base is not None else {}
    given = _environment(cls, environment(environ))
    values.update(given.values)
    return _build(cls, values, given.origins, env_read=True)


def from_mapping(cls: type[LookupConfig], values: Mapping[str, Any], source: str) -> LookupConfig:
    """``cls`` from plain values (a parsed file), lax about str/int forms; unknown keys fail."""
    _refuse_unknown(cls, values, source)
    return _build(cls, dict(values), dict.fromkeys(values, source))


def flag_origin(field: str) -> str:
    """Where a value given as the command-line flag of ``field`` came from."""
    return "flag --" + field.replace("_", "-")


def file_origin(path: str | os.PathLike[str]) -> str:
    """Where a value read from the config file ``path`` came from."""
    return f"file {path}"


def _file(cls: type[LookupConfig], path: str | Path | None) -> Given:
    if not path:
        return Given({}, {})
    p = Path(path)
    given = read_file(p)
    _refuse_unknown(cls, given, file_origin(p))
    return Given(given, dict.fromkeys(given, file_origin(p)))


def _environment(cls: type[LookupConfig], environ: Mapping[str, str]) -> Given:
    """Every ``BROKER_LOOKUP_<FIELD>`` set; a misspelt one is refused."""
    fields = msgspec.structs.fields(cls)
    unknown = unknown_variables((info.name for info in fields), environ)
    if unknown:
        raise ConfigError(
            f"unknown environment variable(s): {', '.join(unknown)}; a setting is "
            f"BROKER_LOOKUP_<FIELD> for a field of LookupConfig"
        )
    types = {info.name: info.type for info in fields}
    found = Given({}, {})
    for name, raw in env_settings(fields, environ).items():
        found.origins[name] = env_origin(name)
        found.values[name] = parse_env(name, raw, types[name], found.origins[name])
    return found


def _flags(cls: type[LookupConfig], flags: Mapping[str, str]) -> Given:
    types = {info.name: info.type for info in msgspec.structs.fields(cls)}
    found = Given({}, {})
    for field, raw in flags.items():
        found.origins[field] = flag_origin(field)
        found.values[field] = parse_env(field, raw, types[field], found.origins[field])
    return found


def _keep_fixed(config: LookupConfig, lmcache: Given, origins: Mapping[str, str]) -> None:
    """Refuse a later source's value of a field LMCache acts on itself: two values would
    make the broker and LMCache disagree (chunks hashed two ways, ranks that serve none)."""
    for field in sorted(lmcache.fixed):
        ours, theirs = getattr(config, field), lmcache.values.get(field)
        if origins.get(field) == lmcache.origins.get(field) or ours == theirs:
            continue
        raise _bad(
            field,
            _shown(field, ours),
            "LMCache uses this field too: set it in LMCache's config only",
            origins.get(field),
            other=(field, _shown(field, theirs)),
            other_origin=lmcache.origins.get(field),
        )


def _refuse_unknown(cls: type[LookupConfig], values: Mapping[str, Any], source: str) -> None:
    fields = cls.__struct_fields__
    unknown = sorted(set(values) - set(fields))
    if unknown:
        named = ", ".join(name + nearest(name, fields) for name in unknown)
        raise ConfigError(f"unknown config field(s) in {source}: {named}")


def _build(
    cls: type[LookupConfig],
    values: dict[str, Any],
    origins: Mapping[str, str],
    *,
    env_read: bool = False,
) -> LookupConfig:
    """``cls`` from ``values`` (lax about str/int forms); an error names the origin of the
    value at fault (``origins``: field -> where it came from). ``env_read``: ``values``
    hold what the environment gives, so credentials are not looked up there again."""
    try:
        if env_read:
            with environment_read():
                return msgspec.convert(values, cls, strict=False)
        return msgspec.convert(values, cls, strict=False)
    except msgspec.ValidationError as exc:
        raise _located(exc, values, origins) from None


def _located(
    exc: msgspec.ValidationError, values: Mapping[str, Any], origins: Mapping[str, str]
) -> ConfigError:
    """``exc`` as a ConfigError naming the field, the (redacted) value and its origin."""
    cause = exc.__cause__
    if isinstance(cause, ConfigError):  # raised by a check (msgspec wraps it)
        if cause.field is None:
            return cause
        where = origins.get(cause.field, "the default")
        if cause.other is not None:
            there = origins.get(cause.other, "the default")
            other = (cause.other, cause.other_shown)
            return _bad(
                cause.field, cause.shown, cause.problem, where, other=other, other_origin=there
            )
        return _bad(cause.field, cause.shown, cause.problem, where)
    text = str(exc)
    found = _AT_FIELD.search(text)
    if found is None or found.group(1) not in values:
        return ConfigError(f"invalid config: {text}")
    field = found.group(1)
    why = _AT_FIELD.sub("", text)
    shown = _shown(field, values[field])
    return _bad(field, shown, f"has the wrong type: {why}", origins.get(field, "the default"))


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
