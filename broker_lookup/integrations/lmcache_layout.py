"""Where each LMCache release keeps the in-process modules the plugin patches: the one place.

LMCache 0.5.6 keeps its in-process stack under ``lmcache.v1`` and
``lmcache.integration.vllm``. LMCache 0.5.7 moved it under ``lmcache.inprocess``, with
no aliases: ``lmcache.inprocess.v1.lookup_client`` and
``lmcache.inprocess.integration.vllm``. The lookup interface, the factory's signatures
and the config and metadata classes (still ``lmcache.v1.config`` and
``lmcache.v1.metadata``) are the same in both. Every module name the plugin and its
tests use is built here from a :class:`Layout`.

:func:`find_layout` tells which layout is installed without running any of LMCache's
code: it looks each package level up with the parent's path, as the import system
would, but executes nothing. (The plugin must not import LMCache before vLLM has set up
the process; see :mod:`broker_lookup.integrations.import_hook`.)

>>> find_layout()                                            # doctest: +SKIP
Layout(package='lmcache.inprocess', versions=('0.5.7rc2',))
>>> load(FACTORY).LookupClientFactory                        # doctest: +SKIP
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
from dataclasses import dataclass
from types import ModuleType

__all__ = [
    "ABSTRACT_CLIENT",
    "ASYNC_CLIENT",
    "FACTORY",
    "LAYOUTS",
    "SERVICE_FACTORY",
    "TESTED_VERSIONS",
    "Layout",
    "expected",
    "find_layout",
    "hook_modules",
    "load",
    "module_exists",
    "service_factories",
]

#: Module names relative to a layout's package.
FACTORY = "v1.lookup_client.factory"
ABSTRACT_CLIENT = "v1.lookup_client.abstract_client"
ASYNC_CLIENT = "v1.lookup_client.lmcache_async_lookup_client"
SERVICE_FACTORY = "integration.vllm.vllm_service_factory"


@dataclass(frozen=True)
class Layout:
    """Where one LMCache release family keeps its in-process modules."""

    #: The package holding ``v1.lookup_client`` and ``integration.vllm``.
    package: str
    #: The LMCache releases the test matrix runs on this layout.
    versions: tuple[str, ...]

    def module(self, relative: str) -> str:
        """The full name of ``relative`` (e.g. :data:`FACTORY`) in this layout."""
        return f"{self.package}.{relative}"

    def __str__(self) -> str:
        return f"{self.module(FACTORY)} (LMCache {', '.join(self.versions)})"


#: Newest first: where a release ships both, the newer one is where LMCache builds from.
LAYOUTS: tuple[Layout, ...] = (
    Layout("lmcache.inprocess", ("0.5.7rc2",)),
    Layout("lmcache", ("0.5.6",)),
)
#: Every LMCache release the test matrix runs.
TESTED_VERSIONS: tuple[str, ...] = tuple(v for layout in LAYOUTS for v in layout.versions)


def hook_modules() -> tuple[str, ...]:
    """The modules whose first import installs the patch: each layout's factory and the
    vLLM service factory that builds the lookup client and server from it."""
    return tuple(layout.module(m) for layout in LAYOUTS for m in (FACTORY, SERVICE_FACTORY))


def service_factories() -> tuple[str, ...]:
    """Each layout's vLLM service factory module."""
    return tuple(layout.module(SERVICE_FACTORY) for layout in LAYOUTS)


def expected() -> str:
    """Where the plugin looks for LMCache's lookup factory, for messages."""
    return " or ".join(str(layout) for layout in LAYOUTS)


def module_exists(fullname: str) -> bool:
    """Whether ``fullname`` can be imported, found without running any package's code.

    ``importlib.util.find_spec`` would import the parent packages; this looks each level
    up in its parent's ``__path__`` instead (or takes it from ``sys.modules``).
    """
    parts = fullname.split(".")
    search: list[str] | None = None
    for depth in range(1, len(parts) + 1):
        name = ".".join(parts[:depth])
        loaded = sys.modules.get(name)
        spec = getattr(loaded, "__spec__", None) if loaded is not None else None
        if spec is None:
            if search is None:  # top level: through sys.meta_path (editable installs too)
                spec = importlib.util.find_spec(name)
            else:
                spec = importlib.machinery.PathFinder.find_spec(name, search)
        if spec is None:
            return False
        if depth < len(parts):
            if not spec.submodule_search_locations:
                return False
            search = list(spec.submodule_search_locations)
    return True


def find_layout() -> Layout | None:
    """The installed LMCache's layout (None: no LMCache, or one this plugin does not know)."""
    return next((lo for lo in LAYOUTS if module_exists(lo.module(FACTORY))), None)


def load(relative: str) -> ModuleType:
    """Import ``relative`` (e.g. :data:`FACTORY`) from the installed LMCache's layout.

    Raises:
        ImportError: LMCache is not installed, or keeps its lookup client elsewhere.
    """
    layout = find_layout()
    if layout is None:
        raise ImportError(f"no LMCache lookup factory is importable; looked for {expected()}")
    return importlib.import_module(layout.module(relative))
