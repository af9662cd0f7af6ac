"""`tritonllm-server`: a local Triton Inference Server with the repository's models (and the OpenAI
front beside it), until Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys
import time
from pathlib import Path

from tritonllm.server.openai_front import FrontStartError, OpenAIFront
from tritonllm.server.tritonserver import (ADMIN_APIS, ADMIN_KEY_HEADER, DEFAULT_MODEL_REPOSITORY, ServerStartError,
                                           TritonServer, model_runs, repository_index)

ADMIN_KEY_ENV = "TRITONLLM_ADMIN_KEY"
LOOPBACK = ("127.0.0.1", "localhost", "::1")
DEAD_STUB_STOP_S = 5  # seconds the other models get to finish when one model's stub has died
OPENAI_PORT = 9000  # the OpenAI-compatible front's default port (0: not started)
API_KEY_ENV = "TRITONLLM_API_KEY"
OPENAI_MODELS = ("llm_inflight", "llm_dynamic", "llm_static")  # what the front serves, in /v1/models' order


def admin_key_for(host: str, given: str | None) -> str | None:
    """The admin key to restrict the server with: the one given, else a random one off loopback."""
    if given:
        return given
    return None if host in LOOPBACK else secrets.token_urlsafe(18)


def _openai_front(server: TritonServer, args) -> OpenAIFront:
    """The OpenAI front for the LLM models this server has ready (all of them when it has none of ours)."""
    models = args.models
    if not models:
        ready = [m["name"] for m in repository_index(server) if m.get("state") == "READY"]
        models = [m for m in OPENAI_MODELS if m in ready] or ready
    grpc_host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    return OpenAIFront(f"{grpc_host}:{args.grpc_port}", port=args.openai_port, host=args.host, models=models,
                       api_key=args.api_key or None, graceful_timeout=args.exit_timeout + 5,
                       log_file=server.log_file.with_name(server.log_file.stem + "-openai.log"))


def _openai_lines(front) -> list[str]:
    """The OpenAI front's URL and a request to paste (the API key, if any, is not printed)."""
    if front is None:
        return []
    body = ('{"model": "llm_inflight", "messages": [{"role": "user", "content": "What is the capital of France?"}], '
            '"max_tokens": 32}')
    auth = ' -H "Authorization: Bearer $TRITONLLM_API_KEY"' if front.api_key else ""
    return [f"  OpenAI:  {front.url}  (log: {front.log_file})",
            f"  curl -s {front.url}/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'"]


def _banner(server: TritonServer, key_made: bool, front=None) -> str:
    """What the server offers; a key given by the user is not printed (logs are often shared)."""
    runs = model_runs(server.metrics_url)
    try:
        models = [f"{m['name']} ({m.get('state', '?')}{', ' + runs[m['name']] if m['name'] in runs else ''})"
                  for m in repository_index(server)]
    except (OSError, ValueError) as e:
        models = [f"<could not list models: {e}>"]
    base = f"http://{server.http_url}"
    body = '{"text_input": "What is the capital of France?", "max_tokens": 32}'
    stream_body = '{"text_input": "What is the capital of France?", "max_tokens": 32, "stream": true}'
    return "\n".join([
        f"Triton ready in {server.ready_seconds:.1f} s (log: {server.log_file})",
        f"  HTTP:    {base}",
        f"  gRPC:    {server.grpc_url}",
        f"  metrics: {server.metrics_url}",
        *_openai_lines(front)[:1],
        "  models:  " + (", ".join(models) or "<none>"),
        *([f"  admin:   {', '.join(ADMIN_APIS)} need header {ADMIN_KEY_HEADER}: "
           + (server.admin_key if key_made else f"(the key given, ${ADMIN_KEY_ENV} or --admin-key)")]
          if server.admin_key else []),
        "Try:",
        f"  curl -s {base}/v2/models/llm_inflight/generate -d '{body}'",
        f"  curl -sN {base}/v2/models/llm_inflight/generate_stream -d '{stream_body}'",
        *_openai_lines(front)[1:],
        "Ctrl-C stops the server.",
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Run Triton Inference Server on this repo's models.")
    p.add_argument("--model-repository", type=Path, default=DEFAULT_MODEL_REPOSITORY)
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default loopback); beyond loopback the admin APIs need a key")
    p.add_argument("--admin-key", default=os.environ.get(ADMIN_KEY_ENV),
                   help=f"key (header/metadata {ADMIN_KEY_HEADER}) for the {', '.join(ADMIN_APIS)} APIs; "
                        f"default ${ADMIN_KEY_ENV}, or a random one when --host is not loopback")
    p.add_argument("--exit-timeout", type=int, default=30,
                   help="seconds Triton waits for requests to end on SIGTERM before it exits")
    p.add_argument("--model", action="append", dest="models", metavar="NAME",
                   help="load only this model (repeatable); default: all")
    p.add_argument("--ready-timeout", type=float, default=120.0)
    p.add_argument("--log-file", type=Path, default=None)
    p.add_argument("--openai-port", type=int, default=OPENAI_PORT,
                   help="port of the OpenAI-compatible API (tritonllm-openai) on --host; 0: do not start it")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"key the OpenAI API requires as 'Authorization: Bearer KEY' (default ${API_KEY_ENV}; "
                        "unset: none, as Triton's own inference APIs)")
    args = p.parse_args(argv)

    server = TritonServer(
        model_repository=args.model_repository, http_port=args.http_port,
        grpc_port=args.grpc_port, metrics_port=args.metrics_port, host=args.host,
        models=args.models, log_file=args.log_file, ready_timeout=args.ready_timeout,
        exit_timeout=args.exit_timeout, admin_key=admin_key_for(args.host, args.admin_key),
    )
    front = None
    stop_timeout = None  # the server's exit timeout
    # SIGTERM and SIGINT (also when inherited as ignored) raise KeyboardInterrupt.
    old_handlers = {s: signal.signal(s, signal.default_int_handler)
                    for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        print(f"Starting tritonserver (log: {server.log_file}) ...", flush=True)
        server.start()
        if args.openai_port:
            front = _openai_front(server, args)
            front.start()
        print(_banner(server, key_made=not args.admin_key, front=front), flush=True)
        if front is not None and args.host not in LOOPBACK and not front.api_key:
            print(f"note: the OpenAI API listens beyond loopback without a key (--api-key / ${API_KEY_ENV})",
                  flush=True)
        while server.is_running():
            if front is not None and not front.is_running():
                print(f"error: the OpenAI front exited (code {front.process.returncode}); stopping the server so "
                      f"that a supervisor can restart both; see {front.log_file}", file=sys.stderr)
                return 1
            dead = server.dead_stubs()
            if dead:
                print(f"error: the Python process of {', '.join(dead)} died; Triton does not restart it and "
                      "would keep answering 'not healthy' (open streams would hang). Stopping the server "
                      "so that a supervisor can restart it; see " + str(server.log_file), file=sys.stderr)
                stop_timeout = DEAD_STUB_STOP_S  # the dead model can never unload: do not wait for it
                return 1
            time.sleep(1)
        code = server.process.returncode
        how = f" (killed by {signal.Signals(-code).name})" if code < 0 else ""
        print(f"tritonserver exited with code {code}{how}; see {server.log_file}", file=sys.stderr)
        return 1
    except (ServerStartError, FrontStartError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nStopping tritonserver ...", flush=True)
        return 0
    finally:
        for sig in old_handlers:  # a second Ctrl-C must not interrupt the stop
            signal.signal(sig, signal.SIG_IGN)
        if front is not None:
            front.terminate()  # it stops taking requests; open ones end as Triton drains them
        server.stop(stop_timeout)
        if front is not None:
            front.stop(timeout=10)
        for sig, handler in old_handlers.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
