"""Sampling parameters with vLLM's names, validated key by key.

Values may arrive as strings (Triton's HTTP generate and the vLLM backend send `"128"`): each key
is coerced to its own type, and a wrong type or out-of-range value raises a RequestError (a
ValueError) naming it, its `field` the key.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from typing import Any

from tritonllm.engine.structured_output import parse_spec
from tritonllm.errors import RequestError, parse_bool

MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI allows


@dataclass
class SamplingParams:
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    skip_special_tokens: bool = True
    logprobs: int | None = None  # each generated token's logprob and its N most likely alternatives
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    structured_outputs: Any = None  # a spec (structured_output.py), kept parsed: (kind, text)

    def __post_init__(self) -> None:
        if not isinstance(self.structured_outputs, tuple):
            self.structured_outputs = parse_spec(self.structured_outputs)
        for key in ("logprobs", "prompt_logprobs"):
            value = getattr(self, key)
            if value is not None:
                _check(0 <= value <= MAX_LOGPROBS, key, value, f"must be in [0, {MAX_LOGPROBS}]")
        _check(self.max_tokens >= 1, "max_tokens", self.max_tokens, "must be >= 1")
        _check(self.min_tokens >= 0, "min_tokens", self.min_tokens, "must be >= 0")
        _check(self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens, "must be <= max_tokens")
        _check(self.temperature >= 0, "temperature", self.temperature, "must be >= 0")
        _check(self.top_k >= -1, "top_k", self.top_k, "must be -1, 0 (off) or a positive count")
        _check(0 < self.top_p <= 1, "top_p", self.top_p, "must be in (0, 1]")
        _check(self.repetition_penalty > 0, "repetition_penalty", self.repetition_penalty, "must be > 0")
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty", self.presence_penalty, "must be in [-2, 2]")
        _check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", self.frequency_penalty, "must be in [-2, 2]")
        _check(all(s for s in self.stop), "stop", self.stop, "must not hold empty strings")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", self.stop_token_ids, "must be >= 0")
        if self.seed is not None:
            _check(0 <= self.seed < 2**63, "seed", self.seed, "must be in [0, 2**63)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @classmethod
    def from_dict(cls, values: dict[str, Any] | str | None) -> "SamplingParams":
        """Build from a JSON object (or its text); unknown keys and bad values raise ValueError."""
        if isinstance(values, (str, bytes)):
            values = json_object(values, "sampling_parameters")
        if not isinstance(values, dict | None):
            raise RequestError("sampling_parameters must be a JSON object", "sampling_parameters")
        known = {f.name: f for f in fields(cls)}
        kwargs = {}
        for key, value in (values or {}).items():
            if key not in known:
                raise RequestError(f"unknown sampling parameter {key!r}; known: {', '.join(sorted(known))}", key)
            if value is None:
                continue
            kwargs[key] = _COERCE[key](key, value)
        return cls(**kwargs)


def _loads(text: str | bytes) -> Any:
    """json.loads with every failure a ValueError: bad syntax, nesting too deep for the parser
    (a RecursionError), or a number too long to convert."""
    try:
        return json.loads(text)
    except RecursionError:
        raise RequestError("JSON nested too deeply") from None


def json_object(text: str | bytes, what: str) -> dict[str, Any]:
    """Parse JSON text that must hold an object; blank text is an empty object."""
    if not text.strip():
        return {}
    try:
        value = _loads(text)
    except ValueError as exc:
        raise RequestError(f"{what} is not valid JSON: {exc}", what) from None
    if not isinstance(value, dict):
        raise RequestError(f"{what} must be a JSON object", what)
    return value


def _check(ok: bool, key: str, value: Any, why: str) -> None:
    if not ok:
        raise RequestError(f"sampling parameter {key!r} {why}, got {_shown(value)}", key)


def _to_int(key: str, value: Any) -> int:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, (int, str, bytes)) and not isinstance(value, bool):
        try:
            return int(value)
        except ValueError:
            pass
    _fail(key, value, "an integer")


def _to_float(key: str, value: Any) -> float:
    if isinstance(value, (int, float, str, bytes)) and not isinstance(value, bool):
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if math.isfinite(number):
            return number
    _fail(key, value, "a finite number")


def _to_bool(key: str, value: Any) -> bool:
    return parse_bool(value, key, f"sampling parameter {key!r}")


def _to_str_list(key: str, value: Any) -> list[str]:
    if isinstance(value, str):
        if value.startswith("["):  # a JSON list sent as text
            try:
                value = _loads(value)
            except ValueError:
                return [value]
        else:
            return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    _fail(key, value, "a string or a list of strings")


def _to_int_list(key: str, value: Any) -> list[int]:
    if isinstance(value, str):
        try:
            value = _loads(value)
        except ValueError:
            _fail(key, value, "a list of integers")
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    _fail(key, value, "a list of integers")


def _fail(key: str, value: Any, kind: str):
    raise RequestError(f"sampling parameter {key!r} must be {kind}, got {_shown(value)}", key)


def _shown(value: Any, limit: int = 80) -> str:
    """repr of a value for an error message, cut short: a huge value must not make a huge error."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


_COERCE = {
    "max_tokens": _to_int,
    "min_tokens": _to_int,
    "temperature": _to_float,
    "top_k": _to_int,
    "top_p": _to_float,
    "seed": _to_int,
    "stop": _to_str_list,
    "stop_token_ids": _to_int_list,
    "ignore_eos": _to_bool,
    "repetition_penalty": _to_float,
    "presence_penalty": _to_float,
    "frequency_penalty": _to_float,
    "skip_special_tokens": _to_bool,
    "logprobs": _to_int,
    "prompt_logprobs": _to_int,
    "structured_outputs": lambda key, value: parse_spec(value),
}
