"""Test scaffolding on the vLLM child's PYTHONPATH: runs in every process vLLM spawns.

vLLM spawns its EngineCore and workers; each runs ``site`` and so this module, which
arms (without importing lmcache or vLLM here) a lazy replacement of LMCache's
``CreateGPUConnector`` (``cpu_connector.py``) and the stats probe (``probe.py``).
"""

import os
import sys

if os.environ.get("BL_TEST_CPU_CONNECTOR") == "1":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import cpu_connector

    cpu_connector.install_lazily()
    if os.environ.get("BL_TEST_PROBE_DIR"):
        import probe

        probe.install_lazily()
