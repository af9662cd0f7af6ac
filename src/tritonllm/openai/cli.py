"""`tritonllm-openai`: the OpenAI-compatible front, alone, in front of any Triton serving these models."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from tritonllm.openai.app import MODELS, Settings, create_app

API_KEY_ENV = "TRITONLLM_API_KEY"
DEFAULT_PORT = 9000


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tritonllm-openai",
                                description="OpenAI-compatible API (/v1/completions, /v1/chat/completions, "
                                            "/v1/models, ...) in front of Triton serving this repository's models.")
    p.add_argument("--grpc-url", default="127.0.0.1:8001", help="Triton's gRPC address (default %(default)s)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to listen on (default %(default)s)")
    p.add_argument("--models", default=",".join(MODELS),
                   help="comma-separated Triton models to serve (default %(default)s)")
    p.add_argument("--default-model", default=None,
                   help="the model of requests that name none (default: the first of --models)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer: bundled, tiny, a directory or a hub id (default: $TRITONLLM_MODEL, else the "
                        "`model` parameter of the served models' config.pbtxt)")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"require 'Authorization: Bearer KEY' on /v1/* and /tokenize (default ${API_KEY_ENV}; "
                        "unset: no key)")
    p.add_argument("--graceful-timeout", type=float, default=40.0,
                   help="seconds open requests get to end on SIGTERM (default %(default)s)")
    p.add_argument("--access-log", action="store_true", help="log every request (off: it costs CPU under load)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    args = parser().parse_args(argv)
    models = tuple(m.strip() for m in args.models.split(",") if m.strip())
    if not models:
        print("error: --models names no model", file=sys.stderr)
        return 2
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = Settings(grpc_url=args.grpc_url, models=models, default_model=args.default_model or models[0],
                        tokenizer=args.tokenizer, api_key=args.api_key or None)
    uvicorn.run(create_app(settings), host=args.host, port=args.port, log_level=args.log_level,
                access_log=args.access_log, timeout_graceful_shutdown=args.graceful_timeout,
                timeout_keep_alive=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
