"""``cstorch.utils.tensorboard``: Cerebras' ``SummaryWriter`` (TensorBoard event files, through
tensorboardX: the ``tensorboard`` extra) with its ``add_tensor``, and the summaries a traced step
writes (``summarize_scalar``, ``summarize_tensor``: to the DataExecutor's writer when it was given
one, and to the run's own, ``model_dir/train``)."""
import time
from pathlib import Path

import torch

from data_tools.files import replacing
from pyapi.cstorch import step as step_mod
from pyapi.cstorch.errors import refusing

try:
    from tensorboardX import SummaryWriter as _Writer
except ImportError:  # the writer's constructor says what to install
    _Writer = None


class SummaryWriter(_Writer or object):
    """A TensorBoard writer (tensorboardX's, whose methods torch's has: ``add_scalar``,
    ``add_text``, ``flush``, ...); ``base_step`` is added to the step of the summaries a traced step
    writes; ``add_tensor`` keeps a whole tensor (``torch.save``) under
    ``log_dir/tensors/<name>/<step>.pt``."""

    def __init__(self, log_dir=None, *args, base_step=1, **kwargs):
        if _Writer is None:
            raise ImportError("cstorch.utils.tensorboard.SummaryWriter needs tensorboardX: "
                              "pip install -e '.[tensorboard]'")
        super().__init__(log_dir, *args, **kwargs)
        self.base_step = base_step

    @property
    def log_dir(self):
        return self.logdir

    def add_tensor(self, name, tensor, step):
        where = Path(self.logdir) / "tensors" / name
        where.mkdir(parents=True, exist_ok=True)
        with replacing(where / f"{int(step)}.pt") as tmp:  # a reader never sees half a file
            torch.save({"step": int(step), "ns_since_epoch": time.time_ns(), "tensor": tensor.detach().cpu()}, tmp)


def summarize_scalar(name, scalar):
    """``name``'s value at this step (a tensor of the traced step, or a Python number), in TensorBoard."""
    step_mod.summarize_scalar(name, scalar)


def summarize_tensor(name, tensor):
    """``name``'s whole tensor at this step, kept by the DataExecutor's writer (``add_tensor``)."""
    step_mod.summarize_tensor(name, tensor)


__getattr__ = refusing("cstorch.utils.tensorboard", "built: SummaryWriter (add_scalar, add_tensor, ...), "
                      "summarize_scalar, summarize_tensor; read event files with TensorBoard")
