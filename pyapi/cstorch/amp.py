"""``cstorch.amp``: the gradient scaler. Mixed precision for a compiled PyTorch model is not built
yet (it trains in float32), so a scaler's settings become the run's loss scaling (and, with
``max_gradient_norm``, its clipping), applied as for a float32 run of any family."""
from pyapi.cstorch.errors import not_built
from pyapi.cstorch.step import recording


class GradScaler:
    """Cerebras' ``GradScaler``: ``loss_scale`` "dynamic" or a number, and the dynamic scaler's bounds."""

    def __init__(self, loss_scale=None, init_scale=None, steps_per_increase=None, min_loss_scale=None,
                 max_loss_scale=None, overflow_tolerance=0.0, max_gradient_norm=None):
        if overflow_tolerance:
            raise not_built("GradScaler(overflow_tolerance=...)", "a step whose gradients overflow is skipped")
        self.spec = {k: v for k, v in {
            "loss_scaling_factor": loss_scale, "initial_loss_scale": init_scale, "steps_per_increase": steps_per_increase,
            "min_loss_scale": min_loss_scale, "max_loss_scale": max_loss_scale,
            "max_gradient_norm": max_gradient_norm}.items() if v is not None}

    def scale(self, loss):
        return loss

    def unscale_(self, optimizer):
        """Nothing to do: MemoryX unscales the gradients it is sent."""

    def step(self, optimizer, *args, **kwargs):
        recording().settings.update(self.spec)
        optimizer.step()

    def update(self, new_scale=None):
        if new_scale is not None:
            raise not_built("GradScaler.update(new_scale)", "the scale follows the dynamic rule")


def set_half_dtype(dtype):
    raise not_built("cstorch.amp.set_half_dtype", "a compiled PyTorch model trains in float32")


use_bfloat16 = set_half_dtype
