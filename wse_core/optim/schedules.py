"""Learning-rate schedules: Model Zoo's scheduler family, by both its spellings.

A schedule maps the 0-based index of an update to its learning rate: the first update uses
``schedule(0)``. Names, keys and formulas follow Model Zoo's schedulers (``scheduler: Linear`` or
``LinearLR``, case-insensitive; ``initial_learning_rate``, ``end_learning_rate``, ``total_iters``, and
the 1.x aliases ``steps``/``decay_steps``, ``values``/``boundaries``, ``t_max``/``t_0``/``t_mult``);
``make_schedule`` turns the plain value of ``optimizer.learning_rate`` (a number, one scheduler, or
a list run one after the other) into a schedule::

    make_schedule([
        {"scheduler": "Linear", "initial_learning_rate": 0.0, "end_learning_rate": 1e-3, "total_iters": 100},
        {"scheduler": "CosineDecay", "initial_learning_rate": 1e-3, "end_learning_rate": 1e-5, "total_iters": 900},
    ])

Schedulers with an end (Linear, Polynomial, CosineDecay) hold their end value after ``total_iters``;
the others follow their formula (each class says which). In a list, every scheduler but the last
needs ``total_iters`` (its length); ``SequentialLR`` may also give ``milestones``; ``ChainedLR`` (or
``main_scheduler: chained`` on an entry of a list) multiplies them instead, each after the first
relative to its own start. ``alpha`` (a TensorFlow leftover in old files) is accepted and, as in
Model Zoo's PyTorch schedulers, has no effect. ``LambdaLR`` needs code and is refused.
"""
import math
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields

from wse_core.checks import Bool, Int, Number, OneOf, show
from wse_core.errors import ConfigError, ConfigTypeError


class Schedule:
    """A learning rate as a function of the 0-based update index."""

    def __call__(self, step):
        raise NotImplementedError

    @property
    def start(self):
        """The value chaining divides by (the rate this schedule starts from)."""
        return self(0)


@dataclass(frozen=True)
class Constant(Schedule):
    """The same learning rate at every step (for ``total_iters`` steps when inside a sequence)."""

    learning_rate: float
    total_iters: int | None = None

    def __call__(self, step):
        return self.learning_rate


@dataclass(frozen=True)
class Polynomial(Schedule):
    """end + (initial - end) * (1 - step / total_iters) ** power, then end. (``cycle`` is accepted
    and, as in Model Zoo's closed form, changes nothing before total_iters.)"""

    initial_learning_rate: float
    end_learning_rate: float
    total_iters: int
    power: float = 1.0
    cycle: bool = False

    def __call__(self, step):
        if step >= self.total_iters:
            return self.end_learning_rate
        span = self.initial_learning_rate - self.end_learning_rate
        return self.end_learning_rate + span * (1.0 - step / self.total_iters) ** self.power


@dataclass(frozen=True)
class Linear(Schedule):
    """initial + (end - initial) * min(step, total_iters) / total_iters: warm-up or linear decay."""

    initial_learning_rate: float
    end_learning_rate: float
    total_iters: int
    cycle: bool = False

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
class Exponential(Schedule):
    """initial * decay_rate ** (step / total_iters), the exponent floored with ``staircase``; no end."""

    initial_learning_rate: float
    total_iters: int
    decay_rate: float
    staircase: bool = False

    def __call__(self, step):
        power = step / self.total_iters
        return self.initial_learning_rate * self.decay_rate ** (math.floor(power) if self.staircase else power)


@dataclass(frozen=True)
class InverseExponentialTimeDecay(Schedule):
    """initial / (1 + decay_rate * step ** step_exponent / total_iters), the ratio floored with
    ``staircase`` (Keras' InverseTimeDecay); no end."""

    initial_learning_rate: float
    step_exponent: float
    total_iters: int
    decay_rate: float
    staircase: bool = False

    def __call__(self, step):
        alpha = float(step) ** self.step_exponent / self.total_iters
        return self.initial_learning_rate / (1.0 + self.decay_rate * (math.floor(alpha) if self.staircase else alpha))


@dataclass(frozen=True)
class InverseSquareRootDecay(Schedule):
    """initial * scale / sqrt(max(step, warmup_steps)); no end."""

    initial_learning_rate: float = 1.0
    scale: float = 1.0
    warmup_steps: int = 1

    def __call__(self, step):
        return self.initial_learning_rate * self.scale / math.sqrt(max(step, self.warmup_steps))


@dataclass(frozen=True)
class PiecewiseConstant(Schedule):
    """learning_rates[i] from milestones[i - 1] on (learning_rates has one more entry than milestones)."""

    learning_rates: tuple
    milestones: tuple

    def __call__(self, step):
        return self.learning_rates[sum(step >= m for m in self.milestones)]


@dataclass(frozen=True)
class MultiStep(Schedule):
    """initial * gamma ** (milestones passed)."""

    initial_learning_rate: float
    gamma: float
    milestones: tuple

    def __call__(self, step):
        return self.initial_learning_rate * self.gamma ** sum(step >= m for m in self.milestones)


@dataclass(frozen=True)
class Step(Schedule):
    """initial * gamma ** floor(step / step_size)."""

    initial_learning_rate: float
    step_size: int
    gamma: float

    def __call__(self, step):
        return self.initial_learning_rate * self.gamma ** (step // self.step_size)


@dataclass(frozen=True)
class CosineAnnealing(Schedule):
    """eta_min + (initial - eta_min) * (1 + cos(pi * step / T_max)) / 2: periodic, as torch's closed form."""

    initial_learning_rate: float
    T_max: int
    eta_min: float = 0.0

    def __call__(self, step):
        return self.eta_min + (self.initial_learning_rate - self.eta_min) * 0.5 * (1.0 + math.cos(math.pi * step / self.T_max))


@dataclass(frozen=True)
class CosineAnnealingWarmRestarts(Schedule):
    """Cosine annealing from initial to eta_min over T_0 steps, restarting every T_0 steps (torch's
    SGDR with T_mult = 1, the only value Model Zoo supports)."""

    initial_learning_rate: float
    T_0: int
    T_mult: int = 1
    eta_min: float = 0.0

    def __call__(self, step):
        t = step % self.T_0
        return self.eta_min + (self.initial_learning_rate - self.eta_min) * 0.5 * (1.0 + math.cos(math.pi * t / self.T_0))


@dataclass(frozen=True)
class Multiplicative(Schedule):
    """initial * coefficient ** step."""

    initial_learning_rate: float
    coefficient: float

    def __call__(self, step):
        return self.initial_learning_rate * self.coefficient ** step


@dataclass(frozen=True)
class Cyclic(Schedule):
    """torch's CyclicLR: from base_lr up to max_lr in step_size_up steps and back in step_size_down,
    the height scaled by 1 (triangular), 1 / 2 ** (cycle - 1) (triangular2) or gamma ** step (exp_range)."""

    base_lr: float
    max_lr: float
    step_size_up: int = 2000
    step_size_down: int | None = None
    mode: str = "triangular"
    gamma: float = 1.0
    scale_mode: str = "cycle"

    @property
    def start(self):
        return self.base_lr

    def __call__(self, step):
        down = self.step_size_up if self.step_size_down is None else self.step_size_down
        total = self.step_size_up + down
        ratio = self.step_size_up / total
        cycle = math.floor(1 + step / total)
        x = 1.0 + step / total - cycle
        factor = x / ratio if x <= ratio else (x - 1) / (ratio - 1)
        height = (self.max_lr - self.base_lr) * factor
        if self.mode == "triangular":
            return self.base_lr + height
        if self.mode == "triangular2":
            return self.base_lr + height / 2.0 ** (cycle - 1)
        return self.base_lr + height * self.gamma ** step


@dataclass(frozen=True)
class OneCycle(Schedule):
    """Model Zoo's OneCycleLR: from initial up to max_lr by step pct_start * total_steps - 1, then
    down to initial / final_div_factor by step total_steps - 1 (three_phase: back to initial first),
    annealed by cosine or linearly."""

    initial_learning_rate: float
    max_lr: float
    total_steps: int = 1000
    pct_start: float = 0.3
    final_div_factor: float = 1e4
    three_phase: bool = False
    anneal_strategy: str = "cos"

    def __call__(self, step):
        low = self.initial_learning_rate / self.final_div_factor
        a, b = self.pct_start * self.total_steps - 1, self.total_steps - 1
        if self.three_phase:
            ends = [a, 2 * self.pct_start * self.total_steps - 2, b]
            values = [(self.initial_learning_rate, self.max_lr), (self.max_lr, self.initial_learning_rate),
                      (self.initial_learning_rate, low)]
        else:
            ends = [a, b]
            values = [(self.initial_learning_rate, self.max_lr), (self.max_lr, low)]
        begin = 0.0
        for i, end in enumerate(ends):
            if i == len(ends) - 1 or step <= end:
                pct = (step - begin) / (end - begin)
                lo, hi = values[i]
                if self.anneal_strategy == "cos":
                    return hi + (lo - hi) / 2.0 * (1.0 + math.cos(math.pi * pct))
                return lo + pct * (hi - lo)
            begin = end


@dataclass(frozen=True)
class Sequential(Schedule):
    """Run schedules one after the other, switching at ``milestones`` (by default the running sums
    of their ``total_iters``); each restarts its own step count at 0."""

    schedulers: tuple
    milestones: tuple = None

    def __call__(self, step):
        bounds = self.milestones or _running_sums(self.schedulers)
        begin = 0
        for sched, bound in zip(self.schedulers, bounds):
            if step < bound:
                return sched(step - begin)
            begin = bound
        return self.schedulers[-1](step - begin)


@dataclass(frozen=True)
class Chained(Schedule):
    """The product of schedules: the first's value times each other's value relative to its start."""

    schedulers: tuple

    def __call__(self, step):
        value = self.schedulers[0](step)
        for sched in self.schedulers[1:]:
            value *= sched(step) / sched.start
        return value


def _running_sums(schedulers):
    out, total = [], 0
    for s in schedulers[:-1]:
        total += s.total_iters
        out.append(total)
    return out


# Name (lower case, without an "lr" suffix) -> class. Each is also accepted with the suffix.
_SCHEDULERS = {
    "constant": Constant, "polynomial": Polynomial, "linear": Linear, "cosinedecay": CosineDecay,
    "exponential": Exponential, "inverseexponentialtimedecay": InverseExponentialTimeDecay,
    "inversesquarerootdecay": InverseSquareRootDecay, "piecewiseconstant": PiecewiseConstant,
    "multistep": MultiStep, "step": Step, "cosineannealing": CosineAnnealing,
    "cosineannealingwarmrestarts": CosineAnnealingWarmRestarts, "multiplicative": Multiplicative,
    "cyclic": Cyclic, "onecycle": OneCycle, "sequential": Sequential, "chained": Chained,
}
_KNOWN = ("Constant, Linear, Polynomial, CosineDecay, Exponential, InverseExponentialTimeDecay, "
          "InverseSquareRootDecay, PiecewiseConstant, MultiStep, Step, CosineAnnealing, "
          "CosineAnnealingWarmRestarts, Multiplicative, Cyclic, OneCycle, SequentialLR, ChainedLR; with or "
          "without 'LR'")
#: Model Zoo 1.x key names -> the 2.x names (``learning_rate`` only where the class has no such field).
_ALIASES = {"steps": "total_iters", "decay_steps": "total_iters", "values": "learning_rates",
            "boundaries": "milestones", "t_max": "T_max", "t_0": "T_0", "t_mult": "T_mult",
            "learning_rate": "initial_learning_rate"}
_IGNORED = ("alpha",)   # read by TensorFlow's CosineDecay only; Model Zoo's PyTorch schedulers ignore it
#: Each argument's constraint (wse_core.checks), where it is not a number >= 0.
_ARGS = {**dict.fromkeys(("total_iters", "step_size", "T_max", "T_0", "T_mult", "warmup_steps", "step_size_up",
                          "total_steps"), Int(1)),
         "step_size_down": Int(1, none=True), "final_div_factor": Number(0, open="low"),
         "mode": OneOf("triangular", "triangular2", "exp_range"), "scale_mode": OneOf("cycle", "iterations"),
         "anneal_strategy": OneOf("cos", "linear"), **dict.fromkeys(("staircase", "cycle", "three_phase"), Bool())}


def _class_of(name, key):
    n = str(name).lower()
    if n in ("chainedscheduler", "chainedlr"):
        return Chained
    if n == "lambda" or n == "lambdalr":
        raise ConfigError(f"{key}.scheduler: {show(name)} needs a Python function; it cannot be given in a params file")
    if n == "scaleperparam" or n == "scaleperparamlr":
        raise ConfigError(f"{key}.scheduler: {show(name)} (per-parameter-group rates, adjust_learning_rate) is not "
                          "built yet")
    cls = _SCHEDULERS.get(n) or (_SCHEDULERS.get(n[:-2]) if n.endswith("lr") else None)
    if cls is None:
        raise ConfigError(f"{key}.scheduler: unknown scheduler {show(name)} (known: {_KNOWN})")
    return cls


def _value(cls, name, v, where):
    """One checked argument of a scheduler."""
    if name == "schedulers":
        if not isinstance(v, (list, tuple)) or not v:
            raise ConfigError(f"{where}: expected a non-empty list of schedulers, got {show(v)}")
        return tuple(_one(s, f"{where}[{i}]", i == len(v) - 1) for i, s in enumerate(v))
    if name in ("milestones", "learning_rates"):
        if not isinstance(v, (list, tuple)) or not v:
            raise ConfigError(f"{where}: expected a non-empty list, got {show(v)}")
        if name == "milestones":
            ms = [Int(1)(x, f"{where}[{i}]") for i, x in enumerate(v)]
            if any(b <= a for a, b in zip(ms, ms[1:])):
                raise ConfigError(f"{where}: expected increasing steps, got {show(v)}")
            return tuple(ms)
        return tuple(Number(0)(x, f"{where}[{i}]") for i, x in enumerate(v))
    return _ARGS.get(name, Number(0))(v, where)


def _one(spec, key, last):
    if not isinstance(spec, Mapping):
        raise ConfigTypeError(f"{key}: expected a number or a mapping with a 'scheduler' key, got {show(spec)}")
    if "scheduler" not in spec:
        raise ConfigError(f"{key}.scheduler: missing (one of {_KNOWN})")
    cls = _class_of(spec["scheduler"], key)
    names = [f.name for f in fields(cls)]
    kwargs = {}
    for k, v in spec.items():
        if k in ("scheduler", "main_scheduler") or k in _IGNORED:
            continue
        name = k if k in names else _ALIASES.get(k)
        if name not in names and k in ("initial_learning_rate", "learning_rate"):  # one rate, two spellings
            name = "learning_rate" if "learning_rate" in names else "initial_learning_rate"
        if name not in names:
            raise ConfigError(f"{key}.{k}: unknown key for {cls.__name__} (known: {', '.join(names)})")
        if name in kwargs:
            raise ConfigError(f"{key}.{k}: given twice (as {name} and an alias of it)")
        kwargs[name] = _value(cls, name, v, f"{key}.{k}")
    required = [f.name for f in fields(cls) if f.default is MISSING]
    if not last:
        # Inside a sequence every scheduler but the last must say how long it lasts.
        required.append("total_iters")
    for name in required:
        if name not in kwargs:
            if name == "total_iters" and "total_iters" not in names:
                raise ConfigError(f"{key}: {cls.__name__} has no end, so it can only be the last of a sequence")
            raise ConfigError(f"{key}.{name}: missing for {cls.__name__}")
    if cls is PiecewiseConstant and len(kwargs["learning_rates"]) != len(kwargs["milestones"]) + 1:
        raise ConfigError(f"{key}.learning_rates: expected one more value than milestones "
                          f"({len(kwargs['milestones'])}), got {len(kwargs['learning_rates'])}")
    if cls is Sequential and kwargs.get("milestones") is not None:
        if len(kwargs["milestones"]) != len(kwargs["schedulers"]) - 1:
            raise ConfigError(f"{key}.milestones: expected {len(kwargs['schedulers']) - 1} (one fewer than the "
                              f"schedulers), got {len(kwargs['milestones'])}")
    if cls is OneCycle and kwargs.get("pct_start", 0.3) * kwargs.get("total_steps", 1000) <= 1:
        raise ConfigError(f"{key}.pct_start: pct_start x total_steps must exceed 1 (the warm-up has no steps)")
    if cls is CosineAnnealingWarmRestarts and kwargs.get("T_mult", 1) != 1:
        raise ConfigError(f"{key}.T_mult: only 1 is supported (as in Model Zoo), got {kwargs['T_mult']}")
    return cls(**kwargs)


def make_schedule(spec, key="learning_rate"):
    """Build a schedule from a number, one scheduler mapping, or a list of them (run in sequence, or
    chained when an entry says ``main_scheduler: chained``)."""
    if isinstance(spec, (int, float)) and not isinstance(spec, bool):
        return Constant(Number(0)(spec, key))
    if isinstance(spec, (list, tuple)):
        if not spec:
            raise ConfigError(f"{key}: expected at least one scheduler, got an empty list")
        chained = any(isinstance(s, Mapping) and str(s.get("main_scheduler", "")).lower() in ("chained", "chainedlr")
                      for s in spec)
        scheds = tuple(_one(s, f"{key}[{i}]", chained or i == len(spec) - 1) for i, s in enumerate(spec))
        if len(scheds) == 1:
            return scheds[0]
        return Chained(scheds) if chained else Sequential(scheds)
    return _one(spec, key, last=True)
