"""Test-only fault injection, off unless the server's environment sets TRITONLLM_TEST_FAULTS=1.

With it on, a prompt that contains `[[hold:N]]` makes a request that cannot finish by itself: it
generates N tokens, then keeps its slot without computing until it is aborted (cancelled by its
client, or the engine shuts down). Tests use it wherever a request must certainly still be
running, instead of a long request that a fast model might finish inside the test's window.
A prompt that contains `[[fail]]` makes every forward that computes it raise, as a broken kernel
or an out-of-memory error would: tests check that only that request ends with an error.

The faults live in a subclass of the engine (`FaultInjectingEngine`, through the engine's seams), which
the Triton adapters run only with the switch on (`engine_class`): the engine itself knows nothing of them.
"""

from __future__ import annotations

import os
import re
import time

from tritonllm.engine.llm_engine import LLMEngine

ENV = "TRITONLLM_TEST_FAULTS"
HOLD_IDLE_S = 0.01  # the engine's pause when every scheduled sequence is held (no busy loop)
_HOLD = re.compile(r"\[\[hold:(\d+)\]\]")
FAIL_MARK = "[[fail]]"


class InjectedFault(RuntimeError):
    """The failure a `[[fail]]` prompt causes."""


def enabled() -> bool:
    return os.environ.get(ENV) == "1"


def hold_after(prompt) -> int | None:
    """Tokens after which a request is held, if its prompt asks for it and faults are on."""
    if not isinstance(prompt, str) or not enabled():
        return None
    match = _HOLD.search(prompt)
    return int(match.group(1)) if match else None


def fails_forward(prompt) -> bool:
    """Whether every forward computing this request must fail (its prompt asks for it, faults are on)."""
    return isinstance(prompt, str) and FAIL_MARK in prompt and enabled()


def hold_prompt(tokens: int, text: str = "") -> str:
    """A prompt that is held after `tokens` generated tokens (for tests)."""
    return f"[[hold:{tokens}]] {text}".rstrip()


class FaultInjectingEngine(LLMEngine):
    """The engine with the test-only faults of prompts that ask for them (the switch read per request)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._hold_after: dict[str, int] = {}  # request id -> tokens after which it is held
        self._failing: set[str] = set()  # request ids whose every forward raises

    def held(self, seq) -> bool:
        after = self._hold_after.get(seq.request_id)
        return after is not None and len(seq.output_ids) >= after

    def _on_add(self, seq, prompt) -> None:
        if (after := hold_after(prompt)) is not None:
            self._hold_after[seq.request_id] = after
        if fails_forward(prompt):
            self._failing.add(seq.request_id)

    def _computable(self, chunks: list) -> list:
        """Held sequences compute nothing; when nothing else is scheduled, the step pauses (no busy loop)."""
        kept = [c for c in chunks if not self.held(c.seq)]
        if chunks and not kept:
            time.sleep(HOLD_IDLE_S)
        return kept

    def _run(self, chunks):
        if any(c.seq.request_id in self._failing and not c.padding for c in chunks):
            raise InjectedFault("test fault: the forward failed")
        return super()._run(chunks)

    def _finish(self, seq, reason: str, error: str | None = None):
        self._hold_after.pop(seq.request_id, None)
        self._failing.discard(seq.request_id)
        return super()._finish(seq, reason, error)

    def _finish_reason(self, seq, token: int) -> str | None:
        if self.held(seq):  # never finishes by itself
            seq.detokenizer.add(token, check_stop=False)
            return None
        return super()._finish_reason(seq, token)


def engine_class() -> type[LLMEngine]:
    """The engine the Triton adapters run: with the switch on, the one that injects the faults."""
    return FaultInjectingEngine if enabled() else LLMEngine
