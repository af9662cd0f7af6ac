"""Test-only fault injection, off unless the server's environment sets TRITONLLM_TEST_FAULTS=1.

With it on, a prompt that contains `[[hold:N]]` makes a request that cannot finish by itself: it
generates N tokens, then keeps its slot without computing until it is aborted (cancelled by its
client, or the engine shuts down). Tests use it wherever a request must certainly still be
running, instead of a long request that a fast model might finish inside the test's window.
A prompt that contains `[[fail]]` makes every forward that computes it raise, as a broken kernel
or an out-of-memory error would: tests check that only that request ends with an error.
"""

from __future__ import annotations

import os
import re

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
