"""Validation: calibrate the simulator on a load test's closed-loop run, then predict its open-loop points."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from tritonllm.capacity.replay import SCHEMES, Predicted, RequestSource, run_scheme
from tritonllm.capacity.simulator import REPOSITORY, SimRequest
from tritonllm.capacity.step_cost import StepCost
from tritonllm_loadtest.report import find_runs
from tritonllm_loadtest.samples import Sample
from tritonllm_loadtest.summary import RunInfo, RunSummary, summarize_run_dir


@dataclass
class Calibration:
    """How the served system differs from the profile, per scheme: a factor on every step (the engine's own
    work around the forward, the load generator on the same cores), a time per row of a step (each row's
    response: the stub, Triton, the stream), and a fixed time each request spends outside the engine
    (client, gRPC, Triton)."""

    scale: float = 1.0
    per_row_s: float = 0.0
    overhead_s: float = 0.0

    @classmethod
    def of(cls, row: dict) -> "Calibration":
        return cls(row.get("scale", 1.0), row.get("per_row_s", 0.0), row.get("overhead_s", 0.0))

    def cost(self, profile: StepCost) -> StepCost:
        return profile.scaled(self.scale, self.per_row_s)


MIN_GAPS = 5  # token gaps at one streaming count for it to take part in the step fit


def gaps_by_streaming(requests: list[tuple[float, list[float]]], end_of: list[float]) -> dict[int, list[float]]:
    """Gaps between a request's consecutive tokens, by how many requests were streaming (between their first
    token and their end) in the middle of the gap. requests: (first token time, later token times)."""
    spans = sorted(zip([first for first, _ in requests], end_of))
    out: dict[int, list[float]] = {}
    for first, later in requests:
        previous = first
        for t in later:
            middle = (previous + t) / 2
            streaming = sum(1 for a, b in spans if a <= middle <= b)
            out.setdefault(streaming, []).append(t - previous)
            previous = t
    return out


def measured_gaps(samples: list[Sample]) -> dict[int, list[float]]:
    ok = [s for s in samples if s.ok and s.ttft is not None]
    requests = [(s.start + s.ttft, list(np.cumsum(s.itl) + s.start + s.ttft)) for s in ok]
    return gaps_by_streaming(requests, [s.end for s in ok])


def simulated_gaps(reqs: list[SimRequest]) -> dict[int, list[float]]:
    ok = [r for r in reqs if r.e2e is not None and r.token_times]
    return gaps_by_streaming([(r.token_times[0], r.token_times[1:]) for r in ok], [r.token_times[-1] for r in ok])


def fit_steps(measured: dict[int, list[float]], simulated: dict[int, list[float]]) -> tuple[float, float] | None:
    """(a, c) with a served step of k rows = a x simulated step + c x k, from the median gap at each
    streaming count k that both have (least squares weighted by the measured gaps); None when fewer than
    two counts or a <= 0; c < 0 (a row costing less than nothing) gives the best a with c = 0."""
    points = [(float(np.median(simulated[k])), k, float(np.median(measured[k])), len(measured[k]))
              for k in measured if len(measured[k]) >= MIN_GAPS and len(simulated.get(k, ())) >= MIN_GAPS]
    if len(points) < 2:
        return None
    x, k, y, w = (np.array(v, dtype=float) for v in zip(*points))
    root = np.sqrt(w)
    (a, c), *_ = np.linalg.lstsq(np.stack([x, k], axis=1) * root[:, None], y * root, rcond=None)
    if c < 0:
        a, c = float(np.sum(w * x * y) / np.sum(w * x * x)), 0.0
    return (float(a), float(c)) if a > 0 else None


ENGINE_TTFT = "tritonllm_time_to_first_token_seconds"  # the in-flight engine's own histogram (_sum, _count)
TRITON_TIMES = ("nv_inference_queue_duration_us", "nv_inference_compute_infer_duration_us")  # per request, summed


def _delta(scrapes: list[dict], metric: str, model: str) -> float | None:
    """How much a counter of `model` grew between the first and the last scrape (None if not scraped)."""
    def value(row: dict) -> float | None:
        found = [v for k, v in row.get("values", {}).items()
                 if k.startswith(metric + "{") and f'model="{model}"' in k]
        return sum(found) if found else None
    first, last = value(scrapes[0]), value(scrapes[-1])
    return None if first is None or last is None else last - first


def hop_time(samples: list[Sample], scrapes: list[dict], model: str, streams: bool = True) -> float | None:
    """What the clients waited beyond the server's own time (client, gRPC, Triton's front end, the
    stub): for a streaming model the clients' mean first token less the engine's own (its TTFT
    histogram), else their mean answer less Triton's queue and compute time per request; both from
    the metrics scraped before and after the run. None without them, or when they saw fewer than half
    the run's requests."""
    if len(scrapes) < 2:
        return None
    if streams:
        total, count = _delta(scrapes, ENGINE_TTFT + "_sum", model), _delta(scrapes, ENGINE_TTFT + "_count", model)
        client = [s.ttft for s in samples if s.ok and s.ttft is not None]
    else:
        times = [_delta(scrapes, metric, model) for metric in TRITON_TIMES]
        total = None if None in times else sum(times) / 1e6
        count = _delta(scrapes, "nv_inference_request_success", model)
        client = [s.e2e for s in samples if s.ok and s.e2e is not None]
    if total is None or not count or not client or count < len(client) / 2:
        return None
    return max(0.0, sum(client) / len(client) - total / count)


def calibrate(scheme: str, closed: RunSummary, info: RunInfo, samples: list[Sample], cost: StepCost,
              source: RequestSource, repository: Path = REPOSITORY, hop_s: float | None = None) -> Calibration:
    """On the closed-loop run alone (the open-loop points stay the validation): the factor that makes the
    simulated run as fast as the measured one; for in-flight, which streams, then a factor and a time per
    row from the gaps between its tokens by how many requests were streaming, measured against simulated
    (the run's drain gives the steps of few rows); then the time per request outside the engine that makes
    the median first token (end, for the batching models) as late. A closed loop shows that time only in
    part: a user's next request waits for a step to end either way, so most of it hides in that wait; where
    the server's own times were scraped (`hop_s`: `hop_time`), that time is measured instead: fitted on
    in-flight's closed-loop median first token it came out 27 ms where 13 were measured, and every first
    token at low load was predicted that much late."""
    users, total = info.concurrency, info.max_requests

    def closed_loop_run(cal: Calibration) -> list[SimRequest]:
        first = [source.make(i, 0.0) for i in range(min(users, total))]
        return run_scheme(scheme, first, cal.cost(cost), users=users, source=source, total=total,
                          overhead_s=cal.overhead_s, record_tokens=True, repository=repository)[0]

    cal = Calibration()
    predicted = Predicted.of(closed_loop_run(cal))
    if not closed.tokens_per_s or not predicted.tokens_per_s:
        return cal
    cal.scale = predicted.tokens_per_s / closed.tokens_per_s
    if scheme != "inflight" and cal.scale > 1:
        # No stream to show the steps: what the served run lacks is priced per row (the stub's work on
        # every row of a batch, its padding included), which leaves a batch of one as the profile says.
        def tokens_per_s(per_row_s: float) -> float:
            return Predicted.of(closed_loop_run(Calibration(1.0, per_row_s))).tokens_per_s or 0.0
        lo, hi = 0.0, 0.05
        for _ in range(14):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if tokens_per_s(mid) > closed.tokens_per_s else (lo, mid)
        cal.scale, cal.per_row_s = 1.0, lo
    if scheme == "inflight":
        measured = measured_gaps(samples)
        for _ in range(2):  # the fit moves the schedule a little: fit again on the fitted one
            fit = fit_steps(measured, simulated_gaps(closed_loop_run(cal)))
            if fit is None:
                break
            a, c = fit
            cal.scale, cal.per_row_s = a * cal.scale, a * cal.per_row_s + c
    if hop_s is not None:
        cal.overhead_s = hop_s
        return cal
    for _ in range(2):  # the time outside the engine also delays each closed-loop user's next request
        got = Predicted.of(closed_loop_run(cal)).ttft_p50
        if closed.ttft_p50 is None or got is None:
            break
        cal.overhead_s = max(0.0, cal.overhead_s + closed.ttft_p50 - got)
    return cal


ERROR_METRICS = ("tokens_per_s", "ttft_p50", "ttft_p90", "e2e_p90")  # what a point's error is the median of


def _err(pred, meas) -> float | None:
    return None if pred is None or not meas else (pred - meas) / meas


def validate(results: Path, cost: StepCost, source: RequestSource, seed: int, repository: Path = REPOSITORY) -> dict:
    """Per scheme: calibrate on the closed-loop run, predict every open-loop point; errors per metric."""
    runs = [summarize_run_dir(d) for d in find_runs(results)]
    out = {"results": str(results), "profile": cost.source, "repository": str(repository), "schemes": {}, "points": []}
    for scheme in SCHEMES:
        mine = [(info, s) for info, _, _, s in runs if info.scheme == scheme]
        closed = [(info, samples, scrapes, s) for info, samples, scrapes, s in runs
                  if info.scheme == scheme and not info.arrival_rate]
        if closed:
            info, samples, scrapes, s = closed[0]
            hop_s = hop_time(samples, scrapes, info.model, streams=scheme == "inflight")
            cal = calibrate(scheme, s, info, samples, cost, source, repository, hop_s)
        else:
            cal = Calibration()
        scaled = cal.cost(cost)
        out["schemes"][scheme] = asdict(cal)
        saturation = closed[0][3].requests_per_s if closed else None  # what the closed loop sustained
        for info, s in sorted(mine, key=lambda x: x[0].arrival_rate):
            if not info.arrival_rate:
                continue
            reqs, _ = run_scheme(scheme, source.open_loop(info.arrival_rate, info.max_requests, seed), scaled,
                                 overhead_s=cal.overhead_s, repository=repository)
            p = Predicted.of(reqs)
            point = {"scheme": scheme, "rate": info.arrival_rate, "requests": info.max_requests,
                     "below_saturation": saturation is not None and info.arrival_rate < saturation}
            for name in ("tokens_per_s", "ttft_p50", "ttft_p90", "e2e_p90", "normalized_latency"):
                point[name] = {"predicted": getattr(p, name), "measured": getattr(s, name),
                               "error": _err(getattr(p, name), getattr(s, name))}
            errors = [abs(point[m]["error"]) for m in ERROR_METRICS if point[m]["error"] is not None]
            point["median_abs_error"] = float(np.median(errors)) if errors else None
            out["points"].append(point)
    for scheme in SCHEMES:
        errors = [abs(pt[m]["error"]) for pt in out["points"] if pt["scheme"] == scheme
                  for m in ERROR_METRICS if pt[m]["error"] is not None]
        below = [pt["median_abs_error"] for pt in out["points"] if pt["scheme"] == scheme and pt["below_saturation"]
                 and pt["median_abs_error"] is not None]
        if scheme in out["schemes"]:
            out["schemes"][scheme]["median_abs_error"] = float(np.median(errors)) if errors else None
            out["schemes"][scheme]["worst_point_below_saturation"] = max(below) if below else None
    return out


def validation_markdown(v: dict) -> list[str]:
    md = [f"Profile: {v['profile']}. Results: `{v['results']}`.", "",
          "| scheme | calibration (on the closed-loop run) | median |error| over the points' tok/s, TTFT p50/p90, "
          "e2e p90 | worst point below saturation |",
          "|---|---:|---:|---:|"]

    def share(x):
        return "–" if x is None else f"{x:.1%}"
    for scheme, row in v["schemes"].items():
        md.append(f"| {scheme} | {row['scale']:.3g} × step + {row.get('per_row_s', 0.0) * 1000:.2f} ms a row, "
                  f"+{row['overhead_s'] * 1000:.0f} ms per request | {share(row.get('median_abs_error'))} | "
                  f"{share(row.get('worst_point_below_saturation'))} |")
    md += ["", "| scheme | offered (req/s) | tok/s pred / meas | TTFT p50 (s) | TTFT p90 (s) | e2e p90 (s) | "
           "norm. latency (s/tok) | point error |", "|---|---:|---|---|---|---|---|---:|"]

    def cell(m):
        if m["predicted"] is None or m["measured"] is None:
            return "–"
        err = "" if m["error"] is None else f" ({m['error']:+.0%})"
        return f"{m['predicted']:.3g} / {m['measured']:.3g}{err}"
    for pt in v["points"]:
        md.append(f"| {pt['scheme']} | {pt['rate']:g} | {cell(pt['tokens_per_s'])} | {cell(pt['ttft_p50'])} | "
                  f"{cell(pt['ttft_p90'])} | {cell(pt['e2e_p90'])} | {cell(pt['normalized_latency'])} | "
                  f"{share(pt.get('median_abs_error'))}{'' if pt.get('below_saturation') else ' (past saturation)'} |")
    return md
