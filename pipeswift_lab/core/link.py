"""The link between two pipeline ranks: a latency plus a bandwidth.

A point-to-point transfer of ``n`` bytes takes ``latency_ms + n / bandwidth`` (the
alpha-beta model of Hockney, *The communication challenge for MPP: Intel Paragon and
Meiko CS-2*, Parallel Computing 1994). ``GB`` here is ``10**9`` bytes, as link
bandwidths are quoted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .checks import check_time


def fit_latency_bandwidth(nbytes: Sequence[float], times: Sequence[float]) -> tuple[float, float] | None:
    """``(latency, time per byte)`` of the least-squares line ``time = latency + nbytes * per_byte`` through the
    samples (Hockney's alpha-beta model, in the samples' own units), or None when it is not physical (a slope <= 0 or
    a negative latency). Callers decide first whether the sizes spread enough to tell the two apart."""
    n = len(nbytes)
    mean_b, mean_t = sum(nbytes) / n, sum(times) / n
    spread = sum((b - mean_b) ** 2 for b in nbytes)
    if spread <= 0:
        return None
    per_byte = sum((b - mean_b) * (t - mean_t) for b, t in zip(nbytes, times)) / spread
    latency = mean_t - per_byte * mean_b
    return (latency, per_byte) if per_byte > 0 and latency >= 0 else None


@dataclass(frozen=True)
class Link:
    """A link between neighbouring pipeline ranks.

    * ``latency_ms`` — fixed cost of one transfer (ms, ``>= 0``);
    * ``bandwidth_GBps`` — sustained bandwidth in GB/s (``10**9`` bytes per second, ``> 0``).
    """

    latency_ms: float  # fixed cost of every transfer, ms
    bandwidth_GBps: float  # GB/s, 10**9 bytes per second

    def __post_init__(self) -> None:
        object.__setattr__(self, "latency_ms", check_time("latency_ms", self.latency_ms))
        object.__setattr__(self, "bandwidth_GBps", check_time("bandwidth_GBps", self.bandwidth_GBps, allow_zero=False))

    def transfer_ms(self, nbytes: float) -> float:
        """Milliseconds to move ``nbytes`` bytes: ``latency_ms + nbytes / bandwidth``."""
        nbytes = check_time("nbytes", nbytes)
        return self.latency_ms + nbytes / (self.bandwidth_GBps * 1e6)  # GB/s = 1e6 bytes per ms

    def as_dict(self) -> dict[str, float]:
        """``{"latency_ms": ..., "bandwidth_GBps": ...}`` (JSON-friendly, for Timeline meta)."""
        return {"latency_ms": self.latency_ms, "bandwidth_GBps": self.bandwidth_GBps}

    def __str__(self) -> str:
        return f"Link(latency_ms={self.latency_ms:g}, bandwidth_GBps={self.bandwidth_GBps:g})"


def check_link(link: Any) -> Link | None:
    """Return ``link`` if it is a :class:`Link` or None; raise ``TypeError`` otherwise."""
    if link is not None and not isinstance(link, Link):
        raise TypeError(f"link must be a pipeswift_lab.Link or None; got {type(link).__name__} {link!r}")
    return link


__all__ = ["Link", "check_link", "fit_latency_bandwidth"]
