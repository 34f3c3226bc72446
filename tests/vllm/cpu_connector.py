"""The CPU connector of the vLLM tests: :mod:`broker_lookup.tools.cpu_connector`, importable
by name from ``site/sitecustomize.py`` and ``probe.py`` (``COUNTS`` is the same dict)."""

from __future__ import annotations

from broker_lookup.tools.cpu_connector import COUNTS, create, install_lazily, noise_level

__all__ = ["COUNTS", "create", "install_lazily", "noise_level"]
