"""Validation: calibrate the simulator on a load test's closed-loop run, then predict its open-loop points."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from tritonllm.capacity.replay import SCHEMES, Predicted, RequestSource, run_scheme
from tritonllm.capacity.step_cost import StepCost
from tritonllm_loadtest.report import find_runs
from tritonllm_loadtest.summary import RunInfo, RunSummary, summarize_run_dir


@dataclass
class Calibration:
    """How the served system differs from the profile, per scheme: a factor on every step, and a fixed
    time each request spends outside the engine (client, gRPC, Triton, the stub, the response)."""

    scale: float = 1.0
    overhead_s: float = 0.0

    @classmethod
    def of(cls, row: dict) -> "Calibration":
        return cls(row.get("scale", 1.0), row.get("overhead_s", 0.0))


def calibrate(scheme: str, closed: RunSummary, info: RunInfo, cost: StepCost, source: RequestSource) -> Calibration:
    """On the closed-loop run: the step factor that makes the simulated run as fast as the measured one, then
    the per-request overhead that makes its median first token (end, for the batching models) as late."""
    users, total = info.concurrency, info.max_requests

    def closed_loop_run(c: StepCost) -> Predicted:
        first = [source.make(i, 0.0) for i in range(min(users, total))]
        return Predicted.of(run_scheme(scheme, first, c, users=users, source=source, total=total)[0])

    predicted = closed_loop_run(cost)
    if not closed.tokens_per_s or not predicted.tokens_per_s:
        return Calibration()
    scale = predicted.tokens_per_s / closed.tokens_per_s
    scaled = closed_loop_run(cost.scaled(scale))
    overhead = (closed.ttft_p50 - scaled.ttft_p50) if closed.ttft_p50 is not None and scaled.ttft_p50 is not None \
        else 0.0
    return Calibration(scale, max(0.0, overhead))


def _err(pred, meas) -> float | None:
    return None if pred is None or not meas else (pred - meas) / meas


def validate(results: Path, cost: StepCost, source: RequestSource, seed: int) -> dict:
    """Per scheme: calibrate on the closed-loop run, predict every open-loop point; errors per metric."""
    runs = [summarize_run_dir(d) for d in find_runs(results)]
    out = {"results": str(results), "profile": cost.source, "schemes": {}, "points": []}
    for scheme in SCHEMES:
        mine = [(info, s) for info, _, _, s in runs if info.scheme == scheme]
        closed = [(info, s) for info, s in mine if not info.arrival_rate]
        cal = calibrate(scheme, closed[0][1], closed[0][0], cost, source) if closed else Calibration()
        scaled = cost.scaled(cal.scale)
        out["schemes"][scheme] = asdict(cal)
        for info, s in sorted(mine, key=lambda x: x[0].arrival_rate):
            if not info.arrival_rate:
                continue
            reqs, _ = run_scheme(scheme, source.open_loop(info.arrival_rate, info.max_requests, seed), scaled,
                                 overhead_s=cal.overhead_s)
            p = Predicted.of(reqs)
            point = {"scheme": scheme, "rate": info.arrival_rate, "requests": info.max_requests}
            for name in ("tokens_per_s", "ttft_p50", "ttft_p90", "e2e_p90", "normalized_latency"):
                point[name] = {"predicted": getattr(p, name), "measured": getattr(s, name),
                               "error": _err(getattr(p, name), getattr(s, name))}
            out["points"].append(point)
    for scheme in SCHEMES:
        errors = [abs(pt[m]["error"]) for pt in out["points"] if pt["scheme"] == scheme
                  for m in ("tokens_per_s", "ttft_p50", "ttft_p90", "e2e_p90") if pt[m]["error"] is not None]
        if scheme in out["schemes"]:
            out["schemes"][scheme]["median_abs_error"] = float(np.median(errors)) if errors else None
    return out


def validation_markdown(v: dict) -> list[str]:
    md = [f"Profile: {v['profile']}. Results: `{v['results']}`.", "",
          "| scheme | calibration (on the closed-loop run) | median |error| over the points' tok/s, TTFT p50/p90, e2e p90 |",
          "|---|---:|---:|"]
    for scheme, row in v["schemes"].items():
        err = row.get("median_abs_error")
        md.append(f"| {scheme} | {row['scale']:.3g} × step, +{row['overhead_s'] * 1000:.0f} ms per request | "
                  f"{'–' if err is None else f'{err:.1%}'} |")
    md += ["", "| scheme | offered (req/s) | tok/s pred / meas | TTFT p50 (s) | TTFT p90 (s) | e2e p90 (s) | "
           "norm. latency (s/tok) |", "|---|---:|---|---|---|---|---|"]

    def cell(m):
        if m["predicted"] is None or m["measured"] is None:
            return "–"
        err = "" if m["error"] is None else f" ({m['error']:+.0%})"
        return f"{m['predicted']:.3g} / {m['measured']:.3g}{err}"
    for pt in v["points"]:
        md.append(f"| {pt['scheme']} | {pt['rate']:g} | {cell(pt['tokens_per_s'])} | {cell(pt['ttft_p50'])} | "
                  f"{cell(pt['ttft_p90'])} | {cell(pt['e2e_p90'])} | {cell(pt['normalized_latency'])} |")
    return md
