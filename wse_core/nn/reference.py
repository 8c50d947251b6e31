"""The single-process reference training step: the oracle the cluster must match bit for bit.

One step on a global batch of B samples split into micro-batches of ``micro_batch_size``:

1. every micro-batch runs forward, loss and backward (``Model.forward_backward``);
2. per unit, micro-batch gradients are summed as a balanced pairwise tree in micro-batch index
   order (``wse_core.tree``), exactly as CS-2s owning contiguous runs of micro-batches and SwarmX
   adding their partial sums will; loss sums and token counts likewise;
3. a parameter used by several units (a tied embedding) gets their sums added in unit order;
4. the loss is the mean over the masked-in tokens N of the global batch, so the gradient is the
   sum / N (or, with ``model.loss_scaling: batch_size``, sum / B * loss_weight: ``model.loss_divisor``). With clipping, the norm of that mean gradient is clipped to ``max_gradient_norm``.
   Both factors are folded into the optimizer's ``grad_scale``: no extra pass over the gradients;
5. the optimizer updates each parameter in place, in ``Model.param_names`` order; biases and norm
   weights take no weight decay (``ParamSpec.decay``), as in Model Zoo.
"""
from dataclasses import dataclass

from wse_core.nn.layers import DropoutKey
from wse_core.optim import clip_coefficient, global_norm
from wse_core.tree import tree_reduce


@dataclass
class StepResult:
    """What one step reports: mean loss, tokens counted, gradient norm before clipping, lr used."""

    loss: float
    n_tokens: int
    grad_norm: float
    lr: float


def micro_batch_ranges(batch_size, micro_batch_size):
    """[(lo, hi), ...] of the micro-batches; the batch must split into whole micro-batches."""
    if micro_batch_size < 1 or batch_size % micro_batch_size:
        raise ValueError(f"micro_batch_size: {micro_batch_size} does not divide the batch size {batch_size}")
    return [(lo, lo + micro_batch_size) for lo in range(0, batch_size, micro_batch_size)]


def _add(a, b):
    """Add two (loss_sum, n_tokens, unit_grads) partial results; reuses a's arrays."""
    for ga, gb in zip(a[2], b[2]):
        for name, value in gb.items():
            ga[name] += value
    return a[0] + b[0], a[1] + b[1], a[2]


def accumulate(model, params, batch, micro_batch_size, lo=0, hi=None, *, dropout=None):
    """Tree sum of micro-batches [lo, hi) of ``batch``: (loss_sum, n_tokens, unit_grads).

    ``dropout``: (seed, step) of the dropout masks (training), or None (no dropout)."""
    ranges = micro_batch_ranges(model.check_batch(batch), micro_batch_size)
    hi = len(ranges) if hi is None else hi

    def leaf(i):
        drop = None if dropout is None else DropoutKey(*dropout, ranges[i][0])
        return model.forward_backward(params, model.slice_batch(batch, *ranges[i]), drop)

    return tree_reduce(lo, hi, leaf, _add)


def apply_update(model, params, opt_state, optimizer, grads, divisor, *, step, lr, max_gradient_norm=None):
    """Normalise by ``divisor`` (``model.loss_divisor``), clip, and update every parameter in place;
    returns the grad norm."""
    names = model.param_names
    norm = global_norm([grads[n] for n in names]) / divisor
    coef = 1.0 if max_gradient_norm is None else clip_coefficient(norm, max_gradient_norm)
    for name in names:
        optimizer.update(params[name], grads[name], opt_state[name], step=step, lr=lr,
                         grad_scale=coef / divisor, name=name, decay=model.param_specs[name].decay)
    return norm


def reference_step(model, params, opt_state, optimizer, batch, *, micro_batch_size, step, lr=None,
                   max_gradient_norm=None, seed=0):
    """Run one full training step in this process; ``params`` and ``opt_state`` are updated in place.
    ``seed`` (the run's ``runconfig.seed``) keys the dropout masks with ``step``."""
    loss_sum, n_tokens, unit_grads = accumulate(model, params, batch, micro_batch_size, dropout=(seed, step))
    if n_tokens < 1:
        raise ValueError("batch: the loss mask selects no token, so the loss is undefined")
    grads = model.combine_unit_grads(unit_grads)
    lr = optimizer.lr if lr is None else lr
    divisor = model.loss_divisor(n_tokens, len(next(iter(batch.values()))))
    norm = apply_update(model, params, opt_state, optimizer, grads, divisor, step=step, lr=lr,
                        max_gradient_norm=max_gradient_norm)
    return StepResult(loss=loss_sum / divisor, n_tokens=n_tokens, grad_norm=norm, lr=lr)
