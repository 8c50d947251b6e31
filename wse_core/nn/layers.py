"""Streaming units: the groups of weights MemoryX streams together, and the layer math on them.

A unit has named parameters (full PyTorch-style names such as ``blocks.0.attn.qkv.weight``,
weights ``[out, in]``) and two methods::

    y, saved = unit.forward(x, params, drop)  # params: name -> array (at least this unit's)
    dx, grads = unit.backward(dy, saved, params)

``drop`` (a ``DropoutKey``, or None: no dropout, as in evaluation) keys the dropout masks of the
micro-batch by (seed, step, sample, layer, site), so a sample gets the same masks whichever CS-2
and micro-batch it lands in: bits are identical across num_csx.

``grads`` maps each of the unit's parameter names to the gradient of the micro-batch loss sum.
A parameter used by two units (a tied embedding) appears in both; its gradient is the sum.
Dense products go through numpy's BLAS (``wse_core.nn.gemm.matmul``); elementwise and row-wise work through ``ops``
(``wse_core.nn.ops`` fused kernels, or ``wse_core.nn.numpy_ops`` for the unfused baseline).
"""
import math
import zlib
from dataclasses import dataclass, field

import numpy as np

from wse_core.nn import attention
from wse_core.nn import ops as fused_ops
from wse_core.nn.gemm import matmul
from wse_core.nn.sample_tree import embedding_grad, sample_sum, samples_of, weight_product


@dataclass(frozen=True)
class ParamSpec:
    """Shape and initialisation of one parameter (``init``: see ``wse_core.nn.init.INITIALIZERS``).

    A sparse weight has ``structure``: the CSR pattern of its dense ``[out, in]`` matrix; the
    parameter itself is then the 1-D array of its nonzero values (``shape == (nnz,)``).
    ``decay`` is False for biases and norm weights, which take no weight decay (as in Model Zoo).
    """

    shape: tuple
    init: tuple
    structure: object = field(default=None, compare=False)
    decay: bool = True
    #: Model Zoo's learning-rate adjustment group (``optimizer.adjust_learning_rate``): embedding,
    #: decoder_attention, decoder_input_ffn, decoder_output_ffn (the last three: decoder_kernel).
    lr_group: str = None


@dataclass(frozen=True)
class DropoutKey:
    """What the dropout masks of one micro-batch are drawn from: the run's seed, the 1-based step
    and the index of the micro-batch's first sample in the step's global batch."""

    seed: int
    step: int
    first_sample: int

    def scale(self, n, layer, site, shape, rate, dtype):
        """[n, *shape] of 0 or 1 / (1 - rate) (inverted dropout, as torch's): sample i's from the
        stream keyed by (seed, step, first_sample + i, layer, site)."""
        out = np.empty((n, *shape), dtype)
        for i in range(n):
            u = np.random.default_rng([self.seed, self.step, self.first_sample + i, layer, site]).random(shape)
            out[i] = (u >= rate) * (1.0 / (1.0 - rate))
        return out


#: Sites of dropout in a decoder layer (the stream key's last part).
EMBEDDING_SITE, ATTENTION_SITE, ATTENTION_OUT_SITE, MLP_OUT_SITE = 0, 1, 2, 3


def fixed_spec(shape, value):
    """A bias (zeros) or a norm weight (ones): no weight decay."""
    return ParamSpec(shape, (value,), decay=False)


def sparse_structure(name, out_features, in_features, density, seed):
    """The fixed mask of a sparse weight: in every row, ``round(density * in)`` columns (at least 1),
    drawn uniformly without replacement from a stream keyed by (seed, name), sorted.

    Random, not by magnitude: at initialisation the weights are random anyway, and a row-balanced
    mask keeps the work per output row equal. The same (seed, name, shape, density) always gives
    the same mask, so every rank rebuilds it instead of receiving it.
    """
    from wse_core.sparse import CSRMatrix

    keep = max(1, int(round(density * in_features)))
    rng = np.random.default_rng([int(seed), zlib.crc32(name.encode()), 1])
    cols = np.stack([np.sort(rng.choice(in_features, keep, replace=False)) for _ in range(out_features)])
    indptr = np.arange(0, out_features * keep + 1, keep, dtype=np.int32)
    return CSRMatrix(indptr, cols.reshape(-1).astype(np.int32), np.zeros(out_features * keep, np.float32),
                     (out_features, in_features))


def weight_spec(name, out_features, in_features, init, density=1.0, seed=0, lr_group=None):
    """The ParamSpec of a Linear weight ``[out, in]``: dense, or sparse when density < 1."""
    if density >= 1.0:
        return ParamSpec((out_features, in_features), init, lr_group=lr_group)
    structure = sparse_structure(name, out_features, in_features, density, seed)
    return ParamSpec((structure.nnz,), init, structure, lr_group=lr_group)


def matmul_wt(x, w, structure=None, sample_rows=None, bias=None):
    """x @ w.T (+ bias) for x [N, in] and w [out, in]; for a sparse w (its values and structure) through
    spmm. ``sample_rows``: x's rows are samples of that many tokens each (``gemm.matmul``).

    Sparse: y^T = W x^T with W in CSR, so the transposes of x and y are formed (O(N (in + out)),
    small next to the O(N nnz) product once in and out are a few hundred).
    """
    if structure is None:
        return matmul(x, w.T, sample_rows, bias)
    from wse_core.sparse import spmm

    y = np.ascontiguousarray(spmm(structure.with_data(w), np.ascontiguousarray(x.T)).T)
    if bias is not None:
        y += bias
    return y


def linear_forward(x, w, b, structure=None, sample_rows=None):
    """y := x @ w.T + b for 2-D x and w [out, in] (dense, or sparse values with their structure)."""
    return matmul_wt(x, w, structure, sample_rows, b)


def linear_backward(dy, x, w, ops, structure=None, sample_rows=None):
    """Gradients of y = x @ w.T + b: returns (dx, dw, db); for a sparse w, dw holds only its nonzeros.
    dw and db are trees over the samples of ``sample_rows`` rows (``sample_tree``); without it, one
    sum over all rows."""
    t = dy.shape[0] if sample_rows is None else sample_rows
    if structure is None:
        dw, db = sample_sum(samples_of(dy.shape[0], t), lambda s: (
            matmul(dy[s * t:(s + 1) * t].T, x[s * t:(s + 1) * t]), ops.column_sum(dy[s * t:(s + 1) * t])))
        return matmul(dy, w, sample_rows), dw, db
    from wse_core.sparse import sddmm, spmm

    a = structure.with_data(w)
    dyt = np.ascontiguousarray(dy.T)
    # dx^T = W^T dy^T: spmm on W^T's pattern (kept by the structure) adds the same terms in the same
    # order as spmm_t(W, dy^T), bit for bit, and runs with spmm's register blocking.
    pattern, perm = structure.transpose_pattern()
    dx = np.ascontiguousarray(spmm(pattern.with_data(np.ascontiguousarray(w[perm])), dyt).T)
    dw, db = sample_sum(samples_of(dy.shape[0], t), lambda s: (
        sddmm(a, np.ascontiguousarray(dy[s * t:(s + 1) * t].T), np.ascontiguousarray(x[s * t:(s + 1) * t].T)),
        ops.column_sum(dy[s * t:(s + 1) * t])))
    return dx, dw, db


def norm_backward(backward, dy, x, t, *stats):
    """(dx, *weight gradients) of a row-wise norm over token-major ``x`` whose kernel ``backward(dy, x,
    *stats)`` returns (dx, dweight, ...): run a sample at a time (a row's dx is its own; the weights'
    gradients are trees over samples, ``sample_tree``). ``stats``: the norm's weight, then per-row
    arrays (mean, rstd) sliced with the rows."""
    weight, rows_stats = stats[0], stats[1:]
    dx = np.empty_like(x)

    def leaf(s):
        lo, hi = s * t, (s + 1) * t
        out = backward(np.ascontiguousarray(dy[lo:hi]), x[lo:hi], weight, *(r[lo:hi] for r in rows_stats))
        dx[lo:hi] = out[0]
        return out[1:]

    return (dx, *sample_sum(samples_of(x.shape[0], t), leaf))


class Unit:
    """Base class of streaming units."""

    name = "unit"

    def param_specs(self):
        """Ordered ``{name: ParamSpec}`` of the parameters this unit uses."""
        raise NotImplementedError

    def forward(self, x, params, drop=None):
        raise NotImplementedError

    def backward(self, dy, saved, params):
        raise NotImplementedError


class Embedding(Unit):
    """Token plus learned position embeddings: h[b, t] = wte[ids[b, t]] + wpe[t]."""

    def __init__(self, vocab_size, max_positions, hidden_size, ops=fused_ops, init=("normal", 0.0, 0.02),
                 dropout=0.0, positions=True):
        self.name = "embedding"
        self.vocab_size, self.max_positions, self.hidden = vocab_size, max_positions, hidden_size
        self.ops, self.init, self.dropout = ops, init, dropout
        self.positions = positions  # learned position embeddings (GPT-2); llama's are rotary, in its blocks

    #: muP's ``model.embeddings_scale``: the embeddings are multiplied by it (set by the model's builder).
    scale = 1.0

    def param_specs(self):
        specs = {"wte.weight": ParamSpec((self.vocab_size, self.hidden), self.init, lr_group="embedding")}
        if self.positions:
            specs["wpe.weight"] = ParamSpec((self.max_positions, self.hidden), self.init, lr_group="embedding")
        return specs

    def _embed(self, ids, params, positions):
        h = params["wte.weight"][ids]
        if self.positions:
            h += params["wpe.weight"][positions]
        if self.scale != 1.0:
            h *= h.dtype.type(self.scale)
        return h

    def infer(self, ids, params, kv):
        """The embeddings of a generation step's new tokens ``ids`` [b, t], at each sequence's positions."""
        return self._embed(ids, params, kv.positions())

    def forward(self, ids, params, drop=None):
        b, t = ids.shape
        h = self._embed(ids, params, slice(0, t))
        mask = None
        if drop is not None and self.dropout > 0:
            mask = drop.scale(b, 0, EMBEDDING_SITE, (t, self.hidden), self.dropout, h.dtype)
            h *= mask
        return h, (ids, mask)

    def backward(self, dy, saved, params):
        ids, mask = saved
        if mask is not None:
            dy = dy * mask
        if self.scale != 1.0:
            dy = dy * dy.dtype.type(self.scale)
        b, t, c = dy.shape
        dy = np.ascontiguousarray(dy)
        dwte = embedding_grad(ids, dy.reshape(b * t, c), self.vocab_size, self.ops.embedding_backward)
        if not self.positions:
            return None, {"wte.weight": dwte}
        dwpe = np.zeros((self.max_positions, c), dy.dtype)
        dwpe[:t] = sample_sum(b, lambda s: (dy[s].copy(),))[0]
        return None, {"wte.weight": dwte, "wpe.weight": dwpe}


class TransformerBlock(Unit):
    """GPT-2 block: x + attn(ln_1(x)), then x + mlp(ln_2(x)); causal multi-head self-attention."""

    def __init__(self, index, hidden_size, num_heads, filter_size, eps, num_layers, ops=fused_ops,
                 density=1.0, sparsity_seed=0, nonlinearity="gelu", init=None, dropout=0.0, attention_dropout=0.0):
        self.name = f"blocks.{index}"
        self.index, self.dropout, self.attention_dropout = index, dropout, attention_dropout
        # "gelu": exact, erf (Model Zoo's and torch's); "gelu_new": GPT-2's tanh approximation.
        self.exact_gelu = nonlinearity == "gelu"
        self.p = f"blocks.{index}."
        self.hidden, self.heads, self.filter, self.eps = hidden_size, num_heads, filter_size, eps
        self.head_dim = hidden_size // num_heads
        self.num_layers = num_layers
        self.ops = ops
        # {"weight": init of q/k/v and fc, "output": init of the two residual projections}; by
        # default GPT-2's: normal(0.02), the projections scaled by 1/sqrt(2 * layers).
        self.init = init or {"weight": ("normal", 0.0, 0.02),
                             "output": ("normal", 0.0, 0.02 / math.sqrt(2 * num_layers))}
        self.specs = self._specs(density, sparsity_seed)
        # The CSR pattern of each sparse Linear weight (none when dense).
        self.structure = {n: s.structure for n, s in self.specs.items() if s.structure is not None}

    def _specs(self, density, seed):
        c, f, p = self.hidden, self.filter, self.p
        w, resid = self.init["weight"], self.init["output"]
        return {
            p + "ln_1.weight": fixed_spec((c,), "ones"),
            p + "ln_1.bias": fixed_spec((c,), "zeros"),
            p + "attn.qkv.weight": weight_spec(p + "attn.qkv.weight", 3 * c, c, w, density, seed, "decoder_attention"),
            p + "attn.qkv.bias": fixed_spec((3 * c,), "zeros"),
            p + "attn.proj.weight": weight_spec(p + "attn.proj.weight", c, c, resid, density, seed, "decoder_attention"),
            p + "attn.proj.bias": fixed_spec((c,), "zeros"),
            p + "ln_2.weight": fixed_spec((c,), "ones"),
            p + "ln_2.bias": fixed_spec((c,), "zeros"),
            p + "mlp.fc.weight": weight_spec(p + "mlp.fc.weight", f, c, w, density, seed, "decoder_input_ffn"),
            p + "mlp.fc.bias": fixed_spec((f,), "zeros"),
            p + "mlp.proj.weight": weight_spec(p + "mlp.proj.weight", c, f, self.init.get("ffn_output", resid), density,
                                               seed, "decoder_output_ffn"),
            p + "mlp.proj.bias": fixed_spec((c,), "zeros"),
        }

    def param_specs(self):
        return dict(self.specs)

    @property
    def attention_scale(self):
        """q.k / sqrt(head size), or / head size with muP's ``model.scale_qk_dot_by_d``."""
        return 1.0 / (self.head_dim if self.scale_qk_dot_by_d else math.sqrt(self.head_dim))

    scale_qk_dot_by_d = False  # set by the model's builder

    def _lin(self, x, params, key, t, bias=True):
        name = self.p + key + ".weight"
        w, st = params[name], self.structure.get(name)
        if bias:
            return linear_forward(x, w, params[self.p + key + ".bias"], st, sample_rows=t)
        return matmul_wt(x, w, st, sample_rows=t)

    def _lin_back(self, dy, x, params, key, t, g):
        name = self.p + key + ".weight"
        dx, g[name], g[self.p + key + ".bias"] = linear_backward(dy, x, params[name], self.ops,
                                                                 self.structure.get(name), sample_rows=t)
        return dx

    def _masks(self, drop, b, t, dtype):
        """(attention probs, attention output, MLP output) dropout scales of this micro-batch, or Nones."""
        layer = self.index + 1  # 0 is the embedding's
        on = drop is not None
        return (drop.scale(b, layer, ATTENTION_SITE, (self.heads, t, t), self.attention_dropout, dtype)
                if on and self.attention_dropout > 0 else None,
                *(drop.scale(b, layer, site, (t, self.hidden), self.dropout, dtype).reshape(b * t, self.hidden)
                  if on and self.dropout > 0 else None for site in (ATTENTION_OUT_SITE, MLP_OUT_SITE)))

    def forward(self, x, params, drop=None):
        return self._run(x, params, drop, None)

    def infer(self, x, params, kv):
        """A generation step: the block on the new positions ``x`` [b, t, c], attending over each
        sequence's KV cache ``kv`` (``wse_core.nn.kv``); training's forward but for attention."""
        return self._run(x, params, None, kv)[0]

    def _run(self, x, params, drop, kv):
        ops, p = self.ops, self.p
        b, t, c = x.shape
        nh, hd = self.heads, self.head_dim
        scale = self.attention_scale
        masks = self._masks(drop, b, t, x.dtype)
        x2 = x.reshape(b * t, c)
        ln1, mu1, rs1 = ops.layernorm_forward(x2, params[p + "ln_1.weight"], params[p + "ln_1.bias"], self.eps)
        qkv = self._lin(ln1, params, "attn.qkv", t)
        q, k, v = _heads(qkv, b, t, nh, hd)                                      # views [b, nh, t, hd]
        if kv is None:
            att = np.empty((b * t, c), x.dtype)
            _, probs = attention.forward(q, k, v, scale, ops, masks[0],         # masks[0]: attention dropout
                                         out=_heads(att, b, t, nh, hd)[0])
        else:
            probs, heads = None, kv.attend(self.name, q, k, v, scale, ops)
            att = np.ascontiguousarray(heads.transpose(0, 2, 1, 3)).reshape(b * t, c)
        proj = self._lin(att, params, "attn.proj", t)
        mid = x2 + (proj if masks[1] is None else proj * masks[1])
        ln2, mu2, rs2 = ops.layernorm_forward(mid, params[p + "ln_2.weight"], params[p + "ln_2.bias"], self.eps)
        pre = self._lin(ln2, params, "mlp.fc", t, bias=False)
        act = ops.bias_gelu_forward(pre, params[p + "mlp.fc.bias"], self.exact_gelu)
        proj = self._lin(act, params, "mlp.proj", t)
        out = mid + (proj if masks[2] is None else proj * masks[2])
        saved = (x2, ln1, mu1, rs1, q, k, v, probs, att, mid, ln2, mu2, rs2, pre, act, masks)
        return out.reshape(b, t, c), saved

    def backward(self, dy, saved, params):
        ops, p = self.ops, self.p
        x2, ln1, mu1, rs1, q, k, v, probs, att, mid, ln2, mu2, rs2, pre, act, masks = saved
        b, t, c = dy.shape
        nh, hd = self.heads, self.head_dim
        scale = self.attention_scale
        g = {}
        dout = np.ascontiguousarray(dy).reshape(b * t, c)
        # MLP
        dact = self._lin_back(dout if masks[2] is None else dout * masks[2], act, params, "mlp.proj", t, g)
        dpre = ops.gelu_backward(pre, dact, self.exact_gelu)
        dln2 = self._lin_back(dpre, ln2, params, "mlp.fc", t, g)
        dmid, g[p + "ln_2.weight"], g[p + "ln_2.bias"] = norm_backward(
            ops.layernorm_backward, dln2, mid, t, params[p + "ln_2.weight"], mu2, rs2)
        dmid += dout
        # Attention
        datt = self._lin_back(dmid if masks[1] is None else dmid * masks[1], att, params, "attn.proj", t, g)
        dqkv = np.empty((b * t, 3 * c), dy.dtype)  # attention.backward writes every gradient
        attention.backward(_heads(datt, b, t, nh, hd)[0], q, k, v, probs, scale, ops, masks[0],
                           grads=_heads(dqkv, b, t, nh, hd))
        dln1 = self._lin_back(dqkv, ln1, params, "attn.qkv", t, g)
        dx, g[p + "ln_1.weight"], g[p + "ln_1.bias"] = norm_backward(
            ops.layernorm_backward, dln1, x2, t, params[p + "ln_1.weight"], mu1, rs1)
        dx += dmid
        return dx.reshape(b, t, c), g


def _heads(x, b, t, nh, hd):
    """The [b, nh, t, hd] views of each head block of token-major ``x`` [b * t, k * nh * hd] (k of them:
    q, k and v of the QKV product, or one)."""
    parts = x.reshape(b, t, -1, nh, hd)
    return tuple(parts[:, :, i].transpose(0, 2, 1, 3) for i in range(parts.shape[2]))


class LMHead(Unit):
    """Final LayerNorm and the output projection to vocabulary logits (tied to ``wte.weight`` or not)."""

    def __init__(self, hidden_size, vocab_size, eps, tied, ops=fused_ops, embedding_init=("normal", 0.0, 0.02),
                 head_init=("normal", 0.0, 0.02)):
        self.name = "head"
        self.hidden, self.vocab_size, self.eps = hidden_size, vocab_size, eps
        self.weight = "wte.weight" if tied else "lm_head.weight"
        # A tied head is the embedding (same spec as the Embedding unit's); an untied one has its own.
        self.init = embedding_init if tied else head_init
        self.ops = ops

    def param_specs(self):
        c = self.hidden
        return {"ln_f.weight": fixed_spec((c,), "ones"),
                "ln_f.bias": fixed_spec((c,), "zeros"),
                self.weight: ParamSpec((self.vocab_size, c), self.init, lr_group="embedding" if
                                       self.weight == "wte.weight" else None)}

    def infer(self, x, params, kv):
        """The logits of a generation step's positions."""
        return self.forward(x, params)[0]

    def forward(self, x, params, drop=None):
        b, t, c = x.shape
        x2 = x.reshape(b * t, c)
        ln, mu, rs = self.ops.layernorm_forward(x2, params["ln_f.weight"], params["ln_f.bias"], self.eps)
        logits = matmul(ln, params[self.weight].T, sample_rows=t)
        if self.logits_scale != 1.0:
            logits *= logits.dtype.type(self.logits_scale)
        return logits.reshape(b, t, self.vocab_size), (x2, ln, mu, rs)

    #: muP's ``model.output_logits_scale``: the logits are multiplied by it (set by the model's builder).
    logits_scale = 1.0

    def backward(self, dlogits, saved, params):
        x2, ln, mu, rs = saved
        b, t, v = dlogits.shape
        d2 = dlogits.reshape(b * t, v)
        if self.logits_scale != 1.0:
            d2 = d2 * d2.dtype.type(self.logits_scale)
        g = {}
        dln = matmul(d2, params[self.weight], sample_rows=t)
        g[self.weight] = weight_product(d2, ln, t)
        dx, g["ln_f.weight"], g["ln_f.bias"] = norm_backward(
            self.ops.layernorm_backward, dln, x2, t, params["ln_f.weight"], mu, rs)
        return dx.reshape(b, t, self.hidden), g


class Dense(Unit):
    """One fully connected layer, y = act(x @ W.T + b), of an MLP (``layers.<i>.weight`` [out, in]);
    ``activation`` relu, gelu (exact), gelu_new (tanh approximation) or None."""

    def __init__(self, index, in_features, out_features, activation, ops=fused_ops, density=1.0, sparsity_seed=0):
        self.name = f"layers.{index}"
        self.p = f"layers.{index}."
        self.in_features, self.out_features, self.activation = in_features, out_features, activation
        self.ops = ops
        # PyTorch's nn.Linear default: U(-1/sqrt(in), 1/sqrt(in)) for weight and bias.
        bound = 1.0 / math.sqrt(self.in_features)
        w = weight_spec(self.p + "weight", out_features, in_features, ("uniform", -bound, bound), density, sparsity_seed)
        self.specs = {self.p + "weight": w,
                      self.p + "bias": ParamSpec((self.out_features,), ("uniform", -bound, bound), decay=False)}
        self.structure = w.structure

    def param_specs(self):
        return dict(self.specs)

    # A sample is one row: each row's products are its own BLAS calls, so a row's values and its part
    # of the weights' gradients do not depend on its micro-batch (``sample_tree``).
    def forward(self, x, params, drop=None):
        w, b = params[self.p + "weight"], params[self.p + "bias"]
        if self.activation is None:
            return linear_forward(x, w, b, self.structure, sample_rows=1), (x, None)
        pre = matmul_wt(x, w, self.structure, sample_rows=1)
        if self.activation == "relu":
            y = self.ops.bias_relu_forward(pre, b)
        else:
            y = self.ops.bias_gelu_forward(pre, b, self.activation == "gelu")
        return y, (x, pre)

    def backward(self, dy, saved, params):
        x, pre = saved
        dy = np.ascontiguousarray(dy)
        if self.activation == "relu":
            dy = self.ops.relu_backward(pre, dy.copy())
        elif self.activation in ("gelu", "gelu_new"):
            dy = self.ops.gelu_backward(pre, dy.copy(), self.activation == "gelu")
        dx, dw, db = linear_backward(dy, x, params[self.p + "weight"], self.ops, self.structure, sample_rows=1)
        return dx, {self.p + "weight": dw, self.p + "bias": db}
