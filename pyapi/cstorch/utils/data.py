"""``cstorch.utils.data``: ``DataLoader`` (a function making the user's loader), ``DataExecutor`` and
``compute_num_steps``.

The executor consumes the loader as one global stream, in the order it yields (one loader, not one
per worker: the micro-batches are then the same for any number of CS-2s), restarting it when it is
exhausted, for ``num_steps`` batches; the run (``pyapi.cstorch.run``) writes them as the job's
dataset. A batch is any nest of tuples, lists and dicts whose leaves are tensors of one batch size
(``(inputs, targets)``, ``{"input_ids": ..., "attention_mask": ..., "labels": ...}``). A loader
whose input function asks the streamer API (``cstorch.distributed``) is made once more per
streamer, as the appliance's input workers make it, and step t's global batch is the CS-2s'
shares in CS-2 order, each from the streamer of that CS-2 whose turn it is (worker t mod
``num_workers_per_csx``).
"""
import itertools
import sys
import time

import torch  # pyapi.cstorch needs it (its __init__ says so): SyntheticDataset is a torch dataset
from torch.utils._pytree import keystr, tree_flatten_with_path, tree_map, tree_unflatten

from pyapi.cstorch import distributed, step as step_mod
from pyapi.cstorch.backend import backend
from pyapi.cstorch.errors import not_built, refusing
from wse_core.errors import ConfigError, DataError, PlanError
# pyapi.cstorch.run (the job: pyapi.job, pyapi.params, yaml) is imported when an executor runs, not with
# the package.


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
                raise DataError(f"DataLoader: {getattr(self.input_fn, '__name__', 'input_fn')}() made a loader "
                                "that yields no batch")
        return out

    def __len__(self):
        return len(self.input_fn(*self.args, **self.kwargs))


class SyntheticDataset(torch.utils.data.IterableDataset):
    """Cerebras' synthetic data: ``num_samples`` samples (endless if None) of ``sample_spec``, a nest of
    tensors (each sample a copy) or functions of the sample's index giving one. An iterable dataset:
    give it to a torch DataLoader in the input function."""

    def __init__(self, sample_spec, num_samples=None):
        super().__init__()
        if num_samples is not None and (isinstance(num_samples, bool) or not isinstance(num_samples, int)
                                        or num_samples < 1):
            raise ConfigError(f"SyntheticDataset: num_samples: expected an integer >= 1 or None, got {num_samples!r}")
        self.sample_spec, self.num_samples = sample_spec, num_samples

    def __iter__(self):
        for i in itertools.count() if self.num_samples is None else range(self.num_samples):
            yield tree_map(lambda leaf: leaf.clone() if isinstance(leaf, torch.Tensor) else leaf(i), self.sample_spec)

    def __len__(self):
        if self.num_samples is None:
            raise TypeError("SyntheticDataset: an endless dataset has no length (give num_samples)")
        return self.num_samples


def compute_num_steps(dataloader, initial_step=0, num_steps=None, max_steps=None, num_epochs=None,
                      steps_per_epoch=None, grad_accum_steps=1):
    """The steps a run takes, as Cerebras computes them: ``num_steps``; or ``max_steps`` less the
    ``initial_step``; or ``num_epochs`` of ``steps_per_epoch`` (default: the loader's length)."""
    given = [k for k, v in (("num_steps", num_steps), ("max_steps", max_steps), ("num_epochs", num_epochs))
             if v is not None]
    if len(given) != 1:
        raise ConfigError(f"compute_num_steps: give one of num_steps, max_steps and num_epochs (got "
                          f"{', '.join(given) or 'none'})")
    if grad_accum_steps != 1:
        raise not_built("compute_num_steps(grad_accum_steps=...)", "micro-batches: cstorch.backend(..., "
                        "micro_batch_size=...)")
    if num_steps is not None:
        total = num_steps
    elif max_steps is not None:
        total = max_steps - initial_step
    else:
        per_epoch = steps_per_epoch if steps_per_epoch is not None else len(dataloader)
        total = num_epochs * per_epoch - initial_step
    if not isinstance(total, int) or total < 1:
        raise ConfigError(f"compute_num_steps: {total!r} steps left to run (initial_step {initial_step})")
    return total


class RateTracker:
    """Samples a second as the appliance logs them (Cerebras' ``rate_tracker``, 2.1 on: values are
    attributes): ``rate``, a smoothed rate of the last steps; ``global_rate`` (``samples_per_sec``)
    since the first step; ``total_samples``; ``total_time``. This machine's wall clock: the
    emulated hardware's samples/s are the run's ``sim_samples_per_s`` (metrics.jsonl)."""

    #: Weight of the previous smoothed rate, as Cerebras' tracker (adapted from torch_xla's) keeps it.
    SMOOTHING = 0.4

    def __init__(self):
        self.total_samples, self._start, self._last, self._rate, self._first = 0, None, None, None, 0

    def add(self, samples):
        """A step of ``samples`` samples is done (the first step starts the clock)."""
        now = time.monotonic()
        if self._start is None:
            self._start = self._last = now
            self._first = samples  # the clock starts when it ends: its samples count toward no rate
        else:
            step_rate = samples / max(now - self._last, 1e-9)
            self._rate = step_rate if self._rate is None else \
                (1 - self.SMOOTHING) * step_rate + self.SMOOTHING * self._rate
            self._last = now
        self.total_samples += samples

    @property
    def total_time(self):
        return 0.0 if self._start is None else self._last - self._start

    @property
    def rate(self):
        return self._rate or 0.0

    @property
    def global_rate(self):
        timed = self.total_samples - self._first
        return timed / self.total_time if self.total_time > 0 else 0.0

    samples_per_sec = global_rate


class Profiler:
    """``executor.profiler``: its ``rate_tracker`` counts each step's samples as the loop takes it;
    the 2.0 spellings are its methods (``rate()``, ``global_rate()``, ``total_samples()``,
    ``total_time()``)."""

    def __init__(self):
        self.rate_tracker = RateTracker()

    def rate(self):
        return self.rate_tracker.rate

    def global_rate(self):
        return self.rate_tracker.global_rate

    def total_samples(self):
        return self.rate_tracker.total_samples

    def total_time(self):
        return self.rate_tracker.total_time


class DataExecutor:
    """Iterating it yields ``num_steps`` batches; the traced step called on each returns that step's
    values from the cluster. ``checkpoint_steps=k``: checkpoints at steps k, 2k, ... and the last.
    ``activation_steps=k``: step closures given the step's tensors run on steps k, 2k, ... and the
    last (the steps whose values are fetched). The 2.0-era keywords are taken: ``cs_config`` (a
    ``cstorch.utils.CSConfig``: the backend's cluster), ``writer`` (summaries go to it),
    ``micro_batch_size``."""

    def __init__(self, dataloader, num_steps=None, checkpoint_steps=None, activation_steps=None, cs_config=None,
                 writer=None, profiler_activities=None, listeners=None, micro_batch_size=None):
        if not isinstance(dataloader, DataLoader):
            raise TypeError("DataExecutor: expected a cstorch.utils.data.DataLoader, got "
                            f"{type(dataloader).__name__} (wrap the loader: DataLoader(input_fn, ...))")
        if listeners is not None:
            raise not_built("DataExecutor(listeners=...)", "step closures on the step's tensors")
        if profiler_activities is not None:
            raise not_built("DataExecutor(profiler_activities=...)", "the profiler's rate tracker")
        if not (checkpoint_steps is None or isinstance(checkpoint_steps, int)):
            raise not_built(f"DataExecutor(checkpoint_steps={type(checkpoint_steps).__name__})",
                            "an integer: checkpoints at its multiples and the last step")
        self.dataloader = dataloader
        self.num_steps = num_steps if num_steps is not None else len(dataloader)
        for name, value, least in (("num_steps", self.num_steps, 1), ("checkpoint_steps", checkpoint_steps, 0),
                                   ("activation_steps", activation_steps, 1)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
                raise ConfigError(f"DataExecutor: {name}: expected an integer >= {least}, got {value!r}")
        self.checkpoint_steps = checkpoint_steps
        self.activation_steps = activation_steps or 1
        self.cs_config, self.writer = cs_config, writer
        self.micro_batch_size = micro_batch_size
        self.step, self.run = 0, None
        self.profiler = Profiler()

    @property
    def iteration(self):
        """The current step, counted from 0."""
        return self.step - 1

    @property
    def user_iteration(self):
        """The current step, counted from 1."""
        return self.step

    @property
    def on_checkpoint_step(self):
        k = self.checkpoint_steps
        return bool(k) and (self.step % k == 0 or self.step == self.num_steps)

    @property
    def on_activation_step(self):
        return self.step % self.activation_steps == 0 or self.step == self.num_steps

    @property
    def on_final_iteration(self):
        return self.step == self.num_steps

    @property
    def artifact_dir(self):
        """The run's directory (``artifact_dir/run_<n>``: its program, data, params and model_dir)."""
        if self.run is None:
            raise RuntimeError("DataExecutor: it has an artifact directory once it is iterated")
        return self.run.dir

    def __len__(self):
        return self.num_steps

    def __iter__(self):
        from pyapi.cstorch.run import Run

        if step_mod._executor is not None:
            raise RuntimeError("DataExecutor: another executor is being iterated")
        current = backend()
        if self.cs_config is not None:
            current.take_cs_config(self.cs_config)
        if not current.is_e2e_execution and self.num_steps > 1:  # as Cerebras': a compile runs no step
            print(f"DataExecutor: num_steps {self.num_steps} taken as 1: the backend compiles, it runs nothing",
                  file=sys.stderr)
            self.num_steps = 1
        batches = self._batches(current)
        self.run = Run(current, self, batches)
        step_mod._executor = self
        samples = len(batches[0].leaves[0])
        try:
            for self.step, batch in enumerate(batches, 1):
                yield batch.value
                self.profiler.rate_tracker.add(samples)
                if self.step == 1 and not self.run.started:
                    raise RuntimeError("DataExecutor: the loop's first step called no @cstorch.trace function")
            self.run.finish()
        finally:
            step_mod._executor = None
            self.run.close()

    def _batches(self, current):
        """The run's global batches: the loader's as the user node makes them, or, for a loader that
        asks the streamer API on a CSX backend, the streamers' shares put together."""
        with distributed.watching() as asked:
            made = self.dataloader.batches(self.num_steps)
        batches = [Batch(b, i) for i, b in enumerate(made, 1)]
        check_batches(batches)
        if asked() and current.is_csx:
            batches = self._streamed(current.cluster_config, len(batches[0].leaves[0]))
            check_batches(batches)
        return batches

    def _streamed(self, config, size):
        """The run's batches as the streamers make them. A streamer whose batches are its CS-2's
        share (``get_streaming_batch_size``) feeds that CS-2: step t's batch is each CS-2's share, in
        CS-2 order, from its worker t mod W (streamer c W + w). A streamer whose batches are the whole
        batch (a loader that shards whole batches over the streamers, ``get_streaming_rank`` /
        ``num_streamers``) takes its turn: step t's batch is streamer t mod S's."""
        n, w_count = config.num_csx, config.workers
        if size < n:
            raise PlanError(f"DataLoader: batches of {size} samples cannot feed {n} CS-2s")
        shares = [size // n + (c < size % n) for c in range(n)]
        count = n * w_count
        made = {}
        for rank in range(count):
            c = rank // w_count
            with distributed.streamer(rank, count, shares[c]):
                # as many as feeding its CS-2 takes (taking turns with all streamers takes fewer)
                steps = len(range(rank % w_count, self.num_steps, w_count))
                made[rank] = [Batch(b, k + 1, f"streamer {rank}'s") for k, b in
                              enumerate(self.dataloader.batches(steps) if steps else [])]
        sizes = {len(b.leaves[0]) for batches in made.values() for b in batches}
        whole = n > 1 and sizes == {size}
        if whole:
            return [made[t % count][t // count] for t in range(self.num_steps)]
        for rank, batches in made.items():
            for b in batches:
                if len(b.leaves[0]) != shares[rank // w_count]:
                    raise DataError(f"DataLoader: streamer {rank} (CS-2 {rank // w_count}) made a batch of "
                                    f"{len(b.leaves[0])} samples; a streamer makes its CS-2's share of the batch, "
                                    f"{shares[rank // w_count]} (cstorch.distributed.get_streaming_batch_size), or "
                                    f"the whole batch, {size}")
        return [Batch.joined([made[c * w_count + t % w_count][t // w_count] for c in range(n)], t + 1)
                for t in range(self.num_steps)]


class Batch:
    """One step's batch as the loader made it (``value``) and its tensors in order (``leaves``, with
    their key paths: ``[0]``, ``['input_ids']``), which the run writes and the graph takes."""

    def __init__(self, value, number, whose="batch"):
        self.value, self.number = value, number
        pairs, self.spec = tree_flatten_with_path(value)
        self.paths = [keystr(path) or "the batch" for path, _ in pairs]
        self.leaves = [leaf for _, leaf in pairs]
        for path, leaf in zip(self.paths, self.leaves):
            if not isinstance(leaf, torch.Tensor) or leaf.dim() < 1:
                kind = type(leaf).__name__ if not isinstance(leaf, torch.Tensor) else "a 0-dimensional tensor"
                where = f"{whose} {number}" + ("" if path == "the batch" else f"'s {path}")
                raise not_built(f"DataLoader: {where} is {kind}", "batches whose leaves are tensors, batch first")
        if not self.leaves:
            raise DataError(f"DataLoader: {whose} {number} holds no tensor")
        sizes = {len(t) for t in self.leaves}
        if len(sizes) > 1:
            raise DataError(f"DataLoader: {whose} {number}'s tensors have batch sizes "
                            f"{', '.join(f'{p} {len(t)}' for p, t in zip(self.paths, self.leaves))}: a batch's "
                            "tensors share their first dimension")

    @classmethod
    def joined(cls, parts, number):
        """The CS-2s' shares of one step, in CS-2 order, as one batch."""
        first = parts[0]
        for p in parts[1:]:
            if p.spec != first.spec:
                raise DataError(f"DataLoader: the streamers' batches of step {number} differ in structure")
        leaves = [torch.cat([p.leaves[i] for p in parts]) for i in range(len(first.leaves))]
        return cls(tree_unflatten(leaves, first.spec), number)


def check_batches(batches):
    """Every batch has the first's structure, batch size, and each tensor its dtype and shape: a graph
    captured once runs them all."""
    first = batches[0]
    for b in batches[1:]:
        if b.spec != first.spec:
            raise DataError(f"DataLoader: batch {b.number} holds {', '.join(b.paths)}, batch 1 "
                            f"{', '.join(first.paths)}: the captured step takes one structure")
        if len(b.leaves[0]) != len(first.leaves[0]):  # a graph captured once runs one batch size
            raise DataError(f"DataLoader: batch {b.number} has {len(b.leaves[0])} samples, batch 1 has "
                            f"{len(first.leaves[0])}: the captured step takes one batch size (drop_last=True)")
        for path, t, t1 in zip(b.paths, b.leaves, first.leaves):
            if (t.dtype, t.shape[1:]) != (t1.dtype, t1.shape[1:]):  # ... and one shape: its graph's
                what = "" if path == "the batch" else f"'s {path}"
                raise DataError(f"DataLoader: batch {b.number}{what} is {_kind(t)}, batch 1{what} {_kind(t1)}: "
                                "the captured step takes one shape and dtype (pad to one length)")


def _kind(t):
    return f"{str(t.dtype).replace('torch.', '')} {list(t.shape)}"


__getattr__ = refusing("cstorch.utils.data", "built: DataLoader, DataExecutor, SyntheticDataset, compute_num_steps")
