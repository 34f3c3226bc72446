"""What ``broker-lookup demo`` and ``broker-lookup server`` are built from, and the tests too.

An embedded server, a local Redis Cluster, worker ranks as local processes, the demo.
Nothing the scheduler or a worker imports lives here (the ``broker-lookup`` command loads a
tool only when its subcommand runs). The benchmarks and the fault proxy are not part of the
package: they live in the checkout's ``benchmarks/`` and ``faultproxy/``.
"""
