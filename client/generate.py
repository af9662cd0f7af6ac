"""`generate`: one prompt to one model; the text goes to stdout as it arrives, timing to stderr."""

from __future__ import annotations

import sys
from contextlib import closing

from tritonllm_client.contract import sampling_from_args
from tritonllm_client.errors import ClientError
from tritonllm_client.grpc_stream import GrpcSession
from tritonllm_client.http import HttpSession
from tritonllm_client.timing import Timing


def open_session(protocol: str, url: str | None):
    if protocol == "grpc":
        return GrpcSession(url) if url else GrpcSession()
    return HttpSession(url) if url else HttpSession()


def read_prompt(prompt: str | None) -> str:
    """The prompt argument, or all of stdin when it is absent or `-`."""
    if prompt is None or prompt == "-":
        prompt = sys.stdin.read()
    if not prompt.strip():
        raise ClientError("empty prompt: give one as an argument or on stdin")
    return prompt


def run(args) -> int:
    prompt = read_prompt(args.prompt)
    sampling = sampling_from_args(args)
    session = open_session(args.protocol, args.url)
    try:
        info = session.model_info(args.model)
        if args.protocol == "grpc":
            label = "gRPC stream" if info.decoupled else "gRPC unary"
            chunks = session.generate(info, prompt, sampling)
        else:
            label = f"HTTP {args.http_mode}"
            chunks = session.generate(info, prompt, sampling, args.http_mode)
        timing = Timing()
        logprobs = []
        with closing(chunks):
            for chunk in chunks:
                timing.add(chunk)
                logprobs += (chunk.logprobs or {}).get("tokens", [])
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
        timing.finish()
        sys.stdout.write("\n")
        sys.stdout.flush()
        for entry in logprobs:
            alternatives = "  ".join(f"{t['token']!r} {t['logprob']:.3f}" for t in entry["top_logprobs"])
            print(f"{entry['token']!r} {entry['logprob']:.3f}  | {alternatives}", file=sys.stderr)
        print(f"[{info.name}, {label}] {timing.summary()}", file=sys.stderr)
        return 0
    finally:
        session.close()
