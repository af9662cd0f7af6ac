"""The FastAPI application of the OpenAI front: routes, API key, errors, disconnects.

Routes (vLLM's layout): `GET /v1/models`, `GET /v1/models/{id}`, `POST /v1/completions`,
`POST /v1/chat/completions`, `GET /health` (the front and Triton are live), `GET /health/ready`
(Triton and every served model are ready), `GET /metrics` (the front's own), `POST /tokenize`,
`POST /detokenize`, `GET /version`. Every failure answers in OpenAI's error shape.

A client that goes away cancels its request upstream: a stream is cancelled by Starlette when the
connection closes, and a non-streaming call (or a stream still waiting for its first text) races
the model against the connection's `http.disconnect`, as vLLM's `with_cancellation` does.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tritonllm.openai import responses
from tritonllm.openai.errors import OpenAIError, bad_request, error_body, from_upstream, unknown_model
from tritonllm.openai.generation import Choice, Generation, Usage, usage
from tritonllm.openai.metrics import FrontMetrics
from tritonllm.openai.prompts import PromptTokenizer, message_text, tokenizer_spec
from tritonllm.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, SamplingFields,
                                       TokenizeRequest, parse_body, unknown_fields)
from tritonllm.openai.sampling import for_choice, max_tokens_of, sampling_parameters
from tritonllm.openai.structured import tool_mode
from tritonllm.openai.upstream import ServedModel, Triton, UpstreamError

log = logging.getLogger(__name__)
MODELS = ("llm_inflight", "llm_dynamic", "llm_static")
COMPLETIONS_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions
OWNED_BY = "tritonllm"


@dataclass
class Settings:
    grpc_url: str = "127.0.0.1:8001"
    models: tuple[str, ...] = MODELS
    default_model: str = "llm_inflight"  # for requests that name no model
    tokenizer: str | None = None  # spec or directory; None: $TRITONLLM_MODEL, else the models' config
    api_key: str | None = None
    triton_headers: dict[str, str] = field(default_factory=dict)


class ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


class Front:
    """What the routes share: Triton, the tokenizer, the metrics."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.triton: Triton | None = None
        self.metrics = FrontMetrics()
        self.created = int(time.time())
        self._tokenizer: PromptTokenizer | None = None
        self._tokenizer_lock: asyncio.Lock | None = None

    # ------------------------------------------------------------------ shared resources

    async def tokenizer(self) -> PromptTokenizer:
        if self._tokenizer is None:
            async with self._tokenizer_lock:
                if self._tokenizer is None:
                    config_spec = None
                    for name in self.settings.models:
                        model = await self.triton.model(name)
                        if model is not None and model.spec:
                            config_spec = model.spec
                            break
                    spec = tokenizer_spec(self.settings.tokenizer, config_spec)
                    try:
                        self._tokenizer = await asyncio.to_thread(PromptTokenizer.load, spec)
                    except Exception as exc:
                        raise OpenAIError(503, f"the tokenizer of {spec!r} could not be loaded: {exc}") from None
                    log.info("tokenizer: %s", self._tokenizer.path)
        return self._tokenizer

    async def served(self, name: str | None) -> ServedModel:
        name = name or self.settings.default_model
        if name not in self.settings.models:
            raise unknown_model(name, list(self.settings.models))
        model = await self.triton.model(name)
        if model is None:
            if not await self.triton.live():
                raise OpenAIError(503, f"Triton at {self.settings.grpc_url} does not answer; retry later")
            ready = [n for n, ok in (await self.triton.readiness()).items() if ok]
            raise unknown_model(name, ready)
        return model

    async def read_body(self, request: Request, model_class, route: str):
        """The checked API key, then the body parsed as `model_class`, its unknown fields logged once."""
        self.check_key(request)
        req = parse_body(await request.body(), model_class)
        unknown_fields(route, req)
        return req

    def check_key(self, request: Request) -> None:
        key = self.settings.api_key
        if not key:
            return
        given = request.headers.get("authorization", "")
        token = given[7:].strip() if given[:7].lower() == "bearer " else ""
        if not hmac.compare_digest(token.encode(), key.encode()):
            raise OpenAIError(401, "Incorrect or missing API key: send the header 'Authorization: Bearer <key>'",
                              code="invalid_api_key")

    # ------------------------------------------------------------------ model list

    async def model_card(self, model: ServedModel) -> dict[str, Any]:
        root = model.spec or model.name
        try:
            root = (await self.tokenizer()).path
        except OpenAIError:
            pass
        return {"id": model.name, "object": "model", "created": self.created, "owned_by": OWNED_BY,
                "root": root, "parent": None, "max_model_len": model.max_model_len,
                "permission": []}

    async def ready_models(self) -> list[ServedModel]:
        states = await self.triton.readiness()
        models = [await self.triton.model(name) for name, ok in states.items() if ok]
        return [m for m in models if m is not None]

    # ------------------------------------------------------------------ generation

    async def choices(self, chat: bool, req: SamplingFields, model: ServedModel) -> list[Choice]:
        tokenizer = await self.tokenizer()
        max_tokens = max_tokens_of(req)
        if chat:
            template_kwargs = {**({"tools": req.tools} if req.tools else {}), **(req.chat_template_kwargs or {})}
            prompt = tokenizer.chat_prompt(req.messages, req.add_generation_prompt, req.continue_final_message,
                                           template_kwargs)
            if max_tokens is None:  # vLLM's default: whatever room the context leaves
                room = (model.max_model_len or 2048) - len(tokenizer.encode(prompt))
                if room < 1:
                    raise bad_request(f"the messages take {len(tokenizer.encode(prompt))} tokens, which leaves no "
                                      f"room for an answer within max_model_len ({model.max_model_len})", "messages")
                max_tokens = room
            last = req.messages[-1]
            echo = message_text(last, len(req.messages) - 1) if req.echo and last.role == "assistant" else ""
            prompts = [(prompt, echo)]
        else:
            prompts = [(p.text, p.text if req.echo else "")
                       for p in tokenizer.completion_prompts(req.prompt)]
            if max_tokens is None:
                max_tokens = COMPLETIONS_MAX_TOKENS
        values = sampling_parameters(req, max_tokens)
        tools = tool_mode(req) if chat else None
        return [Choice(index=i * req.n + j, prompt=text, sampling=for_choice(values, j), echo=echo, tool_mode=tools)
                for i, (text, echo) in enumerate(prompts) for j in range(req.n)]

    async def generate(self, request: Request, chat: bool) -> Response:
        endpoint = "chat" if chat else "completions"
        t0 = time.monotonic()
        model_name = "-"
        try:
            req = await self.read_body(request, ChatCompletionRequest if chat else CompletionRequest,
                                       f"/v1/{'chat/' if chat else ''}completions")
            model = await self.served(req.model)
            model_name = model.name
            choices = await self.choices(chat, req, model)
        except OpenAIError as exc:
            return self.refused(endpoint, model_name, exc)
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        generation = Generation(self.triton, model, choices, bool(req.stream), request_id)
        created = int(time.time())
        self.metrics.running.inc(model.name)
        if req.stream:
            return await self.stream(request, endpoint, chat, req, generation, created, t0)
        try:
            await until_disconnected(request, generation.run())
        except ClientGone:
            self.metrics.cancelled.inc(endpoint, model.name)
            return self.finished(endpoint, model.name, 499, t0, Response(status_code=499))
        except UpstreamError as exc:
            return self.refused(endpoint, model.name, from_upstream(exc.message, exc.status, model.name), running=True)
        except Exception as exc:  # a bug here must not leave the request counted as running
            log.exception("%s %s failed", endpoint, model.name)
            return self.refused(endpoint, model.name, OpenAIError(500, f"internal error: {exc}"), running=True)
        total = usage(choices, req.n)
        self.count_tokens(model.name, total)
        build = responses.chat_completion if chat else responses.completion
        return self.finished(endpoint, model.name, 200, t0,
                             JSONResponse(build(request_id, created, model.name, choices, total)))

    async def stream(self, request: Request, endpoint: str, chat: bool, req: SamplingFields,
                     generation: Generation, created: int, t0: float) -> Response:
        model = generation.model.name
        options = req.stream_options
        include_usage = bool(options and options.include_usage)
        writer = responses.ChunkWriter(chat, generation.request_id, created, model,
                                       bool(options and options.continuous_usage_stats))
        pieces = generation.pieces()
        try:  # the first piece decides the status: an error before any text is a plain error response
            first = await until_disconnected(request, _first(pieces))
        except ClientGone:
            self.metrics.cancelled.inc(endpoint, model)
            return self.finished(endpoint, model, 499, t0, Response(status_code=499))
        except UpstreamError as exc:
            await pieces.aclose()
            return self.refused(endpoint, model, from_upstream(exc.message, exc.status, model), running=True)
        self.metrics.ttft.observe(time.monotonic() - t0, model)

        async def body():
            status, done = 200, False
            try:
                item = first
                while item is not None:
                    choice, piece = item
                    so_far = usage(generation.choices, req.n) if writer.continuous_usage else None
                    chunk = writer.piece(choice, piece.text, choice.finish_reason if piece.final else None, so_far,
                                         piece.num_output_tokens, piece.logprobs)
                    if chunk is not None:
                        yield chunk
                    item = await _first(pieces)
                total = usage(generation.choices, req.n)
                self.count_tokens(model, total)
                if include_usage:
                    yield writer.usage(total)
                done = True
            except UpstreamError as exc:  # after the first chunk: the error goes into the stream
                error = from_upstream(exc.message, exc.status, model)
                status, done = error.status, True
                self.metrics.errors.inc(endpoint, model, error.type)
                yield writer.error(error.body())
            except Exception as exc:  # a bug here still ends the stream, with an error event
                log.exception("%s %s: the stream failed", endpoint, model)
                status, done = 500, True
                self.metrics.errors.inc(endpoint, model, "server_error")
                yield writer.error(OpenAIError(500, f"internal error: {exc}").body())
            finally:
                await pieces.aclose()
                if not done:  # cancelled: the client went away
                    status = 499
                    self.metrics.cancelled.inc(endpoint, model)
                self.finished(endpoint, model, status, t0, None)
            yield responses.DONE

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # ------------------------------------------------------------------ bookkeeping

    def count_tokens(self, model: str, total: Usage) -> None:
        self.metrics.prompt_tokens.inc(model, amount=total.prompt_tokens)
        self.metrics.completion_tokens.inc(model, amount=total.completion_tokens)

    def finished(self, endpoint: str, model: str, status: int, t0: float, response: Response | None):
        self.metrics.running.dec(model)
        self.metrics.requests.inc(endpoint, model, str(status))
        self.metrics.latency.observe(time.monotonic() - t0, endpoint, model)
        return response

    def refused(self, endpoint: str, model: str, exc: OpenAIError, running: bool = False) -> JSONResponse:
        """The error response; `running`: the request was counted as running (it no longer is)."""
        if running:
            self.metrics.running.dec(model)
        self.metrics.requests.inc(endpoint, model, str(exc.status))
        self.metrics.errors.inc(endpoint, model, exc.type)
        if exc.status >= 500:
            log.warning("%s %s: %s", endpoint, model, exc.message)
        return JSONResponse(exc.body(), status_code=exc.status)


async def _first(pieces):
    """The next (choice, piece), or None at the end."""
    try:
        return await pieces.__anext__()
    except StopAsyncIteration:
        return None


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnected(request: Request, awaitable):
    """The awaitable's result, unless the client disconnects first: then it is cancelled (ClientGone)."""
    work = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
        watch.cancel()
    if work.cancelled():
        raise ClientGone()
    return work.result()


def create_app(settings: Settings) -> FastAPI:
    front = Front(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        front.triton = Triton(settings.grpc_url, list(settings.models), settings.triton_headers or None)
        front._tokenizer_lock = asyncio.Lock()
        warm = asyncio.ensure_future(_warm_up(front))
        try:
            yield
        finally:
            warm.cancel()
            await front.triton.close()

    app = FastAPI(title="tritonllm OpenAI-compatible API", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.front = front

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, exc: OpenAIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        message = f"{request.method} {request.url.path}: {exc.detail}"
        type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(message, type), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        log.exception("%s %s failed", request.method, request.url.path)
        return JSONResponse(error_body(f"internal error: {exc}", "server_error"), status_code=500)

    @app.get("/v1/models")
    async def list_models(request: Request):
        front.check_key(request)
        return {"object": "list", "data": [await front.model_card(m) for m in await front.ready_models()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request):
        front.check_key(request)
        ready = {m.name: m for m in await front.ready_models()}
        if model_id not in ready:
            raise unknown_model(model_id, sorted(ready))
        return await front.model_card(ready[model_id])

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await front.generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await front.generate(request, chat=True)

    @app.get("/health")
    async def health():
        if await front.triton.live():
            return Response(status_code=200)
        return JSONResponse(error_body(f"Triton at {settings.grpc_url} is not live", "service_unavailable_error"),
                            status_code=503)

    @app.get("/health/ready")
    async def ready():
        server = await front.triton.server_ready()
        states = await front.triton.readiness(fresh=True)
        tokenizer = "not loaded"
        if server:
            try:
                tokenizer = (await front.tokenizer()).path
            except OpenAIError as exc:
                tokenizer = f"not loaded: {exc.message}"
        body = {"triton": "ready" if server else "not ready", "tokenizer": tokenizer,
                "models": {name: "ready" if ok else "not ready" for name, ok in states.items()}}
        ok = server and all(states.values()) and front._tokenizer is not None
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(front.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/version")
    async def version():
        from importlib.metadata import version as dist_version
        return {"version": dist_version("tritonllm")}

    @app.post("/tokenize")
    @app.post("/v1/tokenize")
    async def tokenize(request: Request):
        req = await front.read_body(request, TokenizeRequest, "/tokenize")
        model = await front.served(req.model)
        tokenizer = await front.tokenizer()
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("send either prompt or messages", "prompt")
        if req.messages is not None:
            text = tokenizer.chat_prompt(req.messages, req.add_generation_prompt)
            tokens = tokenizer.encode(text, add_special_tokens=False)
        else:
            tokens = tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return {"count": len(tokens), "max_model_len": model.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    @app.post("/v1/detokenize")
    async def detokenize(request: Request):
        req = await front.read_body(request, DetokenizeRequest, "/detokenize")
        await front.served(req.model)
        return {"prompt": (await front.tokenizer()).decode(req.tokens)}

    return app


async def _warm_up(front: Front) -> None:
    """Load the tokenizer and the models' configs before the first request needs them."""
    for _ in range(600):
        try:
            if await front.triton.server_ready():
                await front.tokenizer()
                return
        except Exception as exc:  # noqa: BLE001 - retried; the routes report it if it lasts
            log.debug("warm-up: %s", exc)
        await asyncio.sleep(1)
