"""``cstorch.amp``: mixed precision and the gradient scaler.

A run trains in mixed precision when the script called ``set_half_dtype`` (or ``use_bfloat16``)
before the traced step was captured, or the traced step ran its forward inside ``autocast()``: the
run's params get ``model.mixed_precision: true`` and ``fp16_type``, and the cluster computes as
for its built-in families (docs/design/numerics.md "Mixed precision": weights streamed in the 16-bit format, the
values units hand on and their gradients rounded to it, float32 master weights and loss). As on a
real CSX, ``autocast()`` casts nothing itself; the CPU backend gives the cluster's bits (the same
emulated rounding, not ``torch.autocast``). Otherwise the run trains in float32.

A ``GradScaler``'s settings become the run's loss scaling (and, with ``max_gradient_norm``, its
clipping), in any precision: a step whose scaled gradients overflow is skipped and a dynamic scale
halves. cbfloat16 needs dynamic scaling, as in Model Zoo; float16 usually wants it; bfloat16 needs
none.
"""
import contextlib

import torch

from pyapi.cstorch import step as step_mod
from pyapi.cstorch.errors import not_built, refusing
from pyapi.cstorch.step import recording
from wse_core.errors import ConfigError, DataError

#: The 16-bit format ``set_half_dtype`` set ("float16", "bfloat16", "cbfloat16"), or None (float32);
#: it lives in ``step`` (``step_mod.half_dtype``), which reads it when a step is captured.
#: Read when a traced step is captured; ``enable_mixed_precision(False)`` sets it back to None.


class GradScaler:
    """Cerebras' ``GradScaler``: ``loss_scale`` "dynamic" or a number, and the dynamic scaler's bounds;
    recorded as the run's ``optimizer.loss_scaling_factor``, ... when the traced step calls
    ``step(optimizer)``. ``scale`` and ``unscale_`` change nothing: the CS-2s scale the loss's
    gradient, MemoryX divides it out."""

    def __init__(self, loss_scale=None, init_scale=None, steps_per_increase=None, min_loss_scale=None,
                 max_loss_scale=None, overflow_tolerance=0.0, max_gradient_norm=None):
        if overflow_tolerance:
            raise not_built("GradScaler(overflow_tolerance=...)", "a step whose gradients overflow is skipped")
        self.spec = {k: v for k, v in {
            "loss_scaling_factor": loss_scale, "initial_loss_scale": init_scale, "steps_per_increase": steps_per_increase,
            "min_loss_scale": min_loss_scale, "max_loss_scale": max_loss_scale,
            "max_gradient_norm": max_gradient_norm}.items() if v is not None}
        self.cluster_state = None  # the cluster's loss scaler's state after the last step (``Run``)
        self.loaded = None  # a state_dict() loaded to resume from

    def scale(self, loss):
        return loss

    def unscale_(self, optimizer):
        """Nothing to do: MemoryX unscales the gradients it is sent."""

    def step(self, optimizer, *args, **kwargs):
        rec = recording()
        rec.settings.update(self.spec)
        rec.scaler = self
        optimizer.step()

    def get_scale(self):
        """The loss scale after the last step (before any: the initial one, Model Zoo's defaults for a
        dynamic scale: 2^15, 2^31 in cbfloat16)."""
        if self.cluster_state is not None:
            return float(self.cluster_state["scale"])
        if self.spec.get("loss_scaling_factor") == "dynamic":
            big = 2.0 ** (31 if step_mod.half_dtype == "cbfloat16" else 15)
            return float(self.spec.get("initial_loss_scale") or big)
        return float(self.spec.get("loss_scaling_factor", 1.0))

    def state_dict(self, destination=None):
        """Cerebras' layout of the scaler's state after the last step: ``loss_scale``, and for a dynamic
        scale the clean steps since it last changed (``steps_since_rescale``) and
        ``overflows_since_rescale``."""
        st = self.cluster_state
        if st is None:
            return {}
        out = {"loss_scale": float(st["scale"])}
        if self.spec.get("loss_scaling_factor") == "dynamic":
            out.update(steps_since_rescale=int(st["good_steps"]), overflows_since_rescale=0)
        return out

    def load_state_dict(self, state_dict):
        """A saved ``state_dict()``: a run resuming from its step scales as the run that saved it did."""
        if not isinstance(state_dict, dict):
            raise DataError("GradScaler.load_state_dict: expected the dict GradScaler.state_dict() gave")
        self.loaded = dict(state_dict)

    def resumed_state(self):
        """The loaded state, as the cluster's loss scaler keeps it (``LossScaler.state``), or None."""
        if not self.loaded or "loss_scale" not in self.loaded:
            return None
        return {"scale": float(self.loaded["loss_scale"]), "good_steps": int(self.loaded.get("steps_since_rescale", 0))}

    def update(self, new_scale=None):
        if new_scale is not None:
            raise not_built("GradScaler.update(new_scale)", "the scale follows the dynamic rule")


def _format(dtype, who="cstorch.amp.set_half_dtype"):
    """The format name of a half dtype: "float16", "bfloat16", "cbfloat16" or torch.float16 / torch.bfloat16."""
    if isinstance(dtype, str) and dtype in ("float16", "bfloat16", "cbfloat16"):
        return dtype
    if isinstance(dtype, torch.dtype) and dtype in (torch.float16, torch.bfloat16):
        return str(dtype).replace("torch.", "")
    raise ConfigError(f"{who}: {dtype!r} is not a half dtype (give \"float16\", \"bfloat16\", "
                      "\"cbfloat16\", torch.float16 or torch.bfloat16)")


def _torch_dtype(fmt):
    return torch.bfloat16 if fmt == "bfloat16" else torch.float16  # cbfloat16's proxy is float16, as Cerebras'


def set_half_dtype(dtype):
    """Train the traced steps captured from now on in ``dtype``'s 16-bit format; return the torch
    dtype that stands for it (torch.float16 for cbfloat16, as Cerebras' proxy dtype)."""
    step_mod.half_dtype = _format(dtype)
    return _torch_dtype(step_mod.half_dtype)


def use_bfloat16(use):
    """Cerebras' older spelling: ``set_half_dtype`` of bfloat16 if ``use``, else of float16."""
    return set_half_dtype("bfloat16" if use else "float16")


def enable_mixed_precision(enable=True):
    """Cerebras' switch: False trains the steps captured from now on in float32 (the half dtype set is
    forgotten); True in the half dtype set, else float16. Returns whether mixed precision is on."""
    step_mod.half_dtype = (step_mod.half_dtype or "float16") if enable else None
    return step_mod.half_dtype is not None


def get_half_dtype():
    """The torch dtype of the half dtype set (torch.float16 when none is)."""
    return _torch_dtype(step_mod.half_dtype)


def get_half_dtype_str():
    """The half dtype set, by name ("float16" when none is)."""
    return step_mod.half_dtype or "float16"


def mixed_precision():
    """Whether the steps captured from now on train in mixed precision."""
    return step_mod.half_dtype is not None


def get_floating_point_dtype(default=None):
    """The half dtype in mixed precision, else ``default`` (torch.float32)."""
    return get_half_dtype() if mixed_precision() else (default or torch.float32)


def get_floating_point_dtype_str(default="float32"):
    return get_half_dtype_str() if mixed_precision() else default


@contextlib.contextmanager
def autocast(dtype=None):
    """In a traced step, its forward runs in mixed precision: the run trains in the half dtype set,
    else in ``dtype``, else in float16. Nothing is cast here: the cluster rounds, as a CSX does."""
    fmt = None if dtype is None else _format(dtype, "cstorch.amp.autocast")
    rec = step_mod._recording
    if rec is not None:
        rec.fp16_type = rec.fp16_type or fmt or "float16"
    yield None


def optimizer_step(loss, optimizer, grad_scaler, max_gradient_norm=None, max_gradient_value=None):
    """Cerebras' whole update in one call, inside the traced step: the scaled loss's backward, the
    clipping (``max_gradient_norm``: the global L2 norm), the scaler's step and update; as
    Cerebras' own, it calls ``backward()`` itself."""
    if not isinstance(loss, torch.Tensor):
        raise ValueError(f"cstorch.amp.optimizer_step: loss: expected a tensor, got {type(loss).__name__}")
    if not isinstance(grad_scaler, GradScaler):
        raise TypeError(f"cstorch.amp.optimizer_step: grad_scaler: expected a cstorch.amp.GradScaler, got "
                        f"{type(grad_scaler).__name__}")
    if max_gradient_value is not None:
        raise not_built("optimizer_step(max_gradient_value=...)", "max_gradient_norm: the global L2 norm")
    if max_gradient_norm is not None and max_gradient_norm < 0:
        raise ConfigError(f"cstorch.amp.optimizer_step: max_gradient_norm: expected >= 0, got {max_gradient_norm}")
    grad_scaler.scale(loss).backward()
    grad_scaler.unscale_(optimizer)
    grad_scaler.step(optimizer)
    if max_gradient_norm is not None:  # the call's, over the scaler's own
        recording().settings["max_gradient_norm"] = float(max_gradient_norm)
    grad_scaler.update()
    optimizer.zero_grad()


__getattr__ = refusing("cstorch.amp", "built: GradScaler, optimizer_step, autocast, set_half_dtype, "
                      "get_half_dtype(_str), use_bfloat16, enable_mixed_precision, mixed_precision, "
                      "get_floating_point_dtype(_str)")
