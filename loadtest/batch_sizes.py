"""The comparison at several batch capacities (`tritonllm-compare --batch-sizes 8,16,32,64`).

At each capacity B a tritonserver of its own serves the three models with B rows each
(`max_num_seqs` of llm_inflight, `max_batch_size` of the batchers, the preferred batch of
llm_static), each with KV memory for B sequences of max_model_len; the usual comparison runs
against it with B closed-loop users and 6 x B requests (at least --max-requests), then its
open-loop sweep. The SLO is chosen once, at the first capacity (or given), and held for the
rest, so capacities compare. batch_sizes.md and batch_sizes.png show, per scheme, closed-loop
tokens/s and capacity under the SLO against batch capacity, each also as a multiple of its own at
the first capacity: request-level batches wait for the longest of more members, so they gain
little from a bigger batch; continuous batching turns extra rows into throughput.
"""

from __future__ import annotations

import json
from pathlib import Path

SCHEME_MODELS = {"inflight": "llm_inflight", "dynamic": "llm_dynamic", "static": "llm_static"}


def capacity_settings(size: int, schemes: list[str], max_model_len: int = 2048, block_size: int = 64
                      ) -> dict[str, dict[str, str]]:
    """Each scheme's settings at batch capacity `size`; llm_inflight's KV pool is what the batchers
    reserve (size sequences of max_model_len), so all three get the same memory."""
    settings = {"inflight": {"max_num_seqs": str(size), "num_kv_blocks": str(size * -(-max_model_len // block_size))},
                "dynamic": {"max_batch_size": str(size)},
                "static": {"max_batch_size": str(size), "preferred_batch_size": str(size)}}
    return {SCHEME_MODELS[s]: settings[s] for s in schemes if s in SCHEME_MODELS}


def point_argv(argv: list[str], size: int, triton, out: Path, slo: dict | None, max_requests: int) -> list[str]:
    """The comparison's own flags for one capacity: these flags win over the user's (argparse keeps the last)."""
    own = ["--server", "never", "--url", triton.http_url, "--grpc-url", triton.grpc_url,
           "--metrics-url", f"http://{triton.host}:{triton.metrics_port}/metrics",
           "--concurrency", str(size), "--max-requests", str(max(max_requests, 6 * size)), "--out", str(out)]
    if slo is not None:
        own += ["--slo-normalized", repr(slo["normalized_s"]), "--slo-e2e-p90", repr(slo["e2e_p90_s"])]
    return [a for a in without_batch_sizes(argv)] + own


def without_batch_sizes(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--batch-sizes":
            skip = True
        elif not a.startswith("--batch-sizes="):
            out.append(a)
    return out


def run(args, argv: list[str], out: Path) -> int:
    from tritonllm.server.tritonserver import TritonServer, find_free_ports
    from tritonllm.server.repository import configured_repository
    from tritonllm_loadtest import compare

    slo = {"normalized_s": args.slo_normalized, "e2e_p90_s": args.slo_e2e_p90} \
        if args.slo_normalized is not None and args.slo_e2e_p90 is not None else None
    points, code = [], 0
    for size in args.batch_sizes:
        repository = configured_repository(out / f"repository-{size}", capacity_settings(size, args.schemes))
        http, grpc, metrics = find_free_ports(3)
        compare.log(f"batch capacity {size}: starting tritonserver ...")
        with TritonServer(repository, http_port=http, grpc_port=grpc, metrics_port=metrics,
                          log_file=out / f"triton-{size}.log", env={"TRITONLLM_MODEL": args.model},
                          ready_timeout=args.ready_timeout) as triton:
            point_out = out / f"batch-{size}"
            code |= compare.main(point_argv(argv, size, triton, point_out, slo, args.max_requests))
        summary = json.loads((point_out / "summary.json").read_text())
        if slo is None and summary.get("slo"):
            slo = summary["slo"]
        points.append({"batch_size": size, **point_summary(summary)})
        write_report(out, points, slo)
    return code


def point_summary(summary: dict) -> dict:
    closed = {r["scheme"]: r["tokens_per_s"] for r in summary["runs"] if not r.get("arrival_rate")}
    caps = {s: c for s, c in summary.get("capacity", {}).items()}
    return {"tokens_per_s": closed, "capacity": caps}


def write_report(out: Path, points: list[dict], slo: dict | None) -> None:
    schemes = [s for s in SCHEME_MODELS if any(s in p["tokens_per_s"] for p in points)]
    first = points[0]

    def cap_rate(p: dict, scheme: str):
        c = p["capacity"].get(scheme)
        return None if c is None else c["rate"]

    def cap_text(p: dict, scheme: str) -> str:
        c = p["capacity"].get(scheme)
        if c is None:
            return "–"
        if c["rate"] is None:
            return f"< {c['lowest_rate']:.3g}"
        return ("≥ " if c["bound"] == ">=" else "") + f"{c['rate']:.3g}"

    def times(value, base) -> str:
        return f" ({value / base:.2f}x)" if value and base else ""

    md = ["# The schemes against batch capacity", "",
          f"SLO held at every capacity: {slo['normalized_s']:.3g} s/token normalized latency, "
          f"{slo['e2e_p90_s']:.3g} s p90 end-to-end ({slo.get('how', 'given')})." if slo else "No SLO (no sweep).", "",
          "| batch capacity | " + " | ".join(f"{s} tok/s (closed loop)" for s in schemes) + " | "
          + " | ".join(f"{s} capacity under the SLO (req/s)" for s in schemes) + " |",
          "|---:|" + "---:|" * (2 * len(schemes))]
    for p in points:
        toks = [f"{p['tokens_per_s'].get(s, 0):.1f}{times(p['tokens_per_s'].get(s), first['tokens_per_s'].get(s))}"
                for s in schemes]
        caps = [cap_text(p, s) + times(cap_rate(p, s), cap_rate(first, s)) for s in schemes]
        md.append(f"| {p['batch_size']} | " + " | ".join(toks + caps) + " |")
    md += ["", f"(x: a multiple of the scheme's own value at batch capacity {first['batch_size']}.) "
           "Each row's files: batch-<capacity>/report.md."]
    (out / "batch_sizes.md").write_text("\n".join(md) + "\n", encoding="utf-8")
    (out / "batch_sizes.json").write_text(json.dumps({"slo": slo, "points": points}, indent=2) + "\n")
    plot(out / "batch_sizes.png", points, schemes, cap_rate)


def plot(path: Path, points: list[dict], schemes: list[str], cap_rate) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    sizes = [p["batch_size"] for p in points]
    for s in schemes:
        ax1.plot(sizes, [p["tokens_per_s"].get(s) for p in points], marker="o", label=s)
        ax2.plot(sizes, [cap_rate(p, s) for p in points], marker="o", label=s)
    ax1.set(xlabel="batch capacity", ylabel="output tokens/s (closed loop)", xscale="log", xticks=sizes)
    ax2.set(xlabel="batch capacity", ylabel="capacity under the SLO (req/s; a lower bound where no rate failed)",
            xscale="log", xticks=sizes)
    for ax in (ax1, ax2):
        ax.minorticks_off()
        ax.set_xticklabels([str(x) for x in sizes])
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
