"""Planning: capacity within an SLO against replicas, bisected on the simulator, and the replicas a rate needs."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

from tritonllm.capacity.replay import Predicted, RequestSource, run_scheme
from tritonllm.capacity.simulator import REPOSITORY, SimRequest
from tritonllm.capacity.step_cost import StepCost
from tritonllm.capacity.validation import Calibration


@dataclass
class PlanPoint:
    scheme: str
    replicas: int
    capacity_rps: float  # the highest rate within the SLO found by bisection
    tokens_per_s: float | None
    cost_per_million: float | None


def meets(reqs: list[SimRequest], normalized_s: float, e2e_p90_s: float) -> bool:
    p = Predicted.of(reqs)
    return (p.answered == p.requests and p.normalized_latency is not None and p.e2e_p90 is not None
            and p.normalized_latency <= normalized_s and p.e2e_p90 <= e2e_p90_s)


def capacity_for(scheme: str, replicas: int, cost: StepCost, source: RequestSource, slo: tuple[float, float],
                 seconds: float, seed: int, routing: str, hint: float, overhead_s: float = 0.0,
                 repository: Path = REPOSITORY) -> tuple[float, float | None]:
    """Bisection on the offered rate: the highest that meets the SLO over `seconds` of arrivals."""
    def ok(rate: float) -> tuple[bool, float | None]:
        n = max(20, round(rate * seconds))
        reqs, _ = run_scheme(scheme, source.open_loop(rate, n, seed), cost, replicas, routing, overhead_s=overhead_s,
                             repository=repository)
        return meets(reqs, *slo), Predicted.of(reqs).tokens_per_s

    # A ladder of rates up from well below the hint: static batching can miss the SLO at low rates (its
    # batches wait out the queue delay) and meet it higher, so the search starts from the first rate that passes.
    lo = tps = None
    rate = max(hint, 0.05) / 32
    while rate <= max(hint, 0.05) * 64:
        good, t = ok(rate)
        if good:
            lo, tps = rate, t
        elif lo is not None:
            break
        rate *= 2
    if lo is None:
        return 0.0, None
    hi = rate
    for _ in range(6):
        mid = (lo + hi) / 2
        good, t = ok(mid)
        if good:
            lo, tps = mid, t
        else:
            hi = mid
    return lo, tps


def plan(cost: StepCost, calibrations: dict[str, Calibration], source: RequestSource, slo: tuple[float, float], rate: float,
         max_replicas: int, price_per_hour: float | None, seconds: float, seed: int, routing: str,
         repository: Path = REPOSITORY) -> dict:
    counts = [1]
    while counts[-1] < max_replicas:
        counts.append(min(counts[-1] * 2, max_replicas))
    curves, needed = {}, {}
    for scheme, cal in calibrations.items():
        points, hint = [], 1.0
        for r in counts:
            cap, tps = capacity_for(scheme, r, cal.cost(cost), source, slo, seconds, seed, routing, hint,
                                    cal.overhead_s, repository)
            hint = max(cap, 0.05) * 2
            money = (price_per_hour * r / 3600 / tps * 1e6) if price_per_hour is not None and tps else None
            points.append(PlanPoint(scheme, r, cap, tps, money))
        curves[scheme] = points
        per_replica = points[0].capacity_rps
        enough = [p for p in points if p.capacity_rps >= rate]
        needed[scheme] = (enough[0].replicas if enough else
                          (math.ceil(rate / per_replica) if per_replica > 0 else None))
    return {"slo": {"normalized_s": slo[0], "e2e_p90_s": slo[1]}, "rate": rate, "routing": routing,
            "replicas_needed": needed, "curves": {k: [asdict(p) for p in v] for k, v in curves.items()}}


def plan_markdown(result: dict) -> list[str]:
    md = [f"Target {result['rate']:g} req/s, SLO: mean normalized latency ≤ {result['slo']['normalized_s']:.3g} s/token "
          f"and p90 end-to-end ≤ {result['slo']['e2e_p90_s']:.3g} s; routing {result['routing']}.", "",
          "| scheme | replicas needed | " + " | ".join(f"capacity at {p['replicas']}" for p in
                                                       next(iter(result["curves"].values()))) + " |",
          "|---|---:|" + "---:|" * len(next(iter(result["curves"].values())))]
    for scheme, points in result["curves"].items():
        needed = result["replicas_needed"][scheme]
        md.append(f"| {scheme} | {needed if needed is not None else 'never: no rate met the SLO'} | "
                  + " | ".join(f"{p['capacity_rps']:.3g}" for p in points) + " |")
    if any(p["cost_per_million"] is not None for pts in result["curves"].values() for p in pts):
        md += ["", "| scheme | cost per million output tokens at capacity, by replicas |", "|---|---|"]
        for scheme, points in result["curves"].items():
            md.append(f"| {scheme} | " + ", ".join(f"{p['replicas']}: {p['cost_per_million']:.3g}"
                                                 for p in points if p["cost_per_million"] is not None) + " |")
    return md
