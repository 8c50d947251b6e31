"""``cstorch.metrics``: metrics a traced step updates, accumulated over the steps of a loop.

A metric called inside the traced step (``accuracy(labels=..., predictions=...)``) computes its
statistics of the batch there (sums over the batch: correct predictions, counted tokens), which
the step hands to Python as it hands a step closure its tensors; once the step is done they are
added to the metric's state, on every step (a metric is state on the device, not a closure on
activation steps). ``compute()`` (or ``float(metric)``) gives the value of all the steps so far.
The sums of a training step's micro-batches are added by the cluster as the loss's are.
"""
import math

import torch

from pyapi.cstorch import step as step_mod
from pyapi.cstorch.errors import refusing


class Metric:
    """Cerebras' metric protocol: ``update(...)`` (also by calling the metric), ``compute()``,
    ``reset()``, ``float(metric)``, ``num_updates``, ``name``; every metric is listed in
    ``Metric.registry`` by name, for ``get_all_metrics``."""

    registry = {}

    def __init__(self, name, compute_on_system=None):
        # compute_on_system (the experimental API's): where a real system adds the statistics; here,
        # the cluster adds a training step's micro-batches and this process the steps
        if not isinstance(name, str) or not name:
            raise ValueError(f"{type(self).__name__}: name: expected a non-empty string, got {name!r}")
        self.name = name
        Metric.registry.setdefault(name, []).append(self)
        self.reset()

    def reset(self):
        self.state = {key: 0.0 for key in self.STATE}
        self.num_updates = 0

    def update(self, *args, **kwargs):
        """Add a batch's statistics; inside the traced step, once the step's values are in."""
        stats = self.statistics(*args, **kwargs)
        if step_mod._recording is not None:
            step_mod._recording.closures.append((_accumulate, (self, *stats), {}))
        else:
            _accumulate(self, *stats)

    def __call__(self, *args, **kwargs):
        self.update(*args, **kwargs)
        return None if step_mod._recording is not None else self.compute()

    def __float__(self):
        return float(self.compute())

    def statistics(self, *args, **kwargs):
        raise NotImplementedError


def _accumulate(metric, *stats):
    for key, value in zip(metric.STATE, stats):
        metric.state[key] += float(value)
    metric.num_updates += 1


_accumulate._cstorch_closure = True
_accumulate._every_step = True  # a metric's statistics are added on every step, not on activation steps only


def _weights(labels, weights):
    return torch.ones_like(labels, dtype=torch.float32) if weights is None else weights.to(torch.float32)


class AccuracyMetric(Metric):
    """The fraction of predictions equal to their labels (weighted by ``weights``; tokens of weight 0
    not counted)."""

    STATE = ("correct", "total")

    def statistics(self, labels, predictions, weights=None, dtype=None):
        if tuple(labels.shape) != tuple(predictions.shape):
            predictions = predictions.reshape(labels.shape)
        w = _weights(labels, weights)
        return ((labels == predictions).to(w.dtype) * w).sum(), (w > 0).to(w.dtype).sum()

    def compute(self):
        s = self.state
        return s["correct"] / s["total"] if s["total"] else 0.0


class PerplexityMetric(Metric):
    """exp(summed loss / counted tokens): ``loss`` is the batch's loss summed over its tokens."""

    STATE = ("loss", "total")

    def statistics(self, labels, loss, weights=None, dtype=None):
        w = _weights(labels, weights)
        return loss, (w > 0).to(w.dtype).sum()

    def compute(self):
        s = self.state
        return math.exp(s["loss"] / s["total"]) if s["total"] else float("nan")


class MeanMetric(Metric):
    """The weighted mean of the values given: sum(value x weight) / sum(weight)."""

    STATE = ("sum", "weight")

    def statistics(self, value, weight=1.0, dtype=None):
        value = value.to(torch.float32)
        w = torch.as_tensor(weight, dtype=torch.float32)
        return (value * w).sum(), torch.ones_like(value).mul(w).sum()

    def compute(self):
        s = self.state
        return s["sum"] / s["weight"] if s["weight"] else 0.0


def get_all_metrics():
    """(name, metric) of every metric made, a name shared by several numbered ``name.i``."""
    for name, metrics in Metric.registry.items():
        for i, metric in enumerate(metrics):
            yield (name if len(metrics) == 1 else f"{name}.{i}"), metric


def compute_all_metrics():
    """{name: value} of every metric made (Cerebras' 2.0 spelling)."""
    return {name: float(metric) for name, metric in get_all_metrics()}


__getattr__ = refusing("cstorch.metrics", "built: Metric, AccuracyMetric, PerplexityMetric, MeanMetric, "
                      "get_all_metrics, compute_all_metrics")
