"""Redis Cluster and Sentinel tests: a package, like ``helm``, so its conftest is its own."""
