"""The models' `logprobs` output (triton/logprobs_output.py) in OpenAI's two shapes.

Completions: `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}`, with
the prompt's tokens first under `echo` (the first prompt token has no logprob: null). Chat:
`{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}`.
"""

from __future__ import annotations

from typing import Any


def completion_logprobs(entries: list[dict | None], offset: int = 0) -> dict[str, Any]:
    """Completions' logprobs of `entries`, their text offsets counted from `offset`."""
    tokens, logprobs, tops, offsets = [], [], [], []
    for e in entries:
        offsets.append(offset)
        tokens.append(e["token"])
        offset += len(e["token"])
        logprobs.append(e["logprob"])
        tops.append({t["token"]: t["logprob"] for t in e["top_logprobs"]} if e["logprob"] is not None else None)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(entries: list[dict]) -> dict[str, Any]:
    return {"content": [{**_chat_token(e), "top_logprobs": [_chat_token(t) for t in e["top_logprobs"]]}
                        for e in entries]}


def _chat_token(e: dict) -> dict[str, Any]:
    return {"token": e["token"], "logprob": e["logprob"], "bytes": list(e["token"].encode("utf-8"))}
