"""Never a silent fallback: one ERROR per process when LMCache's lookup is not ours.

With ``BROKER_LOOKUP_LMCACHE=1`` the operator asked for the broker. Two things can keep
it out while LMCache goes on with its own ZMQ lookup and nothing else shows:

* the LMCache that is imported keeps its lookup factory where no
  :class:`~broker_lookup.integrations.lmcache_layout.Layout` says (a release that moved
  it again): the patch never goes in. :func:`check_layout` runs on the first
  ``import lmcache`` and says so;
* LMCache's vLLM service factory builds a lookup client or server that is not ours for
  a config that asks for the broker (something replaced our patch, or a release builds
  them some other way). :func:`watch_service_factory` checks what it built.

Either logs one ERROR per process (the first; vLLM forks, and each child says it again),
naming the LMCache version and what was expected; later ones go to DEBUG.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

from broker_lookup.integrations.lmcache_layout import (
    TESTED_VERSIONS,
    expected,
    find_layout,
)
from broker_lookup.lmcache_version import running_lmcache_version

__all__ = ["alarm", "check_layout", "forget", "unwatch_service_factory", "watch_service_factory"]

logger = logging.getLogger(__name__)

#: The service factory methods whose results are checked, and what they build.
_WATCHED = {"maybe_create_lookup_client": "client", "maybe_create_lookup_server": "server"}
#: Our packages: an object of a class defined in one of them is ours.
_OURS = ("broker_lookup", "workers")

_lock = threading.Lock()
_alarmed_pid: int | None = None
_originals: dict[str, Any] = {}


def alarm(message: str, *args: Any) -> bool:
    """Log ``message`` at ERROR if this process has not yet; True if it did now."""
    global _alarmed_pid
    with _lock:
        first = _alarmed_pid != os.getpid()
        _alarmed_pid = os.getpid()
    if first:
        logger.error(message, *args)
    else:
        logger.debug(message, *args)
    return first


def forget() -> None:
    """Let the next :func:`alarm` of this process log at ERROR again (tests)."""
    global _alarmed_pid
    with _lock:
        _alarmed_pid = None


def _tested() -> str:
    return ", ".join(TESTED_VERSIONS)


def check_layout(module: ModuleType | None = None) -> None:
    """On the first ``import lmcache``: an ERROR when no known layout matches LMCache's.

    A known layout with a version the tests never ran gets a WARNING: the patch goes in,
    and :func:`watch_service_factory` still says so if LMCache builds its own lookup.
    """
    layout = find_layout()
    version = running_lmcache_version()
    if layout is None:
        alarm(
            "broker-lookup: LMCache %s (pid %d) keeps its lookup factory in none of the places "
            "broker-lookup knows (%s): the patch is not installed and LMCache uses its own "
            "lookup transport. broker-lookup is tested with LMCache %s",
            version,
            os.getpid(),
            expected(),
            _tested(),
        )
    elif version not in layout.versions:
        logger.warning(
            "broker-lookup is not tested with LMCache %s (tested: %s); its modules match %s, "
            "so the patch goes in there",
            version,
            _tested(),
            layout,
        )


def _ours(obj: Any) -> bool:
    return type(obj).__module__.partition(".")[0] in _OURS


def _verify(kind: str, built: Any, factory: Any, wanted: Callable[[Any], bool]) -> None:
    config = getattr(factory, "lmcache_config", None)
    if built is None or config is None or _ours(built) or not wanted(config):
        return
    alarm(
        "broker-lookup: LMCache %s (pid %d) built its own lookup %s %s.%s for a config that "
        "asks for the broker; expected broker-lookup's, from the patched %s. This process "
        "uses LMCache's lookup transport, not the broker",
        running_lmcache_version(),
        os.getpid(),
        kind,
        type(built).__module__,
        type(built).__qualname__,
        expected(),
    )


def _checked(method: Callable[..., Any], kind: str, wanted: Callable[[Any], bool]) -> Any:
    @functools.wraps(method)
    def create(self: Any, *args: Any, **kwargs: Any) -> Any:
        built = method(self, *args, **kwargs)
        try:
            _verify(kind, built, self, wanted)
        except Exception:  # a failing check must not fail LMCache's start-up
            logger.exception("broker-lookup could not check LMCache's lookup %s", kind)
        return built

    create.__broker_lookup_checked__ = True  # type: ignore[attr-defined]  # marks ours
    return create


def watch_service_factory(module: ModuleType, wanted: Callable[[Any], bool]) -> bool:
    """Check what ``module.VllmServiceFactory`` builds; True if it is watched now.

    ``wanted(lmcache_config)`` tells whether a config asks for the broker. A module
    without the class or its methods gets the ERROR instead: nothing can be checked.
    """
    factory = getattr(module, "VllmServiceFactory", None)
    missing = [n for n in _WATCHED if not callable(getattr(factory, n, None))]
    if factory is None or missing:
        alarm(
            "broker-lookup: LMCache %s (pid %d) has no VllmServiceFactory.%s in %s: "
            "broker-lookup cannot check which lookup client and server LMCache builds",
            running_lmcache_version(),
            os.getpid(),
            " or .".join(missing or _WATCHED),
            module.__name__,
        )
        return False
    with _lock:
        if getattr(factory.maybe_create_lookup_client, "__broker_lookup_checked__", False):
            return False
        for name, kind in _WATCHED.items():
            method = getattr(factory, name)
            _originals[f"{module.__name__}:{name}"] = method
            setattr(factory, name, _checked(method, kind, wanted))
    return True


def unwatch_service_factory(module: ModuleType) -> None:
    """Give ``module.VllmServiceFactory`` its own methods back (tests)."""
    factory = module.VllmServiceFactory
    with _lock:
        for name in _WATCHED:
            original = _originals.pop(f"{module.__name__}:{name}", None)
            if original is not None:
                setattr(factory, name, original)
