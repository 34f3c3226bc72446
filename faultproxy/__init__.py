"""A TCP proxy for the Redis protocol that injects network faults between processes and a server."""

from faultproxy.proxy import FaultProxy

__all__ = ["FaultProxy"]
