"""`tritonllm-simulate`: capacity planning past one machine, from the real schedulers and measured step costs.

    tritonllm-bench-engine --profile-steps profile.json                # once per machine (and model)
    tritonllm-simulate --profile profile.json --validate results/<run> # predicted vs measured, per point
    tritonllm-simulate --profile profile.json --rate 50 --slo-e2e-p90 10 --slo-normalized 0.2 \
        --calibration results/<run>/simulation.json --price-per-hour 2.5   # replicas for 50 req/s

Validation replays a `tritonllm-compare` results directory: the same seeded workload and arrival
times, each scheme's requests through the simulated schemes. The step costs of the profile are
the runner's forward alone; the served system adds Triton, the Python stub, streaming and the
load generator on the same machine, so one factor per scheme is calibrated on the closed-loop run
(simulated time per step = measured) and the open-loop points are the validation.

Planning finds, per scheme, the smallest replica count that carries `--rate` within the SLO, and
capacity (req/s within the SLO) against replicas, up to `--max-replicas`.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from tritonllm_loadtest.arrivals import ArrivalSchedule
from tritonllm_loadtest.report import ReportSettings, SweepResult, find_runs
from tritonllm_loadtest.simulator import SimRequest, closed_loop, make_replicas, simulate
from tritonllm_loadtest.step_cost import StepCost
from tritonllm_loadtest.summary import RunInfo, RunSummary, percentile, summarize_run_dir
from tritonllm_loadtest.workload import DEFAULT_OUTPUT_TOKENS, DEFAULT_PROMPT_WORDS, LengthDist, Workload, load_prompts

SCHEMES = ("inflight", "dynamic", "static")


class RequestSource:
    """Request i of the load test's workload as the simulator needs it: prompt tokens and max_tokens."""

    def __init__(self, workload: Workload, tokenizer=None):
        self.workload, self.tokenizer = workload, tokenizer
        self._prompt_tokens: dict[str, int] = {}

    def make(self, index: int, arrival: float) -> SimRequest:
        spec = self.workload.request(index)
        return SimRequest(index, arrival, self.prompt_tokens(spec.prompt), spec.max_tokens)

    def prompt_tokens(self, prompt: str) -> int:
        if prompt not in self._prompt_tokens:  # the engine encodes the prompt as given (llm_engine.add_request)
            self._prompt_tokens[prompt] = (len(self.tokenizer.encode(prompt)) if self.tokenizer is not None
                                           else max(1, round(1.3 * len(prompt.split()))))
        return self._prompt_tokens[prompt]

    def open_loop(self, rate: float, n: int, seed: int) -> list[SimRequest]:
        schedule = ArrivalSchedule(rate, seed)
        return [self.make(i, schedule.at(i)) for i in range(n)]


@dataclass
class Predicted:
    """What a simulated run would have measured (the load test's definitions)."""

    requests: int
    answered: int
    tokens_per_s: float | None
    ttft_p50: float | None
    ttft_p90: float | None
    e2e_p90: float | None
    normalized_latency: float | None

    @classmethod
    def of(cls, reqs: list[SimRequest]) -> "Predicted":
        ok = [r for r in reqs if r.e2e is not None]
        span = (max(r.end for r in ok) - min(r.arrival for r in ok)) if ok else 0.0
        tokens = sum(r.max_tokens for r in ok)
        return cls(len(reqs), len(ok), tokens / span if span > 0 else None,
                   percentile([r.ttft for r in ok], 50), percentile([r.ttft for r in ok], 90),
                   percentile([r.e2e for r in ok], 90),
                   float(np.mean([r.e2e / r.max_tokens for r in ok])) if ok else None)


@dataclass
class Calibration:
    """How the served system differs from the profile, per scheme: a factor on every step, and a fixed
    time each request spends outside the engine (client, gRPC, Triton, the stub, the response)."""

    scale: float = 1.0
    overhead_s: float = 0.0

    @classmethod
    def of(cls, row: dict) -> "Calibration":
        return cls(row.get("scale", 1.0), row.get("overhead_s", 0.0))


def run_scheme(scheme: str, reqs: list[SimRequest], cost: StepCost, replicas: int = 1, routing: str = "least-loaded",
               users: int = 0, source: RequestSource | None = None, total: int = 0,
               overhead_s: float = 0.0) -> tuple[list[SimRequest], list]:
    """Simulate requests (open loop), or `users` closed-loop users over `total` requests from `source`;
    `overhead_s` is added to what each client sees (first token and end)."""
    reps = make_replicas(scheme, replicas, cost)
    on_done = None
    if users:
        on_done = closed_loop(reqs, lambda i, now: source.make(i, now) if i < total else None)
    done = simulate(reqs, reps, routing, on_done)
    for r in done:
        if r.end is not None and not r.rejected:
            r.first_token += overhead_s
            r.end += overhead_s
    return done, reps


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


# ---------------------------------------------------------------- planning

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
                 seconds: float, seed: int, routing: str, hint: float, overhead_s: float = 0.0) -> tuple[float, float | None]:
    """Bisection on the offered rate: the highest that meets the SLO over `seconds` of arrivals."""
    def ok(rate: float) -> tuple[bool, float | None]:
        n = max(20, round(rate * seconds))
        reqs, _ = run_scheme(scheme, source.open_loop(rate, n, seed), cost, replicas, routing, overhead_s=overhead_s)
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
         max_replicas: int, price_per_hour: float | None, seconds: float, seed: int, routing: str) -> dict:
    counts = [1]
    while counts[-1] < max_replicas:
        counts.append(min(counts[-1] * 2, max_replicas))
    curves, needed = {}, {}
    for scheme, cal in calibrations.items():
        points, hint = [], 1.0
        for r in counts:
            cap, tps = capacity_for(scheme, r, cost.scaled(cal.scale), source, slo, seconds, seed, routing, hint,
                                    cal.overhead_s)
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


# ---------------------------------------------------------------- command line

def load_tokenizer(model: str):
    from transformers import AutoTokenizer

    from tritonllm.models import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path(model))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tritonllm-simulate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", required=True, type=Path, help="step-cost profile (tritonllm-bench-engine --profile-steps)")
    p.add_argument("--model", default="", help="the tokenizer for prompt lengths (default: the profile's model)")
    p.add_argument("--validate", type=Path, help="a tritonllm-compare results directory to predict, point by point")
    p.add_argument("--calibration", type=Path, help="simulation.json of a validation: its per-scheme factors")
    p.add_argument("--scale", type=float, default=1.0, help="factor on every step cost (without --calibration)")
    p.add_argument("--rate", type=float, default=0.0, help="planning: the request rate to carry (req/s)")
    p.add_argument("--slo-normalized", type=float, help="planning SLO: mean end-to-end / output tokens (s/token)")
    p.add_argument("--slo-e2e-p90", type=float, help="planning SLO: p90 end-to-end (s)")
    p.add_argument("--max-replicas", type=int, default=64)
    p.add_argument("--routing", choices=["least-loaded", "round-robin"], default="least-loaded")
    p.add_argument("--price-per-hour", type=float, help="per replica: adds cost per million output tokens")
    p.add_argument("--plan-seconds", type=float, default=30.0, help="planning: seconds of arrivals per trial")
    p.add_argument("--schemes", default=",".join(SCHEMES))
    p.add_argument("--output-tokens", default=DEFAULT_OUTPUT_TOKENS)
    p.add_argument("--prompt-words", default=DEFAULT_PROMPT_WORDS)
    p.add_argument("--prompts-file", default="")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="write simulation.md and simulation.json here (default: the "
                                            "validated results directory, else the current one)")
    args = p.parse_args(argv)
    schemes = [s for s in args.schemes.split(",") if s]
    if not args.validate and not args.rate:
        p.error("give --validate RESULTS and/or --rate R (planning)")
    LengthDist.parse(args.output_tokens)
    t0 = time.monotonic()
    cost = StepCost.load(args.profile)
    profile = json.loads(args.profile.read_text())
    workload = Workload(load_prompts(args.prompts_file or None), args.output_tokens, args.prompt_words, args.seed)
    source = RequestSource(workload, load_tokenizer(args.model or profile.get("model", "bundled")))
    out = args.out or args.validate or Path(".")
    out.mkdir(parents=True, exist_ok=True)
    md, result = ["# Simulation", ""], {}
    print(f"step costs interpolated from {len(profile['measurements'])} measured shapes ({cost.source})")
    calibrations = {s: Calibration(args.scale) for s in schemes}
    if args.validate:
        v = validate(args.validate, cost, source, args.seed)
        result["validation"] = v
        calibrations = {s: Calibration.of(v["schemes"][s]) for s in schemes if s in v["schemes"]}
        md += ["## Validation: predicted / measured", "", *validation_markdown(v), ""]
    elif args.calibration:
        saved = json.loads(args.calibration.read_text())["validation"]["schemes"]
        calibrations = {s: Calibration.of(saved[s]) for s in schemes}
    if args.rate:
        slo = _planning_slo(args)
        r = plan(cost, calibrations, source, slo, args.rate, args.max_replicas,
                 args.price_per_hour, args.plan_seconds, args.seed, args.routing)
        result["plan"] = r
        md += ["## Planning", "", *plan_markdown(r), ""]
    (out / "simulation.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "simulation.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    print(f"done in {time.monotonic() - t0:.1f} s -> {out / 'simulation.md'}")
    return 0


def _planning_slo(args) -> tuple[float, float]:
    if args.slo_normalized is not None and args.slo_e2e_p90 is not None:
        return args.slo_normalized, args.slo_e2e_p90
    if args.validate:  # the SLO the load test judged capacity by
        runs = [summarize_run_dir(d)[3] for d in find_runs(args.validate)]
        sweep = SweepResult.of([s for s in runs if s.arrival_rate], ReportSettings.load(args.validate))
        if sweep is not None and sweep.slo is not None:
            return (args.slo_normalized or sweep.slo.normalized_s, args.slo_e2e_p90 or sweep.slo.e2e_p90_s)
    raise SystemExit("error: planning needs --slo-normalized and --slo-e2e-p90 (or --validate a run with a sweep)")


if __name__ == "__main__":
    raise SystemExit(main())
