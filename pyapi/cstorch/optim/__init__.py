"""``cstorch.optim``: SGD, Adam and AdamW, applied by MemoryX (``wse_core.optim``'s fused updates).

An optimizer here records its hyper-parameters for the run's ``optimizer`` section; ``step()`` and
``zero_grad()`` inside the traced step mark where the update goes, and do nothing themselves (the
update is MemoryX's, on every step). The numerics are torch.optim's formulas (Adam's eps added
after the bias correction, as torch's; Cerebras' own AdamW adds it before: a difference in the last
bits).

Parameter groups may set their own ``lr`` and ``weight_decay`` (``groups()``: what MemoryX applies
to each parameter): a group's learning rate is the schedule's times ``lr / the first group's lr``
(a scheduler scales every group alike, as torch's multiplicative schedulers do), and its weight
decay is 0 or the one nonzero value the groups share (the common split: no decay for biases and
norms). Other per-group values are refused by name.

``state_dict()`` is torch.optim's: ``{"state": {index: {"step", "exp_avg", ...}}, "param_groups":
[...]}``, the state being the cluster's at the last step the model was given (a checkpoint closure's
or the loop's end). ``load_state_dict`` of one makes the next run resume from it: the state's
``step`` is where it starts (``pyapi.cstorch.run``); the hyper-parameters stay the constructor's
(a dynamic loss scale resumes from its GradScaler's loaded state).
"""
import inspect

from pyapi.cstorch import step as step_mod
from pyapi.cstorch.errors import not_built, refusing
from pyapi.cstorch.optim import lr_scheduler  # noqa: F401
from wse_core.errors import ConfigError, DataError

BUILT = "built: SGD, Adam, AdamW"


class Optimizer:
    """What every optimizer records: its parameter groups and hyper-parameters (``defaults``)."""

    optimizer_type = None

    def __init__(self, params, defaults):
        params = list(params)
        groups = params if params and isinstance(params[0], dict) else [{"params": params}]
        self.defaults = defaults
        self.param_groups = [{**defaults, **g, "params": list(g["params"])} for g in groups]
        for g in self.param_groups:
            if "betas" in g:
                g["betas"] = tuple(g["betas"])  # a list and a tuple of the same rates are the same setting
        for g in self.param_groups[1:]:
            differ = [k for k in defaults if k not in ("lr", "weight_decay") and g[k] != self.param_groups[0][k]]
            if differ:
                raise not_built(f"{type(self).__name__}: parameter groups with their own {differ[0]}",
                                "groups with their own lr and weight_decay")
        decays = {g["weight_decay"] for g in self.param_groups} - {0, 0.0}
        if len(decays) > 1:
            raise not_built(f"{type(self).__name__}: parameter groups with weight decays {sorted(decays)}",
                            "one weight decay, and groups without it")
        if self.param_groups[0]["lr"] == 0 and any(g["lr"] for g in self.param_groups[1:]):
            raise not_built(f"{type(self).__name__}: a first parameter group of lr 0 beside others",
                            "every group's lr a multiple of the first's")
        self.weight_decay = decays.pop() if decays else 0.0
        first = self.param_groups[0]["lr"]
        #: each group's share of the schedule: its lr over the first group's, fixed at construction
        self.lr_factors = [g["lr"] / first if first else 1.0 for g in self.param_groups]
        self.scheduler = None  # the spec of an lr_scheduler on it, and the scheduler itself
        self.lr_scheduler = None
        self.state = {}  # parameter -> {"step": tensor, state name: tensor}: the cluster's, or loaded

    def step(self, closure=None):
        """Inside the traced step: where the update goes (MemoryX applies it on every step)."""
        if closure is not None:
            raise not_built("optimizer.step(closure)", "call step() without a closure")
        rec = step_mod._recording
        if rec is None:
            raise RuntimeError(f"{type(self).__name__}.step(): outside the traced step; call it inside the function "
                               "decorated with @cstorch.trace")
        if self not in rec.optimizers:
            rec.optimizers.append(self)

    def zero_grad(self, set_to_none=True):
        """Nothing to do: the cluster keeps no gradients between steps."""

    def spec(self):
        """The run's ``optimizer`` section."""
        h = dict(self.param_groups[0])
        h.pop("params")
        lr = h.pop("lr")
        h.pop("weight_decay")
        out = {"optimizer_type": self.optimizer_type, "learning_rate": self.scheduler or lr,
               "weight_decay": self.weight_decay}
        if "betas" in h:
            out["betas"] = list(h.pop("betas"))
        out.update(h)
        return out

    def groups(self):
        """{id(parameter): (lr factor, takes weight decay)}: what MemoryX applies to each parameter."""
        return {id(p): (factor, g["weight_decay"] != 0)
                for g, factor in zip(self.param_groups, self.lr_factors) for p in g["params"]}

    def _indices(self):
        """Each parameter's index in the state dict: its position over the groups, as torch.optim's."""
        return {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}

    def state_dict(self):
        index = self._indices()
        return {"state": {index[id(p)]: dict(st) for p, st in self.state.items()},
                "param_groups": [{**{k: v for k, v in g.items() if k != "params"},
                                  "params": [index[id(p)] for p in g["params"]]} for g in self.param_groups]}

    def load_state_dict(self, state_dict):
        """The state of ``state_dict`` (``state_dict()``'s, saved and loaded) for this optimizer's parameters."""
        groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        if not isinstance(groups, list) or not isinstance(state_dict.get("state"), dict):
            raise DataError(f"{type(self).__name__}.load_state_dict: expected an optimizer's state_dict() "
                            "({'state': ..., 'param_groups': ...})")
        sizes = [len(g["params"]) for g in self.param_groups]
        if [len(g.get("params", ())) for g in groups] != sizes:
            raise DataError(f"{type(self).__name__}.load_state_dict: the state has groups of "
                            f"{[len(g.get('params', ())) for g in groups]} parameters, this optimizer {sizes}")
        by_index = [p for g in self.param_groups for p in g["params"]]
        state = {}
        for i, st in state_dict["state"].items():
            i = int(i)  # a state saved by cstorch.save comes back with its indices as text
            if not 0 <= i < len(by_index) or not isinstance(st, dict):
                raise DataError(f"{type(self).__name__}.load_state_dict: state {i}: not one of this optimizer's "
                                f"{len(by_index)} parameters")
            p = by_index[i]
            for name, value in st.items():
                if name != "step" and tuple(value.shape) != tuple(p.shape):
                    raise DataError(f"{type(self).__name__}.load_state_dict: state {i} {name}: shape "
                                    f"{list(value.shape)}, the parameter's {list(p.shape)}")
            state[p] = dict(st)
        self.state = state


class SGD(Optimizer):
    optimizer_type = "SGD"

    def __init__(self, params, lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False):
        if dampening:
            raise not_built("SGD(dampening=...)", "dampening 0")
        if maximize:
            raise not_built("SGD(maximize=True)", "minimizing")
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay, "nesterov": nesterov})


class Adam(Optimizer):
    optimizer_type = "Adam"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, correct_bias=True,
                 amsgrad=False):
        if amsgrad:
            raise not_built(f"{type(self).__name__}(amsgrad=True)", "amsgrad False")
        if not correct_bias:
            raise not_built(f"{type(self).__name__}(correct_bias=False)", "bias correction")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})


class AdamW(Adam):
    optimizer_type = "AdamW"


#: configure_optimizer's names for a constructor's arguments (Cerebras' flat optimizer config).
_RENAMED = {"weight_decay_rate": "weight_decay"}


def configure_optimizer(optimizer_type, params, **kwargs):
    """Cerebras' 2.0-2.3 factory: the optimizer named ``optimizer_type`` (any case) over ``params``,
    from a flat config (``learning_rate`` a number: its ``lr``; a schedule: ``lr`` is the
    scheduler's; ``beta1``/``beta2``: ``betas``; ``weight_decay_rate``: ``weight_decay``)."""
    classes = {c.__name__.lower(): c for c in (SGD, Adam, AdamW)}
    cls = classes.get(str(optimizer_type).lower())
    if cls is None:
        raise not_built(f"cstorch.optim.configure_optimizer(optimizer_type={optimizer_type!r})", BUILT)
    kwargs = {_RENAMED.get(k, k): v for k, v in kwargs.items()}
    lr = kwargs.pop("learning_rate", None)
    if "beta1" in kwargs or "beta2" in kwargs:
        kwargs["betas"] = (kwargs.pop("beta1", 0.9), kwargs.pop("beta2", 0.999))
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "params"}
    unused = sorted(set(kwargs) - accepted)
    if unused:
        raise ConfigError(f"cstorch.optim.configure_optimizer: {cls.__name__} takes no {', '.join(unused)}")
    if isinstance(lr, str):  # YAML reads 1e-4 as a string
        try:
            lr = float(lr)
        except ValueError:
            raise ConfigError(f"cstorch.optim.configure_optimizer: learning_rate {lr!r} is not a number") from None
    kwargs["lr"] = lr if isinstance(lr, (int, float)) else kwargs.get("lr", 0.1)
    return cls(params, **kwargs)


def configure_lr_scheduler(optimizer, learning_rate, adjust_learning_rate=None):
    """Cerebras' 2.0-2.3 factory: the scheduler of ``learning_rate``: a number (None: the optimizer's
    constant rate), a dict ``{"scheduler": "Linear", ...}`` (name in any case, with or without
    ``LR``), or a list of them run one after the other (each for its ``total_iters``)."""
    if adjust_learning_rate:
        raise not_built("configure_lr_scheduler(adjust_learning_rate=...)", "parameter groups with their own lr")
    if not learning_rate or isinstance(learning_rate, (int, float, str)):
        return None
    specs = learning_rate if isinstance(learning_rate, (list, tuple)) else [learning_rate]
    made = [_scheduler(optimizer, dict(spec)) for spec in specs]
    if len(made) == 1:
        return made[0]
    milestones, at = [], 0
    for i, spec in enumerate(specs[:-1]):
        if "total_iters" not in spec:
            raise ConfigError(f"configure_lr_scheduler: learning_rate[{i}]: a scheduler followed by another needs "
                              "its total_iters (where the next one starts)")
        at += int(spec["total_iters"])
        milestones.append(at)
    return lr_scheduler.SequentialLR(optimizer, made, milestones)


def _scheduler(optimizer, spec):
    if not isinstance(spec, dict) or "scheduler" not in spec:
        raise ConfigError(f"configure_lr_scheduler: expected {{'scheduler': name, ...}}, got {spec!r}")
    name = str(spec.pop("scheduler"))
    key = name.lower().removesuffix("lr")
    classes = {c.__name__.lower().removesuffix("lr"): c for c in (
        lr_scheduler.ConstantLR, lr_scheduler.LinearLR, lr_scheduler.PolynomialLR, lr_scheduler.CosineDecayLR,
        lr_scheduler.ExponentialLR)}
    if key not in classes:
        raise not_built(f"configure_lr_scheduler: scheduler {name!r}", "Constant, Linear, Polynomial, CosineDecay, "
                        "Exponential, and a list of them in sequence")
    return classes[key](optimizer, **spec)


__getattr__ = refusing("cstorch.optim", f"{BUILT}, configure_optimizer, configure_lr_scheduler, lr_scheduler")
