"""What the lean link reads of redis-py's internals: the installed redis-py has it and is in
the range it is tested with (the one pyproject.toml pins), and a redis-py without one of
them is named, not found out deep in a read."""

from __future__ import annotations

import logging
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from redis.utils import HIREDIS_AVAILABLE

from broker_lookup.transport import redis_internals
from broker_lookup.transport.redis_internals import MISSING, SUPPORTED_REDIS_PY

_PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_the_installed_redis_py_has_what_the_lean_link_reads() -> None:
    assert MISSING is None, (
        f"redis-py {redis.__version__} lacks {MISSING}, which "
        f"broker_lookup/transport/redis_internals.py reads; it is tested with redis-py "
        f"{SUPPORTED_REDIS_PY}"
    )


def test_the_installed_redis_py_is_in_the_tested_range() -> None:
    assert SpecifierSet(SUPPORTED_REDIS_PY).contains(redis.__version__), (
        f"redis-py {redis.__version__} is installed; the lean link's reads below redis-py "
        f"(broker_lookup/transport/redis_internals.py) are tested with {SUPPORTED_REDIS_PY}"
    )


def test_pyproject_pins_the_tested_range() -> None:
    project = tomllib.loads(_PYPROJECT.read_text())["project"]
    [pin] = [Requirement(d) for d in project["dependencies"] if Requirement(d).name == "redis"]
    assert pin.specifier == SpecifierSet(SUPPORTED_REDIS_PY)


def _without(name: str) -> Callable[[Any], None]:
    """A ``Connection.__init__`` hook that takes ``name`` away, as a redis-py that renamed it."""

    def remove(conn: Any) -> None:
        owner, _, attr = name.rpartition(".")
        target = conn._parser if owner == "_parser" else conn
        delattr(target, attr)

    return remove


@pytest.mark.skipif(not HIREDIS_AVAILABLE, reason="the direct read needs hiredis")
@pytest.mark.parametrize(
    ("gone", "named"),
    [
        ("_sock", "Connection._sock"),
        ("_parser", "Connection._parser"),
        ("_parser._buffer", "_HiredisParser._buffer"),
    ],
)
def test_a_redis_py_without_an_internal_is_named(
    gone: str, named: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    init: Any = redis.Connection.__init__
    remove = _without(gone)

    def patched(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        remove(self)

    monkeypatch.setattr(redis.Connection, "__init__", patched)
    assert redis_internals._missing() == named


@pytest.mark.skipif(not HIREDIS_AVAILABLE, reason="the direct read needs hiredis")
def test_a_parser_that_makes_no_reader_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = redis_internals._HIREDIS_PARSER
    on_connect = parser.on_connect

    def no_reader(self: Any, *args: Any, **kwargs: Any) -> None:
        on_connect(self, *args, **kwargs)
        del self._reader

    monkeypatch.setattr(parser, "on_connect", no_reader)
    assert redis_internals._missing() == "_HiredisParser._reader"


def test_a_missing_internal_is_logged_once_with_the_tested_range(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(redis_internals, "MISSING", "Connection._sock")
    monkeypatch.setattr(redis_internals, "_warned", False)
    with caplog.at_level(logging.WARNING, logger=redis_internals.__name__):
        redis_internals.warn_once_if_missing()
        redis_internals.warn_once_if_missing()
    [record] = caplog.records
    message = record.getMessage()
    assert "Connection._sock" in message and SUPPORTED_REDIS_PY in message
    assert redis.__version__ in message
