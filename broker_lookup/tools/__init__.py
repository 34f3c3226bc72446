"""Developer tooling: the bench, the soak, the demo, and what they are built from.

What they are built from: an embedded server, a local Redis Cluster, worker ranks as local
processes, a fault-injecting proxy, and the stub engine (also the tests' engine).

Nothing the scheduler or a worker imports lives here, and nothing outside this package imports it
(the ``broker-lookup`` command loads a tool only when its subcommand runs).
"""
