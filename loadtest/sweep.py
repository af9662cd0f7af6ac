"""The open-loop sweep: which rates to offer, the SLO, and each scheme's capacity under it.

Rates are fractions of a measured saturation throughput (the closed-loop point's best req/s), so
the sweep spans "well below" to "past" saturation on any machine. A point meets the SLO when every
planned request was answered (no error, none cut off or left unsent), the server kept up
(summary.keeping_up: a queue that grows is not a met point, however short the window) and both its mean normalized latency (end-to-end / output tokens, as the Orca and
vLLM papers plot it) and its p90 end-to-end latency are within the limits. Capacity is the highest
offered rate that meets the SLO, interpolated towards the next (failing) rate on a log scale of the
worst ratio; a scheme that met every rate gets more rates (`next_rate`) until one fails, so each
capacity lies between a met and a missed rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tritonllm_loadtest.summary import KEEP_UP, RunSummary  # noqa: F401 (KEEP_UP: the report's)

LOWEST, HIGHEST = 0.1, 1.6  # of the saturation probe's throughput: well below it to past it
SLO_SLACK = 1.5  # the automatic SLO: this many times the worst scheme's value at the lowest rate
EXTEND = 1.6  # a scheme that met every rate is offered this many times the highest next
DRAIN_SLACK = 2.0  # a late request may wait for a running batch about as long as itself, then run


def auto_rates(saturation_rps: float, points: int = 5) -> list[float]:
    """`points` rates (req/s) spaced evenly on a log scale from 0.1x to 1.6x the saturation throughput
    (the default five: 0.1, 0.2, 0.4, 0.8, 1.6), rounded to 3 significant digits for readable run names.
    The closed-loop probe runs 8 users for a few dozen requests and ends in a drain, so it reads below
    what a scheme sustains with a queue: the top rate is well past it."""
    if saturation_rps <= 0:
        raise ValueError("the saturation throughput must be > 0 to set the sweep's rates")
    if points < 1:
        raise ValueError("a sweep needs at least one point")
    step = (HIGHEST / LOWEST) ** (1 / (points - 1)) if points > 1 else 1.0
    return [float(f"{LOWEST * step ** i * saturation_rps:.3g}") for i in range(points)]


def point_requests(rate: float, window_s: float, minimum: int) -> int:
    """Requests of one point: the arrivals expected in the window, at least `minimum`."""
    return max(minimum, round(rate * window_s))


def drain_seconds(longest_tokens: int, step_s: float | None, minimum: float) -> float:
    """How long a point may run past its last arrival: `minimum`, or DRAIN_SLACK x its longest request's
    tokens x the slowest scheme's measured time per step where that is longer. A request still running
    then is cut off and misses the point, so the bound must not be what misses it on a slow CPU."""
    return max(minimum, DRAIN_SLACK * longest_tokens * step_s) if step_s else minimum


@dataclass(frozen=True)
class Slo:
    normalized_s: float  # mean end-to-end / output tokens (s per token)
    e2e_p90_s: float
    how: str  # how the limits were chosen, for the report

    def ratio(self, s: RunSummary) -> float:
        """max(value / limit) over the two limits and the keep-up rule: <= 1 meets them all; inf when a
        request went unanswered."""
        if not complete(s) or s.normalized_latency is None or s.e2e_p90 is None:
            return math.inf
        ratio = max(s.normalized_latency / self.normalized_s, s.e2e_p90 / self.e2e_p90_s)
        floor = s.keep_up_floor_rps or 0.0
        behind = math.inf if floor and not s.sustained_rps else floor / s.sustained_rps if floor else 0.0
        return max(ratio, behind) if behind > 1 else ratio  # falling behind misses; keeping up adds nothing

    def met(self, s: RunSummary) -> bool:
        return self.ratio(s) <= 1.0


def complete(s: RunSummary) -> bool:
    """Every planned request answered: no error, none cut off by the time bound, none left unsent."""
    planned = s.planned or s.finished
    return s.errors == 0 and s.interrupted == 0 and s.ok >= planned > 0


def choose_slo(lowest: list[RunSummary], normalized_s: float | None = None, e2e_p90_s: float | None = None) -> Slo:
    """The given limits; a missing one is SLO_SLACK x the worst scheme's value at the lowest rate (so that
    every scheme meets it at low load: static batching's wait for a full batch sets the bar)."""
    how = []
    if normalized_s is None or e2e_p90_s is None:
        usable = [s for s in lowest if complete(s) and s.normalized_latency is not None and s.e2e_p90 is not None]
        if not usable:
            raise ValueError("no scheme answered every request at the lowest rate: give the SLO limits")
        rate = lowest[0].arrival_rate
        if normalized_s is None:
            worst = max(usable, key=lambda s: s.normalized_latency)
            normalized_s = SLO_SLACK * worst.normalized_latency
            how.append(f"normalized latency {SLO_SLACK:g} x {worst.scheme}'s at {rate:g} req/s")
        if e2e_p90_s is None:
            worst = max(usable, key=lambda s: s.e2e_p90)
            e2e_p90_s = SLO_SLACK * worst.e2e_p90
            how.append(f"p90 end-to-end {SLO_SLACK:g} x {worst.scheme}'s at {rate:g} req/s")
    return Slo(normalized_s, e2e_p90_s, "; ".join(how) or "given")


@dataclass(frozen=True)
class Capacity:
    scheme: str
    rate: float | None  # req/s; None when even the lowest rate missed the SLO
    bound: str  # "=" between a met and a missed rate, ">=" no rate missed, "<" none was met
    lowest_rate: float

    def __str__(self) -> str:
        if self.rate is None:
            return f"< {self.lowest_rate:.3g} req/s"
        return f"{'≥ ' if self.bound == '>=' else ''}{self.rate:.3g} req/s"


def next_rate(points: list[RunSummary], slo: Slo) -> float | None:
    """The rate to offer a scheme next: EXTEND x its highest when it met every rate so far, else None."""
    if not points or capacity(points, slo).bound != ">=":
        return None
    return float(f"{EXTEND * max(s.arrival_rate for s in points):.3g}")


def capacity(points: list[RunSummary], slo: Slo) -> Capacity:
    """The highest rate of one scheme's points that meets the SLO, interpolated towards the next rate."""
    points = sorted(points, key=lambda s: s.arrival_rate)
    if not points:
        raise ValueError("no points")
    ratios = [slo.ratio(s) for s in points]
    passing = [i for i, r in enumerate(ratios) if r <= 1.0]
    scheme, lowest = points[0].scheme, points[0].arrival_rate
    if not passing:
        return Capacity(scheme, None, "<", lowest)
    i = passing[-1]
    if i == len(points) - 1:
        return Capacity(scheme, points[i].arrival_rate, ">=", lowest)
    r0, r1 = points[i].arrival_rate, points[i + 1].arrival_rate
    x0, x1 = ratios[i], ratios[i + 1]
    if math.isinf(x1) or x0 <= 0:  # nothing to interpolate on: the last passing rate
        return Capacity(scheme, r0, "=", lowest)
    t = (0.0 - math.log(x0)) / (math.log(x1) - math.log(x0))
    return Capacity(scheme, r0 + (r1 - r0) * t, "=", lowest)
