"""The single-process reference training step: the oracle the cluster must match bit for bit.

One step on a global batch of B samples split into micro-batches of ``micro_batch_size``:

1. every micro-batch runs forward, loss and backward (``Model.forward_backward``);
2. per unit, micro-batch gradients are summed as a balanced pairwise tree in micro-batch index
   order (``wse_core.microbatch``), as SwarmX summing each round's micro-batches over the CS-2s and MemoryX
   adding the rounds will; loss sums and token counts likewise;
3. a parameter used by several units (a tied embedding) gets their sums added in unit order;
4. the loss is the mean over the masked-in tokens N of the global batch, so the gradient is the
   sum / N (or, with ``model.loss_scaling: batch_size``, sum / B * loss_weight: ``model.loss_divisor``),
   and by the loss scale. With clipping, the norm of that mean gradient is clipped to
   ``max_gradient_norm``. The factors are folded into the optimizer's ``grad_scale``: no extra pass
   over the gradients;
5. the optimizer updates each parameter in place, in ``Model.param_names`` order; biases and norm
   weights take no weight decay (``ParamSpec.decay``), as in Model Zoo.
"""
from dataclasses import dataclass, field

import math

from wse_core.errors import DataError
from wse_core.nn.layers import DropoutKey
from wse_core.optim import clip_coefficient, global_norm
from wse_core.microbatch import MicroBatches, tree_reduce, tree_sum


@dataclass
class StepResult:
    """What one step reports: mean loss, tokens counted, gradient norm before clipping, lr used;
    with loss scaling, the scale the step used and whether it was skipped (its gradients overflowed);
    ``values``: what else the step hands its script (a compiled model's), in order, combined over its
    ``micro_batches``."""

    loss: float
    n_tokens: int
    grad_norm: float
    lr: float
    loss_scale: float = 1.0
    skipped: bool = False
    values: list = field(default_factory=list)
    micro_batches: int = 1


def accumulate(model, params, batch, micro_batch_size, lo=0, hi=None, *, num_csx=1, dropout=None, loss_scale=1.0):
    """Tree sum of micro-batches [lo, hi) of ``batch`` (``MicroBatches`` for ``num_csx`` CS-2s):
    (loss_sum, n_tokens, unit_grads, each micro-batch's ``Model.step_values`` in order).

    ``dropout``: (seed, step) of the dropout masks (training), or None (no dropout); the gradients
    are of the loss times ``loss_scale``, each partial sum in the model's precision."""
    ranges = MicroBatches(model.check_batch(batch), micro_batch_size, num_csx).ranges
    hi = len(ranges) if hi is None else hi

    def leaf(i):
        drop = None if dropout is None else DropoutKey(*dropout, ranges[i][0])
        return model.forward_backward(params, model.slice_batch(batch, *ranges[i]), drop, loss_scale)

    def add(a, b):
        return a[0] + b[0], a[1] + b[1], [model.add_grads(ga, gb) for ga, gb in zip(a[2], b[2])], a[3] + b[3]

    return tree_reduce(lo, hi, leaf, add)


def apply_update(model, params, opt_state, optimizer, grads, grad_scale, *, step, lr, lr_factors=None, names=None):
    """Update every parameter (or those of ``names``: a MemoryX's own) in place with its gradient times
    ``grad_scale``, in ``param_names`` order, at ``lr`` times its ``lr_factors`` entry (``Model.lr_factors``;
    1 by default). The one update rule: the reference step's, and MemoryX's on the cluster."""
    for name in model.param_names if names is None else names:
        factor = 1.0 if lr_factors is None else lr_factors[name]
        optimizer.update(params[name], grads[name], opt_state[name], step=step, lr=lr * factor,
                         grad_scale=grad_scale, name=name, decay=model.param_specs[name].decay)


def reference_step(model, params, opt_state, optimizer, batch, *, micro_batch_size, step, lr=None,
                   max_gradient_norm=None, seed=0, scaler=None, lr_factors=None, num_csx=1):
    """Run one full training step in this process; ``params`` and ``opt_state`` are updated in place.

    ``seed`` (the run's ``runconfig.seed``) keys the dropout masks with ``step``. The forward and
    backward passes use the weights in the model's precision (``params`` are the float32 master
    weights). ``scaler`` (an ``optim.LossScaler``) scales the loss, and with dynamic scaling skips
    a step whose gradient norm is not finite. ``lr_factors`` scale each parameter's learning rate
    (``Model.lr_factors``: Model Zoo's ``adjust_learning_rate``). ``num_csx``: the CS-2s the batch is
    laid out for (``MicroBatches``), when it does not divide evenly."""
    loss_scale = 1.0 if scaler is None else scaler.scale
    loss_sum, n_tokens, unit_grads, values = accumulate(model, model.compute_weights(params), batch, micro_batch_size,
                                                        num_csx=num_csx, dropout=(seed, step), loss_scale=loss_scale)
    if n_tokens < 1:
        raise DataError("batch: the loss mask selects no token, so the loss is undefined")
    grads = model.combine_unit_grads(unit_grads)
    lr = optimizer.lr if lr is None else lr
    divisor = model.loss_divisor(n_tokens, len(next(iter(batch.values()))))
    norm = global_norm([grads[n] for n in model.param_names]) / divisor / loss_scale
    skipped = scaler is not None and scaler.update(norm)
    if not skipped:
        coef = 1.0 if max_gradient_norm is None else clip_coefficient(norm, max_gradient_norm)
        apply_update(model, params, opt_state, optimizer, grads, coef / divisor / loss_scale, step=step, lr=lr,
                     lr_factors=lr_factors)
    return StepResult(loss=loss_sum / divisor, n_tokens=n_tokens, grad_norm=norm, lr=lr, loss_scale=loss_scale,
                      skipped=skipped, values=model.combine_values(values), micro_batches=len(values))


def evaluate(model, weights, dataset, micro_batch_size, n_examples=None):
    """Loss, perplexity and accuracy of the float32 master ``weights`` on the first ``n_examples`` of
    ``dataset`` (all by default; anything with ``read(lo, hi)`` and ``n_examples``), in order, in
    micro-batches, without dropout, in the model's precision. The loss is per counted token
    (sample); accuracy is the fraction of them whose argmax is the label."""
    compute = model.compute_weights(weights)
    n = dataset.n_examples if n_examples is None else min(dataset.n_examples, n_examples)
    sums, tokens, correct = [], 0, 0
    for lo in range(0, n, micro_batch_size):
        batch = model.batch_of(dataset.read(lo, min(lo + micro_batch_size, n)))
        y, _ = model.forward(compute, batch)
        correct += model.correct(y, batch)  # before the loss, which overwrites y with its gradient
        loss_sum, n_tokens, _ = model.loss(y, batch)
        sums.append(loss_sum)
        tokens += n_tokens
    if tokens == 0:
        raise DataError("the loss mask selects no token, so the loss is undefined")
    loss = tree_sum(sums) / tokens
    return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "accuracy": correct / tokens,
            "examples": n, "tokens": tokens}
