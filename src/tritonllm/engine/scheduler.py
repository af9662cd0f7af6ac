"""Token-level scheduler: decides, every step, which tokens of which sequences go into the forward.

Pure Python (no torch), so it is tested on its own. Each step:
1. every running sequence that is decoding gets one token, and a KV block when it fills its last;
2. running sequences still in (chunked) prefill get their next prompt chunk (a sequence resumed
   after preemption recomputes its prompt, then its generated tokens);
3. waiting sequences are admitted first-come first-served while a row is free (`max_num_seqs`)
   and their prompt's blocks fit in the KV pool (block_manager.py; blocks found in the prefix
   cache are shared, and their tokens are not computed again),
all under `max_num_batched_tokens`. A prompt chunk cut short by the budget ends on a multiple of
`chunk_align` (the runner's prefill tile), so that its rows are computed as in any other cut
(batch invariance); a prompt that would get less than that waits for the next step. (A budget
that cannot hold one tile beside a full step of decodes turns the alignment off.)

When a decoding sequence needs a block and the pool has none, the newest running sequence is
preempted (vLLM V1's rule): its blocks are released and it waits at the head of the queue to be
computed again. Its answer does not change: the runner computes its prompt and its generated
tokens by the same paths as the first time (batch invariance, tested).

With `batch_policy="request"` the same scheduler does request-level (static/dynamic) batching:
waiting sequences are admitted only when the batch is empty, each reserving blocks for its whole
prompt + max_tokens (nothing is preempted), and a finished sequence keeps its row in the forward
(fed padding, as `model.generate` does) until the batch's longest member ends.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from tritonllm.engine.block_manager import BlockManager
from tritonllm.engine.sequence import Sequence, Status
from tritonllm.errors import Fault, RequestError, parse_bool


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 16  # rows: sequences in one forward
    max_model_len: int = 2048  # prompt + generated tokens of one sequence
    max_num_batched_tokens: int = 512  # tokens in one forward (decodes + prefill chunks)
    batch_policy: str = "continuous"  # or "request": a batch is admitted together and runs to its end
    block_size: int = 64  # tokens per KV block (a multiple of the runner's prefill tile)
    # KV pool: this many blocks; else kv_cache_memory_gb of memory (the engine converts it); else
    # (both 0) room for max_num_seqs sequences of max_model_len, as fixed slots would reserve.
    num_kv_blocks: int = 0
    kv_cache_memory_gb: float = 0.0
    enable_prefix_caching: bool = True
    # Every row's bits independent of what shares its step (README "Batch invariance"). On CPUs with
    # AMX it costs matmul calls (linear.py's call_ranges); false: one call a weight a step, as vLLM
    # runs unless VLLM_BATCH_INVARIANT is set (a prefix-cache hit is then close to a cold prefill, not equal).
    batch_invariant: bool = True

    def __post_init__(self) -> None:
        if self.batch_policy not in ("continuous", "request"):
            raise ValueError(f"batch_policy must be 'continuous' or 'request', got {self.batch_policy!r}")
        if self.num_kv_blocks < 0 or self.kv_cache_memory_gb < 0:
            raise ValueError("num_kv_blocks and kv_cache_memory_gb must be >= 0")
        for name in ("max_num_seqs", "max_model_len", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) so that every running sequence can decode each step"
            )

    @classmethod
    def from_parameters(cls, params: dict[str, str], **fixed) -> "SchedulerConfig":
        """From config.pbtxt parameters (vLLM's names, string values); `fixed` wins over them."""
        defaults = cls()
        values = {}
        for name, default in vars(defaults).items():
            if name == "batch_policy" or name not in params:
                continue
            text = params[name].strip()
            if isinstance(default, bool):
                values[name] = parse_bool(text, name, f"parameter {name}")
            else:
                values[name] = type(default)(text)
        return cls(**{**values, **fixed})

    @property
    def pool_blocks(self) -> int:
        """Blocks of the KV pool, the null block included (when given in blocks or left default)."""
        per_seq = -(-self.max_model_len // self.block_size)
        return (self.num_kv_blocks or self.max_num_seqs * per_seq) + 1


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
        self.blocks = BlockManager(config.pool_blocks, config.block_size, config.enable_prefix_caching,
                                   lane_blocks=-(-config.max_model_len // config.block_size))
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.padded: list[Sequence] = []  # request policy: finished rows still in the batch
        self.num_preemptions = 0

    def check_fits(self, seq: Sequence) -> None:
        """Raise RequestError if the sequence could never run."""
        if seq.num_prompt == 0:
            raise RequestError("the prompt is empty", "prompt")
        if seq.max_total_tokens > self.config.max_model_len:
            raise RequestError(
                f"prompt ({seq.num_prompt} tokens) + max_tokens ({seq.params.max_tokens}) = "
                f"{seq.max_total_tokens} exceeds max_model_len ({self.config.max_model_len})", "max_tokens", Fault.TOO_LONG)
        pool_tokens = self.blocks.num_usable * self.config.block_size
        if seq.max_total_tokens > pool_tokens:
            raise RequestError(
                f"prompt ({seq.num_prompt} tokens) + max_tokens ({seq.params.max_tokens}) = "
                f"{seq.max_total_tokens} exceeds the KV cache ({pool_tokens} tokens)", "max_tokens", Fault.TOO_LONG)

    def add(self, seq: Sequence) -> None:
        self.check_fits(seq)
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        for seq in list(self.running):  # oldest first: the newest are preempted first
            if seq in self.running and seq.num_tokens - seq.num_computed == 1 and self._grow(seq):
                chunks.append(ScheduledChunk(seq, seq.num_computed, 1))
                budget -= 1
        for seq in self.running:  # prompts (and resumed sequences) catching up
            if seq.num_tokens - seq.num_computed > 1 and budget > 0:
                chunk = self._prefill_chunk(seq, budget)
                if chunk is not None:
                    chunks.append(chunk)
                    budget -= chunk.num_tokens
        if self.config.batch_policy == "request":
            if self.running:  # the batch runs on with its finished rows as padding; nobody joins
                last = self.config.max_model_len - 1
                return chunks + [ScheduledChunk(s, min(s.num_tokens, last), 1, padding=True) for s in self.padded]
        while self.waiting and len(self.running) < self.config.max_num_seqs and budget > 0:
            chunk = self._admit(self.waiting[0], budget)
            if chunk is None:  # first come, first served: nobody overtakes it
                break
            self.running.append(self.waiting.popleft())
            chunks.append(chunk)
            budget -= chunk.num_tokens
        return chunks

    def _admit(self, seq: Sequence, budget: int) -> ScheduledChunk | None:
        """Give the sequence its blocks and its first chunk, or None if it must wait."""
        # Prompt logprobs need every prompt position's logits: such a prompt is computed, not taken from the cache.
        needs_logits = seq.params.prompt_logprobs is not None and len(seq.prompt_logprobs) < seq.num_prompt
        cached = [] if needs_logits else self.blocks.cached_prefix(seq.prompt_ids)
        holds = seq.max_total_tokens if self.config.batch_policy == "request" else seq.num_tokens
        if not self.blocks.can_allocate(holds, cached):
            return None
        seq.num_computed = len(cached) * self.config.block_size
        chunk = self._prefill_chunk(seq, budget)
        if chunk is None:
            seq.num_computed = 0
            return None
        seq.block_table = self.blocks.allocate(holds, cached)
        seq.block_hashes = [self.blocks.blocks[b].hash for b in cached]
        seq.num_cached_tokens = seq.num_computed
        self.blocks.prefix_queries += seq.num_prompt
        self.blocks.prefix_hits += seq.num_cached_tokens
        seq.status = Status.RUNNING
        return chunk

    def _grow(self, seq: Sequence) -> bool:
        """A block for the sequence's next token, preempting the newest sequences until one is free;
        False if the sequence itself was preempted."""
        while not self.blocks.grow(seq.block_table, seq.num_tokens):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def preempt(self, seq: Sequence) -> None:
        """Release a running sequence's blocks; it waits at the head of the queue to be recomputed."""
        self.running.remove(seq)
        self.blocks.release(seq.block_table)
        seq.block_hashes = []
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def _prefill_chunk(self, seq: Sequence, budget: int) -> ScheduledChunk | None:
        """The sequence's next chunk within `budget`, or None if it must wait a step: the rest of
        its prompt, then (resumed after preemption) the rest of its generated tokens."""
        start = seq.num_computed
        in_prompt = start < seq.num_prompt
        n = (seq.num_prompt if in_prompt else seq.num_tokens) - start
        if n > budget:  # cut short: a prompt chunk ends on an aligned position (generated rows need not)
            n = (start + budget) // self.chunk_align * self.chunk_align - start if in_prompt else budget
        return ScheduledChunk(seq, start, n) if n > 0 else None

    def advance(self, chunk: ScheduledChunk) -> None:
        """The chunk was computed: its tokens' keys and values are in the cache."""
        seq = chunk.seq
        seq.num_computed += chunk.num_tokens
        self.blocks.register(seq.block_table, seq.block_hashes, seq.prompt_ids, seq.num_computed)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark finished and release its blocks at once; nothing is copied."""
        if seq.finished:
            return
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
            if self.config.batch_policy == "request" and reason != "abort":
                self.padded.append(seq)  # its row and blocks free when the whole batch has ended
            else:
                self.blocks.release(seq.block_table)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if self.padded and not self.running:  # the batch has ended: every row frees its blocks
            for done in self.padded:
                self.blocks.release(done.block_table)
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
