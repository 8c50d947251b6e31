"""Global gradient-norm clipping, as ``torch.nn.utils.clip_grad_norm_`` with the 2-norm.

The norm is deterministic: each array's sum of squares is accumulated in float64 in fixed blocks
(independent of the thread count) and arrays are combined in the order given. To clip without a
second pass over memory, compute ``clip_coefficient(global_norm(grads), max_norm)`` and pass it as
``grad_scale`` to ``Optimizer.update``; ``clip_grad_norm_`` is the stand-alone, in-place form.
"""
import math

from wse_core.optim import _kernels
from wse_core.checks import Number, check_float_array

#: Added to the norm before dividing, as PyTorch does, so a zero gradient gives no division by zero.
NORM_EPS = 1e-6


def _named_arrays(arrays):
    if isinstance(arrays, dict):
        return [(f"arrays[{k!r}]", v) for k, v in arrays.items()]
    return [(f"arrays[{i}]", v) for i, v in enumerate(arrays)]


def sum_of_squares(x, name="x"):
    """sum(x**2) in float64, the same bits for any thread count: one array's share of the norm."""
    return _kernels.sumsq(check_float_array(name, x))


def global_norm(arrays):
    """sqrt(sum of x**2 over every element of every array), in float64; ``arrays`` is a list or dict.

    Arrays are added in the order given; a cluster whose ranks each hold some of the arrays gets
    the same bits by adding their ``sum_of_squares`` in the same order.
    """
    total = 0.0
    for name, x in _named_arrays(arrays):
        total += sum_of_squares(x, name)
    return math.sqrt(total)


def clip_coefficient(total_norm, max_norm):
    """min(1, max_norm / (total_norm + 1e-6)): the factor that brings the norm down to ``max_norm``."""
    total_norm = float(total_norm)
    max_norm = Number(0)(max_norm, "max_norm")
    return min(1.0, max_norm / (total_norm + NORM_EPS))


def clip_grad_norm_(grads, max_norm):
    """Scale ``grads`` in place so their global norm is at most ``max_norm``; return the norm before."""
    named = [(name, check_float_array(name, x, writeable=True)) for name, x in _named_arrays(grads)]
    norm = global_norm([x for _, x in named])
    coef = clip_coefficient(norm, max_norm)
    if coef < 1.0:
        for _, x in named:
            _kernels.scale(x, coef)
    return norm
