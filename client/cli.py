"""`tritonllm-client`: talk to the three models from a terminal.

    tritonllm-client generate "What is Triton?" --max-tokens 64
    tritonllm-client generate "Hi" --model llm_dynamic --protocol http --http-mode infer
    tritonllm-client chat
    tritonllm-client compare "Tell me a story" --max-tokens 64
    tritonllm-client health

This module only parses the command line and dispatches; expected failures become one line on
stderr and an exit code (see tritonllm_client.errors), Ctrl-C cancels the request and exits 130.
"""

from __future__ import annotations

import argparse
import sys

from tritonllm_client.errors import EXIT_CANCELLED, ClientError
from tritonllm_client.http import MODES


def _add_sampling(p: argparse.ArgumentParser, max_tokens: int | None = None, temperature: float | None = None) -> None:
    g = p.add_argument_group("sampling (sent as the sampling_parameters JSON; unset = server default)")
    g.add_argument("--max-tokens", type=int, default=max_tokens, help=f"new tokens at most (default: {max_tokens or 'server default, 16'})")
    g.add_argument("--temperature", type=float, default=temperature,
                   help=f"0 = greedy (default: {'server default, 1.0' if temperature is None else temperature})")
    g.add_argument("--top-p", type=float, help="nucleus sampling, in (0, 1]")
    g.add_argument("--top-k", type=int, help="sample among the k likeliest tokens (0 or -1: off)")
    g.add_argument("--seed", type=int, help="per-request seed, for reproducible sampling")
    g.add_argument("--stop", action="append", metavar="TEXT", help="stop at this text (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", default=None, help="keep going past end-of-sequence")
    g.add_argument("--logprobs", type=int, metavar="N", help="each token's logprob and its N likeliest alternatives (0-20), on stderr")
    s = p.add_argument_group("structured output (one at most; the answer is constrained to it)")
    s.add_argument("--json-schema", metavar="JSON", help="a JSON schema the answer must match")
    s.add_argument("--json-object", action="store_true", help="any JSON object")
    s.add_argument("--regex", metavar="REGEX", help="a regular expression the answer must match")
    s.add_argument("--choice", action="append", metavar="TEXT", help="one of these texts (repeatable)")
    s.add_argument("--grammar", metavar="LARK", help="a Lark (or GBNF) grammar")


def _add_url(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--url", default=None, help=f"server address host:port (default: {default})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tritonllm-client", description="Talk to the three models (llm_static, llm_dynamic, llm_inflight).",
        epilog="exit codes: 0 ok, 1 request refused or failed, 2 bad arguments, 3 server not reachable, "
               "4 model unknown or not ready, 130 cancelled (Ctrl-C; the request is cancelled on the server)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("generate", help="one prompt to one model; text on stdout, timing on stderr")
    p.add_argument("prompt", nargs="?", help="the prompt (default: read stdin)")
    p.add_argument("--model", default="llm_inflight", help="llm_inflight (default), llm_dynamic or llm_static")
    p.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    p.add_argument("--http-mode", choices=MODES, default="generate_stream",
                   help="HTTP endpoint (default generate_stream); infer: batching models only")
    _add_url(p, "localhost:8001 for grpc, localhost:8000 for http")
    _add_sampling(p)

    p = sub.add_parser("chat", help="interactive chat with llm_inflight; the chat template is applied here")
    p.add_argument("--model", default="llm_inflight")
    p.add_argument("--tokenizer", default=None, help="local tokenizer directory (default: the bundled model's)")
    p.add_argument("--system", default=None, help="a system prompt")
    p.add_argument("--show-prompt", action="store_true", help="print each templated prompt on stderr")
    p.add_argument("--stats", action="store_true", help="print TTFT and tokens/s after each answer")
    _add_url(p, "localhost:8001, gRPC")
    _add_sampling(p, max_tokens=256)

    p = sub.add_parser("compare", help="the same prompt to llm_static, llm_dynamic, llm_inflight; a timing table")
    p.add_argument("prompt", nargs="?", help="the prompt (default: read stdin)")
    p.add_argument("--concurrent", action="store_true", help="send the three requests at once (default: one after another)")
    p.add_argument("--models", nargs="+", metavar="MODEL", help="other models to compare")
    p.add_argument("--show-text", action="store_true", help="print each model's text after the table")
    _add_url(p, "localhost:8001, gRPC")
    _add_sampling(p, max_tokens=32, temperature=0.0)

    p = sub.add_parser("health", help="server and model readiness, config summary, statistics")
    _add_url(p, "localhost:8000, HTTP")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "generate":
        from tritonllm_client.generate import run
    elif args.command == "chat":
        from tritonllm_client.chat import run
    elif args.command == "compare":
        from tritonllm_client.compare import run
    else:
        from tritonllm_client.health import run
    try:
        return run(args)
    except ClientError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        sys.stdout.flush()
        print("\ncancelled", file=sys.stderr)
        return EXIT_CANCELLED


if __name__ == "__main__":
    sys.exit(main())
