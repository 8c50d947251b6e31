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

As on a real system the traced step runs once, when it is captured (``wse_core.compiler``); every
step after is the cluster's: the DataExecutor writes the loader's batches as a dataset, the model's
graph as a program, and runs the job (``pyapi.Job``) with the model family ``torch``; the traced
function returns each step's loss as the cluster finishes it, and the model holds the trained
weights when the executor ends. What is not built is refused in one line naming it
(docs/user-guide.md, "Your own PyTorch model").
"""
try:
    import torch  # noqa: F401
except ImportError:
    raise ImportError("pyapi.cstorch needs PyTorch: pip install -e '.[torch]'") from None

from pyapi.cstorch import amp, optim, utils  # noqa: E402
from pyapi.cstorch.backend import Backend, ClusterConfig, backend, compile, current_backend, use_cs  # noqa: E402
from pyapi.cstorch.step import checkpoint_closure, step_closure, summarize_scalar, trace  # noqa: E402
from pyapi.cstorch.errors import NotBuilt  # noqa: E402
from pyapi.cstorch.storage import load, save  # noqa: E402

__all__ = ["Backend", "ClusterConfig", "amp", "backend", "checkpoint_closure", "compile", "current_backend", "load",
           "optim", "save", "step_closure", "summarize_scalar", "trace", "use_cs", "utils"]


class _NotBuiltAttribute(NotBuilt, AttributeError):
    """A name of Cerebras' API not built here: one line, and an AttributeError, so ``hasattr`` and
    ``getattr(cstorch, name, default)`` answer as for any missing name."""


def __getattr__(name):
    """Cerebras' other modules and functions (metrics, sparse, distributed, ...): one line naming them.
    A submodule of this package not imported yet is imported (``from pyapi.cstorch import run``)."""
    import importlib.util

    if name.startswith("_"):
        raise AttributeError(name)
    if importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise _NotBuiltAttribute(f"cstorch.{name}: not built in wse-cluster (built: {', '.join(__all__)})")
