"""Streaming units: the groups of weights MemoryX streams together, and the layer math on them.

A unit has named parameters (full PyTorch-style names such as ``blocks.0.attn.qkv.weight``,
weights ``[out, in]``) and two methods::

    y, saved = unit.forward(x, params)        # params: name -> array (at least this unit's)
    dx, grads = unit.backward(dy, saved, params)

``grads`` maps each of the unit's parameter names to the gradient of the micro-batch loss sum.
A parameter used by two units (a tied embedding) appears in both; its gradient is the sum.
Dense products go through numpy's BLAS (``wse_core.nn.gemm.matmul``); elementwise and row-wise work through ``ops``
(``wse_core.nn.ops`` fused kernels, or ``wse_core.nn.numpy_ops`` for the unfused baseline).
"""
import math
from dataclasses import dataclass

import numpy as np

from wse_core.nn import ops as fused_ops
from wse_core.nn.gemm import matmul


@dataclass(frozen=True)
class ParamSpec:
    """Shape and initialisation of one parameter: ("normal", std), ("uniform", bound), ("zeros",) or ("ones",)."""

    shape: tuple
    init: tuple


def linear_forward(x, w, b):
    """y := x @ w.T + b for 2-D x and w [out, in]."""
    y = matmul(x, w.T)
    if b is not None:
        y += b
    return y


def linear_backward(dy, x, w, ops):
    """Gradients of y = x @ w.T + b: returns (dx, dw, db)."""
    return matmul(dy, w), matmul(dy.T, x), ops.column_sum(dy)


class Unit:
    """Base class of streaming units."""

    name = "unit"

    def param_specs(self):
        """Ordered ``{name: ParamSpec}`` of the parameters this unit uses."""
        raise NotImplementedError

    def forward(self, x, params):
        raise NotImplementedError

    def backward(self, dy, saved, params):
        raise NotImplementedError


class Embedding(Unit):
    """Token plus learned position embeddings: h[b, t] = wte[ids[b, t]] + wpe[t]."""

    def __init__(self, vocab_size, max_positions, hidden_size, ops=fused_ops):
        self.name = "embedding"
        self.vocab_size, self.max_positions, self.hidden = vocab_size, max_positions, hidden_size
        self.ops = ops

    def param_specs(self):
        return {"wte.weight": ParamSpec((self.vocab_size, self.hidden), ("normal", 0.02)),
                "wpe.weight": ParamSpec((self.max_positions, self.hidden), ("normal", 0.02))}

    def forward(self, ids, params):
        b, t = ids.shape
        h = params["wte.weight"][ids]
        h += params["wpe.weight"][:t]
        return h, ids

    def backward(self, dy, ids, params):
        b, t, c = dy.shape
        dwte = self.ops.embedding_backward(ids.reshape(-1), dy.reshape(b * t, c), self.vocab_size)
        dwpe = np.zeros((self.max_positions, c), dy.dtype)
        dwpe[:t] = dy.sum(axis=0)  # numpy adds the b slices in order: deterministic
        return None, {"wte.weight": dwte, "wpe.weight": dwpe}


class TransformerBlock(Unit):
    """GPT-2 block: x + attn(ln_1(x)), then x + mlp(ln_2(x)); causal multi-head self-attention."""

    def __init__(self, index, hidden_size, num_heads, filter_size, eps, num_layers, ops=fused_ops):
        self.name = f"blocks.{index}"
        self.p = f"blocks.{index}."
        self.hidden, self.heads, self.filter, self.eps = hidden_size, num_heads, filter_size, eps
        self.head_dim = hidden_size // num_heads
        self.num_layers = num_layers
        self.ops = ops

    def param_specs(self):
        c, f, p = self.hidden, self.filter, self.p
        # GPT-2: residual projections are scaled by 1/sqrt(2 * layers) at initialisation.
        resid = ("normal", 0.02 / math.sqrt(2 * self.num_layers))
        return {
            p + "ln_1.weight": ParamSpec((c,), ("ones",)),
            p + "ln_1.bias": ParamSpec((c,), ("zeros",)),
            p + "attn.qkv.weight": ParamSpec((3 * c, c), ("normal", 0.02)),
            p + "attn.qkv.bias": ParamSpec((3 * c,), ("zeros",)),
            p + "attn.proj.weight": ParamSpec((c, c), resid),
            p + "attn.proj.bias": ParamSpec((c,), ("zeros",)),
            p + "ln_2.weight": ParamSpec((c,), ("ones",)),
            p + "ln_2.bias": ParamSpec((c,), ("zeros",)),
            p + "mlp.fc.weight": ParamSpec((f, c), ("normal", 0.02)),
            p + "mlp.fc.bias": ParamSpec((f,), ("zeros",)),
            p + "mlp.proj.weight": ParamSpec((c, f), resid),
            p + "mlp.proj.bias": ParamSpec((c,), ("zeros",)),
        }

    def forward(self, x, params):
        ops, p = self.ops, self.p
        b, t, c = x.shape
        nh, hd = self.heads, self.head_dim
        scale = 1.0 / math.sqrt(hd)
        x2 = x.reshape(b * t, c)
        ln1, mu1, rs1 = ops.layernorm_forward(x2, params[p + "ln_1.weight"], params[p + "ln_1.bias"], self.eps)
        qkv = linear_forward(ln1, params[p + "attn.qkv.weight"], params[p + "attn.qkv.bias"])
        qkv = qkv.reshape(b, t, 3, nh, hd).transpose(2, 0, 3, 1, 4)     # [3, b, nh, t, hd]
        q, k, v = (np.ascontiguousarray(qkv[i]) for i in range(3))
        probs = matmul(q, k.transpose(0, 1, 3, 2))                                # [b, nh, t, t]
        ops.causal_softmax_forward(probs.reshape(b * nh, t, t), scale)
        att = np.ascontiguousarray(matmul(probs, v).transpose(0, 2, 1, 3)).reshape(b * t, c)
        mid = x2 + linear_forward(att, params[p + "attn.proj.weight"], params[p + "attn.proj.bias"])
        ln2, mu2, rs2 = ops.layernorm_forward(mid, params[p + "ln_2.weight"], params[p + "ln_2.bias"], self.eps)
        pre = matmul(ln2, params[p + "mlp.fc.weight"].T)
        act = ops.bias_gelu_forward(pre, params[p + "mlp.fc.bias"])
        out = mid + linear_forward(act, params[p + "mlp.proj.weight"], params[p + "mlp.proj.bias"])
        saved = (x2, ln1, mu1, rs1, q, k, v, probs, att, mid, ln2, mu2, rs2, pre, act)
        return out.reshape(b, t, c), saved

    def backward(self, dy, saved, params):
        ops, p = self.ops, self.p
        x2, ln1, mu1, rs1, q, k, v, probs, att, mid, ln2, mu2, rs2, pre, act = saved
        b, t, c = dy.shape
        nh, hd = self.heads, self.head_dim
        scale = 1.0 / math.sqrt(hd)
        g = {}
        dout = np.ascontiguousarray(dy).reshape(b * t, c)
        # MLP
        dact, g[p + "mlp.proj.weight"], g[p + "mlp.proj.bias"] = linear_backward(
            dout, act, params[p + "mlp.proj.weight"], ops)
        dpre = ops.gelu_backward(pre, dact)
        dln2, g[p + "mlp.fc.weight"], g[p + "mlp.fc.bias"] = linear_backward(
            dpre, ln2, params[p + "mlp.fc.weight"], ops)
        dmid, g[p + "ln_2.weight"], g[p + "ln_2.bias"] = ops.layernorm_backward(
            dln2, mid, params[p + "ln_2.weight"], mu2, rs2)
        dmid += dout
        # Attention
        datt, g[p + "attn.proj.weight"], g[p + "attn.proj.bias"] = linear_backward(
            dmid, att, params[p + "attn.proj.weight"], ops)
        dy_heads = np.ascontiguousarray(datt.reshape(b, t, nh, hd).transpose(0, 2, 1, 3))
        dprobs = matmul(dy_heads, v.transpose(0, 1, 3, 2))
        dv = matmul(probs.transpose(0, 1, 3, 2), dy_heads)
        ops.causal_softmax_backward(probs.reshape(b * nh, t, t), dprobs.reshape(b * nh, t, t), scale)
        dq = matmul(dprobs, k)
        dk = matmul(dprobs.transpose(0, 1, 3, 2), q)
        dqkv = np.empty((b, t, 3, nh, hd), dy.dtype)
        for i, d in enumerate((dq, dk, dv)):
            dqkv[:, :, i] = d.transpose(0, 2, 1, 3)
        dqkv = dqkv.reshape(b * t, 3 * c)
        dln1, g[p + "attn.qkv.weight"], g[p + "attn.qkv.bias"] = linear_backward(
            dqkv, ln1, params[p + "attn.qkv.weight"], ops)
        dx, g[p + "ln_1.weight"], g[p + "ln_1.bias"] = ops.layernorm_backward(
            dln1, x2, params[p + "ln_1.weight"], mu1, rs1)
        dx += dmid
        return dx.reshape(b, t, c), g


class LMHead(Unit):
    """Final LayerNorm and the output projection to vocabulary logits (tied to ``wte.weight`` or not)."""

    def __init__(self, hidden_size, vocab_size, eps, tied, ops=fused_ops):
        self.name = "head"
        self.hidden, self.vocab_size, self.eps = hidden_size, vocab_size, eps
        self.weight = "wte.weight" if tied else "lm_head.weight"
        self.ops = ops

    def param_specs(self):
        c = self.hidden
        return {"ln_f.weight": ParamSpec((c,), ("ones",)),
                "ln_f.bias": ParamSpec((c,), ("zeros",)),
                self.weight: ParamSpec((self.vocab_size, c), ("normal", 0.02))}

    def forward(self, x, params):
        b, t, c = x.shape
        x2 = x.reshape(b * t, c)
        ln, mu, rs = self.ops.layernorm_forward(x2, params["ln_f.weight"], params["ln_f.bias"], self.eps)
        logits = matmul(ln, params[self.weight].T)
        return logits.reshape(b, t, self.vocab_size), (x2, ln, mu, rs)

    def backward(self, dlogits, saved, params):
        x2, ln, mu, rs = saved
        b, t, v = dlogits.shape
        d2 = dlogits.reshape(b * t, v)
        g = {}
        dln = matmul(d2, params[self.weight])
        g[self.weight] = matmul(d2.T, ln)
        dx, g["ln_f.weight"], g["ln_f.bias"] = self.ops.layernorm_backward(
            dln, x2, params["ln_f.weight"], mu, rs)
        return dx.reshape(b, t, self.hidden), g


class Dense(Unit):
    """One fully connected layer, y = act(x @ W.T + b), of an MLP (``layers.<i>.weight`` [out, in])."""

    def __init__(self, index, in_features, out_features, activation, ops=fused_ops):
        self.name = f"layers.{index}"
        self.p = f"layers.{index}."
        self.in_features, self.out_features, self.activation = in_features, out_features, activation
        self.ops = ops

    def param_specs(self):
        # PyTorch's nn.Linear default: U(-1/sqrt(in), 1/sqrt(in)) for weight and bias.
        bound = 1.0 / math.sqrt(self.in_features)
        return {self.p + "weight": ParamSpec((self.out_features, self.in_features), ("uniform", bound)),
                self.p + "bias": ParamSpec((self.out_features,), ("uniform", bound))}

    def forward(self, x, params):
        w, b = params[self.p + "weight"], params[self.p + "bias"]
        if self.activation is None:
            return linear_forward(x, w, b), (x, None)
        pre = matmul(x, w.T)
        if self.activation == "relu":
            y = self.ops.bias_relu_forward(pre, b)
        else:
            y = self.ops.bias_gelu_forward(pre, b)
        return y, (x, pre)

    def backward(self, dy, saved, params):
        x, pre = saved
        dy = np.ascontiguousarray(dy)
        if self.activation == "relu":
            dy = self.ops.relu_backward(pre, dy.copy())
        elif self.activation == "gelu":
            dy = self.ops.gelu_backward(pre, dy.copy())
        dx, dw, db = linear_backward(dy, x, params[self.p + "weight"], self.ops)
        return dx, {self.p + "weight": dw, self.p + "bias": db}
