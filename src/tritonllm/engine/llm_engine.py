"""The in-flight batching engine: scheduler + model runner + sampler + detokenizer, one step at a time.

`step()` runs one forward for everything the scheduler picked, samples one token for each
sequence that reached its last known token, and reports what is new. Finished sequences leave
at once and waiting ones take their slot in the next step. `add_request` and `abort` are safe to
call from any thread: they go through an inbox that the stepping thread drains. `start()` runs
`step()` in a background thread; one thread owns all model state.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Callable

from tritonllm.engine.detokenizer import OutputText
from tritonllm.engine.kv_cache import PagedKVCache
from tritonllm.engine.model_runner import Chunk, ModelRunner
from tritonllm.kernels.prefill_attention import PREFILL_TILE
from tritonllm.engine.sampler import Sampler, record_prompt_logprobs
from tritonllm.engine.sampling_params import SamplingParams
from tritonllm.engine.scheduler import Scheduler, SchedulerConfig
from tritonllm.engine.sequence import RequestOutput, Sequence, TokenLogprobs
from tritonllm.engine.structured_output import GrammarCompiler

log = logging.getLogger(__name__)


@dataclass
class EngineStats:
    steps: int = 0  # forwards run
    decode_steps: int = 0  # forwards that produced at least one token
    tokens_generated: int = 0
    prompt_tokens: int = 0
    # What each forward computed, every scheme counted alike (report: waste and occupancy).
    rows_computed: int = 0  # token rows of every forward: prompt rows, decode rows, padding rows
    padding_rows: int = 0  # rows of finished members kept in a request-level batch (no token)
    sequence_rows: int = 0  # sequences in every forward (padding members included)
    slot_steps: int = 0  # max_num_seqs x forwards: the sequences the cap allowed
    requests_scheduled: int = 0  # requests that got their first forward
    queue_seconds: float = 0.0  # summed over them: arrival at the engine to first forward
    preemptions: int = 0  # sequences preempted for KV blocks (the scheduler's count)
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache at admission
    prefix_cache_hits: int = 0  # of them, found

    @property
    def waste(self) -> float:
        """Rows computed that made no token / rows computed: prompt rows before a prompt's last, padding."""
        return 1 - self.tokens_generated / self.rows_computed if self.rows_computed else 0.0

    @property
    def occupancy(self) -> float:
        """Sequences computed / sequences the cap allowed, over every forward."""
        return self.sequence_rows / self.slot_steps if self.slot_steps else 0.0


class LLMEngine:
    def __init__(self, model, tokenizer, config: SchedulerConfig | None = None, quantization: str | None = None):
        self.config = kv_pool_in_blocks(config or SchedulerConfig(), model)
        if self.config.block_size % PREFILL_TILE:
            raise ValueError(f"block_size ({self.config.block_size}) must be a multiple of {PREFILL_TILE}, the "
                             "prefill tile (a cached prefix must end where a cold prompt's tile does)")
        self.tokenizer = tokenizer
        self.scheduler = Scheduler(self.config, chunk_align=PREFILL_TILE)
        self.runner = ModelRunner(model, self.config.max_num_seqs, self.config.max_model_len, quantization,
                                  self.config.pool_blocks, self.config.block_size, self.config.batch_invariant)
        self.sampler = Sampler(eos_token_ids(model, tokenizer))
        self.grammars = GrammarCompiler(tokenizer, model.config.vocab_size, self.sampler.eos_token_ids)
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.sampler.eos_token_ids)
        self.stats = EngineStats()
        self._ids = itertools.count()
        self._inbox: deque[Sequence] = deque()
        self._aborts: deque[str] = deque()
        self._abort_scope: str | None = None  # "waiting" or "all": abort_all() asked for it
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False

    @classmethod
    def from_spec(cls, model: str | None = None, device: str | None = None, dtype: str | None = None,
                  quantization: str | None = None, **config) -> "LLMEngine":
        from tritonllm.engine.model_loader import load_model

        hf_model, tokenizer = load_model(model, device, dtype)
        return cls(hf_model, tokenizer, SchedulerConfig(**config), quantization)

    # ---- requests (any thread) ----

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    callback: Callable[[RequestOutput], None] | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request; raises ValueError at once if it can never run."""
        params = params or SamplingParams()
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        seq = Sequence(request_id or f"req-{next(self._ids)}", prompt_ids, params, callback)
        self.scheduler.check_fits(seq)
        seq.detokenizer = OutputText(self.tokenizer, params.stop, params.skip_special_tokens)
        seq.generator = None if params.greedy else Sampler.make_generator(params.seed, self.runner.device)
        if params.structured_outputs is not None:  # compiled here, in the caller's thread, never in a step
            seq.matcher, seq.closing = self.grammars.start(params.structured_outputs)
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = [TokenLogprobs(prompt_ids[0], None)]  # the first prompt token has no context
        self._on_add(seq, prompt)
        with self._wake:
            self._inbox.append(seq)
            self._wake.notify()
        return seq.request_id

    def abort(self, request_id: str) -> None:
        """Finish a request with reason `abort`; its slot is free for the next step."""
        with self._wake:
            self._aborts.append(request_id)
            self._wake.notify()

    def abort_all(self, waiting_only: bool = False) -> None:
        """Finish every request not yet running (or every request) with reason `abort`."""
        with self._wake:
            if self._abort_scope != "all":
                self._abort_scope = "waiting" if waiting_only else "all"
            self._wake.notify()

    @property
    def num_waiting(self) -> int:
        return len(self._inbox) + self.scheduler.num_waiting

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    def has_unfinished(self) -> bool:
        return bool(self._inbox or self.scheduler.has_work())

    # ---- stepping (one thread) ----

    def step(self) -> list[RequestOutput]:
        outputs = self._take_inbox()
        chunks = self.scheduler.schedule()
        self._count_first_schedules(chunks)
        blocks = self.scheduler.blocks
        self.stats.preemptions = self.scheduler.num_preemptions
        self.stats.prefix_cache_queries, self.stats.prefix_cache_hits = blocks.prefix_queries, blocks.prefix_hits
        chunks = self._computable(chunks)
        if chunks:
            computed = [c.seq.num_computed for c in chunks]
            try:
                outputs += self._run(chunks)
            except Exception:  # a failed step fails the sequences that fail alone, not the engine
                log.exception("a step of %d sequences failed; running them one by one", len(chunks))
                for c, num_computed in zip(chunks, computed):
                    c.seq.num_computed = num_computed  # the step is redone from where it started
                outputs += self._run_one_by_one(chunks)
        for out, seq in outputs:
            if seq.callback is not None:
                try:
                    seq.callback(out)
                except Exception:
                    log.exception("callback of %s failed", seq.request_id)
        return [out for out, _ in outputs]

    def _count_first_schedules(self, chunks) -> None:
        now = time.perf_counter()
        for c in chunks:
            if not c.padding and c.seq.first_scheduled_time is None:
                c.seq.first_scheduled_time = now
                self.stats.requests_scheduled += 1
                self.stats.queue_seconds += now - c.seq.arrival_time

    def _take_inbox(self) -> list[tuple[RequestOutput, Sequence]]:
        with self._wake:
            arrived, self._inbox = list(self._inbox), deque()
            aborted, self._aborts = list(self._aborts), deque()
            scope, self._abort_scope = self._abort_scope, None
        for seq in arrived:
            self.scheduler.add(seq)
        outputs = []
        if scope is not None:
            doomed = list(self.scheduler.waiting) + (list(self.scheduler.running) if scope == "all" else [])
            outputs += [self._finish(seq, "abort") for seq in doomed]
        for request_id in aborted:
            seq = self.scheduler.find(request_id)
            if seq is not None:
                outputs.append(self._finish(seq, "abort"))
        return outputs

    def _run_one_by_one(self, chunks) -> list[tuple[RequestOutput, Sequence]]:
        outputs = []
        for c in chunks:
            if c.seq.finished:
                continue
            try:
                outputs += self._run([c])
            except Exception as exc:
                log.exception("%s failed alone; it ends with an error", c.seq.request_id)
                outputs.append(self._finish(c.seq, "error", f"the model failed on this request: {exc}"))
        return outputs

    # Seams for a subclass (engine/faults.py injects the test-only faults through them); here they do nothing.
    def _on_add(self, seq: Sequence, prompt) -> None:
        """A request's sequence, before it is queued."""

    def _computable(self, chunks: list) -> list:
        """The scheduled chunks this step computes."""
        return chunks

    def _run(self, chunks) -> list[tuple[RequestOutput, Sequence]]:
        batch = [Chunk(c.seq.block_table, [self.pad_token_id] if c.padding else token_slice(c.seq, c.start, c.num_tokens),
                       c.start, c.samples, c.seq.num_prompt, wants_prompt_logprobs(c)) for c in chunks]
        logits = self._sampled_rows(self.runner.forward(batch), batch, chunks)
        self._count_rows(batch, chunks)
        for c in chunks:
            if c.padding:
                continue
            self.scheduler.advance(c)
            if c.start < c.seq.num_prompt:
                self.stats.prompt_tokens += min(c.num_tokens, c.seq.num_prompt - c.start)
        sampling = [c.seq for c in chunks if c.samples]
        self.stats.steps += 1
        if not sampling:
            return []
        self.stats.decode_steps += 1
        self.stats.tokens_generated += len(sampling)
        now = time.perf_counter()
        outputs = []
        for seq, token in zip(sampling, self.sampler(logits, sampling)):
            reason = self._append_token(seq, token, now)
            if reason == "error":
                outputs.append(self._finish(seq, reason, f"the grammar refused token {token}: {seq.matcher.get_error()}"))
            else:
                outputs.append(self._finish(seq, reason) if reason else (self._output(seq), seq))
        return outputs

    def _sampled_rows(self, logits, batch: list[Chunk], chunks):
        """The logits rows to sample from; every row of a prompt-logprobs chunk is recorded first."""
        if not any(b.all_logits for b in batch):
            return logits
        rows, row = [], 0
        for b, c in zip(batch, chunks):
            n = len(b.token_ids) if b.all_logits else int(b.wants_logits)
            if b.all_logits:
                record_prompt_logprobs(c.seq, c.start, logits[row:row + n])
            if b.wants_logits:
                rows.append(row + n - 1)
            row += n
        return logits[rows]

    def _count_rows(self, batch: list[Chunk], chunks) -> None:
        stats = self.stats
        stats.rows_computed += sum(len(b.token_ids) for b in batch)
        stats.padding_rows += sum(1 for c in chunks if c.padding)
        stats.sequence_rows += len(batch)
        stats.slot_steps += self.config.max_num_seqs

    def _append_token(self, seq: Sequence, token: int, now: float) -> str | None:
        """Record one sampled token; return a finish reason if the sequence is done."""
        seq.output_ids.append(token)
        seq.token_times.append(now)
        if seq.first_token_time is None:
            seq.first_token_time = now
        if seq.matcher is not None and not seq.matcher.consume_token(token):
            return "error"
        return self._finish_reason(seq, token)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        """Why the sequence ends with this (already recorded) token; None: it goes on."""
        p = seq.params
        may_stop = len(seq.output_ids) >= p.min_tokens
        if may_stop and (token in p.stop_token_ids or (not p.ignore_eos and token in self.sampler.eos_token_ids)):
            return "stop"
        if seq.detokenizer.add(token, check_stop=may_stop):
            return "stop"
        if seq.matcher is not None and seq.matcher.is_stopped():  # the grammar is complete
            return "stop"
        if len(seq.output_ids) >= p.max_tokens:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> tuple[RequestOutput, Sequence]:
        self.scheduler.finish(seq, reason)
        seq.detokenizer.finish()
        return self._output(seq, error), seq

    def _output(self, seq: Sequence, error: str | None = None) -> RequestOutput:
        new_ids = seq.output_ids[seq.sent_tokens:]
        new_times = seq.token_times[seq.sent_tokens:]
        new_logprobs = seq.logprobs[seq.sent_tokens:] if seq.params.logprobs is not None else None
        prompt_logprobs = None
        if seq.params.prompt_logprobs is not None and not seq.prompt_logprobs_sent:
            prompt_logprobs, seq.prompt_logprobs_sent = seq.prompt_logprobs, True
        seq.sent_tokens = len(seq.output_ids)
        return RequestOutput(
            request_id=seq.request_id,
            text=seq.detokenizer.release(final=seq.finished),
            token_ids=new_ids,
            finished=seq.finished,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt,
            num_output_tokens=len(seq.output_ids),
            arrival_time=seq.arrival_time,
            first_token_time=seq.first_token_time,
            token_times=new_times,
            error=error,
            logprobs=new_logprobs,
            prompt_logprobs=prompt_logprobs,
        )

    # ---- running ----

    def run_until_done(self) -> None:
        """Step until every queued request has finished (no background thread)."""
        while self.has_unfinished():
            self.step()

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run prompts to the end synchronously; return one whole output (all text and ids) each."""
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        results: dict[str, list[RequestOutput]] = {}
        ids = [self.add_request(p, sp, lambda out: results.setdefault(out.request_id, []).append(out))
               for p, sp in zip(prompts, per_prompt)]
        self.run_until_done()
        return [merge_outputs(results[i]) for i in ids]

    def start(self) -> None:
        """Step in a background thread whenever there is work."""
        self._thread = threading.Thread(target=self.run_loop, name="llm-engine", daemon=True)
        self._thread.start()

    @classmethod
    def start_in_thread(cls, build: Callable[[], "LLMEngine"]) -> "LLMEngine":
        """Build the engine (load the model) and run its loop in one new thread; return once built.

        All torch work then happens in that thread. On CPU this matters: once a thread has run
        parallel torch ops, its OpenMP team competes with any other thread's, and the engine's
        forward measured ~30 % slower when the model was loaded in the main thread.
        """
        built: queue.Queue = queue.Queue()

        def run() -> None:
            try:
                engine = build()
            except BaseException as exc:  # handed to the caller, raised there
                built.put(exc)
                return
            engine._thread = threading.current_thread()
            built.put(engine)
            engine.run_loop()

        threading.Thread(target=run, name="llm-engine", daemon=True).start()
        result = built.get()
        if isinstance(result, BaseException):
            raise result
        return result

    def run_loop(self) -> None:
        """Step whenever there is work, until shutdown(); blocks the calling thread."""
        while True:
            with self._wake:
                while not (self._stopping or self._inbox or self._aborts or self._abort_scope or self.scheduler.has_work()):
                    self._wake.wait()
                if self._stopping:
                    break
            self.step()

    def shutdown(self) -> None:
        """Stop the loop and finish every open request with reason `abort`."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()
        with self._wake:
            open_seqs = list(self._inbox) + list(self.scheduler.waiting) + list(self.scheduler.running)
            self._inbox.clear()
        for seq in open_seqs:
            out, _ = self._finish(seq, "abort")
            if seq.callback is not None:
                seq.callback(out)


def kv_pool_in_blocks(config: SchedulerConfig, model) -> SchedulerConfig:
    """The config with its KV pool in blocks: `kv_cache_memory_gb` converted for this model."""
    if config.num_kv_blocks or not config.kv_cache_memory_gb:
        return config
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    per_block = PagedKVCache.bytes_per_block(c.num_hidden_layers, config.block_size, c.num_key_value_heads,
                                             head_dim, next(model.parameters()).dtype)
    return replace(config, num_kv_blocks=max(1, int(config.kv_cache_memory_gb * 2**30) // per_block))


def wants_prompt_logprobs(c) -> bool:
    """Whether a scheduled chunk computes prompt positions whose next token's logprob is not yet recorded."""
    seq = c.seq
    return (not c.padding and seq.params.prompt_logprobs is not None
            and c.start < len(seq.prompt_logprobs) <= c.start + c.num_tokens and len(seq.prompt_logprobs) < seq.num_prompt)


def token_slice(seq: Sequence, start: int, n: int) -> list[int]:
    """Tokens [start, start + n) of a sequence without building prompt + output."""
    if start >= seq.num_prompt:
        return seq.output_ids[start - seq.num_prompt:start - seq.num_prompt + n]
    return seq.prompt_ids[start:start + n]


def merge_outputs(outputs: list[RequestOutput]) -> RequestOutput:
    """Fold a request's step outputs into one whole output."""
    last = outputs[-1]
    return RequestOutput(
        request_id=last.request_id,
        text="".join(o.text for o in outputs),
        token_ids=[t for o in outputs for t in o.token_ids],
        finished=last.finished,
        finish_reason=last.finish_reason,
        num_prompt_tokens=last.num_prompt_tokens,
        num_output_tokens=last.num_output_tokens,
        arrival_time=last.arrival_time,
        first_token_time=last.first_token_time,
        token_times=[t for o in outputs for t in o.token_times],
        error=last.error,
        logprobs=None if last.logprobs is None else [e for o in outputs for e in o.logprobs or []],
        prompt_logprobs=next((o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None), None),
    )


def eos_token_ids(model, tokenizer) -> set[int]:
    ids = set()
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (configured, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(value)
    return ids
