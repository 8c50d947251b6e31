"""The reference unit runner: a training step executed the way weight streaming executes it.

For each micro-batch (fixed by the global batch and ``micro_batch_size``, never by a CS-2 count)
the units run forward in order, keeping the values they hand on; then backward in reverse, one
``torch.autograd.grad`` per unit. A value from an earlier unit enters a unit as a fresh leaf, so a
unit's backward gives the gradients of its parameters and of those values, the latter waiting for
the unit that made them (added in reverse unit order when several units read one). Nothing
accumulates in ``.grad``: that sum would be sequential, not the tree.

Sums, in the orders the cluster will use (docs/design.md section 3, "The tree sum"): per unit, the micro-batch
gradients are summed as the balanced pairwise tree over micro-batch index (``wse_core.microbatch``), as
CS-2s owning contiguous runs of micro-batches and SwarmX above them will; then a parameter several
units read (a tied embedding) gets their sums added on its owner, from the last unit to the first.

Loss: micro-batch j's loss weighs w_j (``loss.Loss.weights``: n_j / N for a mean over N terms of
the global batch). Its backward is seeded with w_j, rounded to the loss's dtype, instead of 1,
and the step's loss is the tree sum of w_j * loss_j; with one micro-batch w = 1 exactly, and the
runner gives eager ``loss.backward()``'s bits. A micro-batch all of whose targets are ignored
weighs 0 and is not run: its mean would be 0/0, whose NaN no weight of 0 takes back.

Dropout: before each unit's forward, torch's generator is seeded from (seed, step, micro-batch,
unit) inside ``fork_rng``: masks are the same however micro-batches are spread over CS-2s, and the
caller's generator is left as it was. Backward draws nothing (dropout saves its mask).
"""
import contextlib

import numpy as np
import torch

from wse_core.microbatch import MicroBatches, tree_reduce


def dropout_seed(seed, step, micro_batch, unit):
    """torch's generator seed for one unit's forward on one micro-batch (index in the global batch)."""
    return int(np.random.SeedSequence([seed, step, micro_batch, unit]).generate_state(1, np.uint64)[0])


def run_step(units, params, batch, micro_batch_size, step, seed):
    """One step's (loss, grads): the mean loss over the global ``batch`` (a tuple of tensors, batch
    first, as capture's example) and its gradient for each owner name of ``params``."""
    loss, unit_grads = accumulate(units, params, batch, micro_batch_size, step=step, seed=seed)
    return loss, combine(unit_grads, params)


def accumulate(units, params, batch, micro_batch_size, *, step, seed, lo=0, hi=None):
    """Tree sum over micro-batches [lo, hi) of the global ``batch``: (weighted loss, per-unit gradients).

    Partial sums of contiguous runs, added with ``add``, give the whole step's bits when the runs
    are subtrees (a power of two of them, of equal length): a CS-2's share."""
    batch = tuple(batch)
    sizes = {len(t) for t in batch}
    if len(sizes) != 1:
        raise ValueError(f"batch: every input needs the same batch size, got {[len(t) for t in batch]}")
    ranges = MicroBatches(sizes.pop(), micro_batch_size).ranges
    weights = units[-1].loss.weights(batch, ranges)  # from the global batch, as the coordinator counts
    hi = len(ranges) if hi is None else hi

    def leaf(j):
        if weights[j] == 0:
            return torch.zeros(()), [{p: torch.zeros_like(params[p]) for p in u.params} for u in units]
        seeds = [dropout_seed(seed, step, j, u) for u in range(len(units))]
        lo_j, hi_j = ranges[j]
        return forward_backward(units, params, tuple(t[lo_j:hi_j] for t in batch), weights[j], seeds)

    return tree_reduce(lo, hi, leaf, add)


def add(a, b):
    """The sum of two partial results (loss, per-unit gradients), a's first."""
    return a[0] + b[0], [{p: ga[p] + gb[p] for p in ga} for ga, gb in zip(a[1], b[1])]


def combine(unit_grads, params):
    """Per-owner gradients: a parameter several units read gets their sums added from the last unit
    to the first (one fixed order, whatever the micro-batches or CS-2s); in ``params``' order."""
    grads = {}
    for unit_sum in reversed(unit_grads):
        for p, g in unit_sum.items():
            grads[p] = g if p not in grads else grads[p] + g
    return {p: grads[p] for p in params if p in grads}


def forward(units, params, inputs, seeds, meter=None):
    """One micro-batch's forward: (every value the units hand on, by name; what each unit saved for
    its backward); ``seeds[u]`` seeds unit u's forward. ``meter`` (partition's) is given each phase
    and the values each unit hands on."""
    values, ran = {}, []
    for u, unit in enumerate(units):
        with _phase(meter, u, "forward"):
            outputs, saved = unit_forward(unit, params, values, inputs, seeds[u])
        values.update(zip(unit.outputs, outputs))
        if meter is not None:
            meter.hand_on(u, outputs)
        ran.append(saved)
    return values, ran


def forward_backward(units, params, inputs, weight, seeds, meter=None):
    """One micro-batch: (weight * loss, per-unit gradients of weight * loss); ``seeds[u]`` seeds unit u's
    forward. ``meter`` (partition's) is given each phase and the values each unit hands on."""
    values, ran = forward(units, params, inputs, seeds, meter)
    name = units[-1].loss.value
    loss = values[name]
    seed_grad = torch.full_like(loss, weight)
    waiting = {name: seed_grad}
    unit_grads = [None] * len(units)
    for u in reversed(range(len(units))):
        with _phase(meter, u, "backward"):
            unit_grads[u] = unit_backward(units[u], ran[u], waiting)
        ran[u] = None  # this unit's activations are done with
    return loss.detach() * seed_grad, unit_grads


def unit_forward(unit, params, values, inputs, seed):
    """(outputs, saved) of ``unit`` on the values earlier units handed on and the batch's ``inputs``;
    its weights (``params``, by owner name) enter as leaves, and so does each value with a gradient.
    ``seed`` (None: none drawn) seeds torch's generator, inside ``fork_rng``."""
    leaves = {p: params[p].detach().requires_grad_() for p in unit.params}
    taken, args = {}, []  # taken: value name -> the leaf it enters this unit as
    for kind, key in unit.inputs:
        if kind == "param":
            args.append(leaves[key])
        elif kind == "input":
            args.append(inputs[key])
        elif isinstance(values[key], torch.Tensor) and values[key].requires_grad:
            args.append(taken.setdefault(key, values[key].detach().requires_grad_()))
        else:  # masks, positions, sizes: no gradient flows back
            args.append(values[key])
    with torch.random.fork_rng(devices=()):
        if seed is not None:
            torch.manual_seed(seed)
        outputs = unit.module(*args)
    return outputs, (leaves, taken, outputs)


def unit_backward(unit, saved, waiting):
    """``unit``'s parameter gradients ({owner: tensor}) from the gradients ``waiting`` for its outputs
    (by value name; taken from it); the gradients of the values it read are added to ``waiting``
    for the units that made them."""
    leaves, taken, outputs = saved
    pairs = [(o, waiting.pop(n)) for n, o in zip(unit.outputs, outputs) if n in waiting]
    wrt = [*leaves.values(), *taken.values()]
    if pairs and wrt:
        grads = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True,
                                    materialize_grads=True)
    else:  # nothing later depends on this unit differentiably
        grads = [torch.zeros_like(t) for t in wrt]
    for name, g in zip(taken, grads[len(leaves):]):
        waiting[name] = g if name not in waiting else waiting[name] + g
    return dict(zip(leaves, grads))


def _phase(meter, unit, name):
    return contextlib.nullcontext() if meter is None else meter.phase(unit, name)
