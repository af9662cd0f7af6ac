"""The choices of one OpenAI request, run together upstream and seen as one stream of pieces.

A request has one choice per prompt and per `n`: choice `i` is prompt `i // n`, sample `i % n`,
and each is its own request to the model (the engine batches them). `pieces()` yields
`(choice, Piece)` in the order the model answers; one choice that fails ends the whole request,
and leaving the iteration early cancels every choice still running upstream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from tritonllm.openai.structured import ToolMode
from tritonllm.openai.upstream import Piece, ServedModel, Triton

_DONE = object()


@dataclass
class Choice:
    index: int
    prompt: str
    sampling: dict[str, Any]
    echo: str = ""  # text shown before the answer (`echo`)
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    tool_mode: ToolMode | None = None  # the answer is read as tool calls (structured.py)
    logprobs: list[dict] = field(default_factory=list)  # the models' entries, when asked
    prompt_logprobs: list[dict] = field(default_factory=list)

    def add(self, piece: Piece) -> None:
        self.text.append(piece.text)
        self.completion_tokens += piece.num_output_tokens
        if piece.num_input_tokens is not None:
            self.prompt_tokens = piece.num_input_tokens
        if piece.logprobs:
            self.logprobs += piece.logprobs.get("tokens", [])
            self.prompt_logprobs += piece.logprobs.get("prompt", [])
        if piece.final:
            self.finish_reason = finish_reason(piece.finish_reason)
            if self.finish_reason == "stop" and self.tool_mode is not None and self.tool_mode.named is None:
                self.finish_reason = "tool_calls"  # OpenAI's reason when the model had to call tools

    @property
    def wants_logprobs(self) -> bool:
        return "logprobs" in self.sampling


def finish_reason(reason: str | None) -> str:
    """The engine's reason as OpenAI names it (stop and length are the same words)."""
    return reason if reason in ("stop", "length") else (reason or "stop")


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def body(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.total_tokens}


def usage(choices: list[Choice], n: int) -> Usage:
    """Prompt tokens once per prompt (not per sample), completion tokens of every choice."""
    return Usage(sum(c.prompt_tokens for c in choices if c.index % n == 0),
                 sum(c.completion_tokens for c in choices))


class Generation:
    """The choices of one request against one model."""

    def __init__(self, triton: Triton, model: ServedModel, choices: list[Choice], stream: bool, request_id: str):
        self.triton = triton
        self.model = model
        self.choices = choices
        self.stream = stream
        self.request_id = request_id

    def _one(self, choice: Choice) -> AsyncIterator[Piece]:
        return self.triton.generate(self.model, choice.prompt, choice.sampling, self.stream,
                                    f"{self.request_id}-{choice.index}")

    async def pieces(self) -> AsyncIterator[tuple[Choice, Piece]]:
        """Every piece of every choice, as it comes; each is also added to its choice."""
        if len(self.choices) == 1:  # the common case: no task, no queue
            choice = self.choices[0]
            generator = self._one(choice)
            try:
                async for piece in generator:
                    choice.add(piece)
                    yield choice, piece
            finally:
                await generator.aclose()
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(choice: Choice) -> None:
            try:
                async for piece in self._one(choice):
                    await queue.put((choice, piece))
                await queue.put((choice, _DONE))
            except Exception as exc:  # handed to the reader, which ends the request
                await queue.put((choice, exc))

        tasks = [asyncio.ensure_future(pump(c)) for c in self.choices]
        try:
            running = len(tasks)
            while running:
                choice, item = await queue.get()
                if item is _DONE:
                    running -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    choice.add(item)
                    yield choice, item
        finally:
            for task in tasks:
                task.cancel()  # their generators cancel upstream
            await asyncio.gather(*tasks, return_exceptions=True)

    async def run(self) -> list[Choice]:
        """Run to the end (no streaming to the client): every choice complete."""
        async for _ in self.pieces():
            pass
        return self.choices
