"""The llama decoder's units: RMSNorm, rotary positions, grouped-query attention, SwiGLU, no biases.

As Model Zoo's ``llama`` (a GPT-2 model with ``norm_type: rmsnorm``, ``position_embedding_type:
rotary``, ``nonlinearity: swiglu``, ``attention_module: multiquery_attention`` with
``extra_attention_params.num_kv_groups``, and no biases); docs/design/models.md "llama".

Rotary positions rotate *adjacent pairs* (dims 2i, 2i+1 by angle t * theta^(-2i/d)), as Model Zoo
and Meta's LLaMA do; Hugging Face's LlamaForCausalLM rotates the two halves instead, and
``wse_core.nn.hf`` permutes the q/k projection rows on the way out and back (exactly). Position
scaling: ``linear`` (positions / factor) and ``llama3`` (Meta's frequency-dependent scaling).

Unit parameters (``[out, in]`` weights)::

    blocks.{i}.norm_1.weight  blocks.{i}.attn.q.weight [H, H]  attn.k.weight / attn.v.weight [G*d, H]
    blocks.{i}.attn.proj.weight [H, H]  norm_2.weight  mlp.gate.weight / mlp.up.weight [F, H]
    blocks.{i}.mlp.down.weight [H, F]   head: norm_f.weight, lm_head.weight (or the tied wte.weight)

The family (``Llama``) and its build from the params' ``model`` section (``build_llama``) close the file.
"""
import math

import numpy as np

from wse_core.errors import ConfigError
from wse_core.nn import attention
from wse_core.nn import ops as fused_ops
from wse_core.nn.config import LlamaConfig
from wse_core.nn.gemm import matmul
from wse_core.nn.gpt import decoder_initializers, mup_scales
from wse_core.nn.layers import (ATTENTION_OUT_SITE, ATTENTION_SITE, MLP_OUT_SITE, Embedding, ParamSpec, Unit,
                                fixed_spec, norm_backward)
from wse_core.nn.model import LanguageModel
from wse_core.nn.sample_tree import weight_product


def rotary_frequencies(rotary_dim, theta, scaling=None):
    """Angle per position of each adjacent pair: theta^(-2i/d), i < d/2 (float64), with Model Zoo's
    ``pos_scaling_type: llama3`` applied when ``scaling`` says so."""
    inv = theta ** (-np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    if scaling and scaling["type"] == "llama3":
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old / lo, inv / factor, inv)  # long waves: slowed by factor
        smooth = (old / wavelen - lo) / (hi - lo)
        medium = (wavelen >= old / hi) & (wavelen <= old / lo)
        inv = np.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
    return inv


class Rotary:
    """cos/sin of every (position, pair) of a model, and the rotation of q or k by them."""

    def __init__(self, head_dim, rotary_dim, theta, max_positions, scaling=None):
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ConfigError(f"model.rotary_dim: expected an even number in [2, {head_dim}] (the head size), "
                              f"got {rotary_dim}")
        self.dim = rotary_dim
        positions = np.arange(max_positions, dtype=np.float64)
        if scaling and scaling["type"] == "linear":
            positions = positions / scaling["factor"]
        angles = positions[:, None] * rotary_frequencies(rotary_dim, theta, scaling)[None, :]
        self.cos, self.sin = np.cos(angles), np.sin(angles)   # [positions, rotary_dim / 2]

    def apply(self, x, inverse=False, start=0):
        """Rotate the adjacent pairs of the first ``dim`` features of x [..., t, d], at positions
        start..start+t-1, in place (by the negative angle with ``inverse``: the backward pass of an
        orthogonal map); returns x."""
        t = x.shape[-2]
        cos, sin = self.cos[start:start + t].astype(x.dtype), self.sin[start:start + t].astype(x.dtype)
        if inverse:
            sin = -sin
        even, odd = x[..., 0:self.dim:2].copy(), x[..., 1:self.dim:2].copy()
        x[..., 0:self.dim:2] = even * cos - odd * sin
        x[..., 1:self.dim:2] = even * sin + odd * cos
        return x


def rms_norm(x, w, eps):
    """(y, r): y = x * r * w with r = 1 / sqrt(mean(x^2) + eps) per row of 2-D x."""
    r = 1.0 / np.sqrt(np.mean(x * x, axis=1, keepdims=True) + x.dtype.type(eps))
    return x * r * w, r


def rms_norm_backward(dy, x, w, r):
    """(dx, dw) of ``rms_norm``."""
    dw = np.sum(dy * x * r, axis=0)
    g = dy * w
    dx = r * g - x * (r ** 3) * np.mean(g * x, axis=1, keepdims=True)
    return dx, dw


def silu(a):
    return a / (1.0 + np.exp(-a))


class LlamaBlock(Unit):
    """x + attn(rmsnorm(x)), then + down(silu(gate(.)) * up(.)) of rmsnorm; causal grouped-query attention."""

    def __init__(self, index, hidden_size, num_heads, num_kv_heads, filter_size, eps, rotary, ops=fused_ops,
                 init=None, dropout=0.0, attention_dropout=0.0):
        if num_heads % num_kv_heads:
            raise ConfigError(f"model.extra_attention_params.num_kv_groups: {num_kv_heads} does not divide "
                              f"model.num_heads {num_heads}")
        self.name, self.p, self.index = f"blocks.{index}", f"blocks.{index}.", index
        self.hidden, self.heads, self.kv_heads, self.filter, self.eps = hidden_size, num_heads, num_kv_heads, \
            filter_size, eps
        self.head_dim = hidden_size // num_heads
        self.rotary, self.ops = rotary, ops
        self.dropout, self.attention_dropout = dropout, attention_dropout
        self.init = init or {"weight": ("normal", 0.0, 0.02), "output": ("normal", 0.0, 0.02)}

    def param_specs(self):
        p, c, f = self.p, self.hidden, self.filter
        kv = self.kv_heads * self.head_dim
        w, out = self.init["weight"], self.init["output"]
        att, inp, outp = "decoder_attention", "decoder_input_ffn", "decoder_output_ffn"
        return {p + "norm_1.weight": fixed_spec((c,), "ones"),
                p + "attn.q.weight": ParamSpec((c, c), w, lr_group=att),
                p + "attn.k.weight": ParamSpec((kv, c), w, lr_group=att),
                p + "attn.v.weight": ParamSpec((kv, c), w, lr_group=att),
                p + "attn.proj.weight": ParamSpec((c, c), out, lr_group=att),
                p + "norm_2.weight": fixed_spec((c,), "ones"),
                p + "mlp.gate.weight": ParamSpec((f, c), w, lr_group=inp),
                p + "mlp.up.weight": ParamSpec((f, c), w, lr_group=inp),
                p + "mlp.down.weight": ParamSpec((c, f), self.init.get("ffn_output", out), lr_group=outp)}

    scale_qk_dot_by_d = False  # muP: q.k / head size instead of / sqrt(head size); set by the builder

    @property
    def attention_scale(self):
        return 1.0 / (self.head_dim if self.scale_qk_dot_by_d else math.sqrt(self.head_dim))

    def _masks(self, drop, b, t, dtype):
        layer, on = self.index + 1, drop is not None
        return (drop.scale(b, layer, ATTENTION_SITE, (self.heads, t, t), self.attention_dropout, dtype)
                if on and self.attention_dropout > 0 else None,
                *(drop.scale(b, layer, site, (t, self.hidden), self.dropout, dtype).reshape(b * t, self.hidden)
                  if on and self.dropout > 0 else None for site in (ATTENTION_OUT_SITE, MLP_OUT_SITE)))

    def _heads(self, y, b, t, n):
        """[b*t, n*d] -> [b, n, t, d]."""
        return np.ascontiguousarray(y.reshape(b, t, n, self.head_dim).transpose(0, 2, 1, 3))

    def forward(self, x, params, drop=None):
        return self._run(x, params, drop, None)

    def infer(self, x, params, kv):
        """A generation step: the block on the new positions ``x`` [b, t, c], rotated to each
        sequence's positions and attending over its KV cache ``kv`` (``wse_core.nn.kv``)."""
        return self._run(x, params, None, kv)[0]

    def _run(self, x, params, drop, kv):
        p, (b, t, c) = self.p, x.shape
        nh, group = self.heads, self.heads // self.kv_heads
        masks = self._masks(drop, b, t, x.dtype)
        x2 = x.reshape(b * t, c)
        n1, r1 = rms_norm(x2, params[p + "norm_1.weight"], self.eps)
        q = self._heads(matmul(n1, params[p + "attn.q.weight"].T, sample_rows=t), b, t, nh)
        k = self._heads(matmul(n1, params[p + "attn.k.weight"].T, sample_rows=t), b, t, self.kv_heads)
        v = self._heads(matmul(n1, params[p + "attn.v.weight"].T, sample_rows=t), b, t, self.kv_heads)
        if kv is None:
            q, k = self.rotary.apply(q), self.rotary.apply(k)
            kf, vf = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)   # q head h reads kv head h // group
            att = np.empty((b * t, c), x.dtype)
            _, probs = attention.forward(q, kf, vf, self.attention_scale, self.ops, masks[0],
                                         out=att.reshape(b, t, nh, -1).transpose(0, 2, 1, 3))
        else:
            for i, start in enumerate(kv.starts()):  # each sequence at its own positions
                self.rotary.apply(q[i], start=start)
                self.rotary.apply(k[i], start=start)
            kf = vf = probs = None
            heads = kv.attend(self.name, q, k, v, self.attention_scale, self.ops, group)
            att = np.ascontiguousarray(heads.transpose(0, 2, 1, 3)).reshape(b * t, c)
        proj = matmul(att, params[p + "attn.proj.weight"].T, sample_rows=t)
        mid = x2 + (proj if masks[1] is None else proj * masks[1])
        n2, r2 = rms_norm(mid, params[p + "norm_2.weight"], self.eps)
        a = matmul(n2, params[p + "mlp.gate.weight"].T, sample_rows=t)
        u = matmul(n2, params[p + "mlp.up.weight"].T, sample_rows=t)
        s = silu(a)
        m = s * u
        down = matmul(m, params[p + "mlp.down.weight"].T, sample_rows=t)
        out = mid + (down if masks[2] is None else down * masks[2])
        return out.reshape(b, t, c), (x2, n1, r1, q, kf, vf, probs, att, mid, n2, r2, a, u, s, m, masks)

    def backward(self, dy, saved, params):
        p = self.p
        x2, n1, r1, q, kf, vf, probs, att, mid, n2, r2, a, u, s, m, masks = saved
        b, t, c = dy.shape
        nh, group = self.heads, self.heads // self.kv_heads
        g = {}
        dout = np.ascontiguousarray(dy).reshape(b * t, c)
        # SwiGLU
        ddown = dout if masks[2] is None else dout * masks[2]
        g[p + "mlp.down.weight"] = weight_product(ddown, m, t)
        dm = matmul(ddown, params[p + "mlp.down.weight"], sample_rows=t)
        du = dm * s
        sig = 1.0 / (1.0 + np.exp(-a))
        da = dm * u * (sig * (1.0 + a * (1.0 - sig)))
        g[p + "mlp.gate.weight"], g[p + "mlp.up.weight"] = weight_product(da, n2, t), weight_product(du, n2, t)
        dn2 = (matmul(da, params[p + "mlp.gate.weight"], sample_rows=t)
               + matmul(du, params[p + "mlp.up.weight"], sample_rows=t))
        dmid, g[p + "norm_2.weight"] = norm_backward(rms_norm_backward, dn2, mid, t, params[p + "norm_2.weight"], r2)
        dmid += dout
        # Attention
        dproj = dmid if masks[1] is None else dmid * masks[1]
        g[p + "attn.proj.weight"] = weight_product(dproj, att, t)
        datt = self._heads(matmul(dproj, params[p + "attn.proj.weight"], sample_rows=t), b, t, nh)
        dq, dkf, dvf = attention.backward(datt, q, kf, vf, probs, self.attention_scale, self.ops, masks[0])
        dq = self.rotary.apply(dq, inverse=True)
        # A kv head's gradient is the sum over the q heads of its group, in head order.
        dk = self.rotary.apply(dkf.reshape(b, self.kv_heads, group, t, -1).sum(axis=2), inverse=True)
        dv = dvf.reshape(b, self.kv_heads, group, t, -1).sum(axis=2)
        flat = [d.transpose(0, 2, 1, 3).reshape(b * t, -1) for d in (dq, dk, dv)]
        dn1 = 0
        for d, key in zip(flat, ("q", "k", "v")):
            name = p + f"attn.{key}.weight"
            g[name] = weight_product(d, n1, t)
            dn1 = dn1 + matmul(d, params[name], sample_rows=t)
        dx, g[p + "norm_1.weight"] = norm_backward(rms_norm_backward, dn1, x2, t, params[p + "norm_1.weight"], r1)
        dx += dmid
        return dx.reshape(b, t, c), g


class RMSHead(Unit):
    """Final RMSNorm and the projection to vocabulary logits (``lm_head.weight``, or the tied ``wte.weight``)."""

    def __init__(self, hidden_size, vocab_size, eps, tied, init, ops=fused_ops):
        self.name = "head"
        self.hidden, self.vocab_size, self.eps = hidden_size, vocab_size, eps
        self.weight = "wte.weight" if tied else "lm_head.weight"
        self.init, self.ops = init, ops

    logits_scale = 1.0  # muP's output_logits_scale; set by the builder

    def param_specs(self):
        return {"norm_f.weight": fixed_spec((self.hidden,), "ones"),
                self.weight: ParamSpec((self.vocab_size, self.hidden), self.init,
                                       lr_group="embedding" if self.weight == "wte.weight" else None)}

    def infer(self, x, params, kv):
        """The logits of a generation step's positions."""
        return self.forward(x, params)[0]

    def forward(self, x, params, drop=None):
        b, t, c = x.shape
        x2 = x.reshape(b * t, c)
        n, r = rms_norm(x2, params["norm_f.weight"], self.eps)
        logits = matmul(n, params[self.weight].T, sample_rows=t)
        if self.logits_scale != 1.0:
            logits *= logits.dtype.type(self.logits_scale)
        return logits.reshape(b, t, self.vocab_size), (x2, n, r)

    def backward(self, dy, saved, params):
        x2, n, r = saved
        b, t, v = dy.shape
        d2 = np.ascontiguousarray(dy).reshape(b * t, v)
        if self.logits_scale != 1.0:
            d2 = d2 * d2.dtype.type(self.logits_scale)
        g = {self.weight: weight_product(d2, n, t)}
        dn = matmul(d2, params[self.weight], sample_rows=t)
        dx, g["norm_f.weight"] = norm_backward(rms_norm_backward, dn, x2, t, params["norm_f.weight"], r)
        return dx.reshape(b, t, self.hidden), g


class Llama(LanguageModel):
    """llama: rotary positions, RMSNorm, grouped-query attention, SwiGLU (HF: LlamaForCausalLM)."""

    family = "llama"

    def _block_floats_per_token(self, h, f):
        return 7 * h + 4 * f  # x, norm_1, q, k and v (for every head), attention, mid, norm_2; gate, up, silu, product


def build_llama(cfg, ops):
    """Model Zoo's llama: RMSNorm, rotary positions on adjacent pairs, SwiGLU, grouped-query attention
    (``attention_module: multiquery_attention`` with ``extra_attention_params.num_kv_groups``), no
    biases; the head tied or not (``share_embedding_weights``)."""
    c = LlamaConfig.from_params(cfg)
    kv, eps = c.extra_attention_params["num_kv_groups"], c.layer_norm_epsilon
    rotary = Rotary(c.hidden_size // c.num_heads, c.rotary_dim, c.rope_theta, c.max_position_embeddings,
                    c.position_scaling)
    init = decoder_initializers(c)
    units = [Embedding(c.vocab_size, c.max_position_embeddings, c.hidden_size, ops, init["embedding"],
                       c.embedding_dropout_rate, positions=False)]
    units += [LlamaBlock(i, c.hidden_size, c.num_heads, kv, c.filter_size, eps, rotary, ops, init,
                         c.dropout_rate, c.attention_dropout_rate) for i in range(c.num_hidden_layers)]
    units.append(RMSHead(c.hidden_size, c.vocab_size, eps, c.share_embedding_weights,
                         init["embedding"] if c.share_embedding_weights else init["head"], ops))
    return Llama(c.to_dict(), mup_scales(c, units), ops)
