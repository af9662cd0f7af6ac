"""Load shapes (Locust `LoadTestShape`s), chosen with `--shape` (or LOCUST_SHAPE) at run time.

The locustfile imports this module, never the classes themselves: Locust would otherwise pick
the first shape class it finds in the locustfile's namespace and ignore `--shape`.
Each shape's schedule is `at(t)` -> (users, spawn rate) or None (stop), so it can be checked
without running Locust. Poisson arrivals are not a shape: see `--arrival-rate` in the locustfile.
"""

from __future__ import annotations

from locust import LoadTestShape


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in str(text).replace(" ", "").split(",") if x]
    except ValueError:
        raise ValueError(f"expected comma-separated user counts, got {text!r}") from None
    if not values or min(values) < 0:
        raise ValueError(f"expected comma-separated user counts >= 0, got {text!r}")
    return values


class ConcurrencySteps(LoadTestShape):
    """Closed-loop concurrency sweep: hold each user count for `step_time` seconds, then stop."""

    def __init__(self, users: list[int], step_time: float):
        super().__init__()
        if step_time <= 0:
            raise ValueError("step time must be > 0")
        self.users, self.step_time = users, step_time

    @classmethod
    def from_options(cls, opts) -> "ConcurrencySteps":
        return cls(_ints(opts.shape_users or "1,2,4,8"), float(opts.shape_step_time))

    def at(self, t: float):
        step = int(t // self.step_time)
        if step >= len(self.users):
            return None
        n = self.users[step]
        return n, max(n, 1)  # every user of the step at once

    def tick(self):
        return self.at(self.get_run_time())


class Spike(LoadTestShape):
    """`base` users, `peak` users from `spike_at` for `spike_time` seconds, back to `base`; `total` s."""

    def __init__(self, base: int, peak: int, spike_at: float, spike_time: float, total: float):
        super().__init__()
        if not 0 <= spike_at <= total or spike_time <= 0:
            raise ValueError("need 0 <= spike-at <= shape-time and spike-time > 0")
        self.base, self.peak, self.spike_at, self.spike_time, self.total = base, peak, spike_at, spike_time, total

    @classmethod
    def from_options(cls, opts) -> "Spike":
        users = _ints(opts.shape_users or "2,16")
        if len(users) != 2:
            raise ValueError("--shape spike needs --shape-users BASE,PEAK")
        return cls(users[0], users[1], float(opts.spike_at), float(opts.spike_time), float(opts.shape_time or 90))

    def at(self, t: float):
        if t >= self.total:
            return None
        n = self.peak if self.spike_at <= t < self.spike_at + self.spike_time else self.base
        return n, max(self.peak, 1)  # jump up and down at once

    def tick(self):
        return self.at(self.get_run_time())


class Soak(LoadTestShape):
    """Ramp to `users` over `ramp` seconds, then hold until `total` seconds (long stability runs)."""

    def __init__(self, users: int, total: float, ramp: float):
        super().__init__()
        if total <= 0 or ramp < 0:
            raise ValueError("need shape-time > 0 and shape-ramp >= 0")
        self.users, self.total, self.ramp = users, total, ramp

    @classmethod
    def from_options(cls, opts) -> "Soak":
        users = _ints(opts.shape_users or "8")
        if len(users) != 1:
            raise ValueError("--shape soak needs one --shape-users N")
        return cls(users[0], float(opts.shape_time or 3600), float(opts.shape_ramp))

    def at(self, t: float):
        if t >= self.total:
            return None
        rate = self.users / self.ramp if self.ramp > 0 else max(self.users, 1)
        return self.users, max(rate, 0.1)

    def tick(self):
        return self.at(self.get_run_time())


SHAPES = {"steps": ConcurrencySteps, "spike": Spike, "soak": Soak}


def make_shape(opts) -> LoadTestShape | None:
    """The shape named by `opts.shape`, or None for a plain `-u/-r/-t` run."""
    name = (opts.shape or "none").lower()
    if name == "none":
        return None
    if name not in SHAPES:
        raise ValueError(f"unknown shape {opts.shape!r}; choose one of none, {', '.join(SHAPES)}")
    return SHAPES[name].from_options(opts)
