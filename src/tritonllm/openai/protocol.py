"""The request bodies of the OpenAI routes, lenient as vLLM's server.

Every field the issue's clients send is typed here; a field not named is kept (`extra="allow"`),
ignored and logged once per route (`unknown_fields`), never refused: `vllm bench serve`, aiperf
and guidellm each add fields of their own. A field of the wrong type is a 400 naming it.
Fields that ask for what the models cannot give (min_p, logit_bias, best_of > n, suffix,
tool_choice "auto") are refused in `sampling.py` and `structured.py` with the reason.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Union

from pydantic import BaseModel, ConfigDict, ValidationError

from tritonllm.openai.errors import OpenAIError, bad_request

log = logging.getLogger(__name__)


class Lenient(BaseModel):
    model_config = ConfigDict(extra="allow", protected_namespaces=())


class StreamOptions(Lenient):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class SamplingFields(Lenient):
    """What completions and chat share: vLLM's names, None = the model's default."""

    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    skip_special_tokens: bool | None = None
    n: int = 1
    best_of: int | None = None
    user: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's constrained decoding (openai/structured.py), and its older names
    structured_outputs: dict[str, Any] | None = None
    guided_json: Union[dict[str, Any], str, None] = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(SamplingFields):
    prompt: Any = None  # a string, a list of strings, token ids or a list of token-id lists (prompts.py)
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None


class TextPart(Lenient):
    type: str = "text"
    text: str | None = None


class ChatMessage(Lenient):
    role: str
    content: Union[str, list[TextPart], None] = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool | None = False


class TokenizeRequest(Lenient):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(Lenient):
    model: str | None = None
    tokens: list[int]


_seen_unknown: set[tuple[str, str]] = set()


def unknown_fields(route: str, request: BaseModel) -> list[str]:
    """The fields a request sent that no model here reads; each is logged once per route."""
    names = sorted((request.model_extra or {}).keys())
    for name in names:
        if (route, name) not in _seen_unknown:
            _seen_unknown.add((route, name))
            log.warning("%s: ignoring unknown field %r (logged once)", route, name)
    return names


def parse_body(raw: bytes, model: type[BaseModel]) -> BaseModel:
    """Validate a JSON body; any problem is a 400 naming the field."""
    try:
        data = json.loads(raw) if raw.strip() else None
    except (ValueError, RecursionError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc) from None


def _validation_error(exc: ValidationError) -> OpenAIError:
    errors = exc.errors(include_url=False)
    first = errors[0]
    param = ".".join(str(part) for part in first["loc"] if not str(part).startswith(("function-", "union[")))
    # A union reports every branch; its first branch's message names the field well enough.
    message = f"{param or 'body'}: {first['msg']}"
    if first.get("input") is not None and first["type"] != "missing":
        shown = repr(first["input"])
        message += f", got {shown if len(shown) <= 80 else shown[:80] + '...'}"
    if len(errors) > 1 and len({e['loc'][:1] for e in errors}) > 1:
        message += f" (and {len(errors) - 1} more problems)"
    return bad_request(message, param=param.split(".")[0] if param else None)
