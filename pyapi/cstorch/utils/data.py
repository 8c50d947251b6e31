"""``cstorch.utils.data``: ``DataLoader`` (a function making the user's loader) and ``DataExecutor``.

The executor consumes the loader as one global stream, in the order it yields (one loader, not one
per worker: the micro-batches are then the same for any number of CS-2s), restarting it when it is
exhausted, for ``num_steps`` batches; the run (``pyapi.cstorch.run``) writes them as the job's dataset.
"""
from pyapi.cstorch import step as step_mod
from pyapi.cstorch.errors import not_built


class DataLoader:
    """``input_fn(*args, **kwargs)`` makes the loader (a torch DataLoader or any iterable of batches)."""

    def __init__(self, input_fn, *args, **kwargs):
        if not callable(input_fn):
            raise TypeError(f"DataLoader: expected a function that makes the loader, got {type(input_fn).__name__}")
        self.input_fn, self.args, self.kwargs = input_fn, args, kwargs

    def batches(self, n):
        """The first ``n`` batches of the stream (the loader made again when exhausted)."""
        out = []
        while len(out) < n:
            before = len(out)
            for batch in self.input_fn(*self.args, **self.kwargs):
                out.append(batch)
                if len(out) == n:
                    break
            if len(out) == before:
                raise ValueError(f"DataLoader: {getattr(self.input_fn, '__name__', 'input_fn')}() made a loader "
                                 "that yields no batch")
        return out

    def __len__(self):
        return len(self.input_fn(*self.args, **self.kwargs))


class DataExecutor:
    """Iterating it yields ``num_steps`` batches; the traced step called on each returns that step's
    loss from the cluster. ``checkpoint_steps=k``: checkpoints at steps k, 2k, ... and the last."""

    def __init__(self, dataloader, num_steps=None, checkpoint_steps=None, cs_config=None, writer=None,
                 micro_batch_size=None, **kwargs):
        if kwargs:
            raise not_built(f"DataExecutor({next(iter(kwargs))}=...)", "num_steps, checkpoint_steps")
        if cs_config is not None or writer is not None:
            raise not_built("DataExecutor(cs_config/writer)", "give the cluster to cstorch.backend")
        if not isinstance(dataloader, DataLoader):
            raise TypeError("DataExecutor: expected a cstorch.utils.data.DataLoader")
        self.dataloader = dataloader
        self.num_steps = num_steps if num_steps is not None else len(dataloader)
        if isinstance(self.num_steps, bool) or not isinstance(self.num_steps, int) or self.num_steps < 1:
            raise ValueError(f"DataExecutor: num_steps: expected an integer >= 1, got {self.num_steps!r}")
        self.checkpoint_steps = checkpoint_steps
        self.micro_batch_size = micro_batch_size
        self.step, self.run = 0, None

    @property
    def on_checkpoint_step(self):
        k = self.checkpoint_steps
        return bool(k) and (self.step % k == 0 or self.step == self.num_steps)

    @property
    def on_final_iteration(self):
        return self.step == self.num_steps

    def __iter__(self):
        from pyapi.cstorch.backend import backend
        from pyapi.cstorch.run import Run

        if step_mod._executor is not None:
            raise RuntimeError("DataExecutor: another executor is being iterated")
        import torch

        batches = self.dataloader.batches(self.num_steps)
        for i, batch in enumerate(batches, 1):
            if not (isinstance(batch, (tuple, list)) and len(batch) == 2
                    and all(isinstance(t, torch.Tensor) and t.dim() >= 1 for t in batch)):
                raise not_built(f"DataLoader: batch {i} is {type(batch).__name__}", "batches of (inputs, targets) "
                                "tensors")
        first = len(batches[0][0])
        kinds = [(t.dtype, tuple(t.shape[1:])) for t in batches[0]]
        for i, batch in enumerate(batches, 1):
            if len(batch[0]) != first:  # a graph captured once runs one batch size
                raise ValueError(f"DataLoader: batch {i} has {len(batch[0])} samples, batch 1 has {first}: the "
                                 "captured step takes one batch size (drop_last=True)")
            for j, (t, (dtype, shape)) in enumerate(zip(batch, kinds)):
                if (t.dtype, tuple(t.shape[1:])) != (dtype, shape):  # ... and one shape: its graph's
                    raise ValueError(f"DataLoader: batch {i}'s {('inputs', 'targets')[j]} are {_kind(t)}, batch 1's "
                                     f"{_kind(batches[0][j])}: the captured step takes one shape and dtype (pad "
                                     "to one length)")
        self.run = Run(backend(), self, batches)
        step_mod._executor = self
        try:
            for self.step, batch in enumerate(batches, 1):
                yield batch
                if self.step == 1 and not self.run.started:
                    raise RuntimeError("DataExecutor: the loop's first step called no @cstorch.trace function")
            self.run.finish()
        finally:
            step_mod._executor = None
            self.run.close()


def _kind(t):
    return f"{str(t.dtype).replace('torch.', '')} {list(t.shape)}"
