"""One request's state as it moves through the engine, and what the engine reports for it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Callable

from tritonllm.engine.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprobs:
    """A token's log probability and the most likely tokens at its position (id, logprob), best first;
    logprob None for a prompt's first token (nothing before it)."""

    token: int
    logprob: float | None
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RequestOutput:
    """What a request gets after a step: only what is new since the last output."""

    request_id: str
    text: str  # new text since the previous output
    token_ids: list[int]  # new token ids since the previous output
    finished: bool
    finish_reason: str | None  # stop | length | abort | error
    num_prompt_tokens: int
    num_output_tokens: int
    arrival_time: float
    first_token_time: float | None
    token_times: list[float]  # times of the new tokens
    error: str | None = None
    logprobs: list[TokenLogprobs] | None = None  # of the new tokens, when the request asked
    prompt_logprobs: list[TokenLogprobs] | None = None  # every prompt token's, in the first output


@dataclass(eq=False)  # compared by identity
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    callback: Callable[[RequestOutput], None] | None = None
    arrival_time: float = field(default_factory=time.perf_counter)
    status: Status = Status.WAITING
    block_table: list[int] = field(default_factory=list)  # KV blocks holding its tokens, in order
    block_hashes: list[int] = field(default_factory=list)  # prefix-cache hash of each full prompt block computed
    num_computed: int = 0  # tokens whose keys/values are in the cache
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at its (last) admission
    num_preemptions: int = 0
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    first_scheduled_time: float | None = None  # first forward that computed it (the end of its wait)
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    # Filled by the engine: incremental detokenizer and sampling generator.
    detokenizer: object | None = None
    generator: object | None = None
    sent_tokens: int = 0  # output tokens already reported
    matcher: object | None = None  # the grammar's state, for a constrained request (structured_output.py)
    closing: object | None = None  # with it: how its answer closes within max_tokens (structured_output.Closing)
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # of output_ids, when asked
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # of prompt_ids, when asked
    prompt_logprobs_sent: bool = False

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.num_prompt

    @property
    def max_total_tokens(self) -> int:
        """KV room this sequence can ever need: prompt plus every token it may generate."""
        return self.num_prompt + self.params.max_tokens

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
