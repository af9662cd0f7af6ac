"""The served model's tokenizer in the front: prompts in every OpenAI form, chat templates, counts.

The models take text (`text_input`), so the front turns every prompt into text: a string as it
is, token ids decoded (special tokens kept, so the model re-reads the same tokens for ordinary
text), and chat messages through the model's own chat template from its tokenizer. Which
tokenizer: `--tokenizer`, else `$TRITONLLM_MODEL`, else the `model` parameter of the served
model's config.pbtxt, resolved as the models resolve it (`models.resolve_model_path`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from tritonllm.openai.errors import bad_request
from tritonllm.openai.protocol import ChatMessage

MODEL_ENV = "TRITONLLM_MODEL"  # the same override the models read (models.MODEL_ENV)


@dataclass(frozen=True)
class Prompt:
    text: str  # what the model is sent
    token_ids: list[int] | None = None  # as the client sent them, if it sent ids


def tokenizer_spec(given: str | None, config_spec: str | None) -> str:
    return given or os.environ.get(MODEL_ENV) or config_spec or "bundled"


class PromptTokenizer:
    """A Hugging Face tokenizer with what the routes need from it."""

    def __init__(self, tokenizer, path: str):
        self.tokenizer = tokenizer
        self.path = path  # what /v1/models reports as `root` (vllm bench loads its tokenizer from it)
        self.vocab_size = len(tokenizer)

    @classmethod
    def load(cls, spec: str) -> "PromptTokenizer":
        from transformers import AutoTokenizer

        from tritonllm.model_files import BUNDLED, TINY, prepare_bundled, prepare_tiny

        # Not resolve_model_path: $TRITONLLM_MODEL must not win over a tokenizer named on purpose.
        path = str(prepare_bundled()) if spec == BUNDLED else str(prepare_tiny()) if spec == TINY else spec
        return cls(AutoTokenizer.from_pretrained(path), path)

    # ------------------------------------------------------------------ completions

    def completion_prompts(self, prompt: Any) -> list[Prompt]:
        """One Prompt per choice group: a string, a list of strings, token ids or a list of id lists."""
        if isinstance(prompt, str):
            return [Prompt(prompt)]
        if isinstance(prompt, list) and prompt:
            if all(isinstance(p, str) for p in prompt):
                return [Prompt(p) for p in prompt]
            if all(_is_id(t) for t in prompt):
                return [self._from_ids(prompt, "prompt")]
            if all(isinstance(p, list) and p and all(_is_id(t) for t in p) for p in prompt):
                return [self._from_ids(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
        if prompt is None:
            raise bad_request("prompt is required", "prompt")
        raise bad_request("prompt must be a string, a list of strings, a list of token ids or a list of "
                          f"non-empty token-id lists; got {_kind(prompt)}", "prompt")

    def _from_ids(self, ids: list[int], where: str) -> Prompt:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise bad_request(f"{where} holds token ids outside the vocabulary (0..{self.vocab_size - 1}): "
                              f"{bad[:5]}", "prompt")
        return Prompt(self.tokenizer.decode(ids, skip_special_tokens=False), list(ids))

    # ------------------------------------------------------------------ chat

    def chat_prompt(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, kwargs: dict | None = None) -> str:
        if not messages:
            raise bad_request("messages must hold at least one message", "messages")
        plain = [{"role": m.role, "content": message_text(m, i)} for i, m in enumerate(messages)]
        if continue_final_message and add_generation_prompt:
            add_generation_prompt = False  # vLLM's rule: continuing the last message adds no new turn
        try:
            return self.tokenizer.apply_chat_template(
                plain, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, **(kwargs or {}))
        except Exception as exc:  # a template error is the request's (e.g. roles it does not allow)
            raise bad_request(f"the model's chat template refused these messages: {exc}", "messages") from None

    # ------------------------------------------------------------------ counts

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int]) -> str:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise bad_request(f"tokens outside the vocabulary (0..{self.vocab_size - 1}): {bad[:5]}", "tokens")
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def message_text(message: ChatMessage, index: int) -> str:
    """A message's content as one string: text parts joined; other parts are refused."""
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise bad_request(f"messages[{index}].content[{j}]: only text parts are supported, got type "
                              f"{part.type!r}", "messages")
        texts.append(part.text)
    return "\n".join(texts)


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _kind(value: Any) -> str:
    if isinstance(value, list):
        return "an empty list" if not value else f"a list of {', '.join(sorted({type(v).__name__ for v in value}))}"
    return type(value).__name__
