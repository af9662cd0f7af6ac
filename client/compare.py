"""`compare`: the same prompt to llm_static, llm_dynamic and llm_inflight, timed side by side.

Sequential by default: one model after the other, a single request each, so no model slows
another down and each number is that scheme's latency for a lone request. With --concurrent the
three requests leave at once (one thread and one connection each) and share the CPU/GPU.
All go over gRPC: llm_inflight streams, the batching models answer once at the end (so their TTFT
is their end-to-end latency).
"""

from __future__ import annotations

import sys
import threading
import time
from contextlib import closing
from dataclasses import dataclass, field

from tritonllm_client.contract import ModelInfo, sampling_from_args
from tritonllm_client.errors import EXIT_REQUEST, RequestFailed
from tritonllm_client.generate import read_prompt
from tritonllm_client.grpc_stream import GrpcSession
from tritonllm_client.table import format_table
from tritonllm_client.timing import Timing

MODELS = ("llm_static", "llm_dynamic", "llm_inflight")


@dataclass
class Result:
    info: ModelInfo
    timing: Timing | None = None
    text: str = ""
    error: str = ""
    session: GrpcSession | None = field(default=None, repr=False)


def measure(result: Result, prompt: str, sampling: dict) -> None:
    """Send one request on the result's own session; fill in its timing, text or error."""
    timing = Timing()
    parts = []
    try:
        chunks = result.session.generate(result.info, prompt, sampling)
        with closing(chunks):
            for chunk in chunks:
                timing.add(chunk)
                parts.append(chunk.text)
        result.timing = timing.finish()
        result.text = "".join(parts)
    except RequestFailed as exc:
        result.error = str(exc)


def table(results: list[Result]) -> str:
    rows = []
    for r in results:
        mode = "stream" if r.info.decoupled else "unary"
        if r.error:
            rows.append([r.info.name, mode, "-", "-", "-", "-", f"error: {r.error}"])
            continue
        t = r.timing
        ttft = "-" if t.ttft is None else f"{t.ttft:.3f}"
        rows.append([r.info.name, mode, ttft, f"{t.e2e:.3f}", t.tokens, f"{t.tokens_per_s:.1f}", t.finish_reason])
    return format_table(["model", "mode", "TTFT (s)", "e2e (s)", "tokens", "tokens/s", "finish"], rows,
                        right={2, 3, 4, 5})


def _run_concurrently(results: list[Result], prompt: str, sampling: dict) -> None:
    threads = [threading.Thread(target=measure, args=(r, prompt, sampling), daemon=True) for r in results]
    for thread in threads:
        thread.start()
    try:
        while any(thread.is_alive() for thread in threads):
            time.sleep(0.05)
    except KeyboardInterrupt:
        for r in results:
            r.session.cancel()
        raise


def run(args) -> int:
    prompt = read_prompt(args.prompt)
    sampling = sampling_from_args(args)
    models = args.models or list(MODELS)
    results: list[Result] = []
    try:
        for model in models:  # every model must be there before anything is timed
            session = GrpcSession(args.url) if args.url else GrpcSession()
            try:
                results.append(Result(info=session.model_info(model), session=session))
            except BaseException:
                session.close()
                raise
        how = "concurrently" if args.concurrent else "sequentially"
        print(f"{len(results)} models, one request each, sent {how} over gRPC to {results[0].session.url}",
              file=sys.stderr)
        if args.concurrent:
            _run_concurrently(results, prompt, sampling)
        else:
            for r in results:
                measure(r, prompt, sampling)
    finally:
        for r in results:
            r.session.close()
    print(table(results))
    if args.show_text:
        for r in results:
            print(f"\n[{r.info.name}] {r.text if not r.error else 'error: ' + r.error}")
    print("\nTTFT of a unary model = its e2e latency (the answer comes at once). llm_static holds a "
          "lone request until its batch-fill delay expires.", file=sys.stderr)
    return EXIT_REQUEST if any(r.error for r in results) else 0
