"""Which rank was slow, read back from Redis: per-rank latency over the recent completions.

With ``rank_insights`` on, every completion entry on ``bl:{E}:done`` carries each rank's
submit-to-report latency (on the server's clock) and the rank that reported last (see
:mod:`broker_lookup.protocol.messages`). ``broker-lookup inspect`` reads the newest
entries with XREVRANGE; this module turns them into p50/p99 per rank and each rank's
share of last-to-report, and renders that table. Read-only and stateless: the window is
whatever the trimmed stream still holds, and its span comes from the entries' ids.
"""

from __future__ import annotations

from typing import Any

from broker_lookup.protocol.messages import DoneEvent, decode_completions

__all__ = ["rank_latency", "render_rank_latency"]

Snapshot = dict[str, Any]


def _bytes(value: object) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


def _stamp_ms(entry_id: object) -> int | None:
    head = _bytes(entry_id).split(b"-", 1)[0]
    return int(head) if head.isdigit() else None


def _percentile(ordered: list[int], q: float) -> int:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _timed(entries: list[tuple[Any, Any]]) -> tuple[list[DoneEvent], list[int], int]:
    """The entries' events that carry insights, every entry's stamp (server ms), and how
    many completions the entries hold."""
    events: list[DoneEvent] = []
    stamps: list[int] = []
    completions = 0
    for entry_id, fields in entries:
        stamp = _stamp_ms(entry_id)
        if stamp is not None:
            stamps.append(stamp)
        # Every completion of the entry (a batch's are several); one that does not decode,
        # or an entry we did not write, has nothing to time.
        got = decode_completions({_bytes(k): _bytes(v) for k, v in fields.items()})
        completions += len(got.events)
        events += [ev for ev in got.events if ev.last is not None]
    return events, stamps, completions


def rank_latency(entries: list[tuple[Any, Any]], read: int | None = None) -> Snapshot:
    """Per rank: p50/p99 of submit-to-report latency (ms) and the share of lookups it
    reported last, over the completion entries ``entries`` (XREVRANGE's reply).

    Entries without insights (``rank_insights`` off, older scripts) are skipped; the
    window is the span of the entries' stream ids (the server's clock).
    """
    events, stamps, completions = _timed(entries)
    samples: dict[int, list[int]] = {}
    last: dict[int, int] = {}
    for ev in events:
        last[ev.last or 0] = last.get(ev.last or 0, 0) + 1
        for rank, micros in zip(ev.ranks, ev.latency_us, strict=False):
            got = samples.setdefault(rank, [])
            if micros is not None:
                got.append(micros)
    ranks: dict[int, Snapshot] = {}
    for rank in sorted(set(samples) | set(last)):
        got = sorted(samples.get(rank, []))
        ranks[rank] = {
            "samples": len(got),
            "p50_ms": _percentile(got, 0.5) / 1000 if got else None,
            "p99_ms": _percentile(got, 0.99) / 1000 if got else None,
            "last": last.get(rank, 0),
            "last_share": last.get(rank, 0) / len(events) if events else None,
        }
    return {
        "read": completions if read is None else read,
        "timed": len(events),
        "window_s": (max(stamps) - min(stamps)) / 1000 if stamps else None,
        "newest_ms": max(stamps) if stamps else None,
        "ranks": ranks,
    }


def _fmt_ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}ms"


def render_rank_latency(rl: Snapshot | None, lines: list[str]) -> None:
    """Append the RANK LATENCY table of :func:`rank_latency`'s ``rl`` to ``lines``."""
    if not rl:
        return
    window = rl["window_s"]
    span = f" over {window:.1f}s" if window is not None else ""
    lines.append(
        f"RANK LATENCY (submit to report, server clock; {rl['timed']} of the last "
        f"{rl['read']} completions{span})"
    )
    if not rl["ranks"]:
        lines.append("  none timed: rank_insights is off, or no lookup completed yet")
        lines.append("")
        return
    lines.append(f"  {'rank':<6}{'p50':<11}{'p99':<11}{'samples':<9}last to report")
    for rank, row in sorted(rl["ranks"].items()):
        share = row["last_share"]
        shown = f"{share * 100:.0f}% ({row['last']})" if share is not None else "-"
        lines.append(
            f"  {rank!s:<6}{_fmt_ms(row['p50_ms']):<11}{_fmt_ms(row['p99_ms']):<11}"
            f"{row['samples']!s:<9}{shown}"
        )
    lines.append("")
