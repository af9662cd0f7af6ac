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
from tritonllm.openai.logprobs import chat_logprobs, completion_logprobs
from tritonllm.openai.structured import tool_calls

DONE = b"data: [DONE]\n\n"


def sse(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def completion(request_id: str, created: int, model: str, choices: list[Choice], usage: Usage) -> dict[str, Any]:
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": c.index, "text": c.echo + "".join(c.text),
                         "logprobs": completion_logprobs((c.prompt_logprobs if c.echo else []) + c.logprobs)
                         if c.wants_logprobs else None,
                         "finish_reason": c.finish_reason} for c in choices],
            "usage": usage.body()}


def chat_completion(request_id: str, created: int, model: str, choices: list[Choice], usage: Usage) -> dict[str, Any]:
    return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": c.index, "message": message(c),
                         "logprobs": chat_logprobs(c.logprobs) if c.wants_logprobs else None,
                         "finish_reason": c.finish_reason} for c in choices],
            "usage": usage.body()}


def message(c: Choice) -> dict[str, Any]:
    """A chat choice's message: its text, or its tool calls when tools were required or named (and the
    answer is complete JSON; cut off by max_tokens, it stays text, finish_reason "length")."""
    text = c.echo + "".join(c.text)
    calls = tool_calls(text, c.tool_mode) if c.tool_mode is not None else None
    if calls is None:
        return {"role": "assistant", "content": text}
    return {"role": "assistant", "content": None, "tool_calls": calls}


class ChunkWriter:
    """The stream chunks of one request (completions or chat)."""

    def __init__(self, chat: bool, request_id: str, created: int, model: str, continuous_usage: bool):
        self.chat = chat
        self.head = {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": created, "model": model}
        self.continuous_usage = continuous_usage
        self.started: set[int] = set()  # choices whose first chunk went out
        self.offsets: dict[int, int] = {}  # each choice's text sent so far, in characters

    def piece(self, choice: Choice, text: str, finish_reason: str | None, usage: Usage | None,
              tokens: int = 0, logprobs: dict | None = None) -> bytes | None:
        """The chunk for a model response of a choice with `tokens` new tokens, their `text` and
        `logprobs` (the model's output), None when it brings neither, nor the end."""
        first = choice.index not in self.started
        entries = (logprobs or {}).get("tokens", [])
        if first:
            text = choice.echo + text
            if choice.echo:
                entries = (logprobs or {}).get("prompt", []) + entries
        if not text and not tokens and finish_reason is None:
            return None
        self.started.add(choice.index)
        if self.chat:
            delta = self._delta(choice, text, first, finish_reason)
            if delta is None:
                return None
            entry = {"index": choice.index, "delta": delta,
                     "logprobs": chat_logprobs(entries) if choice.wants_logprobs else None,
                     "finish_reason": finish_reason}
        else:
            entry = {"index": choice.index, "text": text, "finish_reason": finish_reason,
                     "logprobs": completion_logprobs(entries, self._offset(choice, text)) if choice.wants_logprobs
                     else None}
        body = {**self.head, "choices": [entry]}
        if self.continuous_usage and usage is not None:
            body["usage"] = usage.body()
        return sse(body)

    def _offset(self, choice: Choice, text: str) -> int:
        """Where this chunk's text starts in the choice's whole text (completions' text_offset)."""
        start = self.offsets.get(choice.index, 0)
        self.offsets[choice.index] = start + len(text)
        return start

    def _delta(self, choice: Choice, text: str, first: bool, finish_reason: str | None) -> dict[str, Any] | None:
        """A chat chunk's delta. Tool calls stream as `delta.tool_calls`: a named function's arguments
        as they come, the calls of `required` whole at the end (their JSON must be complete to be read)."""
        mode = choice.tool_mode
        if mode is None:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
            return {} if not first and not text and finish_reason is not None else delta
        head = {"role": "assistant"} if first else {}
        if mode.named is not None:
            call: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
            if first:
                call = {"index": 0, "id": self._call_id(choice), "type": "function",
                        "function": {"name": mode.named, "arguments": text}}
            return {**head, "tool_calls": [call]} if text or first else head
        if finish_reason is None:
            return head if first else None
        calls = tool_calls("".join(choice.text), mode)
        if calls is None:  # cut off: the text as it is
            return {**head, "content": "".join(choice.text)}
        return {**head, "tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}

    def _call_id(self, choice: Choice) -> str:
        return f"call_{self.head['id'][-24:]}{choice.index}"

    def usage(self, usage: Usage) -> bytes:
        return sse({**self.head, "choices": [], "usage": usage.body()})

    def error(self, body: dict[str, Any]) -> bytes:
        return sse(body)
