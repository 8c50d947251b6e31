"""``cstorch.trace`` and the step closures.

A traced step runs its Python once, on its first call inside a DataExecutor: there it is captured
(``Run.capture``) with ``loss.backward()``, ``optimizer.step()``, ``zero_grad()``, a scheduler's
``step()``, a grad scaler's calls and ``torch.nn.utils.clip_grad_norm_`` recorded, not run, and
``tensor.item()`` refused (a value exists only once the cluster has run the step); the run's
precision (``cstorch.amp``: the half dtype set, or ``autocast()`` in the step) is recorded too. Every
call returns that step's loss as the cluster finished it. Step closures run at once, on values that
are already the step's (the traced step waited for them); a checkpoint closure runs on checkpoint
steps only, with the model holding that step's weights.
"""
import contextlib
import functools

from pyapi.cstorch.errors import not_built


class Recording:
    """What the traced step's first run said beside its graph: its optimizers, their settings, and
    ``fp16_type``, the 16-bit format it trains in (``cstorch.amp``), or None: float32."""

    def __init__(self, fp16_type=None):
        self.optimizers, self.settings, self.fp16_type = [], {}, fp16_type


_recording = None
_executor = None  # the DataExecutor being iterated (utils.data sets it)


def recording():
    if _recording is None:
        raise RuntimeError("this call belongs inside a function decorated with @cstorch.trace")
    return _recording


@contextlib.contextmanager
def record(fn):
    """Run the traced step ``fn``'s Python for capture: gradients and updates are the cluster's to make."""
    import torch
    import torch.nn.utils.clip_grad as clip_grad

    from pyapi.cstorch import amp

    global _recording
    rec = Recording(amp._half_dtype)  # set_half_dtype before the capture; autocast() in the step may set it too
    saved = torch.Tensor.backward, torch.nn.utils.clip_grad_norm_, torch.Tensor.item
    original = saved[1]
    # the step's own names for it too (``from torch.nn.utils import clip_grad_norm_``)
    aliases = [name for name, value in getattr(fn, "__globals__", {}).items() if value is original]

    def backward(tensor, *args, **kwargs):
        pass  # the captured graph is differentiated unit by unit on the CS-2s

    def clip_grad_norm_(parameters, max_norm, norm_type=2.0, *args, **kwargs):
        if norm_type != 2.0:
            raise not_built(f"clip_grad_norm_(norm_type={norm_type})", "the global L2 norm")
        rec.settings["max_gradient_norm"] = float(max_norm)
        return torch.zeros(())

    def item(tensor):
        raise not_built("tensor.item() inside the traced step", "its value exists once the cluster has run the "
                        "step: return the tensor and read it in a @cstorch.step_closure")

    def clip_grad_value_(*args, **kwargs):
        raise not_built("clip_grad_value_", "clip_grad_norm_: the global L2 norm")

    saved_value = torch.nn.utils.clip_grad_value_
    torch.Tensor.backward, torch.nn.utils.clip_grad_norm_, torch.Tensor.item = backward, clip_grad_norm_, item
    torch.nn.utils.clip_grad_value_ = clip_grad.clip_grad_value_ = clip_grad_value_
    clip_grad.clip_grad_norm_ = clip_grad_norm_
    for name in aliases:
        fn.__globals__[name] = clip_grad_norm_
    _recording = rec
    try:
        yield rec
    finally:
        torch.Tensor.backward, torch.nn.utils.clip_grad_norm_, torch.Tensor.item = saved
        torch.nn.utils.clip_grad_value_ = clip_grad.clip_grad_value_ = saved_value
        clip_grad.clip_grad_norm_ = original
        for name in aliases:
            fn.__globals__[name] = original
        _recording = None


def trace(fn):
    """The training step: captured on its first call, the cluster's on every call."""

    @functools.wraps(fn)
    def traced(*args):
        if _executor is None:
            raise RuntimeError(f"{fn.__name__}: a traced step runs inside a DataExecutor loop "
                               "(for batch in cstorch.utils.data.DataExecutor(...))")
        return _executor.run.step(fn, args, _executor.step)

    return traced


def step_closure(fn):
    """Run ``fn`` on the step's values (they are this process's tensors once the step has ended)."""

    @functools.wraps(fn)
    def closure(*args, **kwargs):
        if _recording is not None:
            raise not_built(f"{fn.__name__}: a step closure inside the traced step",
                            "call it on the traced step's return values")
        return fn(*args, **kwargs)

    return closure


def checkpoint_closure(fn):
    """A step closure that runs on checkpoint steps only (``DataExecutor(checkpoint_steps=k)``: k, 2k,
    ... and the last), with the model holding that step's weights."""

    @functools.wraps(fn)
    def closure(*args, **kwargs):
        if _executor is None:
            raise RuntimeError(f"{fn.__name__}: cannot fetch a checkpoint outside of an execution context")
        if _executor.on_checkpoint_step:
            _executor.run.sync_weights(_executor.step)
            return fn(*args, **kwargs)
        return None

    return closure


def summarize_scalar(name, value):
    """The value, with its step, in TensorBoard (the run's model_dir/train, beside the cluster's own
    scalars) and in the run's ``summaries.jsonl``."""
    if _executor is None or _recording is not None:
        raise not_built("summarize_scalar inside the traced step or outside a DataExecutor",
                        "call it on the traced step's return values, in the loop")
    _executor.run.summarize(name, float(value), _executor.step)
