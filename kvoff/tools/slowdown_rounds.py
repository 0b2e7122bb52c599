"""The rounds of a slowdown measurement and what they say: ``kvoff bench transfer``'s
``gemm_slowdown`` (how much slower a GEMM runs while KV blocks move).

A slowdown is measured as interleaved rounds, each timing the work alone and with the transfers,
the order alternating from round to round so that a slow drift of the machine cancels
(:func:`interleaved_slowdowns`). The rounds are summarized by their median, interquartile range,
the median's distribution-free 95 % confidence half-width (order statistics: W. J. Conover,
*Practical Nonparametric Statistics*, 3rd ed., 1999, §3.2), and how many rounds that half-width
needed to fall below :data:`SLOWDOWN_HALF_WIDTH_TARGET` (:func:`summarize_slowdowns`). Pure
Python, no GPU: the timings are the caller's.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = [
    "GEMM_ROUNDS",
    "SLOWDOWN_HALF_WIDTH_TARGET",
    "SlowdownSummary",
    "check_rounds",
    "interleaved_slowdowns",
    "median_half_width",
    "rounds_needed",
    "summarize_slowdowns",
]

GEMM_ROUNDS = 9
"""Default rounds of the GEMM-slowdown measurement (``TransferBenchParams.gemm_rounds``): odd,
so the median is one measured round, and at least 6, the fewest for which a 95 % distribution-free
interval of the median exists (:func:`median_half_width`)."""

SLOWDOWN_HALF_WIDTH_TARGET = 0.01
"""The 95 % confidence half-width of the median slowdown (a fraction: 0.01 = 1 percentage point)
below which a slowdown can be told apart from the 3 % budget (``compute_slowdown_budget``,
:data:`kvoff.transfer.DEFAULT_COMPUTE_SLOWDOWN_BUDGET`)."""


def interleaved_slowdowns(
    alone: Callable[[], float], with_transfers: Callable[[], float], rounds: int
) -> list[float]:
    """Per-round slowdowns of ``rounds`` interleaved rounds: ``with / alone − 1`` (a fraction;
    0.05 = 5 % slower with the transfers).

    Round ``k`` calls ``alone()`` then ``with_transfers()`` when ``k`` is even, and the other way
    round when ``k`` is odd, so a slow drift of the machine (clocks, temperature) that adds to the
    second timing of a round adds to ``with`` and to ``alone`` equally often and cancels in the
    median instead of biasing every round the same way.

    Args:
        alone: times the work alone; returns seconds (> 0, finite).
        with_transfers: times the same work while transfers run; returns seconds (> 0, finite).
        rounds: rounds to run (>= 1).

    Returns:
        ``rounds`` slowdowns (fractions), in round order.

    Raises:
        ValueError: ``rounds`` < 1 (or not an integer), or a callable returned a time that is not
            a positive finite number of seconds.
    """
    check_rounds(rounds, "rounds")
    out = []
    for k in range(rounds):
        if k % 2 == 0:
            a = alone()
            w = with_transfers()
        else:
            w = with_transfers()
            a = alone()
        for name, t in (("alone", a), ("with_transfers", w)):
            if not (isinstance(t, int | float) and math.isfinite(t) and t > 0):
                raise ValueError(
                    f"round {k}: {name}() returned {t!r}; it must return the seconds the work "
                    "took, a finite number > 0"
                )
        out.append(w / a - 1)
    return out


def check_rounds(rounds: object, name: str) -> None:
    """Raises ValueError naming ``name`` unless ``rounds`` is an integer >= 1."""
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(
            f"{name}={rounds!r}: the GEMM slowdown needs at least one round of one 'alone' and "
            "one 'with transfers' timing; pass an integer >= 1 (TransferBenchParams.gemm_rounds, "
            f"--gemm-rounds; default {GEMM_ROUNDS})"
        )


def _median_interval_rank(n: int, confidence: float) -> int | None:
    """The rank ``j`` (1-based) of the distribution-free interval ``[x_(j), x_(n+1-j)]`` of the
    median of ``n`` samples with coverage >= ``confidence``: the largest ``j`` with
    ``2 · P(B <= j − 1) <= 1 − confidence``, ``B ~ Binomial(n, 1/2)``; None when even
    ``[x_(1), x_(n)]`` covers less (W. J. Conover, *Practical Nonparametric Statistics*, 3rd ed.,
    1999, §3.2, confidence interval for a quantile)."""
    alpha = 1.0 - confidence
    rank = None
    below = 0  # sum of C(n, i) for i < j
    for j in range(1, (n + 1) // 2 + 1):
        below += math.comb(n, j - 1)
        if 2 * below / 2**n > alpha:
            break
        rank = j
    return rank


def median_half_width(values: Sequence[float], confidence: float = 0.95) -> float | None:
    """Half the width of a distribution-free ``confidence`` interval of the median of ``values``
    (in the values' unit), or None when there are too few values for one (fewer than 6 at 95 %).

    The interval is ``[x_(j), x_(n+1-j)]`` of the sorted values with the largest ``j`` such that
    ``1 − 2 · P(B <= j − 1) >= confidence``, ``B ~ Binomial(n, 1/2)`` (the order-statistic
    interval: W. J. Conover, *Practical Nonparametric Statistics*, 3rd ed., 1999, §3.2); it
    assumes only independent rounds of one continuous distribution, no normality. The half-width
    is ``(x_(n+1-j) − x_(j)) / 2`` (the interval need not be symmetric about the median).

    Raises:
        ValueError: ``confidence`` not strictly between 0 and 1.
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence!r}: give a fraction between 0 and 1, e.g. 0.95")
    j = _median_interval_rank(len(values), confidence)
    if j is None:
        return None
    xs = sorted(values)
    return (xs[len(xs) - j] - xs[j - 1]) / 2


def rounds_needed(
    values: Sequence[float],
    target: float = SLOWDOWN_HALF_WIDTH_TARGET,
    confidence: float = 0.95,
) -> int | None:
    """The fewest first rounds ``n`` of ``values`` (in round order) whose median has a
    :func:`median_half_width` below ``target``, or None when no prefix up to ``len(values)``
    gets there.

    Raises:
        ValueError: ``target`` <= 0, or ``confidence`` not strictly between 0 and 1.
    """
    if not target > 0:
        raise ValueError(f"target={target!r}: give a half-width > 0, e.g. 0.01 (1 %)")
    for n in range(1, len(values) + 1):
        hw = median_half_width(values[:n], confidence)
        if hw is not None and hw < target:
            return n
    return None


@dataclass(frozen=True)
class SlowdownSummary:
    """The rounds of one GEMM-slowdown measurement and what they say (all fractions: 0.05 = 5 %).

    Attributes:
        rounds: per-round slowdowns, ``with / alone − 1``, in round order.
        median: their median (what ``gemm_slowdown`` reports).
        spread: their interquartile range, Q3 − Q1 (quartiles by linear interpolation between
            order statistics: :func:`statistics.quantiles` ``method="inclusive"``, numpy's
            default percentile); 0 for one round.
        half_width: the 95 % confidence half-width of the median (:func:`median_half_width`),
            None for fewer than 6 rounds.
        rounds_needed: :func:`rounds_needed` for :data:`SLOWDOWN_HALF_WIDTH_TARGET` at 95 %.
    """

    rounds: tuple[float, ...]
    median: float
    spread: float
    half_width: float | None
    rounds_needed: int | None


def summarize_slowdowns(
    values: Sequence[float],
    target: float = SLOWDOWN_HALF_WIDTH_TARGET,
    confidence: float = 0.95,
) -> SlowdownSummary:
    """Median, interquartile range, median's confidence half-width and rounds needed of the
    per-round slowdowns ``values`` (fractions, from :func:`interleaved_slowdowns`).

    Raises:
        ValueError: no values, a value that is not finite, ``target`` <= 0 or ``confidence``
            not strictly between 0 and 1.
    """
    if len(values) == 0:
        raise ValueError("no rounds to summarize: run at least one round (gemm_rounds >= 1)")
    bad = [v for v in values if not math.isfinite(v)]
    if bad:
        raise ValueError(f"slowdown rounds must be finite numbers; got {bad[0]!r} in {values!r}")
    if len(values) >= 2:
        q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
        spread = q3 - q1
    else:
        spread = 0.0
    return SlowdownSummary(
        rounds=tuple(float(v) for v in values),
        median=float(statistics.median(values)),
        spread=spread,
        half_width=median_half_width(values, confidence),
        rounds_needed=rounds_needed(values, target, confidence),
    )
