"""The benchmark lab, run from a checkout: not part of the installed package.

``python -m benchmarks.bench`` measures our lookup path against LMCache's and against the
protocol's floor (``docs/performance.md``); ``python -m benchmarks.soak`` drives mixed
traffic while ranks die, the server restarts and the network fails. Both start real
processes from this checkout (``broker_lookup.processes.child_env`` puts it on their path).
``python -m benchmarks.build_native`` builds the native floor's optional C extension in place.
"""
