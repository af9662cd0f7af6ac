"""An OpenAI request's sampling fields -> the `sampling_parameters` every model reads.

The keys and their checks are the models' own (`engine/sampling_params.py`): the front validates
with the same `SamplingParams`, so a bad value is refused before it reaches Triton, with the same
message the model would give, as a 400 naming the field. What the models cannot honour is refused
here with the reason, rather than silently ignored.
"""

from __future__ import annotations

from typing import Any

from tritonllm.engine.sampling_params import SamplingParams
from tritonllm.errors import RequestError
from tritonllm.openai.errors import bad_request, from_request_error
from tritonllm.openai.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from tritonllm.openai.structured import structured_outputs_of

# OpenAI / vLLM field -> the models' sampling key (the same name, except where noted).
PASSED = ("temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens",
          "repetition_penalty", "presence_penalty", "frequency_penalty", "skip_special_tokens")
MAX_N = 16  # choices per prompt; each is its own request upstream


def refuse_unsupported(req: SamplingFields) -> None:
    """400 for fields whose meaning the models cannot deliver."""
    if req.min_p not in (None, 0, 0.0):
        raise bad_request("min_p is not supported by these models' sampler (use top_p or top_k)", "min_p")
    if not 1 <= req.n <= MAX_N:
        raise bad_request(f"n must be between 1 and {MAX_N}, got {req.n}", "n")
    if req.best_of not in (None, req.n):
        raise bad_request("best_of is not supported; leave it out or equal to n", "best_of")
    if req.logit_bias:
        raise bad_request("logit_bias is not supported by these models' sampler", "logit_bias")
    if isinstance(req, CompletionRequest) and req.suffix:
        raise bad_request("suffix (insertion) is not supported", "suffix")
    if isinstance(req, ChatCompletionRequest) and req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")


def logprob_values(req: SamplingFields) -> dict[str, Any]:
    """The models' logprob keys for a request: completions' `logprobs: N` (and the prompt's under
    `echo`), chat's `logprobs: true` with `top_logprobs: N`."""
    if isinstance(req, CompletionRequest):
        if req.logprobs is None:
            return {}
        return {"logprobs": req.logprobs, **({"prompt_logprobs": req.logprobs} if req.echo else {})}
    if isinstance(req, ChatCompletionRequest) and req.logprobs:
        return {"logprobs": req.top_logprobs or 0}
    return {}


def max_tokens_of(req: SamplingFields) -> int | None:
    """max_completion_tokens (chat's newer name) wins over max_tokens; None: not given."""
    return req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens


def sampling_parameters(req: SamplingFields, max_tokens: int) -> dict[str, Any]:
    """The validated `sampling_parameters` JSON object for one choice (seed as given)."""
    refuse_unsupported(req)
    values: dict[str, Any] = {"max_tokens": max_tokens}
    for key in PASSED:
        value = getattr(req, key)
        if value is not None:
            values[key] = value
    if values.get("stop") == []:
        del values["stop"]
    values.update(logprob_values(req))
    spec = structured_outputs_of(req)
    if spec is not None:
        values["structured_outputs"] = spec
    try:
        SamplingParams.from_dict(values)
    except RequestError as exc:
        param = "max_completion_tokens" if exc.field == "max_tokens" and req.max_completion_tokens is not None \
            else "top_logprobs" if exc.field == "logprobs" and isinstance(req, ChatCompletionRequest) else exc.field
        raise from_request_error(exc, str(exc).replace("sampling parameter", "field", 1), param) from None
    return values


def for_choice(values: dict[str, Any], choice: int) -> dict[str, Any]:
    """Choice i of n gets seed + i, so that seeded choices differ from each other and repeat across calls."""
    if choice == 0 or values.get("seed") is None:
        return values
    return {**values, "seed": (values["seed"] + choice) % 2**63}
