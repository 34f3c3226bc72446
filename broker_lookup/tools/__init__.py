"""Developer tooling: bench, soak, demo, fault proxy, embedded server, local cluster, stub engine.

Nothing the scheduler or a worker imports lives here, and nothing outside this package imports it
(the ``broker-lookup`` command loads a tool only when its subcommand runs).
"""
