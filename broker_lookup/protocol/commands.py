"""A Redis command as data: what the protocol's builders return and every link sends.

Pure data, so :mod:`broker_lookup.protocol` builds commands (the lasting keys' PEXPIREs,
a script's EVALSHA) without importing :mod:`broker_lookup.transport`, which sends them.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["Arg", "Command"]

#: One argument of a command, as redis-py's packer takes it.
Arg = str | bytes | int | float
#: One command as it goes on the wire: its name, then its arguments.
Command = Sequence[Arg]
