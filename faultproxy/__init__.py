"""A TCP proxy for the Redis protocol that injects network faults between processes and a server."""

from broker_lookup.tools.faultproxy.proxy import FaultProxy

__all__ = ["FaultProxy"]
