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
import time
from pathlib import Path

from tritonllm.capacity.planning import plan, plan_markdown
from tritonllm.capacity.replay import SCHEMES, RequestSource
from tritonllm.capacity.simulator import REPOSITORY
from tritonllm.capacity.step_cost import StepCost
from tritonllm.capacity.validation import Calibration, validate, validation_markdown
from tritonllm_loadtest.report import ReportSettings, SweepResult, find_runs
from tritonllm_loadtest.summary import summarize_run_dir
from tritonllm_loadtest.workload import DEFAULT_OUTPUT_TOKENS, DEFAULT_PROMPT_WORDS, LengthDist, Workload, load_prompts


def load_tokenizer(model: str):
    from transformers import AutoTokenizer

    from tritonllm.model_files import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path(model))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tritonllm-simulate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", required=True, type=Path, help="step-cost profile (tritonllm-bench-engine --profile-steps)")
    p.add_argument("--model", default="", help="the tokenizer for prompt lengths (default: the profile's model)")
    p.add_argument("--validate", type=Path, help="a tritonllm-compare results directory to predict, point by point")
    p.add_argument("--repository", type=Path, default=REPOSITORY,
                   help="the model repository the simulated models follow (default: the shipped one)")
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
        v = validate(args.validate, cost, source, args.seed, args.repository)
        result["validation"] = v
        calibrations = {s: Calibration.of(v["schemes"][s]) for s in schemes if s in v["schemes"]}
        md += ["## Validation: predicted / measured", "", *validation_markdown(v), ""]
    elif args.calibration:
        saved = json.loads(args.calibration.read_text())["validation"]["schemes"]
        calibrations = {s: Calibration.of(saved[s]) for s in schemes}
    if args.rate:
        slo = _planning_slo(args)
        r = plan(cost, calibrations, source, slo, args.rate, args.max_replicas,
                 args.price_per_hour, args.plan_seconds, args.seed, args.routing, args.repository)
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
