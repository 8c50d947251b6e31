"""The wafer's kernels as torch custom ops (``torch.ops.wse.*``), each with its backward: what
``lower`` puts in a unit's graph in place of the aten ops they do (docs/design/compiler.md "Lowering").

Each op takes, beside the aten op's arguments, where its operand's samples are (rows a sample, or
entries of the first dimension a sample), fixed at lowering; every sum over samples in its backward
(a weight's gradient, a norm's, a bias's, an embedding's table, a broadcast operand's, the loss's) is
the tree over samples (``wse_core.nn.sample_tree``), so a sample's part does not depend on its
micro-batch. Custom ops, because a program's fx modules are pickled as their code and traced again
when loaded: a custom op stays one node, where a Python function would be traced into.
"""
import math
from typing import Optional

import numpy as np
import torch
from torch import Tensor

from wse_core.nn import attention
from wse_core.nn import ops as kernels
from wse_core.nn.gemm import matmul
from wse_core.nn.layers import norm_backward
from wse_core.nn.sample_tree import embedding_grad, sample_sum, samples_of

aten = torch.ops.aten


def _np(t):
    """A float32 tensor's values as a C-contiguous numpy array (no copy when it is one already)."""
    t = t.detach()
    return (t if t.is_contiguous() else t.contiguous()).numpy()


def _rows_of(n_rows, t):
    """Rows a sample: ``t`` when given and whole, else every row one sample's (sums over them all)."""
    return t if t and n_rows % t == 0 else max(n_rows, 1)


def _needs(ctx, n):
    return getattr(ctx, "needs_input_grad", None) or (True,) * n


# -- weight products ------------------------------------------------------------------------------

@torch.library.custom_op("wse::product", mutates_args=())
def product(x: Tensor, weight: Tensor, bias: Optional[Tensor], rows_per_sample: Optional[int], in_out: bool,
            outer: int) -> Tensor:
    """x @ W^T + b (``aten.linear``: W [out, in]) or b + x @ W (``aten.addmm`` of a weight: W [in, out]),
    on the rows of x; its backward's dW and db are trees over samples of ``rows_per_sample`` rows.
    ``outer`` > 1: x's rows are ``outer`` runs of the batch (a sequence-first layout, as
    ``nn.MultiheadAttention`` makes): they are taken a sample at a time, and the result laid out as x."""
    wn = _np(weight)
    wt = wn if in_out else wn.T
    x2 = _by_sample(x, rows_per_sample, outer)
    y = matmul(x2, wt, _rows_of(x2.shape[0], rows_per_sample), None if bias is None else _np(bias))
    return _as_laid_out(torch.from_numpy(y), x, rows_per_sample, outer)


def _by_sample(x, t, outer):
    """x's rows, 2-D and sample-major (a copy when x's are ``outer`` > 1 runs of the batch)."""
    x2 = _np(x).reshape(-1, x.shape[-1])
    if outer <= 1:
        return x2
    b = x2.shape[0] // t
    return np.ascontiguousarray(x2.reshape(outer, b, t // outer, x2.shape[1]).transpose(1, 0, 2, 3)).reshape(-1, x2.shape[1])


def _as_laid_out(y2, x, t, outer):
    """Rows ``y2`` (sample-major) laid out as x's rows are (``_by_sample``'s inverse), x's shape but the last."""
    if outer > 1:
        b = y2.shape[0] // t
        y2 = y2.reshape(b, outer, t // outer, y2.shape[1]).permute(1, 0, 2, 3).contiguous()
    return y2.reshape(*x.shape[:-1], y2.shape[-1])


@product.register_fake
def _(x, weight, bias, rows_per_sample, in_out, outer):
    return x.new_empty(*x.shape[:-1], weight.shape[1] if in_out else weight.shape[0])


def _product_context(ctx, inputs, output):
    x, weight, bias, t, in_out, outer = inputs
    ctx.save_for_backward(x, weight)
    ctx.t, ctx.in_out, ctx.has_bias, ctx.outer = t, in_out, bias is not None, outer


def _product_backward(ctx, g):
    x, w = ctx.saved_tensors
    in_out, outer = ctx.in_out, ctx.outer
    x2 = _by_sample(x, ctx.t, outer)  # a sample's rows together, as the forward took them
    g2 = _by_sample(g, ctx.t, outer)
    t = _rows_of(x2.shape[0], ctx.t)
    wn = _np(w)
    dx = _as_laid_out(torch.from_numpy(matmul(g2, wn.T if in_out else wn, t)), x, ctx.t, outer) \
        if _needs(ctx, 6)[0] else None

    def leaf(s):
        gs, xs = g2[s * t:(s + 1) * t], x2[s * t:(s + 1) * t]
        return matmul(xs.T, gs) if in_out else matmul(gs.T, xs), kernels.column_sum(gs)

    dw, db = sample_sum(samples_of(g2.shape[0], t), leaf)
    return dx, torch.from_numpy(dw), torch.from_numpy(db) if ctx.has_bias else None, None, None, None


product.register_autograd(_product_backward, setup_context=_product_context)


# -- layer norm -----------------------------------------------------------------------------------

@torch.library.custom_op("wse::layer_norm", mutates_args=())
def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float,
               rows_per_sample: Optional[int]) -> tuple[Tensor, Tensor, Tensor]:
    """LayerNorm over the last axis: (y, mean, rstd); the weight's and bias's gradients are trees over samples."""
    y, mean, rstd = kernels.layernorm_forward(_np(x).reshape(-1, x.shape[-1]), _np(weight), _np(bias), eps)
    return torch.from_numpy(y).reshape(x.shape), torch.from_numpy(mean), torch.from_numpy(rstd)


@layer_norm.register_fake
def _(x, weight, bias, eps, rows_per_sample):
    rows = x.numel() // x.shape[-1]
    return x.new_empty(x.shape), x.new_empty(rows), x.new_empty(rows)


def _layer_norm_context(ctx, inputs, output):
    x, weight, _, _, t = inputs
    ctx.save_for_backward(x, weight, output[1], output[2])
    ctx.t = t


def _layer_norm_backward(ctx, g, _mean, _rstd):
    x, w, mean, rstd = ctx.saved_tensors
    x2 = _np(x).reshape(-1, x.shape[-1])
    dx, dw, db = norm_backward(kernels.layernorm_backward, _np(g).reshape(x2.shape), x2, _rows_of(x2.shape[0], ctx.t),
                               _np(w), _np(mean), _np(rstd))
    return torch.from_numpy(dx).reshape(x.shape), torch.from_numpy(dw), torch.from_numpy(db), None, None


layer_norm.register_autograd(_layer_norm_backward, setup_context=_layer_norm_context)


# -- embedding ------------------------------------------------------------------------------------

@torch.library.custom_op("wse::embedding", mutates_args=())
def embedding(weight: Tensor, indices: Tensor, padding_idx: int, per_sample: int) -> Tensor:
    """A table lookup; its gradient the tree over samples of each sample's table (``per_sample``: the
    indices' first dimension is the batch, that many of its entries a sample; 0: it is not)."""
    ids = indices.numpy()
    if ids.size and (ids.min() < 0 or ids.max() >= weight.shape[0]):
        bad = ids.min() if ids.min() < 0 else ids.max()
        raise IndexError(f"embedding: id {int(bad)} is outside the table's {weight.shape[0]} rows")
    return torch.from_numpy(_np(weight)[ids])


@embedding.register_fake
def _(weight, indices, padding_idx, per_sample):
    return weight.new_empty(*indices.shape, weight.shape[1])


def _embedding_context(ctx, inputs, output):
    weight, indices, padding_idx, per_sample = inputs
    ctx.save_for_backward(indices)
    ctx.rows, ctx.padding_idx, ctx.per_sample = weight.shape[0], padding_idx, per_sample


def _embedding_backward(ctx, g):
    (ids,) = ctx.saved_tensors
    flat = np.ascontiguousarray(ids.numpy().reshape(-1), np.int32)
    g2 = np.array(_np(g).reshape(flat.size, -1))  # a copy: padding rows are zeroed
    if ctx.padding_idx >= 0:
        g2[flat == ctx.padding_idx] = 0.0  # torch's rule: the padding row takes no gradient
    k = ctx.per_sample
    b = ids.shape[0] // k if k and ids.dim() >= 1 and ids.shape[0] % k == 0 else 1
    dw = embedding_grad(flat.reshape(b, -1), g2, ctx.rows, kernels.embedding_backward)
    return torch.from_numpy(dw), None, None, None


embedding.register_autograd(_embedding_backward, setup_context=_embedding_context)


# -- attention ------------------------------------------------------------------------------------

def _is_causal(mask, length):
    """A boolean mask [.., L, L] that is the causal one in every sample and head."""
    if mask is None or mask.dtype != torch.bool or tuple(mask.shape[-2:]) != (length, length):
        return False
    return bool(torch.equal(mask, torch.ones(length, length, dtype=torch.bool).tril().expand(mask.shape)))


@torch.library.custom_op("wse::attention", mutates_args=())
def attention_(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], is_causal: bool,
               scale: Optional[float]) -> tuple[Tensor, Tensor, Tensor]:
    """``aten.scaled_dot_product_attention`` without dropout: (out, probs, whether the kernels ran).
    Causal (``is_causal``, or a boolean causal mask as transformers builds it: known only from its
    values), it runs on the kernels, each (sample, head) its own products; otherwise torch's, whose
    backward is then torch's (``probs`` unused)."""
    causal = is_causal and attn_mask is None or not is_causal and _is_causal(attn_mask, q.shape[-2])
    if not causal or q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        out = aten.scaled_dot_product_attention.default(q, k, v, attn_mask, 0.0, is_causal, scale=scale)
        return out.contiguous(), q.new_empty(*q.shape[:-1], k.shape[-2]), torch.tensor(False)
    out, probs = attention.forward(_np(q), _np(k), _np(v), _scale(q, scale), kernels)
    return torch.from_numpy(out), torch.from_numpy(probs), torch.tensor(True)


def _scale(q, scale):
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


@attention_.register_fake
def _(q, k, v, attn_mask, is_causal, scale):
    return (q.new_empty(*q.shape[:-1], v.shape[-1]), q.new_empty(*q.shape[:-1], k.shape[-2]),
            q.new_empty((), dtype=torch.bool))


def _attention_context(ctx, inputs, output):
    q, k, v, mask, is_causal, scale = inputs
    ctx.save_for_backward(q, k, v, output[1], *(() if mask is None else (mask,)))
    ctx.is_causal, ctx.scale, ctx.kernels = is_causal, scale, bool(output[2])


def _attention_backward(ctx, g, _probs, _kernels):
    q, k, v, probs, *mask = ctx.saved_tensors
    if ctx.kernels:
        dq, dk, dv = attention.backward(_np(g), _np(q), _np(k), _np(v), _np(probs), _scale(q, ctx.scale), kernels)
        return torch.from_numpy(dq), torch.from_numpy(dk), torch.from_numpy(dv), None, None, None
    with torch.enable_grad():  # torch's attention: its backward, recomputed (no dropout: the same values)
        qkv = [t.detach().requires_grad_() for t in (q, k, v)]
        out = aten.scaled_dot_product_attention.default(*qkv, mask[0] if mask else None, 0.0, ctx.is_causal,
                                                        scale=ctx.scale)
        grads = torch.autograd.grad(out, qkv, g)
    return *grads, None, None, None


attention_.register_autograd(_attention_backward, setup_context=_attention_context)


# -- the loss -------------------------------------------------------------------------------------

@torch.library.custom_op("wse::cross_entropy", mutates_args=())
def cross_entropy(logits: Tensor, target: Tensor, mean: bool, ignore_index: int,
                  rows_per_sample: Optional[int]) -> tuple[Tensor, Tensor, Tensor]:
    """Cross-entropy of 2-D logits and class targets, mean or sum: (loss, the gradient of the sum, the
    sum in float64). The sum is the tree over samples (``sample_tree.loss_sum``): what the step's loss
    adds up (``model.TorchModel.loss``), the same whatever the micro-batch."""
    x = np.array(_np(logits))  # the kernel writes the gradient over it
    labels = target.numpy().reshape(-1)
    mask = (labels != ignore_index).astype(np.int32)
    loss_sum, dlogits = kernels.cross_entropy(x, np.where(mask != 0, labels, 0).astype(np.int32), mask,
                                              sample_rows=_rows_of(x.shape[0], rows_per_sample))
    n = int(mask.sum())
    value = (loss_sum / n if n else float("nan")) if mean else loss_sum  # a mean over none: NaN, as torch's
    return (torch.tensor(value, dtype=torch.float32), torch.from_numpy(dlogits),
            torch.tensor(loss_sum, dtype=torch.float64))


@cross_entropy.register_fake
def _(logits, target, mean, ignore_index, rows_per_sample):
    return logits.new_empty(()), logits.new_empty(logits.shape), logits.new_empty((), dtype=torch.float64)


def _cross_entropy_context(ctx, inputs, output):
    _, target, mean, ignore_index, _ = inputs
    ctx.save_for_backward(output[1])
    ctx.divisor = int((target != ignore_index).sum()) if mean else 1


def _cross_entropy_backward(ctx, g, _d, _sum):
    # The gradient of the sum times g / n: a tail seeded with n (times a power-of-two loss scale) gives
    # every token's gradient whatever its micro-batch holds (``model.TorchModel.loss``).
    (dlogits,) = ctx.saved_tensors
    factor = float(g) / ctx.divisor if ctx.divisor else 0.0
    return dlogits * factor, None, None, None, None


cross_entropy.register_autograd(_cross_entropy_backward, setup_context=_cross_entropy_context)


# -- convolution ----------------------------------------------------------------------------------

@torch.library.custom_op("wse::conv2d", mutates_args=())
def conv2d(x: Tensor, weight: Tensor, bias: Optional[Tensor], stride: list[int], padding: list[int],
           dilation: list[int], groups: int, per_sample: int) -> Tensor:
    """torch's ``conv2d``, a sample (``per_sample`` images) at a time (no kernel of the wafer's does it
    here): a sample's values are its own, and the weight's and bias's gradients are trees over samples."""
    k = per_sample
    return torch.cat([aten.conv2d.default(x[s * k:(s + 1) * k], weight, bias, stride, padding, dilation, groups)
                      for s in range(x.shape[0] // k)]).contiguous()


@conv2d.register_fake
def _(x, weight, bias, stride, padding, dilation, groups, per_sample):
    return aten.conv2d.default(x, weight, bias, stride, padding, dilation, groups).contiguous()


def _conv2d_context(ctx, inputs, output):
    x, weight, bias, stride, padding, dilation, groups, per_sample = inputs
    ctx.save_for_backward(x, weight)
    ctx.args, ctx.has_bias, ctx.per_sample = (stride, padding, dilation, groups), bias is not None, per_sample


def _conv2d_backward(ctx, g):
    x, w = ctx.saved_tensors
    stride, padding, dilation, groups = ctx.args
    dx = torch.empty_like(x)
    mask = [True, True, ctx.has_bias]

    k = ctx.per_sample

    def leaf(s):
        dxs, dws, dbs = aten.convolution_backward.default(g[s * k:(s + 1) * k].contiguous(), x[s * k:(s + 1) * k], w,
                                                          [w.shape[0]] if ctx.has_bias else None, stride, padding,
                                                          dilation, False, [0, 0], groups, mask)
        dx[s * k:(s + 1) * k] = dxs
        return (dws.numpy().copy(), *((dbs.numpy().copy(),) if ctx.has_bias else ()))

    sums = sample_sum(x.shape[0] // k, leaf)
    return (dx, torch.from_numpy(sums[0]), torch.from_numpy(sums[1]) if ctx.has_bias else None,
            None, None, None, None, None)


conv2d.register_autograd(_conv2d_backward, setup_context=_conv2d_context)


# -- elementwise ops with an operand broadcast over the batch --------------------------------------

#: The elementwise ops ``broadcast`` runs, by the name it takes.
BINARY = {"add": aten.add.Tensor, "sub": aten.sub.Tensor, "mul": aten.mul.Tensor, "div": aten.div.Tensor}


@torch.library.custom_op("wse::broadcast", mutates_args=())
def broadcast(a: Tensor, b: Tensor, op: str, batched: int, per_sample: int) -> Tensor:
    """``aten.<op>.Tensor(a, b)`` where operand ``batched`` has the batch first and the other is
    broadcast over it (a bias, a norm's weight, a position table): the broadcast one's gradient is the
    tree over samples (``per_sample`` entries of the first dimension each) of each sample's slice
    reduced to its shape."""
    return BINARY[op](a, b).contiguous()


@broadcast.register_fake
def _(a, b, op, batched, per_sample):
    return BINARY[op](a, b).contiguous()


def _broadcast_context(ctx, inputs, output):
    a, b, op, batched, per_sample = inputs
    ctx.save_for_backward(a, b)
    ctx.op, ctx.batched, ctx.per_sample = op, batched, per_sample


def _broadcast_backward(ctx, g):
    a, b = ctx.saved_tensors
    grads = [None, None]
    for i, x in enumerate((a, b)):
        local = _local_grad(ctx.op, i, a, b, g)  # g times d out / d x, at the output's shape (elementwise)
        if i == ctx.batched:
            grads[i] = local.sum_to_size(x.shape) if local.shape != x.shape else local
        else:
            k = ctx.per_sample
            grads[i] = torch.from_numpy(sample_sum(local.shape[0] // k, lambda s: (
                np.array(local[s * k:(s + 1) * k].sum_to_size(x.shape).numpy(), np.float32),))[0])
    return grads[0], grads[1], None, None, None


def _local_grad(op, i, a, b, g):
    if op in ("add", "sub"):
        return g if i == 0 or op == "add" else -g
    if op == "mul":
        return g * (b if i == 0 else a)
    return g / b if i == 0 else -g * a / (b * b)


broadcast.register_autograd(_broadcast_backward, setup_context=_broadcast_context)
