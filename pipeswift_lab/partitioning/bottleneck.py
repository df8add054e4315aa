"""The exact contiguous min-max (bottleneck) split behind ``partition(method="balanced")``.

Splits costs ``cost(a, b) = U[b] - D[a]`` of layer ranges ``[a, b)`` into ``K`` contiguous
stages minimizing the largest stage cost (the linear-partition problem, Bokhari, IEEE
Trans. Computers 1988): a bisection over the bottleneck ``T`` whose feasibility test is a
reachability DP over prefixes, ``O(K * L)`` numpy work per test, optionally with a smallest
allowed stage start per end (memory caps). See :mod:`pipeswift_lab.partitioning.balance`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["Infeasible", "MinMaxSplit", "window_max"]


class Infeasible(Exception):
    """No split meets the memory cap."""


class MinMaxSplit:
    """Exact contiguous min-max split of costs ``cost(a, b) = U[b] - D[a]`` into ``K`` stages.

    ``lo_by_k`` (optional) gives, per stage index, the smallest start ``a`` allowed for each
    end ``b`` (memory caps: a stage's memory grows as its start moves left).
    """

    def __init__(self, U: np.ndarray, D: np.ndarray, K: int, lo_by_k: Sequence[np.ndarray] | None = None) -> None:
        self.U, self.D, self.K = U, D, K
        self.lo_by_k = lo_by_k
        self.n1 = len(U)
        self.idx = np.arange(self.n1)
        # Without transfers D is a prefix sum of non-negative times: the largest D over a window of
        # reachable starts is D at the last reachable start, so no range-maximum structure is needed.
        self.monotone = bool(np.all(np.diff(D) >= 0))

    def _best_prev(self, reach_prev: np.ndarray, k: int) -> np.ndarray:
        """For every end b: the largest ``D[a]`` over reachable starts a < b allowed for stage k."""
        if self.lo_by_k is None:
            Dm = np.where(reach_prev, self.D, -np.inf)
            out = np.empty(self.n1)
            out[0] = -np.inf
            np.maximum.accumulate(Dm[:-1], out=out[1:])
            return out
        if self.monotone:
            last = np.where(reach_prev, self.idx, -1)
            np.maximum.accumulate(last, out=last)
            prev = np.empty(self.n1, dtype=np.int64)  # prev[b]: the last reachable start a < b (-1: none)
            prev[0] = -1
            prev[1:] = last[:-1]
            return np.where((prev >= 0) & (prev >= self.lo_by_k[k]), self.D[prev], -np.inf)
        return window_max(np.where(reach_prev, self.D, -np.inf), self.lo_by_k[k], self.idx)

    def reach(self, T: float) -> np.ndarray | None:
        """Reachability table ``reach[k][b]``: layers ``[0, b)`` split into k stages of cost <= T; None if
        infeasible."""
        reach = np.zeros((self.K + 1, self.n1), dtype=bool)
        reach[0, 0] = True
        for k in range(1, self.K + 1):
            best = self._best_prev(reach[k - 1], k - 1)
            reach[k] = (self.U - best) <= T
            reach[k, 0] = False
        return reach if reach[self.K, self.n1 - 1] else None

    def backtrack(self, reach: np.ndarray, T: float) -> tuple[tuple[int, int], ...]:
        """Bounds of a split with cost <= T, each stage as close as possible to the mean of what precedes it."""
        b = self.n1 - 1
        bounds: list[tuple[int, int]] = []
        for k in range(self.K, 0, -1):
            cand = reach[k - 1].copy()
            cand[b:] = False
            if self.lo_by_k is not None:
                cand[: self.lo_by_k[k - 1][b]] = False
            cost = self.U[b] - self.D
            cand &= cost <= T
            target = (self.U[b] - self.D[0]) / k
            score = np.where(cand, np.abs(cost - target), np.inf)
            a = int(np.argmin(score))
            if not cand[a]:  # pragma: no cover - reach guarantees a candidate
                raise RuntimeError("internal error: backtracking found no stage start")
            bounds.append((a, b))
            b = a
        bounds.reverse()
        return tuple(bounds)

    def max_cost(self, bounds: Sequence[tuple[int, int]]) -> float:
        """The largest stage cost of ``bounds``."""
        return max(float(self.U[b] - self.D[a]) for a, b in bounds)

    def solve(self) -> tuple[tuple[tuple[int, int], ...], float]:
        """Return ``(bounds, bottleneck)`` of an optimal split; raise :class:`Infeasible` if none exists."""
        hi_T = float(np.max(self.U) - np.min(self.D))
        reach = self.reach(hi_T)
        if reach is None:
            raise Infeasible
        best = self.backtrack(reach, hi_T)
        hi = self.max_cost(best)
        lo = -1.0  # costs are >= 0, so a bottleneck of -1 is infeasible
        settled = self._none_below(hi)
        while True:
            below = float(np.nextafter(hi, -np.inf))
            if settled or below <= lo:
                return best, hi  # nothing strictly between an infeasible lo and hi: hi is optimal
            mid = lo + (hi - lo) / 2
            if not (lo < mid < hi):
                mid = below
            reach = self.reach(mid)
            if reach is None:
                lo = mid
            else:
                best = self.backtrack(reach, mid)
                hi = self.max_cost(best)
                settled = self._none_below(hi)

    def _none_below(self, hi: float) -> bool:
        """Whether no bottleneck below ``hi`` is feasible. The reachability changes only where ``T`` passes a stage
        cost, so testing the largest stage cost below ``hi`` tells: when it fails, so would every test the
        bisection has left, and its answer stays as it is (hundreds of float halvings saved)."""
        costs = self.U[None, :] - self.D[:, None]  # costs[a, b]: of the stage [a, b) when a < b
        below = costs[(costs < hi) & (self.idx[:, None] < self.idx[None, :])]
        return len(below) == 0 or self.reach(float(below.max())) is None


def window_max(x: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """``max(x[lo[b]:hi[b]])`` for every b (``-inf`` for empty windows), with a sparse table."""
    n = len(x)
    levels = [x]
    width = 1
    while 2 * width <= n:
        prev = levels[-1]
        nxt = np.full(n, -np.inf)
        nxt[: n - width] = np.maximum(prev[: n - width], prev[width:])
        levels.append(nxt)
        width *= 2
    table = np.stack(levels)
    length = hi - lo
    ok = length > 0
    j = np.zeros(n, dtype=np.int64)
    j[ok] = np.floor(np.log2(length[ok])).astype(np.int64)
    span = np.left_shift(1, j)
    left = np.where(ok, lo, 0)
    right = np.where(ok, hi - span, 0)
    out = np.maximum(table[j, left], table[j, right])
    out[~ok] = -np.inf
    return out
