"""Learning-rate schedules: constant, linear (warm-up or decay), cosine decay, and sequences.

A schedule maps the 0-based index of an update to its learning rate: the first update uses
``schedule(0)``. Names and keys follow the Model Zoo params (``scheduler: Linear``,
``initial_learning_rate``, ``end_learning_rate``, ``total_iters``); ``make_schedule`` turns the
plain value of ``optimizer.learning_rate`` (a number, one scheduler, or a list run one after the
other) into a schedule::

    make_schedule([
        {"scheduler": "Linear", "initial_learning_rate": 0.0, "end_learning_rate": 1e-3, "total_iters": 100},
        {"scheduler": "CosineDecay", "initial_learning_rate": 1e-3, "end_learning_rate": 1e-5, "total_iters": 900},
    ])

After its ``total_iters`` a schedule holds its end value.
"""
import math
from dataclasses import MISSING, dataclass, fields

from wse_core._checks import check_number, show


class Schedule:
    """A learning rate as a function of the 0-based update index."""

    def __call__(self, step):
        raise NotImplementedError


@dataclass(frozen=True)
class Constant(Schedule):
    """The same learning rate at every step (for ``total_iters`` steps when inside a sequence)."""

    learning_rate: float
    total_iters: int | None = None

    def __call__(self, step):
        return self.learning_rate


@dataclass(frozen=True)
class Linear(Schedule):
    """initial + (end - initial) * min(step, total_iters) / total_iters: warm-up or linear decay."""

    initial_learning_rate: float
    end_learning_rate: float
    total_iters: int

    def __call__(self, step):
        frac = min(step, self.total_iters) / self.total_iters
        return self.initial_learning_rate + (self.end_learning_rate - self.initial_learning_rate) * frac


@dataclass(frozen=True)
class CosineDecay(Schedule):
    """end + (initial - end) * (1 + cos(pi * min(step, total_iters) / total_iters)) / 2."""

    initial_learning_rate: float
    end_learning_rate: float
    total_iters: int

    def __call__(self, step):
        frac = min(step, self.total_iters) / self.total_iters
        span = self.initial_learning_rate - self.end_learning_rate
        return self.end_learning_rate + span * 0.5 * (1.0 + math.cos(math.pi * frac))


@dataclass(frozen=True)
class Sequential(Schedule):
    """Run schedules one after the other; each restarts its own step count at 0."""

    schedulers: tuple

    def __call__(self, step):
        for sched in self.schedulers[:-1]:
            if step < sched.total_iters:
                return sched(step)
            step -= sched.total_iters
        return self.schedulers[-1](step)


_SCHEDULERS = {"constant": Constant, "constantlr": Constant, "linear": Linear, "linearlr": Linear,
               "cosinedecay": CosineDecay, "cosinedecaylr": CosineDecay}


def _one(spec, key, last):
    if not isinstance(spec, dict):
        raise TypeError(f"{key}: expected a number or a mapping with a 'scheduler' key, got {show(spec)}")
    if "scheduler" not in spec:
        raise ValueError(f"{key}.scheduler: missing (one of Constant, Linear, CosineDecay)")
    cls = _SCHEDULERS.get(str(spec["scheduler"]).lower())
    if cls is None:
        raise ValueError(f"{key}.scheduler: unknown scheduler {show(spec['scheduler'])} "
                         f"(known: Constant, Linear, CosineDecay)")
    names = [f.name for f in fields(cls)]
    kwargs = {}
    for k, v in spec.items():
        if k == "scheduler":
            continue
        if k not in names:
            raise ValueError(f"{key}.{k}: unknown key for {cls.__name__} (known: {', '.join(names)})")
        if k == "total_iters":
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{key}.{k}: expected an integer >= 1, got {show(v)}")
            kwargs[k] = v
        else:
            kwargs[k] = check_number(f"{key}.{k}", v, low=0.0)
    required = [f.name for f in fields(cls) if f.default is MISSING]
    if not last:
        # Inside a sequence every scheduler but the last must say how long it lasts.
        required.append("total_iters")
    for name in required:
        if name not in kwargs:
            raise ValueError(f"{key}.{name}: missing for {cls.__name__}")
    return cls(**kwargs)


def make_schedule(spec, key="learning_rate"):
    """Build a schedule from a number, one scheduler mapping, or a list of them (run in sequence)."""
    if isinstance(spec, (int, float)) and not isinstance(spec, bool):
        return Constant(check_number(key, spec, low=0.0))
    if isinstance(spec, (list, tuple)):
        if not spec:
            raise ValueError(f"{key}: expected at least one scheduler, got an empty list")
        scheds = tuple(_one(s, f"{key}[{i}]", i == len(spec) - 1) for i, s in enumerate(spec))
        return scheds[0] if len(scheds) == 1 else Sequential(scheds)
    return _one(spec, key, last=True)
