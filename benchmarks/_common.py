"""What the benchmark scripts share: statistics, versions, progress lines, and which broker
to measure (``--url``, else ``$AMQP_URL``, else a private node started for the run)."""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from importlib import metadata

from amqp_locks.broker import LocalBroker


def percentile(values: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile (``pct`` in 0..100) of a non-empty sequence."""
    ordered = sorted(values)
    rank = max(1, math.ceil(pct / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def summary(values: Sequence[float]) -> dict[str, float | int]:
    return {
        "n": len(values),
        "median": statistics.median(values),
        "mean": statistics.fmean(values),
        "p10": percentile(values, 10),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "min": min(values),
        "max": max(values),
    }


def version_of(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def broker(url: str | None) -> Iterator[tuple[str, str]]:
    """``(url, where it came from)``: ``url``, else ``$AMQP_URL``, else a private node that is
    stopped on exit (a broker this script did not start is never stopped)."""
    if url:
        yield url, "--url"
    elif os.environ.get("AMQP_URL"):
        yield os.environ["AMQP_URL"], "$AMQP_URL"
    else:
        progress("starting a private RabbitMQ node (LocalBroker)")
        with LocalBroker() as node:
            yield node.url, "private LocalBroker"


def table(header: tuple[str, ...], rows: Sequence[tuple[str, ...]], aligned: str) -> str:
    """A plain-text table; ``aligned`` has one of ``<`` or ``>`` per column."""
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]

    def line(row: tuple[str, ...]) -> str:
        return "  ".join(f"{c:{a}{w}}" for c, a, w in zip(row, aligned, widths)).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), rule, *(line(r) for r in rows)])
