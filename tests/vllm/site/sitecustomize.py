"""Test scaffolding on the vLLM child's PYTHONPATH: runs in every process vLLM spawns.

vLLM spawns its EngineCore and workers; each runs ``site`` and so this module, which
arms (without importing lmcache or vLLM here) the stats probe (``probe.py``) where
``BL_TEST_PROBE_DIR`` is set. The CPU connector is the product's try-out switch
(``BROKER_LOOKUP_CPU_CONNECTOR=1``), installed by the vLLM plugin, not here.
"""

import os
import sys

if os.environ.get("BL_TEST_PROBE_DIR"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import probe

    probe.install_lazily()
