"""The side-by-side report: Markdown with PNG plots (matplotlib, Agg) and summary.json.

Reads a results directory laid out by `tritonllm-compare` (runs/<name>/ with run.json,
samples.jsonl, metrics.jsonl and Locust's CSV/HTML) and rebuilds the report from it alone:

    python -m tritonllm_loadtest.report results/20260101-120000
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from tritonllm_loadtest.metrics_scraper import interval_points  # noqa: E402
from tritonllm_loadtest.samples import Sample  # noqa: E402
from tritonllm_loadtest.summary import RunSummary, ratios, summarize_run_dir  # noqa: E402
from tritonllm_loadtest.sweep import KEEP_UP, Capacity, Slo, capacity, choose_slo, complete  # noqa: E402

SCHEME_ORDER = {"inflight": 0, "dynamic": 1, "static": 2, "inflight_shipped": 3}
COLORS = {"inflight": "tab:green", "dynamic": "tab:blue", "static": "tab:red", "inflight_shipped": "tab:olive"}


@dataclass
class ReportSettings:
    """What the report is judged by (settings.json in the results directory, written by tritonllm-compare)."""

    slo_ttft_s: float = 2.0  # goodput
    slo_tpot_s: float = 0.5
    slo_normalized_s: float | None = None  # the sweep's SLO; None: chosen from the lowest rate (sweep.choose_slo)
    slo_e2e_p90_s: float | None = None
    price_per_hour: float | None = None
    ideal_ratio: dict[int, float] = field(default_factory=dict)  # closed-loop users -> in-flight's ideal gain
    notes: list[str] = field(default_factory=list)  # the command, the server, the wall time: kept for rebuilds
    models: dict[str, dict] = field(default_factory=dict)  # model -> dtype, device, quantization, cap, KV blocks
    machine: dict = field(default_factory=dict)  # the CPU, its AMX / AVX512-BF16 flags, torch

    def save(self, results_dir: Path) -> None:
        (Path(results_dir) / "settings.json").write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, results_dir: Path) -> "ReportSettings":
        path = Path(results_dir) / "settings.json"
        if not path.exists():
            return cls()
        row = json.loads(path.read_text())
        row["ideal_ratio"] = {int(k): v for k, v in row.get("ideal_ratio", {}).items()}
        return cls(**{k: v for k, v in row.items() if k in cls.__dataclass_fields__})

    def cost_per_million(self, s: RunSummary) -> float | None:
        """What the machine cost during the run per million output tokens (it is billed idle or busy)."""
        if self.price_per_hour is None or not s.tokens_per_s:
            return None
        return self.price_per_hour / 3600 / s.tokens_per_s * 1e6


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


def plot_occupancy(runs: list[Run], path: Path) -> Path | None:
    measured = [r for r in runs if r.scrapes and interval_points(r.scrapes, r.info.model)]
    if not measured:
        return None
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    for run in measured:
        points = interval_points(run.scrapes, run.info.model)
        t0 = run.info.started or points[0].time
        xs = [p.time - t0 for p in points]
        ax.plot(xs, [_nan(p.occupancy) for p in points], marker=".", color=run.color, label=run.label)
        ax2.plot(xs, [_nan(p.waste) for p in points], marker=".", color=run.color, label=run.label)
    ax.set_ylim(0, 1.05)
    ax2.set_ylim(0, 1.05)
    for a in (ax, ax2):
        a.set_xlabel("seconds since the run started")
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    ax.set_ylabel("sequences computed / sequences the cap allows")
    ax.set_title("Occupancy per scrape interval")
    ax2.set_ylabel("rows computed that made no token / rows computed")
    ax2.set_title("Waste per scrape interval (batchers: counted when a batch ends)")
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
            "norm. latency (s/tok) | queue wait (s) | goodput (req/s) | waste | occupancy | Triton batch | core-s / 1k tok |",
            "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in summaries:
        load = f"rate {s.arrival_rate:g}/s, ≤{s.concurrency} users" if s.arrival_rate else f"{s.concurrency} users"
        rows.append(
            f"| {s.name} | {s.scheme} | {s.protocol} | {load} | {s.finished} | {s.errors} | "
            f"{_fmt(s.error_rate, '%')} | {_fmt(s.tokens_per_s)} | {_fmt(s.requests_per_s)} | "
            f"{_fmt(s.ttft_p50, 'ms')} | {_fmt(s.ttft_p90, 'ms')} | "
            f"{_fmt(s.e2e_p50)} | {_fmt(s.e2e_p90)} | {_fmt(s.itl_p50, 'ms')} | {_fmt(s.tpot_p50, 'ms')} | "
            f"{_fmt(s.normalized_latency)} | {_fmt(s.queue_wait_s)} | "
            f"{_fmt(s.goodput_rps)} | {_fmt(s.waste, '%')} | {_fmt(s.occupancy, '%')} | {_fmt(s.triton_batch_size)} | "
            f"{_fmt(s.core_s_per_1k_tokens)} |")
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


def _schemes(summaries: list[RunSummary]) -> list[str]:
    return sorted({s.scheme for s in summaries}, key=lambda x: (SCHEME_ORDER.get(x, 9), x))


@dataclass
class SweepResult:
    """The open-loop points, the SLO they are judged by and each scheme's capacity under it."""

    points: list[RunSummary]
    slo: Slo | None
    capacities: dict[str, Capacity]
    problem: str = ""  # why there is no SLO or capacity

    @classmethod
    def of(cls, points: list[RunSummary], settings: ReportSettings) -> "SweepResult | None":
        if not points:
            return None
        lowest = min(s.arrival_rate for s in points)
        try:
            slo = choose_slo([s for s in points if s.arrival_rate == lowest], settings.slo_normalized_s,
                             settings.slo_e2e_p90_s)
        except ValueError as exc:
            return cls(points, None, {}, str(exc))
        caps = {scheme: capacity([s for s in points if s.scheme == scheme], slo) for scheme in _schemes(points)}
        return cls(points, slo, caps)


def _what_ran(settings: ReportSettings, summaries: list[RunSummary]) -> list[str]:
    """Each scheme's model with its dtype, device, quantization, cap and KV blocks; the CPU; torch."""
    md = ["## What ran", ""]
    m = settings.machine
    if m:
        flags = ", ".join(f for f in ("amx_bf16", "avx512_bf16", "avx512f") if m.get(f)) or "no AVX512"
        md += [f"CPU: {m.get('cpu', '?')} ({flags}; AMX paths {'on' if m.get('amx_paths') else 'off'}, "
               f"ONEDNN_MAX_CPU_ISA {m.get('onednn_max_cpu_isa', 'default')}); torch {m.get('torch', '?')}. "
               "(The load generator's machine: the server's too when this command started it.)", ""]
    schemes = {s.scheme: s.model for s in summaries}
    if settings.models:
        md += ["| scheme | model | dtype | device | quantization | cap on concurrent sequences | KV blocks |",
               "|---|---|---|---|---|---:|---:|"]
        for scheme in _schemes(summaries):
            info = settings.models.get(schemes[scheme], {})
            md.append(f"| {scheme} | `{schemes[scheme]}` | {info.get('dtype', '–')} | {info.get('device', '–')} | "
                      f"{info.get('quantization', '–')} | {info.get('max_concurrent_sequences') or '–'} | "
                      f"{info.get('kv_blocks') or '–'} |")
        md.append("")
    return md


def _headline(closed: list[RunSummary], sweep: SweepResult | None, settings: ReportSettings) -> list[str]:
    top = max((s.concurrency for s in closed), default=None)
    at_top = {s.scheme: s for s in closed if s.concurrency == top}
    schemes = _schemes(closed + (sweep.points if sweep else []))
    models = {s.scheme: s.model for s in closed + (sweep.points if sweep else [])}

    def head(x: str) -> str:
        cap = settings.models.get(models.get(x, ""), {}).get("max_concurrent_sequences")
        shipped = " (as shipped: admission by KV memory)" if x == "inflight_shipped" else ""
        return f"`{x}`" + (f" ≤{cap} sequences{shipped}" if cap else shipped)

    rows = ["| | " + " | ".join(head(x) for x in schemes) + " |", "|---|" + "---:|" * len(schemes)]

    def row(label, value):
        rows.append(f"| {label} | " + " | ".join(value(x) for x in schemes) + " |")

    if sweep is not None and sweep.capacities:
        row("capacity under the SLO (req/s, open loop)", lambda x: str(sweep.capacities[x]) if x in sweep.capacities else "–")
    if at_top:
        def closed_value(attr, unit=""):
            return lambda x: _fmt(getattr(at_top[x], attr), unit) if x in at_top else "–"
        row(f"output tokens/s ({top} users, closed loop)", closed_value("tokens_per_s"))
        row("median time to first token (ms)", closed_value("ttft_p50", "ms"))
        row("p90 end-to-end (s)", closed_value("e2e_p90"))
        row("waste: rows computed that made no token", closed_value("waste", "%"))
        row("of them padding: finished members kept in a batch", closed_value("padding_share", "%"))
        row("occupancy: sequences computed / the cap allows", closed_value("occupancy", "%"))
        if any(s.core_s_per_1k_tokens is not None for s in at_top.values()):
            row("server core-seconds per 1,000 output tokens", closed_value("core_s_per_1k_tokens"))
        if any(s.gpu_s_per_1k_tokens is not None for s in at_top.values()):
            row("GPU-seconds (busy) per 1,000 output tokens", closed_value("gpu_s_per_1k_tokens"))
        if settings.price_per_hour is not None:
            row(f"cost per million output tokens at {settings.price_per_hour:g}/hour",
                lambda x: _fmt(settings.cost_per_million(at_top[x])) if x in at_top else "–")
    return rows


def _sweep_tables(sweep: SweepResult) -> list[str]:
    md = []
    if sweep.slo is None:
        md += [f"No capacity: {sweep.problem}.", ""]
    else:
        md += [f"SLO: mean normalized latency ≤ {sweep.slo.normalized_s:.3g} s per output token and p90 end-to-end "
               f"≤ {sweep.slo.e2e_p90_s:.3g} s, every request answered, and the server keeping up ({sweep.slo.how}). Keeping up: over the arrival "
               "window W, offered = (arrivals − 1) / W; sustained = answers within W shifted by the median "
               f"end-to-end latency, / W; it must reach {KEEP_UP:g} of the offered less one standard deviation of "
               "the count (√(arrivals − 1) / W). Capacity: the highest offered rate that "
               "meets it, interpolated towards the next rate (log of the worst ratio); a scheme that met every rate "
               "was offered more until one missed (≥ only where the time budget ended that first).", "",
               "| scheme | capacity under the SLO | × in-flight's |", "|---|---:|---:|"]
        inflight = sweep.capacities.get("inflight")
        for scheme, cap in sweep.capacities.items():
            rel = (_fmt(cap.rate / inflight.rate, "x") if inflight is not None and inflight.rate and cap.rate
                   else "–")
            md.append(f"| {scheme} | {cap} | {rel} |")
        md.append("")
    md += ["| offered (req/s) | scheme | answered / planned | errors | cut off | req/s | output tok/s | "
           "TTFT p50 (s) | TTFT p90 (s) | e2e p90 (s) | norm. latency (s/tok) | queue wait (s) | late p90 (s) | "
           "sustained / offered (req/s) | waste | SLO |",
           "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for s in sorted(sweep.points, key=lambda s: (s.arrival_rate, SCHEME_ORDER.get(s.scheme, 9))):
        verdict = "–" if sweep.slo is None else ("met" if sweep.slo.met(s) else (
            "missed" if complete(s) else "missed (unanswered)"))
        md.append(f"| {s.arrival_rate:g} | {s.scheme} | {s.ok} / {s.planned} | {s.errors} | {s.interrupted} | "
                  f"{_fmt(s.requests_per_s)} | {_fmt(s.tokens_per_s)} | {_fmt(s.ttft_p50)} | {_fmt(s.ttft_p90)} | "
                  f"{_fmt(s.e2e_p90)} | {_fmt(s.normalized_latency)} | {_fmt(s.queue_wait_s)} | {_fmt(s.late_p90)} | "
                  f"{_fmt(s.sustained_rps)} / {_fmt(s.offered_rps)} | {_fmt(s.waste, '%')} | {verdict} |")
    md += ["", "Sustained / offered: the server kept up where sustained ≥ the floor "
           f"({KEEP_UP:g} x offered less one standard deviation of the count)."]
    return md


def _targets(closed: list[RunSummary], sweep: SweepResult | None, settings: ReportSettings) -> list[str]:
    """The project's targets, checked on this run's numbers."""
    md = []
    if sweep is not None and sweep.capacities.get("inflight") is not None:
        inflight = sweep.capacities["inflight"]
        for other in ("dynamic", "static"):
            cap = sweep.capacities.get(other)
            if cap is None:
                continue
            if cap.rate is None or inflight.rate is None or inflight.bound != "=" or cap.bound != "=":
                md.append(f"- in-flight capacity ≥ 2.5x {other}'s at the same cap: in-flight {inflight}, {other} "
                          f"{cap}: not bracketed by a met and a missed rate, no verdict")
                continue
            ratio = inflight.rate / cap.rate
            md.append(f"- in-flight capacity ≥ 2.5x {other}'s at the same cap: {ratio:.2f}x ({inflight} vs {cap}) — "
                      f"{'met' if ratio >= 2.5 else 'missed'}")
    if sweep is not None:
        lowest = min(s.arrival_rate for s in sweep.points)
        at = {s.scheme: s for s in sweep.points if s.arrival_rate == lowest}
        if "static" in at and "dynamic" in at and at["static"].queue_wait_s is not None \
                and at["dynamic"].queue_wait_s:
            md.append(f"- (information) at the lowest rate ({lowest:g} req/s) static's mean queue wait is "
                      f"{at['static'].queue_wait_s / at['dynamic'].queue_wait_s:.3g}x dynamic's "
                      f"({at['static'].queue_wait_s:.3g} s vs {at['dynamic'].queue_wait_s:.3g} s): it waits for a "
                      "full batch")
    top = {s.scheme: s for s in closed if s.concurrency == max((c.concurrency for c in closed), default=0)}
    for scheme in ("dynamic", "static"):
        i, o = top.get("inflight"), top.get(scheme)
        if i is not None and o is not None and i.waste is not None and o.waste is not None:
            md.append(f"- in-flight waste below {scheme}'s (closed loop, from the models' counters): "
                      f"{i.waste:.1%} vs {o.waste:.1%} — {'met' if i.waste < o.waste else 'missed'}")
    for users, ideal in sorted(settings.ideal_ratio.items()):
        at = {s.scheme: s for s in closed if s.concurrency == users}
        if "inflight" in at and "dynamic" in at and at["inflight"].tokens_per_s and at["dynamic"].tokens_per_s:
            measured = at["inflight"].tokens_per_s / at["dynamic"].tokens_per_s
            line = (f"- at saturation ({users} users) in-flight / dynamic output tok/s ≥ 0.9x the workload's ideal "
                    f"ratio: {measured:.3g}x measured, ideal {ideal:.3g}x (Σ per-batch longest / (Σ lengths / "
                    f"{users})) = {measured / ideal:.2f} of ideal — {'met' if measured >= 0.9 * ideal else 'missed'}")
            i, d = at["inflight"], at["dynamic"]
            if i.engine_steps and d.engine_steps and i.ms_per_step and d.ms_per_step:
                line += (f". Steps: dynamic ran {d.engine_steps / i.engine_steps:.3g}x in-flight's ({d.engine_steps:.0f} "
                         f"vs {i.engine_steps:.0f}); in-flight needed {i.output_tokens / users:.0f} with every slot "
                         f"full (the rest is the run's end, its longest requests finishing beside empty slots); time "
                         f"per step: in-flight {i.ms_per_step:.1f} ms, dynamic {d.ms_per_step:.1f} ms (run duration / "
                         f"steps)")
            md.append(line)
    return md


def plot_sweep(points: list[RunSummary], slo: Slo | None, path: Path) -> Path | None:
    if not points:
        return None
    panels = [("ttft", "Time to first token (s): p50 —, p90 - -"), ("e2e_p90", "p90 end-to-end (s)"),
              ("normalized_latency", "Normalized latency (s per output token)"),
              ("tokens_per_s", "Achieved output tokens/s"), ("queue_wait_s", "Mean queue wait (s)"),
              ("occupancy", "Occupancy (sequences / cap)")]
    log_panels = ("ttft", "e2e_p90", "normalized_latency", "queue_wait_s")
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (what, title) in zip(axes.flat, panels):
        plotted = False  # log axes need a value to show (all None or, on a log axis, 0: a plain axis)
        for scheme in _schemes(points):
            mine = sorted((s for s in points if s.scheme == scheme), key=lambda s: s.arrival_rate)
            xs = [s.arrival_rate for s in mine]
            color = COLORS.get(scheme, "tab:gray")
            def ys(attr, runs):
                return [_nan(getattr(s, attr), above_zero=what in log_panels) for s in runs]
            series = [ys("ttft_p50", mine), ys("ttft_p90", mine)] if what == "ttft" else [ys(what, mine)]
            plotted = plotted or any(y == y for values in series for y in values)  # nan != nan
            ax.plot(xs, series[0], marker="o", color=color, label=scheme)
            if what == "ttft":
                ax.plot(xs, series[1], marker="x", linestyle="--", color=color)
            missed = [s for s in mine if slo is not None and not slo.met(s)]
            if what != "ttft" and missed:
                ax.scatter([s.arrival_rate for s in missed], ys(what, missed), s=120, facecolors="none",
                           edgecolors=color)
        if plotted:
            ax.set_xscale("log")  # the auto sweep's rates double
            if what in log_panels:
                ax.set_yscale("log")
        if slo is not None and what == "e2e_p90":
            ax.axhline(slo.e2e_p90_s, color="black", linestyle=":", label="SLO")
        if slo is not None and what == "normalized_latency":
            ax.axhline(slo.normalized_s, color="black", linestyle=":", label="SLO")
        ax.set_title(title)
        ax.set_xlabel("offered rate (requests/s, Poisson)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Under live traffic: open-loop sweep (circled: the point missed the SLO)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _nan(value, above_zero: bool = False):
    """A plottable number: nan for none, infinity, or (on a log axis) zero."""
    if value is None or (isinstance(value, float) and math.isinf(value)) or (above_zero and value <= 0):
        return np.nan
    return value


def build_report(results_dir: str | Path, title: str = "LLM batching on Triton: in-flight vs dynamic vs static",
                 notes: list[str] | None = None, settings: ReportSettings | None = None) -> Path:
    """Write report.md, plots/*.png and summary.json into results_dir; return report.md's path."""
    results_dir = Path(results_dir)
    settings = settings or ReportSettings.load(results_dir)
    run_dirs = find_runs(results_dir)
    if not run_dirs:
        raise ValueError(f"{results_dir}: no runs (expected runs/<name>/ with samples.jsonl)")
    runs = sorted((Run(d, slo_ttft_s=settings.slo_ttft_s, slo_tpot_s=settings.slo_tpot_s) for d in run_dirs),
                  key=_sort_key)
    summaries = [r.summary for r in runs]
    closed_runs = [r for r in runs if not r.info.arrival_rate]
    closed = [r.summary for r in closed_runs]
    sweep = SweepResult.of([s for s in summaries if s.arrival_rate], settings)
    shown = closed_runs or runs  # the per-request plots: the closed-loop runs (the sweep has its own)
    plots_dir = results_dir / "plots"
    plots_dir.mkdir(parents=True, exist_ok=True)
    plots = [
        ("Under live traffic: curves against the offered rate",
         plot_sweep(sweep.points, sweep.slo, plots_dir / "sweep.png") if sweep else None),
        ("Output tokens per second", plot_throughput(shown, plots_dir / "throughput.png")),
        ("Time to first token (CDF)", plot_cdfs(shown, plots_dir / "ttft_cdf.png", "ttft")),
        ("End-to-end latency (CDF)", plot_cdfs(shown, plots_dir / "e2e_cdf.png", "e2e")),
        ("Inter-token latency and per-token latency", plot_itl(shown, plots_dir / "itl.png")),
        ("Occupancy and waste over time (from each model's counters)",
         plot_occupancy(shown, plots_dir / "occupancy.png")),
        ("End-to-end latency against output length", plot_hostage(shown, plots_dir / "e2e_vs_tokens.png")),
    ]
    workloads = sorted({r.info.workload for r in runs if r.info.workload})
    md = [f"# {title}", "", f"Generated {time.strftime('%Y-%m-%d %H:%M:%S')} from `{results_dir}`.", ""]
    if workloads:
        md += ["Workload: " + "; ".join(workloads), ""]
    md += [*(notes or settings.notes), "", *_what_ran(settings, summaries), "## Headline", "",
           *_headline(closed, sweep, settings), "",
           "Waste = rows computed in forwards that made no token / rows computed (Δtritonllm_rows_computed_total, "
           "Δtritonllm_generation_tokens_total): prompt rows before each prompt's last, and for the batchers finished "
           "members kept in the batch as padding (the padding row). Occupancy = sequences computed / sequences the "
           "scheme's cap allows (Δtritonllm_sequence_rows_total / Δtritonllm_slot_steps_total, the cap once per "
           "forward): how full the scheme kept the rows it may run. Both from each model's own counters. Core-seconds: CPU time of the server's processes during the "
           "run (known when this command started the server). Cost: the machine's price per hour over the "
           "closed-loop run's tokens/s (a machine is billed busy or idle).", ""]
    targets = _targets(closed, sweep, settings)
    if targets:
        md += ["### Targets, checked on this run", "", *targets, ""]
    if sweep is not None:
        md += ["## Under live traffic (open-loop sweep)", "",
               "Poisson arrivals at each offered rate, the same seeded arrival times and requests for every scheme; "
               "times count from when a request was due (late: all users were busy). Normalized latency = mean of "
               "end-to-end / output tokens per request. Queue wait = mean time before a request's batch or slot "
               "starts: Triton's queue (Δnv_inference_queue_duration_us / Δnv_inference_request_success; Triton "
               "keeps sums, not percentiles) plus the engine's wait before a request's first forward.", "",
               *_sweep_tables(sweep), ""]
    md += ["## Summary", "", *_summary_table(summaries), "",
           "Times are exact percentiles of the raw samples (Locust's own tables round them). Throughput = "
           "output tokens of finished requests / (last end − first start). `dynamic` and `static` answer once "
           "at the end, so their TTFT equals their end-to-end latency and they have no ITL. Goodput counts "
           f"requests with TTFT ≤ {settings.slo_ttft_s:g} s and TPOT ≤ {settings.slo_tpot_s:g} s. Waste and occupancy as "
           "in the headline. Triton batch = "
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
        {"runs": [asdict(s) for s in summaries], "ratios": [asdict(r) for r in ratios(summaries)],
         "slo": asdict(sweep.slo) if sweep and sweep.slo else None,
         "capacity": {k: asdict(c) for k, c in sweep.capacities.items()} if sweep else {},
         "settings": asdict(settings)}, indent=2) + "\n")
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Rebuild the comparison report of a results directory.")
    p.add_argument("results_dir", type=Path)
    p.add_argument("--slo-normalized", type=float, default=None, help="the sweep's SLO on normalized latency (s/token)")
    p.add_argument("--slo-e2e-p90", type=float, default=None, help="the sweep's SLO on p90 end-to-end latency (s)")
    p.add_argument("--price-per-hour", type=float, default=None, help="the machine's price per hour")
    args = p.parse_args(argv)
    settings = ReportSettings.load(args.results_dir)  # what the run used, unless overridden here
    for name in ("slo_normalized", "slo_e2e_p90", "price_per_hour"):
        value = getattr(args, name)
        if value is not None:
            setattr(settings, name + ("_s" if name.startswith("slo") else ""), value)
    print(build_report(args.results_dir, settings=settings))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
