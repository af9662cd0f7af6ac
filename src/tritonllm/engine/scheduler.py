"""Token-level scheduler: decides, every step, which tokens of which sequences go into the forward.

Pure Python (no torch), so it is tested on its own. Each step:
1. every running sequence that is decoding gets one token;
2. running sequences still in (chunked) prefill get their next prompt chunk;
3. waiting sequences are admitted first-come first-served while a slot is free,
all under `max_num_batched_tokens`. A prompt chunk cut short by the budget ends on a multiple of
`chunk_align` (the runner's prefill tile), so that its rows are computed as in any other cut
(batch invariance); a prompt that would get less than that waits for the next step. (A budget
that cannot hold one tile beside a full step of decodes turns the alignment off.) A slot holds a whole sequence (prompt + max_tokens), so an
admitted sequence never runs out of KV room and nothing needs preempting.

With `batch_policy="request"` the same scheduler does request-level (static/dynamic) batching:
waiting sequences are admitted only when the batch is empty, and a finished sequence keeps its
row in the forward (fed padding, as `model.generate` does) until the batch's longest member ends.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from tritonllm.engine.sequence import Sequence, Status


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 16  # slots: sequences in one forward
    max_model_len: int = 2048  # prompt + generated tokens of one sequence
    max_num_batched_tokens: int = 512  # tokens in one forward (decodes + prefill chunks)
    batch_policy: str = "continuous"  # or "request": a batch is admitted together and runs to its end

    def __post_init__(self) -> None:
        if self.batch_policy not in ("continuous", "request"):
            raise ValueError(f"batch_policy must be 'continuous' or 'request', got {self.batch_policy!r}")
        for name in ("max_num_seqs", "max_model_len", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) so that every running sequence can decode each step"
            )


@dataclass(frozen=True)
class ScheduledChunk:
    seq: Sequence
    start: int  # first token position computed in this step
    num_tokens: int
    padding: bool = False  # a finished row kept in a request-level batch: computed, never sampled

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the sequence's last known token, so a new token is sampled."""
        return not self.padding and self.start + self.num_tokens == self.seq.num_tokens


class Scheduler:
    def __init__(self, config: SchedulerConfig, chunk_align: int = 1):
        self.config = config
        fits_a_tile = config.max_num_batched_tokens - config.max_num_seqs >= chunk_align
        self.chunk_align = chunk_align if fits_a_tile else 1
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.free_slots: list[int] = list(range(config.max_num_seqs - 1, -1, -1))
        self.padded: list[Sequence] = []  # request policy: finished rows still in the batch

    def check_fits(self, seq: Sequence) -> None:
        """Raise ValueError if the sequence could never run."""
        if seq.num_prompt == 0:
            raise ValueError("the prompt is empty")
        if seq.max_total_tokens > self.config.max_model_len:
            raise ValueError(
                f"prompt ({seq.num_prompt} tokens) + max_tokens ({seq.params.max_tokens}) = "
                f"{seq.max_total_tokens} exceeds max_model_len ({self.config.max_model_len})"
            )

    def add(self, seq: Sequence) -> None:
        self.check_fits(seq)
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        decoding = [s for s in self.running if not s.in_prefill]
        prefilling = [s for s in self.running if s.in_prefill]
        for seq in decoding:
            chunks.append(ScheduledChunk(seq, seq.num_computed, seq.num_tokens - seq.num_computed))
            budget -= chunks[-1].num_tokens
        for seq in prefilling:
            chunk = self._prefill_chunk(seq, budget) if budget > 0 else None
            if chunk is not None:
                chunks.append(chunk)
                budget -= chunk.num_tokens
        if self.config.batch_policy == "request":
            if self.running:  # the batch runs on with its finished rows as padding; nobody joins
                last = self.config.max_model_len - 1
                return chunks + [ScheduledChunk(s, min(s.num_tokens, last), 1, padding=True) for s in self.padded]
        while self.waiting and self.free_slots and budget > 0:
            chunk = self._prefill_chunk(self.waiting[0], budget)
            if chunk is None:  # first come, first served: nobody overtakes it
                break
            seq = self.waiting.popleft()
            seq.slot = self.free_slots.pop()
            seq.status = Status.RUNNING
            self.running.append(seq)
            chunks.append(chunk)
            budget -= chunk.num_tokens
        return chunks

    def _prefill_chunk(self, seq: Sequence, budget: int) -> ScheduledChunk | None:
        """The sequence's next prompt chunk within `budget`, or None if it must wait a step."""
        start, n = seq.num_computed, seq.num_prompt - seq.num_computed
        if n > budget:  # cut short: end on an aligned position
            n = (start + budget) // self.chunk_align * self.chunk_align - start
        return ScheduledChunk(seq, start, n) if n > 0 else None

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark finished and give its slot back at once; nothing is copied."""
        if seq.finished:
            return
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.slot is not None:
            if self.config.batch_policy == "request" and reason != "abort":
                self.padded.append(seq)  # its slot frees when the whole batch has ended
            else:
                self.free_slots.append(seq.slot)
                seq.slot = None
        if self.padded and not self.running:  # the batch has ended: every row frees its slot
            for done in self.padded:
                self.free_slots.append(done.slot)
                done.slot = None
            self.padded.clear()

    def find(self, request_id: str) -> Sequence | None:
        for seq in (*self.running, *self.waiting):
            if seq.request_id == request_id:
                return seq
        return None

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)
