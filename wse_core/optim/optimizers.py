"""Optimizers with fused in-place updates, following the documented ``torch.optim`` formulas.

An optimizer is hyperparameters plus a fused update of one parameter at a time. It holds no
arrays: the state lives with whoever owns the weights (MemoryX keeps it beside them and writes it
into checkpoints), so ``init_state(param)`` returns the zeroed buffers named by ``state_names`` and
``update(param, grad, state, step=t)`` applies update number ``t`` (1-based) in place::

    opt = AdamW(lr=1e-3, weight_decay=0.1)
    state = opt.init_state(w)
    for t in range(1, 11):
        opt.update(w, grad_of(w), state, step=t)

``grad_scale`` multiplies the gradient inside the same pass, which is how gradient clipping is
applied without a second pass over the gradient (see ``wse_core.optim.clip``).
"""
import inspect

import numpy as np

from wse_core.optim import _kernels
from wse_core.checks import Number, check_float_array, check_like, show
from wse_core.errors import ConfigError, ConfigTypeError


class Optimizer:
    """Base class: validated hyperparameters, per-parameter state and the in-place update."""

    #: Names of the per-parameter state arrays, each shaped like the parameter.
    state_names = ()

    def __init__(self, lr):
        self.lr = Number(0)(lr, "lr")

    def hparams(self):
        """Hyperparameters as a plain dict (the constructor's arguments)."""
        names = inspect.signature(type(self).__init__).parameters
        return {k: getattr(self, k) for k in names if k != "self"}

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.hparams().items())
        return f"{type(self).__name__}({args})"

    def init_state(self, param):
        """Zeroed state arrays for ``param``, keyed by ``state_names``."""
        check_float_array("param", param)
        return {k: np.zeros_like(param) for k in self.state_names}

    def update(self, param, grad, state, *, step, lr=None, grad_scale=1.0, name="param", decay=True):
        """Apply update number ``step`` (1-based) to ``param`` and ``state`` in place.

        ``lr`` overrides the constructor's learning rate for this update (a schedule's value);
        ``decay=False`` leaves out the weight decay (a bias or a norm weight, as torch's parameter
        groups with ``weight_decay: 0`` do); ``name`` is used in error messages.
        """
        p = check_float_array(name, param, writeable=True)
        g = check_like(f"grad of {name}", grad, name, param)
        if not isinstance(state, dict):
            raise TypeError(f"state of {name}: expected a dict of arrays, got {type(state).__name__}")
        if set(state) != set(self.state_names):
            raise ValueError(
                f"state of {name}: expected keys {sorted(self.state_names)}, got {sorted(state)}")
        bufs = {k: check_like(f"state[{k!r}] of {name}", state[k], name, param, writeable=True)
                for k in self.state_names}
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 1:
            raise ValueError(f"step: expected an integer >= 1 (1-based update count), got {show(step)}")
        lr = self.lr if lr is None else Number(0)(lr, "lr")
        grad_scale = Number(0)(grad_scale, "grad_scale")
        self._apply(p, g, bufs, int(step), lr, grad_scale, self.weight_decay if decay else 0.0)

    def _apply(self, p, g, bufs, step, lr, grad_scale, weight_decay):
        raise NotImplementedError


class SGD(Optimizer):
    """Stochastic gradient descent with optional momentum, dampening, Nesterov and L2 decay.

    As ``torch.optim.SGD``: g = grad + weight_decay * param; with momentum, b = g on the first
    step and b = momentum * b + (1 - dampening) * g after; g = g + momentum * b (Nesterov) or b;
    param -= lr * g.
    """

    def __init__(self, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False):
        super().__init__(lr)
        self.momentum = Number(0)(momentum, "momentum")
        self.dampening = Number(0, 1)(dampening, "dampening")
        self.weight_decay = Number(0)(weight_decay, "weight_decay")
        if not isinstance(nesterov, bool):
            raise ConfigTypeError(f"nesterov: expected true or false, got {show(nesterov)}")
        if nesterov and (self.momentum == 0.0 or self.dampening != 0.0):
            raise ConfigError("nesterov: requires momentum > 0 and dampening = 0")
        self.nesterov = nesterov
        self.state_names = ("momentum_buffer",) if self.momentum != 0.0 else ()

    def _apply(self, p, g, bufs, step, lr, grad_scale, weight_decay):
        if self.momentum == 0.0:
            _kernels.sgd(p, g, lr, weight_decay, grad_scale)
        else:
            _kernels.sgd_momentum(p, g, bufs["momentum_buffer"], lr, self.momentum, self.dampening,
                                  weight_decay, self.nesterov, step == 1, grad_scale)


class Adam(Optimizer):
    """Adam with bias correction; ``weight_decay`` is an L2 term added to the gradient.

    As ``torch.optim.Adam``: m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
    param -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps).
    """

    state_names = ("exp_avg", "exp_avg_sq")
    _decoupled = False

    def __init__(self, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        super().__init__(lr)
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ConfigTypeError(f"betas: expected two numbers (beta1, beta2), got {show(betas)}")
        self.betas = (Number(0, 1, open="high")(betas[0], "betas[0]"),
                      Number(0, 1, open="high")(betas[1], "betas[1]"))
        self.eps = Number(0)(eps, "eps")
        self.weight_decay = Number(0)(weight_decay, "weight_decay")

    def _apply(self, p, g, bufs, step, lr, grad_scale, weight_decay):
        _kernels.adam(p, g, bufs["exp_avg"], bufs["exp_avg_sq"], lr, self.betas[0], self.betas[1],
                      self.eps, weight_decay, self._decoupled, step, grad_scale)


class AdamW(Adam):
    """Adam with decoupled weight decay (param *= 1 - lr * weight_decay before the Adam step).

    As ``torch.optim.AdamW``, including its default ``weight_decay=0.01``.
    """

    _decoupled = True

    def __init__(self, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        super().__init__(lr, betas, eps, weight_decay)


_OPTIMIZERS = {"sgd": SGD, "adam": Adam, "adamw": AdamW}


def make_optimizer(optimizer_type, **hparams):
    """Build an optimizer by name (``"SGD"``, ``"Adam"``, ``"AdamW"``; any case) and hyperparameters."""
    cls = _OPTIMIZERS.get(str(optimizer_type).lower())
    if cls is None:
        raise ConfigError(f"optimizer_type: unknown optimizer {show(optimizer_type)} "
                          f"(known: SGD, Adam, AdamW)")
    known = [k for k in inspect.signature(cls.__init__).parameters if k != "self"]
    for key in hparams:
        if key not in known:
            raise ConfigError(f"{key}: not a {cls.__name__} hyperparameter (known: {', '.join(known)})")
    return cls(**hparams)
