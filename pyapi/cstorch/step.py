"""``cstorch.trace`` and the step closures.

A traced step (a training step, or an evaluation step: one that calls neither ``backward`` nor an
optimizer) runs its Python on its first call inside a DataExecutor: there it is captured
(``Run._start``) with ``loss.backward()``, ``optimizer.step()``, ``zero_grad()``, a scheduler's
``step()``, a grad scaler's calls and ``torch.nn.utils.clip_grad_norm_`` recorded, not run, and
``tensor.item()`` refused (a value exists only once the cluster has run the step); the run's
precision (``cstorch.amp``: the half dtype set, or ``autocast()`` in the step) is recorded too. Every
call returns what the step returns, its tensors the values the cluster computed for that step.
Step closures called in the loop run at once, on values that are already the step's (the traced
step waited for them); step closures and summaries called inside the traced step run when the
step is done, in the order called, on the step's values (the step's Python then runs on every
step, on fake tensors: ``ops_of``, about a tenth of an eager forward pass, so Python values such
as a step count are each step's own). Both run on the executor's activation steps (a metric's
update on every step). A checkpoint closure runs on checkpoint steps only, with the model holding
that step's weights.
"""
import contextlib
import functools

import torch
import torch.nn.utils.clip_grad as clip_grad
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from pyapi.cstorch.errors import not_built


class Recording:
    """What the traced step's first run said beside its graph: its optimizers, their settings, and
    ``fp16_type``, the 16-bit format it trains in (``cstorch.amp``), or None: float32."""

    def __init__(self, fp16_type=None):
        self.optimizers, self.settings, self.fp16_type = [], {}, fp16_type
        self.backward = False  # loss.backward() was called: a training step (an evaluation step calls none)
        self.loss = None  # the tensor it was called on
        self.scaler = None  # the cstorch.amp.GradScaler whose step() it called
        self.closures = []  # (closure, args, kwargs) the step called: run once the step is done


_recording = None
half_dtype = None  # the 16-bit format cstorch.amp.set_half_dtype set, or None (float32)
_executor = None  # the DataExecutor being iterated (utils.data sets it)


def current_executor():
    """The DataExecutor being iterated."""
    if _executor is None:
        raise RuntimeError("cstorch.current_executor(): no DataExecutor is being iterated")
    return _executor


def recording():
    if _recording is None:
        raise RuntimeError("this call belongs inside a function decorated with @cstorch.trace")
    return _recording


@contextlib.contextmanager
def record(fn):
    """Run the traced step ``fn``'s Python for capture: gradients and updates are the cluster's to make."""
    global _recording
    rec = Recording(half_dtype)  # set_half_dtype before the capture; autocast() in the step may set it too
    saved = torch.Tensor.backward, torch.nn.utils.clip_grad_norm_, torch.Tensor.item
    original = saved[1]
    # the step's own names for it too (``from torch.nn.utils import clip_grad_norm_``)
    aliases = [name for name, value in getattr(fn, "__globals__", {}).items() if value is original]

    def backward(tensor, *args, **kwargs):
        if rec.loss is not None and tensor is not rec.loss:
            raise not_built("a traced step that calls backward() on two tensors", "one loss's backward()")
        rec.backward, rec.loss = True, tensor  # the captured graph is differentiated unit by unit on the CS-2s

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


def ops_of(fn, args, kwargs):
    """Run the traced step ``fn``'s Python on ``args`` as fake tensors (no arithmetic, torch's generator
    untouched): (the aten ops it runs, name, output shape and the Python numbers it takes, in order:
    what a graph captured from it holds; its recording: the step closures it called, with their
    arguments, and its loss; what it returned)."""
    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            # the Python numbers an op takes (a scale, a dimension): a graph holds them as constants
            numbers = tuple(a for a in tree_leaves((args, kwargs or {})) if isinstance(a, (bool, int, float)))
            self.seen.append((str(func), tuple(out.shape) if isinstance(out, torch.Tensor) else (), numbers))
            return out

    with record(fn) as rec, torch.random.fork_rng(devices=()), FakeTensorMode(allow_non_fake_inputs=True), \
            Ops() as ops:
        out = fn(*args, **kwargs)
    return ops.seen, rec, out


def handed(rec, out):
    """The tensors a run of the traced step hands to Python, in order: those its step closures and
    summaries were given, then those it returned; each once, the loss (``rec.loss``) left out."""
    seen, found = {id(rec.loss)} if rec.loss is not None else set(), []
    for leaf in [x for _, args, kwargs in rec.closures for x in tree_leaves((args, kwargs))] + tree_leaves(out):
        if isinstance(leaf, torch.Tensor) and id(leaf) not in seen:
            seen.add(id(leaf))
            found.append(leaf)
    return found


def names_closures(fn):
    """Whether the traced step ``fn``'s own code names a step closure, a checkpoint closure or
    ``summarize_scalar`` (a global, a name it closes over, or an attribute such as
    ``cstorch.summarize_scalar``): then its Python runs every step, since it may call them on some
    steps only. A closure reached only through another function is not seen (docs/design/compiler.md
    "The front-end: pyapi.cstorch")."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return False
    cells = dict(zip(code.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))
    scope = {**getattr(fn, "__globals__", {}), **cells}
    return {"summarize_scalar", "summarize_tensor"} & set(code.co_names) or any(
        getattr(scope.get(name), "_cstorch_closure", False) for name in (*code.co_names, *code.co_freevars))


def with_values(value, values):
    """``value`` (a nest) with each tensor replaced by its step's value: ``values`` maps id(tensor)
    to it (the loss's and the handed tensors' of the run that made ``value``)."""
    return tree_map(lambda x: values[id(x)] if isinstance(x, torch.Tensor) else x, value)


def run_closures(calls, values):
    """The step closures a step called, in order, on its values (``with_values``)."""
    for closure, args, kwargs in calls:
        closure(*with_values(args, values), **with_values(kwargs, values))


def trace(fn):
    """The training step: captured on its first call, the cluster's on every call."""

    @functools.wraps(fn)
    def traced(*args, **kwargs):
        if _executor is None:
            raise RuntimeError(f"{fn.__name__}: a traced step runs inside a DataExecutor loop "
                               "(for batch in cstorch.utils.data.DataExecutor(...))")
        return _executor.run.step(fn, args, kwargs, _executor.step)

    return traced


def step_closure(fn):
    """Run ``fn`` on the step's values (they are this process's tensors once the step has ended)."""

    @functools.wraps(fn)
    def closure(*args, **kwargs):
        if _recording is not None:  # inside the traced step: run once the step is done
            _recording.closures.append((closure, args, kwargs))
            return None
        if _executor is not None and _executor.run is not None and _executor.run.started and (
                not _executor.run.backend.is_e2e_execution or not _executor.on_activation_step):
            return None  # a compile runs nothing; values are fetched on activation steps only
        return fn(*args, **kwargs)

    closure._cstorch_closure = True  # names_closures finds it in a traced step
    return closure


def checkpoint_closure(fn):
    """A step closure that runs on checkpoint steps only (``DataExecutor(checkpoint_steps=k)``: k, 2k,
    ... and the last), with the model holding that step's weights."""

    @functools.wraps(fn)
    def closure(*args, **kwargs):
        if _recording is not None:  # inside the traced step: run once the step is done
            _recording.closures.append((closure, args, kwargs))
            return None
        if _executor is None:
            raise RuntimeError(f"{fn.__name__}: cannot fetch a checkpoint outside of an execution context")
        if _executor.on_checkpoint_step and _executor.run.backend.is_e2e_execution:
            _executor.run.sync_weights(_executor.step)
            return fn(*args, **kwargs)
        return None

    closure._cstorch_closure = True
    return closure


def summarize_scalar(name, value):
    """The value, with its step, in TensorBoard (the run's model_dir/train, beside the cluster's own
    scalars, and the DataExecutor's writer when given one) and in the run's ``summaries.jsonl``."""
    if _recording is not None:  # inside the traced step: once the step is done, on its value
        _recording.closures.append((summarize_scalar, (name, value), {}))
        return
    if _executor is None:
        raise RuntimeError("summarize_scalar: outside a DataExecutor loop (it writes the value with its step)")
    if getattr(value, "numel", lambda: 1)() != 1:
        raise ValueError(f"summarize_scalar({name!r}): a tensor of shape {list(value.shape)}, not a scalar "
                         "(cstorch.summarize_tensor keeps a whole tensor)")
    if not _executor.on_activation_step:
        return
    _executor.run.summarize(name, float(value), _executor.run.start + _executor.step)  # the run's global step
    if _executor.writer is not None:
        _executor.writer.add_scalar(name, float(value), _executor.writer.base_step + _executor.step - 1)


def summarize_tensor(name, tensor):
    """The tensor, with its step, kept by the DataExecutor's writer (``SummaryWriter.add_tensor``)."""
    if _recording is not None:
        _recording.closures.append((summarize_tensor, (name, tensor), {}))
        return
    if _executor is None:
        raise RuntimeError("summarize_tensor: outside a DataExecutor loop (it writes the tensor with its step)")
    if _executor.writer is None:
        raise ValueError("summarize_tensor: the DataExecutor has no writer to keep it "
                         "(DataExecutor(..., writer=cstorch.utils.tensorboard.SummaryWriter(log_dir)))")
    if not _executor.on_activation_step:
        return
    _executor.writer.add_tensor(name, tensor, _executor.writer.base_step + _executor.step - 1)
