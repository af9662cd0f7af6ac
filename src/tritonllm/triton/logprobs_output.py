"""The `logprobs` output: a response's token log probabilities as JSON text.

Set on every response of a request whose sampling parameters ask for `logprobs` or
`prompt_logprobs` (vLLM's keys), for the tokens that response carries:
`{"tokens": [entry, ...], "prompt": [entry, ...]}`, an entry being
`{"id", "token", "logprob", "top_logprobs": [{"id", "token", "logprob"}, ...]}` and "prompt" only
in the first response of a request that asked for it (its first entry's logprob null: nothing
comes before the prompt's first token). Logprobs are the model's, after penalties and
before temperature, the grammar's mask and top-k/top-p (engine/sampler.py).
"""

from __future__ import annotations

import json

from tritonllm.engine.sequence import RequestOutput, TokenLogprobs


class TokenTexts:
    """Each token id's text (decoded alone), remembered."""

    def __init__(self, tokenizer):
        self.tokenizer, self._texts = tokenizer, {}

    def __call__(self, token: int) -> str:
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = self.tokenizer.decode([token])
        return text


def logprobs_text(out: RequestOutput, texts: TokenTexts) -> str | None:
    """The JSON of the `logprobs` output, or None when the request asked for none."""
    if out.logprobs is None and out.prompt_logprobs is None:
        return None
    body = {"tokens": [entry(e, texts) for e in out.logprobs or []]}
    if out.prompt_logprobs is not None:
        body["prompt"] = [entry(e, texts) for e in out.prompt_logprobs]
    return json.dumps(body)


def entry(e: TokenLogprobs, texts: TokenTexts) -> dict:
    return {"id": e.token, "token": texts(e.token), "logprob": e.logprob,
            "top_logprobs": [{"id": t, "token": texts(t), "logprob": lp} for t, lp in e.top]}
