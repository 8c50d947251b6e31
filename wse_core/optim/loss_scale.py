"""Loss scaling for 16-bit gradients: static, or dynamic (skip a step whose gradients overflowed).

The gradient of the loss is multiplied by ``scale`` before the backward pass, so small gradients
survive 16-bit rounding, and divided by it again in the optimizer's ``grad_scale``. Dynamic
scaling, as Model Zoo's (``loss_scaling_factor: dynamic``): a step whose gradient norm is not
finite is skipped (no update, the step still counts) and the scale halves, down to
``min_loss_scale``; after ``steps_per_increase`` finite steps in a row it doubles, up to
``max_loss_scale``. Defaults are Model Zoo's: 2^15 to start and at most (2^31 for cbfloat16),
2^-14 at least, 2000 steps per increase.
"""
import math
from dataclasses import dataclass


@dataclass
class LossScaler:
    """The scale of the current step, and how it moves."""

    scale: float = 1.0
    dynamic: bool = False
    max_scale: float = 2.0 ** 15
    min_scale: float = 2.0 ** -14
    steps_per_increase: int = 2000
    good_steps: int = 0

    @classmethod
    def from_params(cls, optimizer, fp16_type=None):
        """From an ``OptimizerSpec`` (``loss_scaling_factor``, ``initial_loss_scale``, ...) and the 16-bit type."""
        factor = optimizer.loss_scaling_factor
        if factor != "dynamic":
            return cls(scale=float(factor))
        big = 2.0 ** 31 if fp16_type == "cbfloat16" else 2.0 ** 15
        return cls(scale=optimizer.initial_loss_scale or big, dynamic=True,
                   max_scale=optimizer.max_loss_scale or big,
                   min_scale=optimizer.min_loss_scale or 2.0 ** -14,
                   steps_per_increase=optimizer.steps_per_increase or 2000)

    def update(self, grad_norm):
        """After a step with this (unscaled) gradient norm: True if the step must be skipped."""
        finite = math.isfinite(grad_norm)
        if not self.dynamic:
            return False
        if not finite:
            self.scale = max(self.scale / 2, self.min_scale)
            self.good_steps = 0
            return True
        self.good_steps += 1
        if self.good_steps == self.steps_per_increase:
            self.scale = min(self.scale * 2, self.max_scale)
            self.good_steps = 0
        return False

    def state(self):
        """What a checkpoint keeps, so a resumed run scales as an uninterrupted one."""
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load(self, state):
        if state:
            self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
