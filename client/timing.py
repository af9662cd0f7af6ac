"""Client-side timing of one generation: time to first token, end-to-end latency, tokens/s."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tritonllm_client.contract import Chunk


@dataclass
class Timing:
    """Fed with every response of a request, in order; read once the request has ended.

    TTFT is the time until the first response that carries text or tokens: for a model that cannot
    stream it equals the end-to-end latency. tokens/s is tokens / end-to-end latency.
    """

    start: float = field(default_factory=time.perf_counter)
    first: float | None = None
    end: float | None = None
    tokens: int = 0
    finish_reason: str = ""

    def add(self, chunk: Chunk) -> None:
        now = time.perf_counter()
        if self.first is None and (chunk.text or chunk.num_tokens):
            self.first = now
        self.tokens += chunk.num_tokens
        self.finish_reason = chunk.finish_reason or self.finish_reason
        self.end = now

    def finish(self) -> "Timing":
        self.end = time.perf_counter()
        return self

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.start

    @property
    def e2e(self) -> float:
        return (self.end or time.perf_counter()) - self.start

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.e2e if self.e2e > 0 else 0.0

    def summary(self) -> str:
        ttft = "n/a" if self.ttft is None else f"{self.ttft * 1000:.0f} ms"
        line = (f"TTFT {ttft}, {self.tokens} tokens in {self.e2e:.3f} s, "
                f"{self.tokens_per_s:.1f} tokens/s")
        if self.finish_reason:
            line += f" (finish: {self.finish_reason})"
        return line
