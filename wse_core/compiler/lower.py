"""Lowering: a unit's heavy aten ops run on the wafer's kernels (``wse_core.nn``), with their backward.

``lower(unit, known)`` rewrites a partitioned unit's graph in place: each node of an op the kernels
do becomes a node of a custom op (``torch.ops.wse.*``, ``torch.library.custom_op``) whose forward
and backward (``register_autograd``) are ``wse_core.nn``'s kernels: the weight products
(``aten.linear``, and ``aten.addmm`` of a weight, GPT-2's ``Conv1D``), ``aten.layer_norm``,
``aten.embedding``, causal ``aten.scaled_dot_product_attention``, ``aten.cross_entropy_loss``, the
elementwise ``add``/``sub``/``mul``/``div`` whose operand is broadcast over the batch (a bias, a
norm's weight, a position embedding), and ``aten.conv2d`` (torch's, a sample at a time). The rest
(reshapes, elementwise glue) runs in torch.

What decides the bits is fixed at lowering, from the graph's symbolic shapes: ``batch_dims`` follows
the batch through the step, and every sum over samples of a lowered op (a weight's gradient, a
norm's, an embedding's table, the loss) is the tree over samples (``wse_core.nn.sample_tree``), so a
sample's part does not depend on its micro-batch. ``report`` names the ops left to torch, their
share of the unit's work, and every op whose sums span a micro-batch (docs/design/compiler.md
"Lowering").

Custom ops, because a program's fx modules are pickled as their code and traced again when loaded:
a custom op stays one node, where a Python function would be traced into.
"""
import math
import operator
from typing import Optional

import numpy as np
import torch
from torch import Tensor, fx

from wse_core.nn import attention
from wse_core.nn import ops as kernels
from wse_core.nn.gemm import matmul
from wse_core.nn.sample_tree import embedding_grad, sample_sum, samples_of

aten = torch.ops.aten
#: The name a unit hands a lowered loss's float64 sum on by: the loss's, and this.
SUM = ":sum"


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
    from wse_core.nn.layers import norm_backward

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

_BINARY = {"add": aten.add.Tensor, "sub": aten.sub.Tensor, "mul": aten.mul.Tensor, "div": aten.div.Tensor}


@torch.library.custom_op("wse::broadcast", mutates_args=())
def broadcast(a: Tensor, b: Tensor, op: str, batched: int, per_sample: int) -> Tensor:
    """``aten.<op>.Tensor(a, b)`` where operand ``batched`` has the batch first and the other is
    broadcast over it (a bias, a norm's weight, a position table): the broadcast one's gradient is the
    tree over samples (``per_sample`` entries of the first dimension each) of each sample's slice
    reduced to its shape."""
    return _BINARY[op](a, b).contiguous()


@broadcast.register_fake
def _(a, b, op, batched, per_sample):
    return _BINARY[op](a, b).contiguous()


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


#: aten ops that draw from the default generator without naming one in their schema.
_RANDOM = {"rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "randperm", "bernoulli",
           "multinomial", "normal", "uniform", "exponential", "poisson", "rrelu", "rrelu_with_noise",
           "cauchy", "geometric", "log_normal", "random"}
_DROPOUT = {aten.dropout.default, aten.native_dropout.default,
            aten.feature_dropout.default, aten.alpha_dropout.default}


def draws(node):
    """Whether ``node`` draws from torch's generator when it runs: an op whose schema takes one
    (rand, bernoulli, normal_, uniform_, rrelu with training, ...), or dropout at a rate above 0
    (its schema names none; it draws from the default one) in training (eval mode's is the identity)."""
    if node.op != "call_function":
        return False
    if node.target in _DROPOUT:
        rate = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
        return train is not False and not (isinstance(rate, (int, float)) and rate == 0)
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return False
    return schema.name.split("::")[-1].rstrip("_") in _RANDOM or any("Generator" in str(a.type)
                                                                   for a in schema.arguments)



# -- the rewrite ----------------------------------------------------------------------------------

_BY_TARGET = {v: k for k, v in _BINARY.items()}
#: Ops that compute nothing (views, sizes, metadata): neither lowered nor work left to torch.
_FREE = {"view", "reshape", "_unsafe_view", "transpose", "permute", "t", "unsqueeze", "squeeze", "expand", "slice",
         "select", "split", "split_with_sizes", "unflatten", "flatten", "contiguous", "clone", "alias", "detach",
         "sym_size", "_assert_tensor_metadata", "to", "getitem", "lift_fresh_copy", "unbind", "chunk"}
_SCHEMAS = {  # an aten op's arguments, by name, with their defaults
    aten.linear.default: (("input", None), ("weight", None), ("bias", None)),
    aten.addmm.default: (("self", None), ("mat1", None), ("mat2", None), ("beta", 1), ("alpha", 1)),
    aten.layer_norm.default: (("input", None), ("normalized_shape", None), ("weight", None), ("bias", None),
                              ("eps", 1e-5), ("cudnn_enable", True)),
    aten.embedding.default: (("weight", None), ("indices", None), ("padding_idx", -1), ("scale_grad_by_freq", False),
                             ("sparse", False)),
    aten.scaled_dot_product_attention.default: (("query", None), ("key", None), ("value", None), ("attn_mask", None),
                                                ("dropout_p", 0.0), ("is_causal", False), ("scale", None),
                                                ("enable_gqa", False)),
    aten.cross_entropy_loss.default: (("self", None), ("target", None), ("weight", None), ("reduction", 1),
                                      ("ignore_index", -100), ("label_smoothing", 0.0)),
    aten.conv2d.default: (("input", None), ("weight", None), ("bias", None), ("stride", [1, 1]), ("padding", [0, 0]),
                          ("dilation", [1, 1]), ("groups", 1)),
}


def _arguments(node):
    """The node's arguments by name, defaults filled in (``_SCHEMAS``)."""
    names = _SCHEMAS[node.target]
    out = {name: default for name, default in names}
    out.update(zip((n for n, _ in names), node.args))
    out.update(node.kwargs)
    return out


def _float32(*nodes):
    return all(isinstance(_val(n), torch.Tensor) and _val(n).dtype == torch.float32 for n in nodes)


def _lowering(node, batch):
    """(custom op, its arguments, whether it returns a tuple whose first item is the value) that runs
    ``node`` on the kernels, or None: torch keeps it."""
    if node.target in _BY_TARGET and len(node.args) == 2 and not node.kwargs:
        batched = _broadcast_operand(node, batch)
        return None if batched is None else (
            broadcast, (*node.args, _BY_TARGET[node.target], batched, batch.per_sample(node.args[batched])), False)
    if node.target not in _SCHEMAS:
        return None
    a = _arguments(node)
    t = node.target
    if t is aten.linear.default and _float32(a["input"], a["weight"]) and _val(a["weight"]).dim() == 2 \
            and (a["bias"] is None or _float32(a["bias"])):
        rows, outer = batch.product_layout(a["input"])
        return product, (a["input"], a["weight"], a["bias"], rows, False, outer), False
    if t is aten.addmm.default and a["beta"] == 1 and a["alpha"] == 1 and _float32(a["self"], a["mat1"], a["mat2"]) \
            and _val(a["self"]).dim() == 1:
        rows, outer = batch.product_layout(a["mat1"])
        return product, (a["mat1"], a["mat2"], a["self"], rows, True, outer), False
    if t is aten.layer_norm.default and a["weight"] is not None and a["bias"] is not None \
            and len(a["normalized_shape"]) == 1 and _float32(a["input"], a["weight"], a["bias"]):
        return layer_norm, (a["input"], a["weight"], a["bias"], float(a["eps"]),
                            batch.rows(a["input"])), True
    if t is aten.embedding.default and not a["scale_grad_by_freq"] and not a["sparse"] and _float32(a["weight"]):
        return embedding, (a["weight"], a["indices"], a["padding_idx"], batch.per_sample(a["indices"])), False
    if t is aten.scaled_dot_product_attention.default and a["dropout_p"] == 0.0 and not a["enable_gqa"] \
            and _float32(a["query"], a["key"], a["value"]):
        return attention_, (a["query"], a["key"], a["value"], a["attn_mask"], a["is_causal"], a["scale"]), True
    if t is aten.cross_entropy_loss.default and a["weight"] is None and a["label_smoothing"] == 0.0 \
            and a["reduction"] in (1, 2) and _float32(a["self"]) and _val(a["self"]).dim() == 2 \
            and _val(a["target"]).dim() == 1 and not _val(a["target"]).is_floating_point():
        return cross_entropy, (a["self"], a["target"], a["reduction"] == 1, a["ignore_index"],
                               batch.rows(a["self"])), True
    if t is aten.conv2d.default and batch.first(a["input"]) and _val(a["input"]).dim() == 4 \
            and _float32(a["input"], a["weight"]) and (a["bias"] is None or _float32(a["bias"])):
        pairs = [list(v) if isinstance(v, (list, tuple)) else [v, v] for v in (a["stride"], a["padding"], a["dilation"])]
        return conv2d, (a["input"], a["weight"], a["bias"], *pairs, a["groups"], batch.per_sample(a["input"])), False
    return None


def lower(unit, known=None):
    """Rewrite ``unit``'s graph (its fx module, in place, while it holds its symbolic shapes: before
    ``save_program`` writes it) to run the ops the kernels do; return ``report``'s. ``known``: the
    batch dimension of each of the step's values, by name (``batch_dims`` of the whole step: what a
    unit reads from another is laid out as it was made)."""
    batch = _Batch(unit, known)
    graph = unit.module.graph
    sums = {}  # a lowered loss's value node -> the node of its float64 sum
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        how = _lowering(node, batch)
        if how is None:
            continue
        op, args, tupled = how
        with graph.inserting_after(node):
            new = graph.call_function(op._opoverload, args)
            new.meta.update(node.meta)
            new.meta["wse_lowered"] = node.target
            value = new
            if tupled:
                with graph.inserting_after(new):
                    value = graph.call_function(operator.getitem, (new, 0))
                value.meta["val"] = node.meta.get("val")
            if op is cross_entropy:
                with graph.inserting_after(value):
                    sums[value] = graph.call_function(operator.getitem, (new, 2))
        batch.dims[new] = batch.dims[value] = batch.dims.get(node)  # later nodes read the new one
        node.replace_all_uses_with(value)
        graph.erase_node(node)
    out = next(n for n in graph.nodes if n.op == "output")
    extra = {name + SUM: sums[n] for n, name in zip(out.args[0], unit.outputs) if n in sums}
    if extra:  # the unit hands each loss's sum on too: "<loss>:sum"
        out.args = ((*out.args[0], *extra.values()),)
    graph.lint()
    unit.module.recompile()
    batch.dims = batch_dims(graph, known)  # the rewritten graph's nodes
    return {**report(unit, batch), "sums": list(extra)}


def _val(node):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _sym_dims(val):
    return [i for i, d in enumerate(val.shape) if isinstance(d, torch.SymInt)] if isinstance(val, torch.Tensor) else []


def _prefix(shape, dim):
    return math.prod(int(d) for d in shape[:dim])


#: Ops that move, repeat or join entries along a dimension (``_acts_on`` says which).
_REORDERS = {"cat", "flip", "roll", "index_select", "repeat", "gather", "scatter", "index", "sort", "argsort",
             "narrow", "take_along_dim", "repeat_interleave", "stack"}
#: Reductions over a list of dimensions (``mean.dim``, ``sum.dim_IntList``, ...).
_REDUCTIONS = {"mean", "sum", "amax", "amin", "prod", "var", "std", "logsumexp", "norm"}
#: Ops that lay a value's elements out anew (the batch kept where the elements before it stay as many).
_RESHAPES = {"view", "reshape", "_unsafe_view", "flatten", "unflatten", "unsqueeze", "squeeze", "expand"}


def batch_dims(graph, known=None):
    """{node: (d, outer) where dimension d of its value holds the batch, or None} over ``graph``, its
    placeholders' from ``known`` (by name: the whole step's, for a unit's) or the batch first.
    ``outer``: how many runs of the batch dimension d holds, one after the other ([L * B, E] made
    from a sequence-first [L, B, E]: (0, L)); (d, 1): each sample's part of it one contiguous run
    (sample-major). A reshape keeps the batch where the elements before it stay as many; a transpose
    or permute moves it; other ops keep it where an input of the output's rank has it."""
    dims = {}
    for node in graph.nodes:
        out = _val(node)
        syms = _sym_dims(out)
        if node.op in ("placeholder", "get_attr"):
            dims[node] = known.get(node.name) if known is not None and node.name in known else \
                ((0, 1) if syms == [0] else None)
            continue
        if node.op != "call_function":
            continue
        ins = [(a, dims.get(a)) for a in node.all_input_nodes if isinstance(_val(a), torch.Tensor)]
        src, d = next(((a, b) for a, b in ins if b is not None), (None, None))
        name = _name(node.target)
        b = None
        if name == "getitem":
            b = dims.get(node.args[0])  # a split's piece, a tuple's item: the tuple's (checked by shape below)
        elif isinstance(out, (tuple, list)):  # a split's pieces: the input's, unless it splits the batch
            at = node.args[1 if name == "unbind" else 2] if len(node.args) > (1 if name == "unbind" else 2) else 0
            b = None if d is None or isinstance(at, int) and at % _val(src).dim() == d[0] else d
        elif len(syms) != 1:
            b = None
        elif src is None:  # made from sizes (arange, new_ones) or a value broadcast over the batch (its
            # copies, one a sample: an expand's backward sums them, which ``report`` names); from a value
            # whose batch is not followed: none
            b = None if any(_sym_dims(_val(a)) for a in node.all_input_nodes) else (syms[0], 1)
        elif name in _REORDERS and _acts_on(node, d[0]):
            b = None  # samples moved, repeated or joined along the batch: not one run each
        elif name in ("transpose", "t"):
            d0, d1 = (node.args[1], node.args[2]) if name == "transpose" else (0, 1)
            rank = _val(src).dim()
            d0, d1 = d0 % rank, d1 % rank
            b = ({d0: d1, d1: d0}.get(d[0], d[0]), d[1])
        elif name == "permute":
            b = ([p % _val(src).dim() for p in node.args[1]].index(d[0]), d[1])
        elif name in _RESHAPES:
            before = _prefix(_val(src).shape, d[0]) * d[1]  # elements' runs before each sample's part
            prefix = _prefix(out.shape, syms[0])
            outer = before // prefix if before % prefix == 0 else 0
            coef = out.shape[syms[0]].node.expr / next(iter(out.shape[syms[0]].node.expr.free_symbols))
            b = (syms[0], outer) if outer and coef.is_Integer and int(coef) % outer == 0 else None
        elif name in ("select", "slice"):
            dim = node.args[1] % _val(src).dim() if len(node.args) > 1 else 0
            whole = name == "slice" and (len(node.args) < 3 or node.args[2] in (0, None)) \
                and (len(node.args) < 4 or node.args[3] is None or isinstance(node.args[3], int)
                     and node.args[3] >= 2 ** 62) and (len(node.args) < 5 or node.args[4] == 1)
            b = d if whole or dim != d[0] else None
            if b is not None and name == "select" and dim < b[0]:
                b = (b[0] - 1, b[1])
        elif name == "embedding":
            b = dims.get(node.args[1])
        elif name in _REDUCTIONS and len(node.args) > 1 and isinstance(node.args[1], (list, tuple)) \
                and not (len(node.args) > 2 and node.args[2] is True or node.kwargs.get("keepdim")):
            gone = [x % _val(src).dim() for x in node.args[1]]
            b = None if d[0] in gone else (d[0] - sum(x < d[0] for x in gone), d[1])
        else:
            same = [bb for a, bb in ins if bb is not None and _val(a).dim() == out.dim()]
            b = same[0] if same else None
        if b is not None and not isinstance(out, (tuple, list)) and b[0] not in syms:
            b = None
        dims[node] = b
    return dims


def _acts_on(node, dim):
    """Whether a ``_REORDERS`` op moves, repeats or joins entries along dimension ``dim`` of its input (when
    it cannot tell: yes)."""
    name, args = _name(node.target), node.args
    if name in ("cat", "stack"):
        return (args[1] if len(args) > 1 else node.kwargs.get("dim", 0)) % max(1, _val(node).dim()) == dim
    if name in ("flip", "roll"):
        dims = args[1] if name == "flip" else (args[2] if len(args) > 2 else None)
        return dims is None or dim in [x % _val(node).dim() for x in (dims if isinstance(dims, (list, tuple)) else [dims])]
    if name in ("index_select", "gather", "narrow", "sort", "argsort", "take_along_dim"):
        return len(args) < 2 or not isinstance(args[1], int) or args[1] % _val(node).dim() == dim
    if name == "repeat":
        repeats = args[1] if len(args) > 1 else None
        return not isinstance(repeats, (list, tuple)) or dim >= len(repeats) or repeats[dim] != 1
    return True


class _Batch:
    """Where the batch is in a unit's values (``batch_dims``), and what follows for its sums."""

    def __init__(self, unit, known):
        self.dims = batch_dims(unit.module.graph, known)

    def first(self, node):
        """Whether the value's batch is its first dimension, sample-major."""
        return self.dims.get(node) == (0, 1)

    def per_sample(self, node):
        """Entries of the first dimension a sample has, of a value whose batch is first; 0 otherwise."""
        if not self.first(node):
            return 0
        expr = _val(node).shape[0].node.expr
        k = expr / next(iter(expr.free_symbols))
        return int(k) if len(expr.free_symbols) == 1 and k.is_Integer and int(k) >= 1 else 0

    def has(self, node):
        return bool(_sym_dims(_val(node)))

    def rows(self, node):
        """Rows a sample of a value whose batch is first (its rows: all dimensions but the last), else None."""
        val = _val(node)
        if not self.first(node) or val.dim() < 1:
            return None
        expr = val.shape[0].node.expr
        k = expr / next(iter(expr.free_symbols))
        if len(expr.free_symbols) != 1 or not k.is_Integer or int(k) < 1:
            return None
        return int(k) * math.prod(int(d) for d in val.shape[1:-1])

    def product_layout(self, node):
        """(rows a sample, the runs of the batch its rows are: 1, sample-major; L, a sequence-first
        layout's, as ``nn.MultiheadAttention`` makes inside ``nn.TransformerEncoderLayer``) of a
        product's input; (None, 1) when its batch is not followed (one sum over all its rows)."""
        val, where = _val(node), self.dims.get(node)
        if where is None or where[0] >= val.dim() - 1:
            return None, 1
        d, runs = where
        expr = val.shape[d].node.expr
        coef = expr / next(iter(expr.free_symbols))
        if len(expr.free_symbols) != 1 or not coef.is_Integer:
            return None, 1
        before = _prefix(val.shape, d)
        return before * int(coef) * math.prod(int(x) for x in val.shape[d + 1:-1]), before * runs


def _broadcast_operand(node, batch):
    """The index of the operand with the batch first when the other is broadcast over it (a weight, a
    position table), else None."""
    vals = [_val(a) for a in node.args]
    out = _val(node)
    if not all(isinstance(v, torch.Tensor) and v.dtype == torch.float32 for v in (*vals, out)) or not batch.first(node):
        return None
    first = [batch.first(a) and v.dim() == out.dim() for a, v in zip(node.args, vals)]
    if first.count(True) != 1:
        return None
    other = vals[first.index(False)]
    if other.dim() == out.dim() and not (isinstance(other.shape[0], int) and other.shape[0] == 1):
        return None
    return first.index(True)


def _name(target):
    return getattr(target, "__name__", str(target)).split(".")[0]


def report(unit, batch):
    """What the lowering of ``unit`` did: {"lowered": {op: count}, "torch": {op: count} (ops that compute,
    left to torch), "flops": {"lowered": n, "torch": n} (the example micro-batch's forward), "torch_flops":
    the share of the unit's FLOPs left to torch, "batch_dependent": [one line per op whose sums span a
    micro-batch]}."""
    lowered, left, reasons = {}, {}, []
    flops = {"lowered": 0, "torch": 0}
    trained = _trained(unit, batch)
    for node in unit.module.graph.nodes:
        if node.op != "call_function":
            continue
        original = node.meta.get("wse_lowered")
        name = _name(original or node.target)
        if original is not None:
            lowered[name] = lowered.get(name, 0) + 1
            flops["lowered"] += _lowered_flops(node)
            operand = node.args[1] if name == "embedding" else node.args[node.args[3]] if name in _BY_TARGET.values() \
                else node.args[0]
            if name != "scaled_dot_product_attention" and batch.has(operand) and not _followed(node):
                reasons.append(f"{unit.name}: {name} of a tensor whose samples it cannot tell apart")
            continue
        work = _flops(node.target, node)
        if name == "expand" and _spans_batch(node, trained, batch):  # its backward sums the copies
            reasons.append(f"{unit.name}: expand broadcasts a weight over the batch (left to torch)")
        if name in _FREE or not isinstance(_val(node), torch.Tensor):  # a view, or a size or tuple
            continue
        left[name] = left.get(name, 0) + 1
        flops["torch"] += work
        reason = "draws its random numbers for the whole micro-batch" if draws(node) else _spans_batch(node, trained, batch)
        if reason:
            reasons.append(f"{unit.name}: {name} {reason} (left to torch)")
    total = flops["lowered"] + flops["torch"]
    return {"lowered": lowered, "torch": left, "flops": flops, "torch_flops": flops["torch"] / total if total else 0.0,
            "batch_dependent": reasons}


def _followed(node):
    """Whether a lowered node's sums over samples are trees: it was told where its operand's samples are."""
    op, args = node.target, node.args
    if op is torch.ops.wse.product.default:
        return args[3] is not None
    if op in (torch.ops.wse.layer_norm.default, torch.ops.wse.cross_entropy.default):
        return args[4] is not None
    return args[-1] > 0  # embedding, conv2d, broadcast: the entries a sample has


def _trained(unit, batch):
    """The unit's nodes whose values depend on a weight it reads, or on a value an earlier unit handed
    on that is not per sample: what a gradient flows into."""
    kinds = dict(zip((n for n in unit.module.graph.nodes if n.op == "placeholder"), unit.inputs))
    out = set()
    for node in unit.module.graph.nodes:
        if node.op == "placeholder":
            kind = kinds[node][0]
            if kind == "param" or kind == "value" and not batch.first(node):
                out.add(node)
        elif any(a in out for a in node.all_input_nodes):
            out.add(node)
    return out


def _spans_batch(node, trained, batch):
    """Why ``node``, run by torch, sums over a micro-batch: it broadcasts a trained tensor over the
    batch (its backward sums over it) or reduces the batch away; None: neither."""
    out = _val(node)
    if not isinstance(out, torch.Tensor) or not out.is_floating_point():
        return None
    ins = [(a, _val(a)) for a in node.all_input_nodes]
    floats = [(a, v) for a, v in ins if isinstance(v, torch.Tensor) and v.is_floating_point()]
    if batch.first(node) and any(a in trained and not batch.first(a) for a, v in floats):
        return "broadcasts a weight over the batch"
    if not batch.first(node) and any(batch.first(a) for a, _ in floats):
        return "sums over the batch"
    return None


def _flops(target, node):
    """Multiply-adds x 2 of a product (a weight's, attention's, a convolution's) from the node's
    shapes; an element operation per output element otherwise."""
    out = _val(node)
    if not isinstance(out, torch.Tensor):
        return 0
    numel = concrete(out.numel())
    if target in (aten.linear.default, aten.addmm.default, aten.mm.default, aten.bmm.default, aten.matmul.default):
        inner = _val(node.args[1] if target is aten.addmm.default else node.args[0])
        return 2 * numel * concrete(inner.shape[-1]) if isinstance(inner, torch.Tensor) else numel
    if target is aten.scaled_dot_product_attention.default:
        q, k = _val(node.args[0]), _val(node.args[1])
        return 4 * concrete(q.numel()) * concrete(k.shape[-2])
    if "conv" in _name(target):
        w = _val(node.args[1])
        return 2 * numel * math.prod(concrete(d) for d in w.shape[1:]) if isinstance(w, torch.Tensor) else numel
    return numel


def _lowered_flops(node):
    """``_flops`` of a lowered node: a product's and attention's from their operands' shapes."""
    out = _val(node)
    numel = concrete(out.numel()) if isinstance(out, torch.Tensor) else 0
    if node.target is torch.ops.wse.product.default:
        return 2 * numel * concrete(_val(node.args[0]).shape[-1])
    if node.target is torch.ops.wse.attention.default:
        return 4 * concrete(_val(node.args[0]).numel()) * concrete(_val(node.args[1]).shape[-2])
    if node.target is torch.ops.wse.conv2d.default:
        return 2 * numel * math.prod(concrete(d) for d in _val(node.args[1]).shape[1:])
    return numel


def concrete(n):
    """A size's value on the example: a symbolic one's hint (``int()`` of it would fix the symbol to it for
    every later reader of the graph's shapes)."""
    return int(n.node.hint) if isinstance(n, torch.SymInt) else int(n)
