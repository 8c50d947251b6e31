"""The graph compiler (issue 25): a user's PyTorch model captured as one training-step graph, cut
into streaming units, and run unit by unit as weight streaming runs it.

    graph = capture(model, (inputs, targets), torch.nn.CrossEntropyLoss())   # capture.py
    units = partition(graph)                                                 # partition.py
    loss, grads = run_step(units, dict(model.named_parameters()), batch,     # runner.py
                           micro_batch_size=4, step=1, seed=0)

PyTorch is optional for the project: only this package imports it (``pip install -e '.[torch]'``).
"""
try:
    import torch  # noqa: F401
except ImportError:
    raise ImportError("wse_core.compiler needs PyTorch: pip install -e '.[torch]'") from None

from wse_core.compiler.capture import Graph, Step, capture
from wse_core.compiler.errors import CompileError
from wse_core.compiler.loss import Loss
from wse_core.compiler.partition import Unit, partition
from wse_core.compiler.runner import accumulate, add, combine, dropout_seed, run_step

__all__ = ["CompileError", "Graph", "Loss", "Step", "Unit", "accumulate", "add", "capture", "combine",
           "dropout_seed", "partition", "run_step"]
