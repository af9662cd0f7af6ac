"""An OpenAI-compatible HTTP front for the three models (`tritonllm-openai`).

It speaks OpenAI's API over HTTP (FastAPI/Starlette on uvicorn) and Triton's over gRPC
(`tritonclient.grpc.aio`): a stream per request to the decoupled `llm_inflight`, an infer call to
the batching models. Nothing here runs a model: prompts and sampling keys are translated into the
request contract that every model already speaks (DESIGN section 3; `triton/request.py`,
`engine/sampling_params.py`, `client/contract.py`), so answers, counts and finish reasons are the
models' own.

One concept per file:
- `errors.py`       OpenAI's error shape, and which status each failure gets
- `protocol.py`     the request bodies, lenient as vLLM's server (unknown fields ignored, logged once)
- `sampling.py`     an OpenAI request's sampling fields -> the models' `sampling_parameters`
- `prompts.py`      the tokenizer: prompts in every OpenAI form, chat templates, tokenize/detokenize
- `upstream.py`     Triton over async gRPC: models, readiness, one generate call
- `generation.py`   the choices of one request (n x prompts), run together, as one stream of pieces
- `responses.py`    OpenAI's response and stream-chunk bodies, and SSE framing
- `metrics.py`      the front's own Prometheus metrics
- `app.py`          the FastAPI application: routes, API key, errors, disconnects
- `cli.py`          `tritonllm-openai`
- `process.py`      the front as a child process (the launcher and the tests start it so)
"""
