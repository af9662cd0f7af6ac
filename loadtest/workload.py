"""The workload: which prompt and how many output tokens request number i gets.

Pure Python (no Locust, no network), so every model of a comparison gets the same requests:
request i depends only on (seed, stream, i), never on timing or on which user sends it.
Output lengths are forced with `max_tokens` + `ignore_eos`; by default they are heavy-tailed
(capped exponential, the shape of Anyscale's continuous-batching study), so that short requests
share batches with long ones.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROMPTS_FILE = Path(__file__).resolve().parent / "prompts.jsonl"
DEFAULT_OUTPUT_TOKENS = "exp:48:256"
DEFAULT_PROMPT_WORDS = "dataset"


@dataclass(frozen=True)
class LengthDist:
    """A distribution of lengths, written `fixed:N`, `uniform:A:B` or `exp:MEAN:CAP[:MIN]`.

    `exp` is a capped exponential: round(Exp(mean)) clipped to [MIN, CAP] (MIN defaults to 1).
    """

    kind: str
    a: float
    b: float = 0.0
    minimum: int = 1

    @classmethod
    def parse(cls, spec: str) -> "LengthDist":
        parts = spec.strip().lower().split(":")
        kind, args = parts[0], parts[1:]
        try:
            nums = [float(x) for x in args]
        except ValueError:
            raise ValueError(f"bad length distribution {spec!r}: numbers expected after '{kind}:'") from None
        if kind == "fixed" and len(nums) == 1 and nums[0] >= 1:
            return cls("fixed", nums[0])
        if kind == "uniform" and len(nums) == 2 and 1 <= nums[0] <= nums[1]:
            return cls("uniform", nums[0], nums[1])
        if kind == "exp" and len(nums) in (2, 3) and nums[0] > 0 and nums[1] >= 1:
            minimum = int(nums[2]) if len(nums) == 3 else 1
            if not 1 <= minimum <= nums[1]:
                raise ValueError(f"bad length distribution {spec!r}: need 1 <= MIN <= CAP")
            return cls("exp", nums[0], nums[1], minimum)
        raise ValueError(f"bad length distribution {spec!r}: use fixed:N, uniform:A:B (1 <= A <= B) "
                         "or exp:MEAN:CAP[:MIN]")

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        value = round(rng.expovariate(1.0 / self.a))
        return int(min(self.b, max(self.minimum, value)))

    @property
    def cap(self) -> int:
        return int(self.a if self.kind == "fixed" else self.b)

    def mean(self) -> float:
        """The expected value (exact for fixed/uniform, numeric for the capped exponential)."""
        if self.kind == "fixed":
            return self.a
        if self.kind == "uniform":
            return (self.a + self.b) / 2
        lam = 1.0 / self.a
        total = 0.0
        for n in range(self.minimum, int(self.b) + 1):  # P(round(X) == n), clipped at both ends
            lo = 0.0 if n == self.minimum else n - 0.5
            hi = math.inf if n == int(self.b) else n + 0.5
            total += n * (math.exp(-lam * lo) - (0.0 if hi == math.inf else math.exp(-lam * hi)))
        return total

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{int(self.a)}"
        if self.kind == "uniform":
            return f"uniform:{int(self.a)}:{int(self.b)}"
        text = f"exp:{self.a:g}:{int(self.b)}"
        return text + (f":{self.minimum}" if self.minimum != 1 else "")


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str
    kind: str = ""


def load_prompts(path: str | Path | None = None) -> list[Prompt]:
    """Prompts from a JSON-lines file with a `prompt` (and optional `id`, `kind`) per line."""
    path = Path(path) if path else PROMPTS_FILE
    prompts = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            text = row["prompt"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(f"{path}:{n}: expected a JSON object with a 'prompt'") from None
        prompts.append(Prompt(str(row.get("id", f"{path.stem}-{n}")), str(text), str(row.get("kind", ""))))
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


@dataclass(frozen=True)
class RequestSpec:
    """One request of the workload."""

    index: int
    prompt_id: str
    prompt: str
    max_tokens: int
    sampling: dict[str, Any] = field(default_factory=dict)

    @property
    def sampling_json(self) -> str:
        return json.dumps(self.sampling, sort_keys=True)

    @property
    def prompt_words(self) -> int:
        return len(self.prompt.split())


class Workload:
    """Deterministic request generator: `request(i)` is the same for every model and every run."""

    def __init__(self, prompts: list[Prompt] | None = None, output_tokens: str | LengthDist = DEFAULT_OUTPUT_TOKENS,
                 prompt_words: str | LengthDist | None = DEFAULT_PROMPT_WORDS, seed: int = 0,
                 temperature: float = 0.0, ignore_eos: bool = True, shared_prefix_words: int = 0):
        """shared_prefix_words: every prompt starts with the same text of this many words (a system
        prompt); its share of each prompt is shared / (shared + the prompt's own words)."""
        self.prompts = prompts if prompts is not None else load_prompts()
        if not self.prompts:
            raise ValueError("the workload needs at least one prompt")
        self.output_tokens = output_tokens if isinstance(output_tokens, LengthDist) else LengthDist.parse(output_tokens)
        if isinstance(prompt_words, str):
            prompt_words = None if prompt_words.strip().lower() in ("", "dataset") else LengthDist.parse(prompt_words)
        self.prompt_words = prompt_words
        if temperature < 0:
            raise ValueError("temperature must be >= 0")
        self.seed, self.temperature, self.ignore_eos = seed, temperature, ignore_eos
        if shared_prefix_words < 0:
            raise ValueError("shared_prefix_words must be >= 0")
        self.shared_prefix_words = shared_prefix_words
        # The shared text: the prompt set read backwards from its last prompt (so it is not the
        # opening of any request's own text), as many times as it takes.
        words: list[str] = []
        while len(words) < shared_prefix_words:
            words += " ".join(p.text for p in reversed(self.prompts)).split()
        self.shared_prefix = " ".join(words[:shared_prefix_words])

    def request(self, index: int, stream: int = 0) -> RequestSpec:
        """Request `index` of stream `stream` (distributed workers use their worker index)."""
        rng = random.Random(f"tritonllm/{self.seed}/{stream}/{index}")
        first = rng.randrange(len(self.prompts))
        max_tokens = self.output_tokens.sample(rng)
        prompt = self.prompts[first]
        text = prompt.text if self.prompt_words is None else self._words(first, self.prompt_words.sample(rng))
        if self.shared_prefix:
            text = f"{self.shared_prefix}\n\n{text}"
        sampling: dict[str, Any] = {"max_tokens": max_tokens, "ignore_eos": self.ignore_eos,
                                    "temperature": self.temperature}
        if self.temperature > 0:
            sampling["seed"] = rng.randrange(2**31)
        return RequestSpec(index, prompt.id, text, max_tokens, sampling)

    def _words(self, first: int, n: int) -> str:
        """Exactly n words: prompts from `first` on, joined, cut at n words."""
        words: list[str] = []
        i = first
        while len(words) < n:
            words += self.prompts[i % len(self.prompts)].text.split()
            i += 1
        return " ".join(words[:n])

    def ideal_inflight_ratio(self, n: int, batch: int) -> float:
        """What in-flight batching can gain over request-level batches of `batch` on requests 0..n-1 taken in
        order, when every step costs the same: Σ per-batch longest output / (Σ outputs / batch). Request-level
        batches run until their longest member ends; slots refilled every step need only Σ / batch steps."""
        lengths = [self.request(i).max_tokens for i in range(n)]
        if not lengths or batch < 1:
            raise ValueError("need n >= 1 requests and a batch of >= 1")
        batched_steps = sum(max(lengths[i:i + batch]) for i in range(0, n, batch))
        return batched_steps / (sum(lengths) / batch)

    def describe(self) -> str:
        prompts = "dataset prompts as written" if self.prompt_words is None else f"prompt words {self.prompt_words}"
        if self.shared_prefix_words:
            prompts += f", after a shared prefix of {self.shared_prefix_words} words"
        return (f"{len(self.prompts)} prompts ({prompts}); output tokens {self.output_tokens} "
                f"(mean {self.output_tokens.mean():.1f}, forced with max_tokens + ignore_eos={self.ignore_eos}); "
                f"temperature {self.temperature:g}; seed {self.seed}")
