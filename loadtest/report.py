"""The side-by-side report: Markdown with PNG plots (matplotlib, Agg) and summary.json.

Reads a results directory laid out by `tritonllm-compare` (runs/<name>/ with run.json,
samples.jsonl, metrics.jsonl and Locust's CSV/HTML) and rebuilds the report from it alone:

    python -m tritonllm_loadtest.report results/20260101-120000
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from tritonllm_loadtest.metrics_scraper import slot_utilisation  # noqa: E402
from tritonllm_loadtest.samples import Sample  # noqa: E402
from tritonllm_loadtest.summary import RunSummary, ratios, summarize_run_dir  # noqa: E402

SCHEME_ORDER = {"inflight": 0, "dynamic": 1, "static": 2}
COLORS = {"inflight": "tab:green", "dynamic": "tab:blue", "static": "tab:red"}


class Run:
    def __init__(self, run_dir: Path, **slo):
        self.dir = run_dir
        self.info, self.samples, self.scrapes, self.summary = summarize_run_dir(run_dir, **slo)

    @property
    def ok(self) -> list[Sample]:
        return [s for s in self.samples if s.ok]

    @property
    def label(self) -> str:
        load = f"rate {self.info.arrival_rate:g}/s" if self.info.arrival_rate else f"c={self.info.concurrency}"
        return f"{self.info.scheme} ({load})"

    @property
    def color(self) -> str:
        return COLORS.get(self.info.scheme, "tab:gray")


def find_runs(results_dir: Path) -> list[Path]:
    runs_root = results_dir / "runs"
    root = runs_root if runs_root.is_dir() else results_dir
    return sorted(p for p in root.iterdir()
                  if p.is_dir() and (any(p.glob("samples*.jsonl")) or (p / "run.json").exists()))


def _sort_key(run: Run):
    return (run.info.arrival_rate, run.info.concurrency, SCHEME_ORDER.get(run.info.scheme, 9), run.info.name)


def _fmt(value, unit: str = "", digits: int = 3) -> str:
    if value is None:
        return "–"
    if unit == "ms":
        return f"{value * 1000:.1f}"
    if unit == "%":
        return f"{value * 100:.2f}%"
    if unit == "x":
        return f"{value:.3g}×"
    if isinstance(value, float):
        return f"{value:.1f}" if abs(value) >= 100 else f"{value:.{digits}g}"
    return str(value)


def _cdf(ax, values, run: Run, title: str, xlabel: str, ylabel: str = "fraction of requests") -> None:
    values = np.sort([v for v in values if v is not None])
    if values.size == 0:
        return
    ax.step(values, np.arange(1, values.size + 1) / values.size, where="post", color=run.color, label=run.label)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)


def _loads(runs: list[Run]) -> list[tuple[float, int]]:
    return sorted({(r.info.arrival_rate, r.info.concurrency) for r in runs})


def plot_throughput(runs: list[Run], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.2))
    loads = _loads(runs)
    schemes = sorted({r.info.scheme for r in runs}, key=lambda s: SCHEME_ORDER.get(s, 9))
    if len(loads) > 1 and all(rate == 0 for rate, _ in loads):  # a concurrency sweep: tokens/s vs concurrency
        for scheme in schemes:
            pts = sorted((r.info.concurrency, r.summary.tokens_per_s or 0) for r in runs if r.info.scheme == scheme)
            ax.plot([c for c, _ in pts], [t for _, t in pts], marker="o", color=COLORS.get(scheme), label=scheme)
        ax.set_xlabel("concurrent users (closed loop)")
        ax.set_xscale("log", base=2)
        ax.legend()
    else:
        width = 0.8 / max(len(schemes), 1)
        for i, scheme in enumerate(schemes):
            xs, ys = [], []
            for j, load in enumerate(loads):
                match = [r for r in runs
                         if r.info.scheme == scheme and (r.info.arrival_rate, r.info.concurrency) == load]
                if match:
                    xs.append(j + i * width)
                    ys.append(match[0].summary.tokens_per_s or 0)
            bars = ax.bar(xs, ys, width, color=COLORS.get(scheme), label=scheme)
            ax.bar_label(bars, fmt="%.1f")
        ax.set_xticks([j + width * (len(schemes) - 1) / 2 for j in range(len(loads))],
                      [f"rate {r:g}/s" if r else f"concurrency {c}" for r, c in loads])
        ax.legend()
    ax.set_ylabel("output tokens / s")
    ax.set_title("Throughput per batching scheme")
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_cdfs(runs: list[Run], path: Path, what: str) -> Path:
    loads = _loads(runs)
    fig, axes = plt.subplots(1, len(loads), figsize=(6 * len(loads), 4.2), squeeze=False)
    for ax, load in zip(axes[0], loads):
        for run in runs:
            if (run.info.arrival_rate, run.info.concurrency) != load:
                continue
            values = [getattr(s, what) for s in run.ok]
            title = {"ttft": "Time to first token", "e2e": "End-to-end latency"}[what]
            _cdf(ax, values, run, f"{title} (c={load[1]})" if not load[0] else f"{title} (rate {load[0]:g}/s)",
                 "seconds")
        ax.legend(loc="lower right")
    if what == "ttft":
        fig.text(0.5, 0.005, "dynamic/static cannot stream: their first token arrives with the last (TTFT = e2e)",
                 ha="center", fontsize=8)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_itl(runs: list[Run], path: Path) -> Path:
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    for run in runs:
        if run.summary.streaming:
            _cdf(ax1, [g for s in run.ok for g in s.itl], run, "Inter-token latency (streamed pieces)", "seconds",
                 "fraction of gaps")
        # Per request: time per output token after the first (streaming) / e2e per token (non-streaming).
        per_token = [s.tpot if run.summary.streaming else (s.e2e / s.output_tokens if s.output_tokens else None)
                     for s in run.ok]
        _cdf(ax2, per_token, run, "Per-token latency per request", "seconds per output token (log)")
    ax2.set_xscale("log")
    if not any(run.summary.streaming for run in runs):
        ax1.text(0.5, 0.5, "no streaming scheme in these runs", ha="center", transform=ax1.transAxes)
    else:
        ax1.legend(loc="lower right")
    ax2.legend(loc="lower right")
    fig.text(0.5, 0.005, "right: TPOT for streaming schemes; e2e / output tokens for dynamic and static",
             ha="center", fontsize=8)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_utilisation(runs: list[Run], path: Path) -> Path | None:
    measured = [r for r in runs if r.scrapes and slot_utilisation(r.scrapes, r.info.model)]
    if not measured:
        return None
    fig, ax = plt.subplots(figsize=(9, 4.2))
    ax2 = ax.twinx()
    for run in measured:
        points = slot_utilisation(run.scrapes, run.info.model)
        t0 = run.info.started or points[0].time
        xs = [p.time - t0 for p in points]
        ax.plot(xs, [p.utilisation if p.utilisation is not None else np.nan for p in points], marker=".",
                label=f"{run.label}: slot utilisation")
        if any(p.running is not None for p in points):  # the in-flight engine's gauges
            ax2.plot(xs, [p.running for p in points], linestyle="--", alpha=0.6, label=f"{run.label}: running")
            ax2.plot(xs, [p.waiting for p in points], linestyle=":", alpha=0.6, label=f"{run.label}: waiting")
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("seconds since the run started")
    ax.set_ylabel("tokens / (slots × steps) per scrape interval")
    ax2.set_ylabel("requests")
    ax.set_title("Slot utilisation over time (batching models: counted when a batch ends)")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="lower center", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_hostage(runs: list[Run], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for run in runs:
        ok = run.ok
        ax.scatter([s.output_tokens for s in ok], [s.e2e for s in ok], s=10, alpha=0.6, color=run.color,
                   label=run.label)
    ax.set_xlabel("output tokens of the request")
    ax.set_ylabel("end-to-end latency (s)")
    ax.set_title("Short requests held hostage by long ones (batch to the end)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _summary_table(summaries: list[RunSummary]) -> list[str]:
    rows = ["| run | scheme | protocol | load | finished | errors | error rate | output tok/s | req/s | "
            "TTFT p50 (ms) | TTFT p90 (ms) | e2e p50 (s) | e2e p90 (s) | ITL p50 (ms) | TPOT p50 (ms) | "
            "goodput (req/s) | slot util. | Triton batch |",
            "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in summaries:
        load = f"rate {s.arrival_rate:g}/s, ≤{s.concurrency} users" if s.arrival_rate else f"{s.concurrency} users"
        rows.append(
            f"| {s.name} | {s.scheme} | {s.protocol} | {load} | {s.finished} | {s.errors} | "
            f"{_fmt(s.error_rate, '%')} | {_fmt(s.tokens_per_s)} | {_fmt(s.requests_per_s)} | "
            f"{_fmt(s.ttft_p50, 'ms')} | {_fmt(s.ttft_p90, 'ms')} | "
            f"{_fmt(s.e2e_p50)} | {_fmt(s.e2e_p90)} | {_fmt(s.itl_p50, 'ms')} | {_fmt(s.tpot_p50, 'ms')} | "
            f"{_fmt(s.goodput_rps)} | {_fmt(s.slot_utilisation, '%')} | {_fmt(s.triton_batch_size)} |")
    return rows


def _ratio_table(summaries: list[RunSummary]) -> list[str]:
    rs = ratios(summaries)
    if not rs:
        return ["(no in-flight run with a baseline at the same load: no ratios)"]
    rows = ["| load | in-flight vs | output tok/s ratio | median TTFT ratio | p90 e2e ratio | req/s ratio | "
            "error rate (in-flight / baseline) |",
            "|---|---|---:|---:|---:|---:|---:|"]
    for r in rs:
        load = f"rate {r.arrival_rate:g}/s" if r.arrival_rate else f"{r.concurrency} users"
        rows.append(f"| {load} | {r.baseline} | {_fmt(r.tokens_per_s, 'x')} | {_fmt(r.ttft_p50, 'x')} | "
                    f"{_fmt(r.e2e_p90, 'x')} | {_fmt(r.requests_per_s, 'x')} | "
                    f"{_fmt(r.error_rate_inflight, '%')} / {_fmt(r.error_rate_baseline, '%')} |")
    return rows


def build_report(results_dir: str | Path, title: str = "LLM batching on Triton: in-flight vs dynamic vs static",
                 notes: list[str] | None = None, slo_ttft_s: float = 2.0, slo_tpot_s: float = 0.5) -> Path:
    """Write report.md, plots/*.png and summary.json into results_dir; return report.md's path."""
    results_dir = Path(results_dir)
    run_dirs = find_runs(results_dir)
    if not run_dirs:
        raise ValueError(f"{results_dir}: no runs (expected runs/<name>/ with samples.jsonl)")
    runs = sorted((Run(d, slo_ttft_s=slo_ttft_s, slo_tpot_s=slo_tpot_s) for d in run_dirs), key=_sort_key)
    summaries = [r.summary for r in runs]
    plots_dir = results_dir / "plots"
    plots_dir.mkdir(parents=True, exist_ok=True)
    plots = [
        ("Output tokens per second", plot_throughput(runs, plots_dir / "throughput.png")),
        ("Time to first token (CDF)", plot_cdfs(runs, plots_dir / "ttft_cdf.png", "ttft")),
        ("End-to-end latency (CDF)", plot_cdfs(runs, plots_dir / "e2e_cdf.png", "e2e")),
        ("Inter-token latency and per-token latency", plot_itl(runs, plots_dir / "itl.png")),
        ("Slot utilisation over time (from each model's metrics)",
         plot_utilisation(runs, plots_dir / "slot_utilisation.png")),
        ("End-to-end latency against output length", plot_hostage(runs, plots_dir / "e2e_vs_tokens.png")),
    ]
    workloads = sorted({r.info.workload for r in runs if r.info.workload})
    md = [f"# {title}", "", f"Generated {time.strftime('%Y-%m-%d %H:%M:%S')} from `{results_dir}`.", ""]
    if workloads:
        md += ["Workload: " + "; ".join(workloads), ""]
    md += [*(notes or []), "", "## Summary", "", *_summary_table(summaries), "",
           "Times are exact percentiles of the raw samples (Locust's own tables round them). Throughput = "
           "output tokens of finished requests / (last end − first start). `dynamic` and `static` answer once "
           "at the end, so their TTFT equals their end-to-end latency and they have no ITL. Goodput counts "
           f"requests with TTFT ≤ {slo_ttft_s:g} s and TPOT ≤ {slo_tpot_s:g} s. Slot utilisation = "
           "Δgeneration tokens / Δ(slots × steps) from each model's metrics; 1 − it is the share of computed "
           "rows that was waste (padding rows of finished requests, idle slots). Triton batch = "
           "Δnv_inference_count / Δnv_inference_exec_count (average batch the batchers formed).", "",
           "## In-flight against the request-level batchers", "", *_ratio_table(summaries), "",
           "Ratios are in-flight ÷ baseline: above 1 is better for tokens/s and req/s, below 1 is better "
           "for latency.", "", "## Plots", ""]
    for caption, path in plots:
        if path is not None:
            md += [f"### {caption}", "", f"![{caption}](plots/{path.name})", ""]
    md += ["## Runs", ""]
    for run in runs:
        s = run.summary
        files = ", ".join(f"[{p.name}](runs/{run.dir.name}/{p.name})" for p in sorted(run.dir.iterdir())
                          if p.suffix in (".html", ".csv", ".jsonl", ".json", ".log"))
        line = f"- **{run.dir.name}**: {run.info.user_class or s.protocol} → `{s.model}`"
        if s.interrupted:
            line += f"; {s.interrupted} request(s) cut off at the run's end (not counted)"
        if run.info.locust_rc not in (None, 0):
            line += f"; locust exit code {run.info.locust_rc}"
        md.append(line + f". Files: {files}")
        for message, count in s.top_errors:
            md.append(f"  - {count} × error: `{message[:200]}`")
    report = results_dir / "report.md"
    report.write_text("\n".join(md) + "\n", encoding="utf-8")
    (results_dir / "summary.json").write_text(json.dumps(
        {"runs": [asdict(s) for s in summaries], "ratios": [asdict(r) for r in ratios(summaries)]}, indent=2) + "\n")
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Rebuild the comparison report of a results directory.")
    p.add_argument("results_dir", type=Path)
    p.add_argument("--slo-ttft", type=float, default=2.0, help="goodput SLO on TTFT (s)")
    p.add_argument("--slo-tpot", type=float, default=0.5, help="goodput SLO on TPOT (s)")
    args = p.parse_args(argv)
    print(build_report(args.results_dir, slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
