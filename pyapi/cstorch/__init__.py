"""Cerebras' PyTorch API (``cerebras.pytorch``) on the emulated cluster: a training script written for
it runs here with one changed line, ``import pyapi.cstorch as cstorch``.

    backend = cstorch.backend("CSX", num_csx=2)          # or "CPU": the same steps in this process
    compiled = cstorch.compile(model, backend)
    optimizer = cstorch.optim.AdamW(model.parameters(), lr=1e-3)

    @cstorch.trace
    def training_step(inputs, targets):
        loss = loss_fn(compiled(inputs), targets)
        loss.backward(); optimizer.step(); optimizer.zero_grad()
        return loss

    executor = cstorch.utils.data.DataExecutor(cstorch.utils.data.DataLoader(input_fn), num_steps=100)
    for step, (inputs, targets) in enumerate(executor, 1):
        loss = training_step(inputs, targets)

As on a real system the traced step is captured once, on its first call (``wse_core.compiler``; its
Python runs again on fake tensors to check the graph and run its closures); every step after is
the cluster's: the DataExecutor writes the loader's batches as a dataset, the model's
graph as a program, and runs the job (``pyapi.Job``) with the model family ``torch``; the traced
function returns what the step returns as the cluster finishes it, and the model holds the trained
weights when the executor ends. What is not built is refused in one line naming it
(docs/user-guide.md, "Your own PyTorch model").
"""

import contextlib
import importlib.machinery

import numpy as np

try:
    import torch  # noqa: F401
except ImportError:
    raise ImportError("pyapi.cstorch needs PyTorch: pip install -e '.[torch]'") from None

from pyapi.cstorch import alias  # noqa: E402  (cerebras.pytorch and cerebras_pytorch name this package)
from pyapi.cstorch import amp, distributed, metrics, optim, utils  # noqa: E402
from pyapi.cstorch.backends import backends  # noqa: E402  (the flags object, as Cerebras' cstorch.backends)
from pyapi.cstorch.backend import (Backend, ClusterConfig, backend, compile, current_backend,  # noqa: E402
                                   current_torch_device, use_cs)
from pyapi.cstorch.step import (checkpoint_closure, current_executor, step_closure, summarize_scalar,  # noqa: E402
                                summarize_tensor, trace)
from pyapi.cstorch.errors import JobError, NotBuilt, NotBuiltAttribute  # noqa: E402, F401  (what scripts catch)
from pyapi.cstorch.storage import load, save  # noqa: E402

#: The release of Cerebras' API whose surface this package follows (docs/user-guide.md's table).
__version__ = "2.3.1"

__all__ = ["Backend", "ClusterConfig", "amp", "backend", "backends", "checkpoint_closure", "compile", "current_backend",
           "current_executor", "current_torch_device", "distributed", "from_numpy", "full", "full_like", "load",
           "make_constant", "manual_seed", "metrics", "name_scope", "ones", "ones_like", "optim", "save", "step_closure",
           "summarize_scalar", "summarize_tensor", "to_numpy", "trace", "use_cs", "utils", "zeros", "zeros_like"]


def from_numpy(array):
    """A tensor of a numpy array (sharing its memory; a read-only array is copied first)."""
    return torch.from_numpy(array if array.flags.writeable else np.array(array))


def to_numpy(tensor):
    """The numpy array of a tensor (float32 for bfloat16, which numpy has not)."""
    t = tensor.detach().cpu()
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()


def full(shape, value, dtype=None):
    return torch.full(shape, value, dtype=dtype)


def full_like(other, value, dtype=None):
    return torch.full_like(other, value, dtype=dtype)


def ones(shape, dtype=None):
    return torch.ones(shape, dtype=dtype)


def ones_like(other, dtype=None):
    return torch.ones_like(other, dtype=dtype)


def zeros(shape, dtype=None):
    return torch.zeros(shape, dtype=dtype)


def zeros_like(other, dtype=None):
    return torch.zeros_like(other, dtype=dtype)


def make_constant(tensor):
    """The tensor: a tensor the step makes is a constant of its graph already."""
    return tensor


def name_scope(name, raw=False):
    """Names the ops of a block on a real system (for its debugging tools); nothing here."""
    return contextlib.nullcontext()


def manual_seed(seed):
    """Cerebras' 2.0-era seed: torch's generator, as ``torch.manual_seed`` (the model's initial
    weights; dropout on the cluster is keyed by the run's seed and the step)."""
    torch.manual_seed(seed)


def __getattr__(name):
    """Cerebras' other modules and functions (sparse, ...): one line naming them. A submodule of this
    package not imported yet is imported (``from pyapi.cstorch import run``)."""
    if name.startswith("_"):
        raise AttributeError(name)
    if importlib.machinery.PathFinder.find_spec(f"{__name__}.{name}", __path__) is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise NotBuiltAttribute(f"cstorch.{name}: not built in wse-cluster (built: {', '.join(__all__)})")
