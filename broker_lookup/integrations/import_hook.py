"""Run a callback when a module is first imported, without importing it ourselves.

vLLM loads its ``general_plugins`` in every process before it has initialised that
process; importing lmcache at that point breaks vLLM-CPU's worker (its kernel
overrides fail with ``'_lib_fn_wrapper' object has no attribute 'get'``). So the
plugin does not import lmcache: :func:`when_imported` puts a finder on
``sys.meta_path`` that wraps the loader of the named modules and calls back right
after the first of them has executed, in whatever process imports it (vLLM's spawned
EngineCore and workers load the plugin again, so each process arms its own hook).

>>> when_imported(["json.tool"], lambda module: print("loaded", module.__name__))  # doctest: +SKIP
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from types import ModuleType
from typing import Any

__all__ = ["PostImportFinder", "forget", "hook_fired", "when_imported"]

logger = logging.getLogger(__name__)

Callback = Callable[[ModuleType], None]


class _Hook:
    """One registration: its module names and a callback that runs at most once."""

    def __init__(self, key: str, names: Sequence[str], callback: Callback) -> None:
        self.key = key
        self.names = tuple(names)
        self.callback = callback
        self.fired = False


class _NotifyingLoader(importlib.abc.Loader):
    """Wraps a module's real loader; tells the finder once the module has executed."""

    def __init__(self, loader: Any, finder: PostImportFinder) -> None:
        self._loader = loader
        self._finder = finder

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        # Hand the module its real loader back (inspect, importlib.resources, reload).
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._finder.loaded(module)

    def __getattr__(self, name: str) -> Any:
        # get_source, is_package, get_resource_reader, ...: the real loader's.
        return getattr(self._loader, name)


class PostImportFinder(importlib.abc.MetaPathFinder):
    """A ``sys.meta_path`` finder that finds nothing itself; it wraps watched modules' loaders."""

    def __init__(self) -> None:
        self._hooks: dict[str, _Hook] = {}
        self._lock = threading.RLock()
        self._local = threading.local()

    def _watched(self, fullname: str) -> bool:
        with self._lock:
            return any(fullname in h.names and not h.fired for h in self._hooks.values())

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        """The spec the other finders give ``fullname``, with a notifying loader if watched."""
        if getattr(self._local, "searching", False) or not self._watched(fullname):
            return None
        self._local.searching = True  # the other finders may call back into sys.meta_path
        try:
            spec = self._find_elsewhere(fullname, path, target)
        finally:
            self._local.searching = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _NotifyingLoader(spec.loader, self)
        return spec

    def _find_elsewhere(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None
    ) -> importlib.machinery.ModuleSpec | None:
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec: importlib.machinery.ModuleSpec | None = find(fullname, path, target)
            if spec is not None:
                return spec
        return None

    def add(self, hook: _Hook) -> bool:
        """Register ``hook`` (False if its key is already registered); fire now if loaded."""
        with self._lock:
            if hook.key in self._hooks:
                return False
            self._hooks[hook.key] = hook
        loaded = next((sys.modules[n] for n in hook.names if n in sys.modules), None)
        if loaded is not None:
            self._fire(hook, loaded)
        return True

    def loaded(self, module: ModuleType) -> None:
        """Called by the loader wrapper after ``module`` executed: run the due callbacks."""
        with self._lock:
            due = [h for h in self._hooks.values() if module.__name__ in h.names]
        for hook in due:
            self._fire(hook, module)

    def _fire(self, hook: _Hook, module: ModuleType) -> None:
        with self._lock:
            if hook.fired:
                return
            hook.fired = True
        try:
            hook.callback(module)
        except Exception:
            # The import that triggered us belongs to someone else (vLLM, LMCache):
            # a failing patch must not fail it.
            logger.exception("import hook %s failed on %s", hook.key, module.__name__)

    def fired(self, key: str) -> bool:
        """Whether the hook registered under ``key`` has run."""
        with self._lock:
            hook = self._hooks.get(key)
            return hook is not None and hook.fired

    def remove(self, key: str) -> None:
        """Forget the hook registered under ``key`` (tests)."""
        with self._lock:
            self._hooks.pop(key, None)


_finder_lock = threading.Lock()


def _finder() -> PostImportFinder:
    """This process's finder, first on ``sys.meta_path`` (put there on first use)."""
    with _finder_lock:
        for finder in sys.meta_path:
            if isinstance(finder, PostImportFinder):
                return finder
        finder = PostImportFinder()
        sys.meta_path.insert(0, finder)
        return finder


def when_imported(names: Iterable[str], callback: Callback, *, key: str | None = None) -> bool:
    """Call ``callback(module)`` once, when the first of ``names`` has finished importing.

    If one of them is already imported, the callback runs now. ``key`` (default: the
    names) makes registration idempotent: a second call with the same key does
    nothing and returns False. Exceptions from the callback are logged, never raised
    into the import that triggered it.
    """
    hook_names = tuple(names)
    if not hook_names:
        raise ValueError("when_imported needs at least one module name")
    hook = _Hook(key or ",".join(hook_names), hook_names, callback)
    return _finder().add(hook)


def hook_fired(key: str) -> bool:
    """Whether the hook registered under ``key`` in this process has run."""
    return _finder().fired(key)


def forget(key: str) -> None:
    """Drop the hook registered under ``key`` (so tests can register it again)."""
    _finder().remove(key)
