"""What one engine step costs, interpolated from measured step times.

`tritonllm-bench-engine --profile-steps FILE` times the model runner's forward over a grid of
step shapes on the machine at hand: `rows` rows in the forward, of which one is a prefill chunk
of `prefill` prompt tokens (when prefill > 0) and the others decode one token each at
`decode_context` tokens of context. The simulator reads that file and prices a step by
interpolating the grid linearly along each axis (prefill tokens, then decode context, then rows),
extrapolating linearly past its edges. No formula is assumed: on a CPU a decode row costs little
next to the weights every step reads, while prompt tokens are compute-bound, and the grid shows both.

A `scale` multiplies every cost and `per_row_s` is added for every row of a step: the served system
adds Triton, the Python stub, a response per row and step, and the load generator on the same
machine (`tritonllm-simulate` calibrates both per scheme).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path


def step_shape(chunks) -> tuple[int, int, int]:
    """(rows, prompt tokens, mean decode context) of a step's chunks; padding rows are computed, so they count.
    A chunk of more than one token is prompt (all of a step's prompt chunks priced as one)."""
    decodes = [c.start + 1 for c in chunks if c.num_tokens == 1]
    prefill = sum(c.num_tokens for c in chunks if c.num_tokens > 1)
    rows = len(decodes) + (1 if prefill else 0)
    return rows, prefill, round(sum(decodes) / len(decodes)) if decodes else 0


def _interp(x: float, xs: list[float], ys: list[float]) -> float:
    """Piecewise linear through (xs, ys), extended past both ends along the end segments, never downhill
    (more work does not cost less: a noisy end segment must not extrapolate to nothing)."""
    if len(xs) == 1:
        return ys[0]
    i = 1
    while i < len(xs) - 1 and x > xs[i]:
        i += 1
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    slope = (y1 - y0) / (x1 - x0)
    if x > xs[-1]:
        return y1 + max(slope, 0.0) * (x - x1)
    if x < xs[0]:
        return y0 - max(slope, 0.0) * (x0 - x)
    return y0 + slope * (x - x0)


@dataclass(frozen=True)
class StepCost:
    table: "Grid" = field(compare=False)
    scale: float = 1.0
    source: str = ""
    per_row_s: float = 0.0

    @classmethod
    def from_measurements(cls, measurements: list[dict], source: str = "") -> "StepCost":
        grid = {(m["rows"], m["decode_context"], m["prefill"]): m["seconds"] for m in measurements}
        rows, ctxs, prefills = (sorted({k[i] for k in grid}) for i in range(3))
        missing = [(r, c, p) for r in rows for c in ctxs for p in prefills if (r, c, p) not in grid]
        if missing or len(rows) < 2 or len(ctxs) < 2 or len(prefills) < 2:
            raise ValueError(f"a step profile needs a full grid of >= 2 values per axis (missing {missing[:3]})")
        return cls(Grid(grid), 1.0, source)

    @classmethod
    def load(cls, path: str | Path) -> "StepCost":
        data = json.loads(Path(path).read_text())
        return cls.from_measurements(data["measurements"], source=f"{path} ({data.get('model', '?')}, "
                                                                  f"{data.get('device', '?')}, {data.get('dtype', '?')})")

    def scaled(self, scale: float, per_row_s: float = 0.0) -> "StepCost":
        return StepCost(self.table, scale, self.source, per_row_s)

    def seconds(self, chunks) -> float:
        return self.seconds_for(*step_shape(chunks))

    def seconds_for(self, rows: int, prefill: int, decode_context: int) -> float:
        return self.scale * self.table.seconds(rows, prefill, decode_context) + self.per_row_s * rows


class Grid:
    """Measured seconds by (rows, decode_context, prefill), and the interpolation between them."""

    def __init__(self, grid: dict):
        self.grid = grid
        self.rows, self.ctxs, self.prefills = (sorted({k[i] for k in grid}) for i in range(3))
        self.seconds = lru_cache(maxsize=200_000)(self._seconds)  # a simulation asks the same shapes again

    def _seconds(self, rows: int, prefill: int, decode_context: int) -> float:
        by_rows = []
        for r in self.rows:
            by_ctx = [_interp(prefill, self.prefills, [self.grid[(r, c, p)] for p in self.prefills])
                      for c in self.ctxs]
            by_rows.append(_interp(decode_context or self.ctxs[0], self.ctxs, by_ctx))
        return max(_interp(rows, self.rows, by_rows), 1e-6)
