"""Open-loop arrival times: a seeded Poisson process, the same for every scheme at a given rate.

Request i of an open-loop run is sent at `start + schedule.at(i)`, whatever the server does with
the earlier ones (a closed loop would wait for them): queues grow when the offered rate passes
what the server can carry, as they do in production.
"""

from __future__ import annotations

import random


class ArrivalSchedule:
    """Offsets (s) of the arrivals of a Poisson process at `rate` req/s; `at(i)` is request i's.

    Depends only on (rate, seed, stream): every scheme run at one rate gets the same arrival times.
    """

    def __init__(self, rate: float, seed: int = 0, stream: int = 0):
        if rate <= 0:
            raise ValueError(f"arrival rate must be > 0, got {rate:g}")
        self.rate = rate
        self._rng = random.Random(f"tritonllm-arrivals/{seed}/{stream}/{rate!r}")
        self._offsets: list[float] = []

    def at(self, index: int) -> float:
        while len(self._offsets) <= index:
            last = self._offsets[-1] if self._offsets else 0.0
            self._offsets.append(last + self._rng.expovariate(self.rate))
        return self._offsets[index]
