"""``cstorch.optim``: SGD, Adam and AdamW, applied by MemoryX (``wse_core.optim``'s fused updates).

An optimizer here records its hyper-parameters for the run's ``optimizer`` section; ``step()`` and
``zero_grad()`` inside the traced step mark where the update goes, and do nothing themselves (the
update is MemoryX's, on every step). The numerics are torch.optim's formulas (Adam's eps added
after the bias correction, as torch's; Cerebras' own AdamW adds it before: a difference in the last
bits). Parameter groups must share their hyper-parameters: per-group values are not built.
"""
from pyapi.cstorch import step as step_mod
from pyapi.cstorch.errors import not_built
from pyapi.cstorch.optim import lr_scheduler  # noqa: F401

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
            differ = [k for k in defaults if g[k] != self.param_groups[0][k]]
            if differ:
                raise not_built(f"{type(self).__name__}: parameter groups with their own {differ[0]}",
                                "every group takes the optimizer's hyper-parameters")
        self.scheduler = None  # set by an lr_scheduler on it

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
        out = {"optimizer_type": self.optimizer_type, "learning_rate": self.scheduler or lr,
               "weight_decay": h.pop("weight_decay")}
        if "betas" in h:
            out["betas"] = list(h.pop("betas"))
        out.update(h)
        return out

    def state_dict(self):
        return {"optimizer_type": self.optimizer_type, "param_groups": [
            {k: v for k, v in g.items() if k != "params"} for g in self.param_groups]}


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


def __getattr__(name):
    if name[:1].isupper():  # one of Cerebras' other optimizers (Lamb, Lion, Adafactor, ...)
        raise not_built(f"cstorch.optim.{name}", BUILT)
    raise AttributeError(name)
