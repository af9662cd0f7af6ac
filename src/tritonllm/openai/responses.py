"""OpenAI's response bodies and stream chunks, and their SSE framing (`data: {json}\n\n`, `data: [DONE]`).

Streams follow OpenAI and vLLM: one chunk per model response that brings tokens, even when their
text is empty (a special token, a character's first bytes: vLLM sends these too, and clients time
the first token by them; leaving them out made the first chunk wait a step for text),
`finish_reason` on the choice's last chunk, the chat role together with the first token (not
before it, so that a client's time to first token is the model's), then, when `stream_options.include_usage` asks,
one chunk with `choices: []` and the request's `usage` (the same counts a non-streaming call
reports); with `continuous_usage_stats`, every chunk also carries the counts so far.
"""

from __future__ import annotations

import json
from typing import Any

from tritonllm.openai.generation import Choice, Usage

DONE = b"data: [DONE]\n\n"


def sse(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def completion(request_id: str, created: int, model: str, choices: list[Choice], usage: Usage) -> dict[str, Any]:
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": c.index, "text": c.echo + "".join(c.text), "logprobs": None,
                         "finish_reason": c.finish_reason} for c in choices],
            "usage": usage.body()}


def chat_completion(request_id: str, created: int, model: str, choices: list[Choice], usage: Usage) -> dict[str, Any]:
    return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": c.index,
                         "message": {"role": "assistant", "content": c.echo + "".join(c.text)},
                         "logprobs": None, "finish_reason": c.finish_reason} for c in choices],
            "usage": usage.body()}


class ChunkWriter:
    """The stream chunks of one request (completions or chat)."""

    def __init__(self, chat: bool, request_id: str, created: int, model: str, continuous_usage: bool):
        self.chat = chat
        self.head = {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": created, "model": model}
        self.continuous_usage = continuous_usage
        self.started: set[int] = set()  # choices whose first chunk went out

    def piece(self, choice: Choice, text: str, finish_reason: str | None, usage: Usage | None,
              tokens: int = 0) -> bytes | None:
        """The chunk for a model response of a choice with `tokens` new tokens and their `text`
        (None when it brings neither, nor the end)."""
        first = choice.index not in self.started
        if first:
            text = choice.echo + text
        if not text and not tokens and finish_reason is None:
            return None
        self.started.add(choice.index)
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
            if not first and not text and finish_reason is not None:
                delta = {}
            entry = {"index": choice.index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            entry = {"index": choice.index, "text": text, "logprobs": None, "finish_reason": finish_reason}
        body = {**self.head, "choices": [entry]}
        if self.continuous_usage and usage is not None:
            body["usage"] = usage.body()
        return sse(body)

    def usage(self, usage: Usage) -> bytes:
        return sse({**self.head, "choices": [], "usage": usage.body()})

    def error(self, body: dict[str, Any]) -> bytes:
        return sse(body)
