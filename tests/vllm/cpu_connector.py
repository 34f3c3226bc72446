"""The CPU connector the vLLM tests run on (``BROKER_LOOKUP_CPU_CONNECTOR=1``, installed by
the vLLM plugin): :mod:`broker_lookup.integrations.cpu_connector`, importable by name from
``probe.py`` (``COUNTS`` is the same dict)."""

from __future__ import annotations

from broker_lookup.integrations.cpu_connector import COUNTS, create, install_lazily, noise_level

__all__ = ["COUNTS", "create", "install_lazily", "noise_level"]
