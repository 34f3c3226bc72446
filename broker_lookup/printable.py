"""Text from a caller, made safe to print on an operator's terminal or in a log line.

Lookup ids come from HTTP clients (vLLM takes them from ``X-Request-Id``): printed raw, an
id could clear the operator's screen, write to their clipboard (OSC 52) or, with a
newline, forge a log line of its own. :func:`shown` is the one place such text is made
printable; every report and log line that prints a caller's id goes through it.
"""

from __future__ import annotations

__all__ = ["shown"]


def shown(value: object) -> str:
    """``value`` as text with every non-printable character escaped (``\\n``, ``\\x1b``,
    ``\\u202e``) and nothing cut: what an operator copies back is what was stored, less
    only the characters a terminal would act on.

    >>> shown("req-1")
    'req-1'
    >>> shown("a\\nrank 0: forged\\x1b[2J")
    'a\\\\nrank 0: forged\\\\x1b[2J'
    """
    text = value if isinstance(value, str) else str(value)
    if text.isprintable():  # the common case: nothing to escape, no copy
        return text
    # ascii() escapes exactly one character as Python would ('\n' -> '\\n'); its quotes go.
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)
