"""``python -m benchmarks.route``: routing by the fleet query against an event-fed index.

See :mod:`benchmarks.route.__main__` for what is measured and how.
"""
